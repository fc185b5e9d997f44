#!/bin/bash
# Harbor runs this after the agent; it writes the reward to /logs/verifier/reward.txt.
mkdir -p /logs/verifier
if python3 /tests/check_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
