"""`fleetrl status`'s table (daemon/status_table.py, pure): the run line, one row per
actor with its state, restarts, inbox, reports and first statistics, and its last error."""

from __future__ import annotations

from fleetrl.daemon.status_table import render_status

BODY = {
    "run_id": "run-3f9c", "instance_id": "h-1", "uptime_s": 3725.0, "phase": "running", "paused": False,
    "draining": False, "mounts": [],
    "checkpoint": {"seq": 12, "written_at": 1000.0, "reason": "interval"},
    "actors": {
        "trainer": {"state": "running", "restarts": 0, "inbox": {"messages": 3, "capacity": 64},
                    "versions": {}, "last_error": None, "last_error_at": None,
                    "statistics": {"step": 120, "version": 120, "loss": 0.123456, "groups": 960, "tokens": 5,
                                   "healthy": True, "phase": "train"}},
        "pool": {"state": "backoff", "restarts": 2, "inbox": {"messages": 0, "capacity": 64},
                 "versions": {"trainer": 120}, "last_error": "RuntimeError: boom", "last_error_at": 990.0,
                 "statistics": None},
    },
}


def test_the_table_shows_the_run_each_actor_and_its_last_error():
    text = render_status(BODY, now=1041.0)
    lines = text.splitlines()
    assert lines[0] == "run run-3f9c · running · up 1h02m · checkpoint #12 41 s ago (interval)"
    assert lines[1].split() == ["ACTOR", "STATE", "RESTARTS", "INBOX", "REPORTS", "STATISTICS"]
    trainer = lines[2].split()
    assert trainer[:5] == ["trainer", "running", "0", "3/64", "-"]
    assert trainer[5:] == ["step=120", "version=120", "loss=0.1235", "groups=960", "(+1)"]  # booleans are not numbers
    assert lines[3].split()[:5] == ["pool", "backoff", "2", "0/64", "trainer=120"]
    assert lines[4] == "  last error (51 s ago): RuntimeError: boom"
    # the columns line up
    assert lines[2].index("running") == lines[3].index("backoff") == lines[1].index("STATE")


def test_paused_draining_and_no_checkpoint_are_said():
    body = dict(BODY, paused=True, checkpoint=None, actors={})
    assert render_status(body, now=0).splitlines()[0] == "run run-3f9c · paused · up 1h02m · no checkpoint yet"
    assert "· draining ·" in render_status(dict(body, draining=True), now=0)
