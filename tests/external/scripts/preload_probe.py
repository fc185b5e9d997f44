"""Reports how it was started: whether ``probe_mod`` (a module the fork server may have
preloaded) was imported before this script ran and in which process, its argv, working
directory, one environment variable and stdin; exits with the code in argv[1]."""

import json
import os
import sys

preloaded = "probe_mod" in sys.modules
import probe_mod  # noqa: E402

print(json.dumps({"preloaded": preloaded, "imported_in": probe_mod.PID, "pid": os.getpid(),
                  "sid": os.getsid(0), "argv": sys.argv, "cwd": os.getcwd(),
                  "var": os.environ.get("PROBE_VAR"), "attempt": os.environ.get("FLEETRL_ATTEMPT_ID"),
                  "stdin": sys.stdin.read(), "name": __name__}))
print("to stderr", file=sys.stderr)
code = int(sys.argv[1])
if code == 99:
    raise RuntimeError("the probe failed")
sys.exit(code)
