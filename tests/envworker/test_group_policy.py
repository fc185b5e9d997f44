"""Pure attempt/group bookkeeping: retry policy, group tracker, task cursor.

The invariant (Hypothesis): every attempt ticket the tracker issues ends in exactly
one of {scored trajectory, retried failure, final failure}; the group is emitted only
when every slot has ended, with the scored trajectories in slot order, and only when
few enough slots failed.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.envworker.cursor import CursorState, TaskCursor
from fleetrl.actors.envworker.group import GroupStateError, GroupTracker
from fleetrl.actors.envworker.policy import DEFAULT_MAX_TRIES, FAILURE_KINDS, RetryPolicy
from fleetrl.daemon.messages import ROLLOUTS, Trajectory


def traj(ticket, reward=1.0) -> Trajectory:
    return Trajectory(attempt_id=ticket.attempt_id, task_id=ticket.task_id, group_id=ticket.group_id,
                      segments=(), reward=reward)


# -- policy ---------------------------------------------------------------------------------

def test_policy_bounds_tries_per_kind():
    p = RetryPolicy(max_tries={"sandbox_error": 3})
    assert [p.decide("sandbox_error", t) for t in (1, 2, 3)] == ["retry", "retry", "give_up"]
    assert p.decide("harness_crash", 1) == "give_up"  # default: crashes are not retried
    assert p.decide("timeout", 1) == "give_up"
    assert p.tries_for("sampler_error") == DEFAULT_MAX_TRIES["sampler_error"]


def test_policy_rejects_unknown_kinds_with_their_names():
    with pytest.raises(ValueError, match="unknown failure kind.*sandbox_eror"):
        RetryPolicy(max_tries={"sandbox_eror": 2})
    with pytest.raises(ValueError, match="nope"):
        RetryPolicy().decide("nope", 1)
    with pytest.raises(msgspec.ValidationError, match="max_tries"):
        msgspec.convert({"max_tries": {"timeout": 0}}, RetryPolicy)


def test_failed_allowed_defaults_to_keeping_two_scored():
    assert RetryPolicy().failed_allowed(4) == 2
    assert RetryPolicy().failed_allowed(1) == 0
    assert RetryPolicy(max_failed_per_group=0).failed_allowed(8) == 0


# -- tracker --------------------------------------------------------------------------------

def test_group_emitted_only_when_every_slot_has_ended():
    tr = GroupTracker(group_id="g", task_id="t", group_size=3, policy=RetryPolicy(max_tries={"sandbox_error": 2}))
    a, b, c = tr.start()
    tr.scored(b, traj(b, 0.0))
    msg, retry = tr.failed(a, "sandbox_error", "engine down")
    assert msg.reason == "sandbox_error" and msg.group_id == "g" and "retrying" in msg.detail
    assert retry is not None and retry.slot == 0 and retry.try_no == 2
    with pytest.raises(GroupStateError, match="still in flight"):
        tr.result()
    tr.scored(c, traj(c, 1.0))
    tr.scored(retry, traj(retry, 0.5))
    res = tr.result()
    assert res.group is not None
    assert [t.attempt_id for t in res.group.trajectories] == ["g/0.2", "g/1.1", "g/2.1"]
    assert res.group.rewards == (0.5, 0.0, 1.0)
    assert len(res.retried) == 1 and res.failures == ()
    assert ROLLOUTS.decode(ROLLOUTS.encode(res.group)) == res.group


def test_ticket_cannot_end_twice_or_for_another_attempt():
    tr = GroupTracker(group_id="g", task_id="t", group_size=2, policy=RetryPolicy())
    a, b = tr.start()
    tr.scored(a, traj(a))
    with pytest.raises(GroupStateError, match="not in flight"):
        tr.failed(a, "timeout", "late")
    with pytest.raises(GroupStateError, match="reported for g/1.1"):
        tr.scored(b, traj(a))


def test_too_many_failures_make_an_incomplete_group_that_keeps_its_scored_attempts():
    tr = GroupTracker(group_id="g", task_id="t", group_size=3, policy=RetryPolicy())
    a, b, c = tr.start()
    tr.failed(a, "harness_crash", "boom")
    tr.failed(b, "timeout", "hung")
    tr.scored(c, traj(c))
    res = tr.result()
    assert res.group is None and not res.abandoned
    assert [f.reason for f in res.failures] == ["harness_crash", "timeout"]
    assert [t.attempt_id for t in res.unused] == ["g/2.1"]


def test_abandoned_attempt_is_a_final_timeout_and_blocks_the_group():
    tr = GroupTracker(group_id="g", task_id="t", group_size=2, policy=RetryPolicy(max_failed_per_group=2))
    a, b = tr.start()
    tr.scored(a, traj(a))
    msg = tr.abandon(b, "grace passed")
    assert msg.reason == "timeout" and msg.detail.startswith("abandoned at shutdown")
    res = tr.result()
    assert res.group is None and res.abandoned and len(res.unused) == 1


endings = st.sampled_from(["scored", *FAILURE_KINDS, "abandon"])


@settings(max_examples=300, deadline=None)
@given(group_size=st.integers(1, 6),
       tries=st.dictionaries(st.sampled_from(FAILURE_KINDS), st.integers(1, 4)),
       max_failed=st.none() | st.integers(0, 6),
       script=st.lists(endings, max_size=60),
       order=st.randoms(use_true_random=False))
def test_every_attempt_ends_exactly_once_and_nothing_is_lost(group_size, tries, max_failed, script, order):
    policy = RetryPolicy(max_tries=tries, max_failed_per_group=max_failed)
    tr = GroupTracker(group_id="g", task_id="t", group_size=group_size, policy=policy)
    open_tickets = list(tr.start())
    issued = {t.attempt_id for t in open_tickets}
    scored: set[str] = set()
    retried: set[str] = set()
    final: set[str] = set()
    steps = iter(script)
    while open_tickets:
        ticket = open_tickets.pop(order.randrange(len(open_tickets)))
        ending = next(steps, "scored")  # past the script, everything succeeds
        if ending == "scored":
            tr.scored(ticket, traj(ticket))
            scored.add(ticket.attempt_id)
        elif ending == "abandon":
            tr.abandon(ticket, "test")
            final.add(ticket.attempt_id)
        else:
            msg, nxt = tr.failed(ticket, ending, "x")
            assert msg.attempt_id == ticket.attempt_id and msg.reason == ending
            if nxt is None:
                final.add(ticket.attempt_id)
            else:
                assert nxt.slot == ticket.slot and nxt.try_no == ticket.try_no + 1
                assert ticket.try_no < policy.tries_for(ending)
                retried.add(ticket.attempt_id)
                issued.add(nxt.attempt_id)
                open_tickets.append(nxt)
        assert tr.done == (not open_tickets)
    # exactly one ending per issued ticket
    assert scored | retried | final == issued
    assert len(scored) + len(retried) + len(final) == len(issued) == tr.issued
    res = tr.result()
    out_scored = {t.attempt_id for t in (res.group.trajectories if res.group else res.unused)}
    assert out_scored == scored
    assert {f.attempt_id for f in res.failures} == final
    assert {f.attempt_id for f in res.retried} == retried
    assert len(scored) + len(final) == group_size  # each slot ends once for good
    if res.group is not None:
        assert not res.abandoned and len(final) <= policy.failed_allowed(group_size)
        slots = [int(t.attempt_id.split("/")[1].split(".")[0]) for t in res.group.trajectories]
        assert slots == sorted(slots)
    else:
        assert res.abandoned or len(final) > policy.failed_allowed(group_size) or not scored


# -- cursor ---------------------------------------------------------------------------------

def test_cursor_keeps_unfinished_tasks_due_across_a_restore():
    c = TaskCursor()
    got = [c.take() for _ in range(4)]
    assert got == [0, 1, 2, 3]
    c.finish(1)
    c.finish(3)
    c.release(2)  # abandoned
    state = c.state()
    assert state == CursorState(floor=0, done=(1, 3))
    c2 = TaskCursor(msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=CursorState))
    assert [c2.take() for _ in range(3)] == [0, 2, 4]
    c2.finish(0)
    c2.finish(2)
    assert c2.state() == CursorState(floor=4, done=())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 10)), max_size=40))
def test_cursor_never_repeats_a_finished_task_and_never_skips_an_unfinished_one(ops):
    c = TaskCursor()
    finished: set[int] = set()
    for restore, pick in ops:
        if restore:
            c = TaskCursor(c.state())
            continue
        i = c.take()
        assert i not in finished
        if pick % 3:
            c.finish(i)
            finished.add(i)
        else:
            c.release(i)
    s = c.state()
    assert all(i in finished for i in range(s.floor))
    assert set(s.done) == {i for i in finished if i >= s.floor}
    restored = TaskCursor(s)
    first = restored.take()
    assert first not in finished and all(i in finished for i in range(first))


def test_cursor_state_is_checked():
    with pytest.raises(ValueError, match="floor"):
        CursorState(floor=-1)
    with pytest.raises(ValueError, match="after floor=3"):
        CursorState(floor=3, done=(2,))
    with pytest.raises(ValueError, match="not taken"):
        TaskCursor().finish(0)


def test_only_error_episodes_fail_and_model_failures_are_sampler_errors():
    from fleetrl.actors.envworker.policy import episode_failure

    for state in ("submitted", "turn_limit", "timeout"):
        assert episode_failure(state, None) is None  # scored, even when the answer is wrong
    assert episode_failure("error", "model unavailable: no sampler") == ("sampler_error",
                                                                         "model unavailable: no sampler")
    assert episode_failure("error", "tool blew up") == ("harness_crash", "tool blew up")
    assert episode_failure("error", None)[0] == "harness_crash"
