"""The remote workers' conversation (daemon/worker_messages.py): every message round-trips
through `WORKERS`, malformed ones are refused with the field named, and the credential
and signing key never appear in a repr."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.daemon import messages as m
from fleetrl.daemon import worker_messages as w
from fleetrl.daemon.errors import BadMessage

text = st.text(max_size=20)
blob = st.binary(max_size=64)

STRATEGIES = {
    w.WorkerJoin: st.builds(w.WorkerJoin, token=text, name=text, protocol=st.integers(0, 5), groups=st.integers(1, 4096)),
    w.WorkerWelcome: st.builds(w.WorkerWelcome, worker_id=text, run_id=text, actor=text, protocol=st.integers(0, 5),
                               heartbeat_s=st.floats(0.01, 100), settings=blob,
                               tokenizer=st.dictionaries(text, blob, max_size=3), harness_key=blob),
    w.HarnessShipped: st.builds(w.HarnessShipped, kind=st.sampled_from(["import", "pickle"]), ref=text,
                                payload=blob, mac=blob),
    w.TaskAssigned: st.builds(w.TaskAssigned, index=st.integers(0, 2**40), task=blob),
    w.TaskEnded: st.builds(w.TaskEnded, index=st.integers(0, 2**40), outcome=st.sampled_from(["finished", "abandoned"])),
}


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda c: c.__name__)
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_round_trip(cls, data):
    msg = data.draw(STRATEGIES[cls])
    assert w.WORKERS.decode(w.WORKERS.encode(msg)) == msg


def test_the_conversation_carries_the_sampler_and_rollout_messages_it_needs():
    assert {m.GenerateRequest, m.Generation, m.GenerateFailed, m.TokenChunk, m.RolloutGroup, m.RolloutFailed,
            m.Heartbeat, m.Leave, m.Refused} <= set(w.WORKERS.types)
    assert w.WORKERS.error_reply


def test_bad_frames_name_what_is_wrong():
    with pytest.raises(BadMessage, match="groups"):
        w.WORKERS.decode(_with(w.WorkerJoin(token="t"), groups=0))
    with pytest.raises(BadMessage, match="outcome"):
        w.WORKERS.decode(_with(w.TaskEnded(index=1, outcome="finished"), outcome="maybe"))


def _with(msg, **fields) -> bytes:
    import msgspec

    raw = msgspec.to_builtins(msg)
    raw.update(fields)
    raw["type"] = type(msg).__name__
    return msgspec.msgpack.encode(raw)


def test_secrets_stay_out_of_reprs():
    join = w.WorkerJoin(token="s3cret-token")
    welcome = w.WorkerWelcome(worker_id="worker-1", run_id="r", actor="remote", protocol=1, heartbeat_s=1.0,
                              settings=b"", tokenizer={"tokenizer.json": b"{}"}, harness_key=b"k3y-bytes")
    assert "s3cret" not in repr(join) and "k3y" not in repr(welcome)
