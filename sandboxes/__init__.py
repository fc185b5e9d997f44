"""fleetrl.sandboxes"""
