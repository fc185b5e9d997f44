"""The messages between the trainer actor and rank 0 of its rank group, and their framing.

Sans-IO: typed msgspec structs (a closed tagged union each way), encoded as msgpack and
framed with a 4-byte big-endian length. `FrameReader` turns received bytes into
messages; `frame` turns a message into bytes. The socket owner (`rank_group`, the actor
side; `rank_main`, rank 0) does the I/O.

Actor -> rank 0: `Start` (once, first), `Train`, `Save`, `Stop`.
Rank 0 -> actor: `Ready` (answers `Start`), `Trained` (answers `Train`), `Saved`
(answers `Save`), `RankError` (answers any request that raised; the group stays usable
only if ``fatal`` is false).

Rank 0 forwards each request to the other ranks as the same bytes (a broadcast over the
process group), so every rank runs the same command.
"""

from __future__ import annotations

import struct

import msgspec

from fleetrl.daemon.messages import RolloutGroup

from .errors import RankProtocolError as ProtocolError

__all__ = ["ActorRequest", "FrameReader", "MAX_FRAME", "ProtocolError", "RankError", "RankReply", "Ready",
           "Save", "Saved", "Start", "Stop", "Train", "Trained", "decode_reply", "decode_request", "frame"]

MAX_FRAME = 1 << 31
"""Largest frame accepted (bytes): a batch of groups, never weights."""

_HEADER = struct.Struct(">I")


class Start(msgspec.Struct, frozen=True, tag="start", kw_only=True):
    resume: str | None
    """Sharded checkpoint directory to load (`dcp.latest_checkpoint`'s path), or None for
    the model directory's weights."""
    publish: bool
    """Publish the loaded weights as the next version (False after a rank restart: the
    weights are replayed to the last published state and the next step publishes)."""


class Train(msgspec.Struct, frozen=True, tag="train", kw_only=True):
    step: int
    """Optimizer steps before this one."""
    lr: float
    trainer_version: int
    groups: list[RolloutGroup]
    publish: bool = True
    """False when replaying steps already published before a rank restart."""
    detail: bool = False
    """Send each row's `step.RowDetail` back (the trainer's rollout log)."""


class Save(msgspec.Struct, frozen=True, tag="save", kw_only=True):
    step: int


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    pass


ActorRequest = Start | Train | Save | Stop


class Ready(msgspec.Struct, frozen=True, tag="ready", kw_only=True):
    vocab_size: int
    version: int | None
    """Version published at start (None when ``Start.publish`` was false)."""
    digest: str | None
    """Hex digest of the published version."""
    world_size: int
    pids: list[int]
    """Process ids of every rank, rank order."""


class Trained(msgspec.Struct, frozen=True, tag="trained", kw_only=True):
    metrics: bytes
    """msgpack of the step's `StepMetrics` (version and delta fields filled when published)."""
    digest: str | None
    """Hex digest of the version published after the step (None: none published)."""
    detail: bytes = b""
    """msgpack of the step's `step.RowDetail` list, every rank's rows (asked by ``Train.detail``)."""


class Saved(msgspec.Struct, frozen=True, tag="saved", kw_only=True):
    step: int
    path: str


class RankError(msgspec.Struct, frozen=True, tag="error", kw_only=True):
    error: str
    """``Type: message`` of the exception a request raised on a rank."""
    kind: str
    """The exception's class name (``BadBatch``, ``CheckpointError``, ...)."""
    fatal: bool
    """True when the rank group cannot go on (a collective may be half done)."""


RankReply = Ready | Trained | Saved | RankError

_REQUEST = msgspec.msgpack.Decoder(ActorRequest)
_REPLY = msgspec.msgpack.Decoder(RankReply)
_ENCODER = msgspec.msgpack.Encoder()


def frame(msg: ActorRequest | RankReply) -> bytes:
    """The bytes of ``msg`` on the wire: 4-byte big-endian length, then msgpack."""
    body = _ENCODER.encode(msg)
    if len(body) >= MAX_FRAME:
        raise ProtocolError(f"{type(msg).__name__} is {len(body)} bytes, over the {MAX_FRAME}-byte frame limit")
    return _HEADER.pack(len(body)) + body


def decode_request(body: bytes) -> ActorRequest:
    try:
        return _REQUEST.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"rank request cannot be decoded: {exc}") from None


def decode_reply(body: bytes) -> RankReply:
    try:
        return _REPLY.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"rank reply cannot be decoded: {exc}") from None


class FrameReader:
    """Accumulates received bytes; `next_frame()` gives each complete frame's body in order."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_frame(self) -> bytes | None:
        """The body of the oldest complete frame (removed from the buffer), or None."""
        if len(self._buf) < _HEADER.size:
            return None
        (n,) = _HEADER.unpack_from(self._buf)
        if n >= MAX_FRAME:
            raise ProtocolError(f"frame length {n} is over the {MAX_FRAME}-byte limit")
        if len(self._buf) < _HEADER.size + n:
            return None
        body = bytes(self._buf[_HEADER.size:_HEADER.size + n])
        del self._buf[:_HEADER.size + n]
        return body

    @property
    def pending(self) -> int:
        """Bytes received that are not yet a whole frame."""
        return len(self._buf)
