"""Starts a detached loop in the sandbox (appending to /work/tick) with docker exec -d,
which outlives this process unless someone kills it in the container, then hangs."""

import os
import subprocess
import time

subprocess.run(["docker", "exec", "-d", "-u", os.environ["FLEETRL_SANDBOX_USER"], "-w",
                os.environ["FLEETRL_SANDBOX_WORKDIR"], os.environ["FLEETRL_SANDBOX_CONTAINER"],
                "sh", "-c", "while :; do echo t >> tick; sleep 0.1; done"], check=True, timeout=30)
print("ticking", flush=True)
time.sleep(1000)
