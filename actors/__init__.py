"""fleetrl.actors"""
