import os
import sys
from pathlib import Path

want = Path("/app/greeting.txt").read_text().strip().upper() + os.environ["EXPECTED_SUFFIX"]
got = Path("/app/shout.txt").read_text().strip() if Path("/app/shout.txt").exists() else None
print(f"want {want!r}, got {got!r}")
sys.exit(0 if got == want else 1)
