"""fleetrl.daemon"""
