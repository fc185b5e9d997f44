#!/bin/bash
printf '%s!\n' "$(tr '[:lower:]' '[:upper:]' < /app/greeting.txt)" > /app/shout.txt
