"""The trainer <-> rank 0 protocol (framing and messages) and the row split over ranks:
pure functions, tested with Hypothesis."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.actors.trainer.rank_protocol import (
    FrameReader,
    ProtocolError,
    RankError,
    Ready,
    Save,
    Start,
    Stop,
    Train,
    Trained,
    decode_reply,
    decode_request,
    frame,
)
from fleetrl.actors.trainer.sharding import assign_rows

REQUESTS = [Start(resume=None, publish=True), Start(resume="step-00000004", publish=False),
            Train(step=3, lr=1e-4, trainer_version=5, groups=[], publish=False), Save(step=7), Stop()]
REPLIES = [Ready(vocab_size=259, version=4, digest="ab", world_size=2, pids=[10, 11]),
           Trained(metrics=b"\x80", digest=None), RankError(error="BadBatch: x", kind="BadBatch", fatal=False)]


@given(st.lists(st.sampled_from(range(len(REQUESTS))), max_size=8), st.lists(st.integers(1, 7), min_size=1))
def test_frames_split_anywhere_come_out_whole_and_in_order(picks, chunk_sizes):
    msgs = [REQUESTS[i] for i in picks]
    wire = b"".join(frame(m) for m in msgs)
    reader, got, pos, k = FrameReader(), [], 0, 0
    while pos < len(wire):
        n = chunk_sizes[k % len(chunk_sizes)]
        reader.feed(wire[pos:pos + n])
        pos, k = pos + n, k + 1
        while (body := reader.next_frame()) is not None:
            got.append(decode_request(body))
    assert got == msgs
    assert reader.pending == 0


@pytest.mark.parametrize("reply", REPLIES)
def test_replies_round_trip(reply):
    reader = FrameReader()
    reader.feed(frame(reply))
    assert decode_reply(reader.next_frame()) == reply


def test_a_request_is_not_a_reply_and_garbage_is_named():
    with pytest.raises(ProtocolError, match="rank reply cannot be decoded"):
        decode_reply(msgspec.msgpack.encode(Save(step=1)))
    with pytest.raises(ProtocolError, match="rank request cannot be decoded"):
        decode_request(b"\xc1")
    reader = FrameReader()
    reader.feed(struct.pack(">I", 0xFFFFFFFF))
    with pytest.raises(ProtocolError, match="over the"):
        reader.next_frame()


@given(st.lists(st.integers(0, 50), max_size=40), st.integers(1, 9))
def test_assign_rows_covers_every_row_once_in_order(tokens, world):
    ranges = assign_rows(tokens, world)
    assert len(ranges) == world
    flat = [i for r in ranges for i in r]
    assert flat == list(range(len(tokens)))
    if len(tokens) >= world:
        assert all(len(r) >= 1 for r in ranges)


@given(st.lists(st.integers(1, 20), min_size=8, max_size=60), st.integers(2, 4))
def test_assign_rows_balances_tokens_within_one_row(tokens, world):
    ranges = assign_rows(tokens, world)
    total = sum(tokens)
    biggest = max(tokens)
    for r in ranges:
        share = sum(tokens[i] for i in r)
        # a cut falls at the first row reaching each k/world mark: a share is off by at most two rows
        assert abs(share - total / world) <= 2 * biggest


def test_assign_rows_refuses_a_bad_world():
    with pytest.raises(ValueError, match="world size"):
        assign_rows([1, 2], 0)
