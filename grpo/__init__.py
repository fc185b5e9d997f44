"""fleetrl.grpo"""
