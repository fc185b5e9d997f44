"""Prints what an external command sees: its environment, argv, task and prompt files; exits 3."""

import json, os, sys
names = ["OPENAI_BASE_URL", "OPENAI_API_KEY", "FLEETRL_TASK_ID", "FLEETRL_SANDBOX_WORKDIR",
         "FLEETRL_MAX_TURNS", "SECRET_OF_OURS", "EXTRA"]
print(json.dumps({n: os.environ.get(n) for n in names} | {"argv": sys.argv[1:],
      "task": json.load(open(os.environ["FLEETRL_TASK_FILE"]))["id"],
      "prompt": open(os.environ["FLEETRL_PROMPT_FILE"]).read()}))
sys.stderr.write("bye")
sys.exit(3)
