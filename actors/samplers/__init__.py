"""fleetrl.actors.samplers"""
