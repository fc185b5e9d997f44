"""fleetrl.actors.weights"""
