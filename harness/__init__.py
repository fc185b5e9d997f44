"""fleetrl.harness"""
