"""`fleetrl status` as a table a person reads (pure: the /status body in, text out).

    run run-3f9c0a12 · running · up 1h02m · checkpoint #12 41 s ago (interval)
    ACTOR      STATE    RESTARTS  INBOX   REPORTS              STATISTICS
    trainer    running  0         3/64    -                    step=120 version=120 ...
    pool       backoff  2         0/64    trainer=120          samplers=3 ...
      last error (12 s ago): RuntimeError: ...

Statistics show their first numeric fields (at most `MAX_STATS`); `fleetrl status --json`
prints the whole body.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["MAX_STATS", "render_status"]

MAX_STATS = 4


def _age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _numbers(stats: Any) -> str:
    if not isinstance(stats, dict):
        return "-"
    out = [f"{k}={_value(v)}" for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    more = len(out) - MAX_STATS
    return " ".join(out[:MAX_STATS]) + (f" (+{more})" if more > 0 else "") if out else "-"


def render_status(body: dict[str, Any], *, now: float | None = None) -> str:
    """The /status body as a table (see the module docstring); `now` is unix time."""
    now = time.time() if now is None else now
    state = "draining" if body.get("draining") else "paused" if body.get("paused") else body.get("phase", "?")
    head = [f"run {body.get('run_id', '?')}", str(state), f"up {_age(float(body.get('uptime_s', 0.0)))}"]
    ckpt = body.get("checkpoint")
    if isinstance(ckpt, dict) and "written_at" in ckpt:
        how = "restored" if ckpt.get("restored") else ckpt.get("reason", "")
        head.append(f"checkpoint #{ckpt.get('seq')} {_age(now - float(ckpt['written_at']))} ago"
                    + (f" ({how})" if how else ""))
    else:
        head.append("no checkpoint yet")
    rows = [("ACTOR", "STATE", "RESTARTS", "INBOX", "REPORTS", "STATISTICS")]
    errors: dict[str, str] = {}
    for name, a in (body.get("actors") or {}).items():
        inbox = a.get("inbox") or {}
        versions = a.get("versions") or {}
        reports = " ".join(f"{k}={_value(v)}" for k, v in versions.items()) or "-"
        rows.append((name, str(a.get("state", "?")), str(a.get("restarts", 0)),
                     f"{inbox.get('messages', 0)}/{inbox.get('capacity', 0)}", reports, _numbers(a.get("statistics"))))
        if a.get("last_error"):
            at = a.get("last_error_at")
            when = f" ({_age(now - float(at))} ago)" if isinstance(at, (int, float)) else ""
            errors[name] = f"  last error{when}: {a['last_error']}"
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [" · ".join(head)]
    for r in rows:
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r[:5])) + "  " + r[5])
        if r[0] in errors:
            lines.append(errors[r[0]])
    return "\n".join(line.rstrip() for line in lines)
