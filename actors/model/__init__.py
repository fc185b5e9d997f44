"""fleetrl.actors.model"""
