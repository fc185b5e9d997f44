"""Typed messages on the wire: structs, tensors, codecs and the schema-evolution check.

Every message fleetrl sends between processes or hosts is an immutable msgspec Struct
derived from `Message`, encoded as MessagePack. A *conversation* (the messages two
peers exchange on one connection) is a closed tagged union of such structs, wrapped
in a `Codec`; decoding validates the whole message against its schema, so a receiver
works only with well-typed values and a bad frame becomes one exception,
`BadMessage`, that names what is wrong and where. Everything here is pure, without I/O:
the connections that carry the bytes (WebSocket, a local socket) are their owners' code.

- `Record` / `Message`: frozen struct bases. A `Message` carries its type in a
  ``"type"`` field (the class name, or an explicit short ``tag=``); a `Record` is a
  value embedded in messages and carries no tag.
- `Tensor`: an n-d array as raw little-endian bytes + dtype name + shape, including
  dtypes NumPy lacks (``bfloat16``, ``float8_e4m3fn``, ``float8_e5m2``: they travel
  as raw bits). `DTYPE_NAMES` maps the short dtype names of configs (``"bf16"``) to
  these wire names (``"bfloat16"``).
- `Codec`: encode/decode for one conversation.
- `schema_snapshot` / `evolution_problems`: check a catalogue against a released one.

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
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import msgspec
import numpy as np

from .errors import BadMessage

if TYPE_CHECKING:  # torch is imported lazily, inside the helpers that need it
    import torch

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "MAX_WEBSOCKET_MESSAGE",
    "PROTOCOL_VERSION",
    "BadMessage",
    "Codec",
    "DTypeName",
    "Message",
    "Record",
    "Rejected",
    "Tensor",
    "config_dtype",
    "evolution_problems",
    "schema_snapshot",
    "wire_dtype",
]

PROTOCOL_VERSION = 1
"""Version of the message catalogue; raised when a message *type* is added."""

MAX_WEBSOCKET_MESSAGE = 256 << 20
"""The largest message either end of a WebSocket of fleetrl accepts (the control plane's
join endpoints, remote samplers and workers): 256 MiB, about 60,000 generated tokens of
a capped record (4-6 KB a token at a real vocabulary) in one `Generation` or
`Trajectory`. The libraries' defaults (1 MiB in trio-websocket, 16 MiB in hypercorn)
would cut a remote call of a few hundred to a few thousand tokens."""

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
    1 KiB of it).
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

DTypeName = Literal["fp32", "bf16", "fp16", "fp8"]
"""A weight dtype as configs name it (samplers, trainer)."""

DTYPE_NAMES: Mapping[str, str] = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp8": "float8_e4m3fn",
}
"""Config name -> wire name (a key of `DTYPES`): the one map between the two spellings.
A sampler's identity (``SamplerIdentity.dtype``) carries the wire name."""


def wire_dtype(name: str) -> str:
    """The wire name of a config dtype name (``"bf16"`` -> ``"bfloat16"``); a wire name
    passes through unchanged. Else ValueError naming both spellings."""
    if name in DTYPE_NAMES:
        return DTYPE_NAMES[name]
    if name in DTYPES:
        return name
    raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)} "
                     f"or a wire name ({', '.join(DTYPES)})")


def config_dtype(name: str) -> str:
    """The config name of a wire dtype name (``"bfloat16"`` -> ``"bf16"``); a config name
    passes through unchanged. Else ValueError."""
    for short, wire in DTYPE_NAMES.items():
        if name in (short, wire):
            return short
    raise ValueError(f"dtype {name!r} has no config name; expected one of "
                     f"{', '.join(f'{k} ({v})' for k, v in DTYPE_NAMES.items())}")



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
    conversation also carries `Rejected`, which a receiver sends back for each frame it
    cannot accept.
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
