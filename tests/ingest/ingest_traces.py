"""Trace lines of our own format for the ingest tests (`session(i)` -> one JSON line)."""

from __future__ import annotations

import json


def session(i: int, *, outcome: str = "failure", command: str = "test -f ok.txt", reward: str = "exit_code") -> dict:
    return {
        "id": f"s{i:02d}",
        "messages": [{"role": "system", "content": "You fix bugs."},
                     {"role": "user", "content": f"Create ok.txt ({i})"},
                     {"role": "assistant", "content": "Done."}],
        "workspace": {"files": {"README": f"task {i}\n"}},
        "eval": {"command": command, "reward": reward, "timeout_s": 10},
        "outcome": outcome,
    }


def body(*sessions: dict | str) -> bytes:
    """JSONL: dicts encoded, strings kept as they are (malformed lines)."""
    return ("\n".join(s if isinstance(s, str) else json.dumps(s) for s in sessions) + "\n").encode()
