"""A module to preload: records the process that imported it."""

import os

PID = os.getpid()
