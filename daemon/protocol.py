"""Typed messages on the wire: structs, tensors, codecs, framing and a receiver loop.

Every message fleetrl sends between processes or hosts is an immutable msgspec Struct
derived from `Message`, encoded as MessagePack. A *conversation* (the messages two
peers exchange on one connection) is a closed tagged union of such structs, wrapped
in a `Codec`; decoding validates the whole message against its schema, so a receiver
works only with well-typed values and a bad frame becomes one exception,
`BadMessage`, that names what is wrong and where.

Layers, bottom up (the first three are pure, without I/O):

- `Record` / `Message`: frozen struct bases. A `Message` carries its type in a
  ``"type"`` field (the class name, or an explicit short ``tag=``); a `Record` is a
  value embedded in messages and carries no tag.
- `Tensor`: an n-d array as raw little-endian bytes + dtype name + shape, including
  dtypes NumPy lacks (``bfloat16``, ``float8_e4m3fn``, ``float8_e5m2``: they travel
  as raw bits).
- `Codec`: encode/decode for one conversation.
- `FramedStream`: length-prefixed frames over a `trio.abc.Stream`, with a maximum
  frame size.
- `MessageStream`: a `FramedStream` plus a `Codec`: send and receive messages.
- `serve_messages`: a receiver loop that survives bad frames.

Schema evolution (the rule every message follows)
-------------------------------------------------
Senders and receivers of different releases must keep understanding each other, so a
released message may only change by **appending fields that have defaults**. Never
remove, rename, reorder or retype a field, and never narrow what a field accepts
(adding a value to a ``Literal`` is a retyping: old receivers reject it). Structs do
*not* set ``forbid_unknown_fields``: an old receiver ignores fields it does not know,
and a new receiver fills a missing appended field with its default. A new message
type, or a ``type`` tag that a receiver does not know, is rejected as
``unknown_type``: a sender may only send a new message type to a peer that announced
a `PROTOCOL_VERSION` that has it (see ``Join``/``Welcome`` in `messages`).

Framing
-------
A frame is a 4-byte big-endian unsigned length followed by that many bytes of
MessagePack. Frames longer than the connection's ``max_frame`` are rejected: the
sender refuses to send one, and a receiver that gets one reads past it (without
keeping it) and goes on with the next frame, unless its length exceeds ``max_skip``,
in which case the framing is taken as lost and the connection ends.
"""

from __future__ import annotations

import math
import re
import struct
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Union

import msgspec
import numpy as np
import structlog
import trio
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from .errors import BadMessage

if TYPE_CHECKING:  # torch is imported lazily, inside the helpers that need it
    import torch

__all__ = [
    "DEFAULT_MAX_FRAME",
    "DTYPES",
    "PROTOCOL_VERSION",
    "BadMessage",
    "Codec",
    "FramedStream",
    "Message",
    "MessageStream",
    "Record",
    "Rejected",
    "StreamStatistics",
    "Tensor",
    "evolution_problems",
    "rejected_counter",
    "schema_snapshot",
    "serve_messages",
]

PROTOCOL_VERSION = 1
"""Version of the message catalogue; raised when a message *type* is added."""

DEFAULT_MAX_FRAME = 64 * 1024 * 1024
"""Default largest frame (bytes) a connection accepts: a 2,000-token trajectory with a
K=20 support is about 0.4 MB, so this leaves two orders of magnitude of room."""

_HEADER = struct.Struct(">I")
_MAX_LENGTH = 2**32 - 1  # what the 4-byte header can express
_READ_CHUNK = 65536

_log = structlog.get_logger("fleetrl.protocol")



def rejected_counter(registry: CollectorRegistry) -> PromCounter:
    """The Prometheus counter of rejected frames, ``fleetrl_messages_rejected_total``
    with labels ``conversation`` and ``kind``, created in ``registry`` (a daemon has
    its own registry, so the protocol keeps no global metric). Pass it to
    `MessageStream` as ``rejected``; several streams may share one."""
    return PromCounter(
        "fleetrl_messages_rejected",
        "Frames rejected by a message receiver, by conversation and reason.",
        ["conversation", "kind"],
        registry=registry,
    )


# --------------------------------------------------------------------------- structs


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """Base of immutable values embedded in messages (no ``type`` tag).

    Fields may only be appended, with defaults (see the module docstring).
    """


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=True):
    """Base of every message: an immutable struct tagged with its type.

    The tag is the class name, or a short explicit one (``class X(Message, tag="x")``).
    Fields may only be appended, with defaults (see the module docstring).
    """


class Rejected(Message):
    """Reply to a frame the receiver could not accept (on conversations that reply).

    ``kind`` is a `BadMessageKind` (kept a plain string so that a kind added later
    does not break old peers); ``detail`` says what is wrong and where (at most
    1 KiB of it, and never more than fits in a frame).
    """

    kind: str
    detail: str


# --------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class _DType:
    name: str
    itemsize: int
    numpy: str  # little-endian numpy dtype string for to_numpy (raw bits when exotic)
    native: bool  # NumPy has this dtype itself (otherwise: raw bits)


DTYPES: Mapping[str, _DType] = {
    d.name: d
    for d in (
        _DType("float64", 8, "<f8", True),
        _DType("float32", 4, "<f4", True),
        _DType("float16", 2, "<f2", True),
        _DType("bfloat16", 2, "<u2", False),
        _DType("float8_e4m3fn", 1, "|u1", False),
        _DType("float8_e5m2", 1, "|u1", False),
        _DType("int64", 8, "<i8", True),
        _DType("int32", 4, "<i4", True),
        _DType("int16", 2, "<i2", True),
        _DType("int8", 1, "|i1", True),
        _DType("uint64", 8, "<u8", True),
        _DType("uint32", 4, "<u4", True),
        _DType("uint16", 2, "<u2", True),
        _DType("uint8", 1, "|u1", True),
        _DType("bool", 1, "|b1", True),
    )
}
"""Dtypes a `Tensor` may carry, by the name used on the wire (torch's names)."""


class Tensor(Record):
    """An n-d array on the wire: raw little-endian bytes, a dtype name, a shape.

    ``dtype`` is one of `DTYPES` (torch's names, e.g. ``"float32"``, ``"bfloat16"``,
    ``"float8_e4m3fn"``). Invariant, checked on construction and on decode:
    ``len(data) == prod(shape) * itemsize(dtype)``.

    NumPy has no bfloat16 or float8 dtypes: `to_numpy` returns those as their raw
    bits (uint16 / uint8 arrays), and `from_numpy` accepts raw-bit arrays together
    with an explicit ``dtype=``. `to_torch` / `from_torch` convert bit-exactly for
    every dtype (torch is imported only when they are called).
    """

    data: bytes
    dtype: str
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]

    def __post_init__(self) -> None:
        spec = DTYPES.get(self.dtype)
        if spec is None:
            raise ValueError(
                f"unknown tensor dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}"
            )
        # construction from Python skips msgspec's type checks (decoding does not)
        if not all(type(d) is int and d >= 0 for d in self.shape):
            raise ValueError(f"tensor shape {self.shape!r} must hold ints >= 0")
        expected = math.prod(self.shape) * spec.itemsize
        if len(self.data) != expected:
            raise ValueError(
                f"tensor of dtype {self.dtype} and shape {list(self.shape)} needs "
                f"{expected} bytes, got {len(self.data)}"
            )

    @property
    def numel(self) -> int:
        """Number of elements (``prod(shape)``)."""
        return math.prod(self.shape)

    @classmethod
    def from_numpy(cls, array: np.ndarray, dtype: str | None = None) -> Tensor:
        """Wrap a NumPy array (copied, made little-endian and C-contiguous).

        ``dtype`` defaults to the array's own dtype name. For bfloat16 / float8 pass
        ``dtype=`` with an array of their raw bits (uint16 / uint8), or an array of
        an extension dtype of that name (e.g. ml_dtypes).
        """
        array = np.asarray(array)
        name = dtype if dtype is not None else array.dtype.name
        spec = DTYPES.get(name)
        if spec is None:
            raise ValueError(
                f"unknown tensor dtype {name!r}; expected one of {', '.join(DTYPES)}"
            )
        if spec.native:
            if array.dtype.name != name:
                raise ValueError(
                    f"array has dtype {array.dtype}, not {name}; cast it first"
                )
            array = array.astype(spec.numpy, copy=False)
        elif array.dtype.name != name and not (
            array.dtype.kind == "u" and array.dtype.itemsize == spec.itemsize
        ):
            raise ValueError(
                f"{name} travels as raw bits: pass a uint{8 * spec.itemsize} array of "
                f"its bits (got dtype {array.dtype})"
            )
        elif array.dtype.kind == "u" and array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        data = array.tobytes()  # C order, whatever the array's layout
        return cls(data=data, dtype=name, shape=tuple(int(d) for d in array.shape))

    def to_numpy(self) -> np.ndarray:
        """A read-only NumPy view of the data (raw bits for bfloat16 / float8)."""
        return np.frombuffer(self.data, dtype=DTYPES[self.dtype].numpy).reshape(self.shape)

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> Tensor:
        """Copy a torch tensor (any device, any layout) bit-exactly."""
        import torch

        _require_little_endian()
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(f"torch dtype {tensor.dtype} cannot travel as a Tensor")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes()
        return cls(data=data, dtype=name, shape=tuple(int(d) for d in tensor.shape))

    def to_torch(self) -> torch.Tensor:
        """A new CPU torch tensor with exactly these bits (writable, owns its memory)."""
        import torch

        _require_little_endian()
        torch_dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=torch_dtype)
        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return raw.view(torch_dtype).reshape(self.shape)


def _require_little_endian() -> None:
    if sys.byteorder != "little":  # pragma: no cover - no such host in the fleet
        raise RuntimeError("Tensor's torch helpers assume a little-endian host")


# --------------------------------------------------------------------------- codec


class _Envelope(msgspec.Struct):
    """Reads only the tag of a rejected frame, to say which message it claimed to be."""

    type: Any = None


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_PATH = re.compile(r"^(?P<what>.*?)(?: - at `(?P<path>\$[^`]*)`)?$", re.S)


class Codec:
    """Encoder and validating decoder for one conversation (a union of `Message` types).

    ``Codec("sampler", [GenerateRequest, Generation])``. With ``error_reply=True`` the
    conversation also carries `Rejected`, which `serve_messages` sends back for each
    frame it cannot accept.
    """

    def __init__(
        self, name: str, types: Iterable[type[Message]], *, error_reply: bool = False
    ) -> None:
        members = list(dict.fromkeys(types))
        if error_reply and Rejected not in members:
            members.append(Rejected)
        if not members:
            raise ValueError(f"conversation {name!r} has no message types")
        tags: dict[str, type[Message]] = {}
        for cls in members:
            if not (isinstance(cls, type) and issubclass(cls, Message)):
                raise TypeError(f"conversation {name!r}: {cls!r} is not a Message type")
            tag = cls.__struct_config__.tag
            if tag in tags:
                raise ValueError(
                    f"conversation {name!r}: {cls.__name__} and {tags[tag].__name__} "
                    f"share the tag {tag!r}"
                )
            tags[tag] = cls
        self.name = name
        self.types: tuple[type[Message], ...] = tuple(members)
        self.tags: Mapping[str, type[Message]] = tags
        self.error_reply = error_reply
        self._encoder = msgspec.msgpack.Encoder()
        union = Union[tuple(members)] if len(members) > 1 else members[0]  # noqa: UP007
        self._decoder = msgspec.msgpack.Decoder(union)

    def __repr__(self) -> str:
        return f"Codec({self.name!r}, [{', '.join(self.tags)}])"

    def encode(self, msg: Message) -> bytes:
        """MessagePack bytes of ``msg``; a type outside the conversation is a bug."""
        if type(msg) not in self.types:
            raise TypeError(
                f"{type(msg).__name__} is not a message of conversation {self.name!r} "
                f"(it carries {', '.join(self.tags)})"
            )
        return self._encoder.encode(msg)

    def decode(self, data: bytes | bytearray | memoryview) -> Message:
        """The message in ``data``, fully validated; else `BadMessage` saying why."""
        try:
            return self._decoder.decode(data)
        except msgspec.ValidationError as exc:
            raise self._invalid(data, str(exc)) from None
        except msgspec.DecodeError as exc:
            text = str(exc)
            if not len(data):
                text = "empty frame"
            elif text.startswith("Input data was truncated"):
                text = "MessagePack data ends early (input data was truncated)"
            raise BadMessage(
                text, kind="malformed", conversation=self.name, frame_len=len(data)
            ) from None

    def _invalid(self, data: bytes | bytearray | memoryview, text: str) -> BadMessage:
        match = _PATH.match(text)
        what, path = (match["what"], match["path"]) if match else (text, None)
        try:
            tag = _ENVELOPE.decode(data).type
        except msgspec.DecodeError:
            tag = None
        accepts = ", ".join(self.tags)
        if path is None and "`type`" in what:
            return BadMessage(
                f"message has no 'type' field; this conversation carries {accepts}",
                kind="invalid",
                conversation=self.name,
                frame_len=len(data),
                path="$.type",
            )
        if path == "$.type":
            return BadMessage(
                f"unknown message type {tag!r}; this conversation carries {accepts}",
                kind="unknown_type",
                conversation=self.name,
                frame_len=len(data),
                path="$.type",
            )
        if path is None and what.startswith("Expected `object`"):
            detail = f"a message is a map with a 'type' field: {what}"
        else:
            name = tag if isinstance(tag, str) and tag in self.tags else "message"
            detail = f"{name}: {what}" + (f" at `{path}`" if path else "")
        return BadMessage(
            detail, kind="invalid", conversation=self.name, frame_len=len(data), path=path
        )


# --------------------------------------------------------------------------- framing


class FramedStream(trio.abc.AsyncResource):
    """Length-prefixed frames over a Trio byte stream.

    A frame is a 4-byte big-endian length and that many payload bytes. Any number of
    tasks may send (a lock keeps frames whole); one task at a time may receive.

    ``max_frame`` bounds a frame's payload. ``max_skip`` (default ``4 * max_frame``)
    bounds the oversized frames a receiver reads past to keep the connection: a longer
    header is taken as lost framing (e.g. a peer that does not speak this protocol).
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_skip: int | None = None,
        name: str = "",
    ) -> None:
        if not 0 < max_frame <= _MAX_LENGTH:
            raise ValueError(f"max_frame must be in 1..{_MAX_LENGTH}, got {max_frame}")
        self.stream = stream
        self.max_frame = max_frame
        self.max_skip = min(_MAX_LENGTH, 4 * max_frame if max_skip is None else max_skip)
        self.name = name
        self._buf = bytearray()
        self._send_lock = trio.Lock()
        self._receiving = False
        self._broken: str | None = None

    async def send_frame(self, payload: bytes) -> None:
        """Send one frame; `BadMessage` ("oversized") without sending if too long."""
        if len(payload) > self.max_frame:
            raise BadMessage(
                f"refusing to send a frame of {len(payload)} bytes; the limit is "
                f"{self.max_frame}",
                kind="oversized",
                conversation=self.name,
                frame_len=len(payload),
            )
        async with self._send_lock:
            await self.stream.send_all(_HEADER.pack(len(payload)) + payload)

    async def receive_frame(self) -> bytes:
        """The next frame's payload.

        Raises `trio.EndOfChannel` when the peer closed the stream between frames;
        `BadMessage` with ``recoverable=True`` for an oversized frame that was read
        past; `BadMessage` with ``recoverable=False`` when the stream ended mid-frame
        or a length is beyond ``max_skip`` (later calls then raise
        `trio.BrokenResourceError`).
        """
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving frames")
        if self._broken is not None:
            raise trio.BrokenResourceError(f"framing lost earlier: {self._broken}")
        self._receiving = True
        try:
            return await self._receive_frame()
        except BadMessage as exc:
            if not exc.recoverable:
                self._broken = str(exc)
            raise
        finally:
            self._receiving = False

    async def _receive_frame(self) -> bytes:
        if not await self._fill(_HEADER.size):
            if not self._buf:
                raise trio.EndOfChannel
            raise self._truncated(f"stream ended inside a frame header ({len(self._buf)} of 4 bytes)")
        (length,) = _HEADER.unpack_from(self._buf)
        if length > self.max_frame:
            if length > self.max_skip:
                raise BadMessage(
                    f"frame header announces {length} bytes, beyond the {self.max_skip}-byte "
                    "skip limit: framing lost, closing the connection",
                    kind="oversized",
                    conversation=self.name,
                    frame_len=length,
                    recoverable=False,
                )
            del self._buf[: _HEADER.size]
            await self._skip(length)
            raise BadMessage(
                f"frame of {length} bytes exceeds the {self.max_frame}-byte limit; skipped it",
                kind="oversized",
                conversation=self.name,
                frame_len=length,
            )
        if not await self._fill(_HEADER.size + length):
            got = len(self._buf) - _HEADER.size
            raise self._truncated(
                f"stream ended inside a frame: got {got} of {length} bytes", length
            )
        payload = bytes(self._buf[_HEADER.size : _HEADER.size + length])
        del self._buf[: _HEADER.size + length]
        return payload

    async def _fill(self, size: int) -> bool:
        """Buffer at least ``size`` bytes; False if the stream ends first."""
        while len(self._buf) < size:
            chunk = await self.stream.receive_some(max(_READ_CHUNK, size - len(self._buf)))
            if not chunk:
                return False
            self._buf += chunk
        return True

    async def _skip(self, size: int) -> None:
        """Read past ``size`` payload bytes without keeping them."""
        remaining = size
        while remaining:
            if self._buf:
                n = min(remaining, len(self._buf))
                del self._buf[:n]
                remaining -= n
                continue
            chunk = await self.stream.receive_some(_READ_CHUNK)
            if not chunk:
                raise self._truncated(
                    f"stream ended while skipping an oversized frame: "
                    f"{size - remaining} of {size} bytes",
                    size,
                )
            self._buf += chunk

    def _truncated(self, detail: str, frame_len: int | None = None) -> BadMessage:
        self._buf.clear()
        return BadMessage(
            detail,
            kind="truncated",
            conversation=self.name,
            frame_len=frame_len,
            recoverable=False,
        )

    async def aclose(self) -> None:
        await self.stream.aclose()


# --------------------------------------------------------------------------- messages over frames


@dataclass(frozen=True)
class StreamStatistics:
    """Counters of one `MessageStream` (a snapshot)."""

    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    rejected: Mapping[str, int] = field(default_factory=dict)
    """Frames rejected, by `BadMessageKind`."""

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


class MessageStream(trio.abc.AsyncResource):
    """Typed messages over a byte stream: a `FramedStream` plus a `Codec`.

    ``send`` encodes and frames a message (safe from several tasks); ``receive``
    returns the next valid message, raising `BadMessage` for a frame it rejects
    (which it counts in `statistics`, and in ``rejected``, a Prometheus counter
    labelled by conversation and kind such as `rejected_counter` makes) and
    `trio.EndOfChannel` at a clean end. ``peer`` names the other end in logs.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        codec: Codec,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_skip: int | None = None,
        peer: str = "",
        rejected: PromCounter | None = None,
    ) -> None:
        self.codec = codec
        self.peer = peer
        self._rejected_metric = rejected
        self.frames = FramedStream(stream, max_frame=max_frame, max_skip=max_skip, name=codec.name)
        self._sent = self._received = self._bytes_sent = self._bytes_received = 0
        self._rejected: Counter[str] = Counter()

    async def send(self, msg: Message) -> None:
        payload = self.codec.encode(msg)
        await self.frames.send_frame(payload)
        self._sent += 1
        self._bytes_sent += len(payload)

    async def receive(self) -> Message:
        try:
            payload = await self.frames.receive_frame()
            self._bytes_received += len(payload)
            msg = self.codec.decode(payload)
        except BadMessage as exc:
            self._rejected[exc.kind] += 1
            if self._rejected_metric is not None:
                self._rejected_metric.labels(self.codec.name, exc.kind).inc()
            raise
        self._received += 1
        return msg

    async def send_eof(self) -> None:
        """Tell the peer we will send no more (the stream must support half-close)."""
        stream = self.frames.stream
        if not isinstance(stream, trio.abc.HalfCloseableStream):
            raise TypeError(f"{type(stream).__name__} cannot half-close; use aclose()")
        async with self.frames._send_lock:
            await stream.send_eof()

    def statistics(self) -> StreamStatistics:
        return StreamStatistics(
            frames_sent=self._sent,
            frames_received=self._received,
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            rejected=dict(self._rejected),
        )

    async def aclose(self) -> None:
        await self.frames.aclose()


Handler = Callable[[Message], Awaitable[Message | None]]


async def serve_messages(stream: MessageStream, handler: Handler) -> None:
    """Feed each valid message of ``stream`` to ``handler`` until the peer is done.

    ``handler(msg)`` may return a reply, which is sent back on the same stream. A frame
    that is not an acceptable message is logged (``message rejected``, with its kind
    and detail), counted (see `MessageStream`), answered with `Rejected` when the
    conversation has error replies, and then the next frame is served. Returns when
    the peer closes the stream, when a frame is cut off by the end of the stream, when
    framing is lost, or when the peer is gone while we reply. Exceptions from
    ``handler`` propagate: a bug in the handler is not the peer's fault.
    """
    log = _log.bind(conversation=stream.codec.name, peer=stream.peer)
    while True:
        try:
            msg = await stream.receive()
        except trio.EndOfChannel:
            return
        except BadMessage as exc:
            log.warning(
                "message rejected",
                kind=exc.kind,
                detail=exc.detail,
                path=exc.path,
                frame_len=exc.frame_len,
                recoverable=exc.recoverable,
            )
            if exc.kind == "truncated":
                return  # the peer stopped sending mid-frame: nobody to answer
            if stream.codec.error_reply:
                reply = _rejection(exc, stream)
                if reply is not None and not await _reply(stream, reply, log):
                    return
            if not exc.recoverable:
                return
            continue
        reply = await handler(msg)
        if reply is not None and not await _reply(stream, reply, log):
            return


_MAX_REJECTION_DETAIL = 1024  # bytes of UTF-8


def _rejection(exc: BadMessage, stream: MessageStream) -> Rejected | None:
    """The `Rejected` reply to ``exc``, its detail cut to fit a frame (None: cannot fit)."""
    overhead = len(stream.codec.encode(Rejected(kind=exc.kind, detail=""))) + 5  # str header
    budget = min(_MAX_REJECTION_DETAIL, stream.frames.max_frame - overhead)
    if budget < 0:
        return None
    raw = exc.detail.encode()
    detail = exc.detail if len(raw) <= budget else raw[:budget].decode(errors="ignore")
    return Rejected(kind=exc.kind, detail=detail)


async def _reply(stream: MessageStream, msg: Message, log: Any) -> bool:
    """Send ``msg``; False (logged) if the peer has gone away."""
    try:
        await stream.send(msg)
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        log.info("peer gone before reply", reply=type(msg).__name__, error=str(exc))
        return False
    return True


# --------------------------------------------------------------------------- evolution checks


def schema_snapshot(types: Iterable[type[msgspec.Struct]]) -> dict[str, Any]:
    """The wire schema of ``types`` and every struct they contain, as JSON-able data.

    One entry per struct name: its fields in order, the required ones, and each
    field's JSON schema (type, constraints, default). Docstrings are left out, so
    only changes that matter on the wire show. Store a snapshot when a catalogue is
    released and check later versions against it with `evolution_problems`.
    """
    _, components = msgspec.json.schema_components(list(types), ref_template="#/$defs/{name}")
    components = msgspec.json.decode(msgspec.json.encode(components))  # JSON-normal: () -> []
    return {
        name: {
            "fields": list(c.get("properties", {})),
            "required": sorted(c.get("required", [])),
            "properties": c.get("properties", {}),
        }
        for name, c in sorted(components.items())
    }


def evolution_problems(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Ways schema ``new`` breaks the evolution rule relative to snapshot ``old``.

    Allowed: new structs, and new fields with defaults appended after the old ones.
    Reported: a struct that disappeared; a field removed, renamed, moved, retyped
    (including a changed constraint, default or ``Literal`` value set); a field
    whose required-ness changed; an appended field without a default.
    """
    problems: list[str] = []
    for name, was in old.items():
        now = new.get(name)
        if now is None:
            problems.append(f"{name}: struct removed or renamed")
            continue
        old_fields, new_fields = list(was["fields"]), list(now["fields"])
        if new_fields[: len(old_fields)] != old_fields:
            missing = [f for f in old_fields if f not in new_fields]
            what = f"fields removed or renamed: {missing}" if missing else "fields reordered"
            problems.append(f"{name}: {what} (old order {old_fields}, new {new_fields})")
        for f in old_fields:
            if f in now["properties"] and now["properties"][f] != was["properties"][f]:
                problems.append(
                    f"{name}.{f}: retyped from {was['properties'][f]} to {now['properties'][f]}"
                )
            if f in new_fields and (f in was["required"]) != (f in now["required"]):
                problems.append(f"{name}.{f}: required-ness changed")
        for f in new_fields:
            if f not in old_fields and f in now["required"]:
                problems.append(f"{name}.{f}: appended field has no default")
    return problems
