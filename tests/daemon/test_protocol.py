"""The protocol machinery: Tensor, dtype names, Codec errors, schema evolution."""

from __future__ import annotations

import pickle

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.daemon.errors import BadMessage, FleetrlError
from fleetrl.daemon.protocol import (
    DTYPE_NAMES,
    DTYPES,
    Codec,
    Message,
    Record,
    Rejected,
    Tensor,
    config_dtype,
    evolution_problems,
    schema_snapshot,
    wire_dtype,
)

# --------------------------------------------------------------------------- a tiny conversation


class Point(Record):
    x: int
    y: int


class Ping(Message):
    seq: int
    tokens: list[int] = []


class Shape(Message, tag="shape"):
    name: str
    at: Point
    kind: str = "dot"


class Blob(Message):
    t: Tensor


TEST = Codec("test", [Ping, Shape, Blob], error_reply=True)
NO_REPLY = Codec("quiet", [Ping])
ENC = msgspec.msgpack.Encoder()


def bad(data: bytes, codec: Codec = TEST) -> BadMessage:
    with pytest.raises(BadMessage) as info:
        codec.decode(data)
    assert isinstance(info.value, FleetrlError)
    return info.value


# --------------------------------------------------------------------------- Tensor


def random_bits(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    spec = DTYPES[dtype]
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * spec.itemsize)
    return raw.astype(np.uint8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn", "int64"])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 0, 4)])
def test_tensor_round_trips_bit_exactly_through_numpy_codec_and_torch(dtype, shape):
    bits = random_bits(dtype, shape)  # every bit pattern, NaN payloads included
    spec = DTYPES[dtype]
    arr = bits.view(spec.numpy).reshape(shape)
    t = Tensor.from_numpy(arr, dtype=dtype)
    assert (t.dtype, t.shape, t.data) == (dtype, shape, bits.tobytes())
    assert t.numel == int(np.prod(shape))

    back = TEST.decode(TEST.encode(Blob(t=t))).t
    assert back == t
    assert back.to_numpy().tobytes() == bits.tobytes()
    assert back.to_numpy().shape == shape

    tt = back.to_torch()
    assert tt.dtype == getattr(torch, dtype) and tuple(tt.shape) == shape
    assert tt.reshape(-1).view(torch.uint8).numpy().tobytes() == bits.tobytes()
    assert Tensor.from_torch(tt) == t


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_dtype_round_trips_through_torch(dtype):
    bits = random_bits(dtype, (4, 3), seed=1)
    t = Tensor.from_numpy(bits.view(DTYPES[dtype].numpy).reshape(4, 3), dtype=dtype)
    if dtype == "bool":  # torch requires 0/1 bytes for bool
        t = Tensor.from_numpy(bits.reshape(4, 3) % 2 == 1)
    assert Tensor.from_torch(t.to_torch()) == t


def test_tensor_values_agree_with_torch():
    values = [1.5, -2.0, 0.0, 448.0, -0.125]
    for dtype in ("bfloat16", "float8_e4m3fn", "float16", "float32"):
        tt = torch.tensor(values, dtype=torch.float32).to(getattr(torch, dtype))
        t = Tensor.from_torch(tt)
        assert t.to_torch().to(torch.float32).tolist() == values
    bf = Tensor.from_torch(torch.tensor([1.0], dtype=torch.bfloat16))
    assert bf.to_numpy().dtype == np.uint16 and bf.to_numpy().tolist() == [0x3F80]
    f8 = Tensor.from_torch(torch.tensor([1.0], dtype=torch.float8_e4m3fn))
    assert f8.to_numpy().tolist() == [0x38]  # sign 0, exponent 0111, mantissa 000


def test_tensor_from_torch_handles_non_contiguous_tensors():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = Tensor.from_torch(base.T)
    assert t.shape == (4, 3)
    np.testing.assert_array_equal(t.to_numpy(), base.T.numpy())


def test_tensor_from_numpy_copies_non_contiguous_arrays_in_c_order():
    arr = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2].T
    t = Tensor.from_numpy(arr)
    assert t.shape == (2, 3)
    np.testing.assert_array_equal(t.to_numpy(), arr)


def test_tensor_from_numpy_normalises_byte_order():
    arr = np.arange(5, dtype=">i8")
    t = Tensor.from_numpy(arr)
    assert t.dtype == "int64" and t.data == np.arange(5, dtype="<i8").tobytes()
    np.testing.assert_array_equal(t.to_numpy(), arr)
    bits = Tensor.from_numpy(np.array([0x3F80], dtype=">u2"), dtype="bfloat16")
    assert bits.data == b"\x80\x3f" and bits.to_torch().item() == 1.0


def test_tensor_rejects_mismatched_byte_length():
    with pytest.raises(ValueError, match=r"dtype float32 and shape \[2, 3\] needs 24 bytes, got 20"):
        Tensor(data=b"\0" * 20, dtype="float32", shape=(2, 3))
    payload = ENC.encode({"type": "Blob", "t": {"data": b"\0" * 5, "dtype": "int64", "shape": [1]}})
    err = bad(payload)
    assert err.kind == "invalid" and err.path == "$.t"
    assert "needs 8 bytes, got 5" in str(err) and "Blob" in str(err)


def test_tensor_rejects_unknown_dtype_and_bad_shape():
    with pytest.raises(ValueError, match="unknown tensor dtype 'float128'"):
        Tensor(data=b"", dtype="float128", shape=(0,))
    with pytest.raises(ValueError, match="must hold ints >= 0"):
        Tensor(data=b"", dtype="int8", shape=(-1,))
    err = bad(ENC.encode({"type": "Blob", "t": {"data": b"", "dtype": "int8", "shape": [-1]}}))
    assert err.path == "$.t.shape[0]" and ">= 0" in err.detail


def test_tensor_from_numpy_refuses_ambiguous_input():
    with pytest.raises(ValueError, match="has dtype float64, not float32"):
        Tensor.from_numpy(np.zeros(3), dtype="float32")
    with pytest.raises(ValueError, match="bfloat16 travels as raw bits"):
        Tensor.from_numpy(np.zeros(3, dtype=np.float32), dtype="bfloat16")
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        Tensor.from_numpy(np.zeros(3, dtype=np.complex64))


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    size = int(np.prod(shape)) * DTYPES[dtype].itemsize
    data = draw(st.binary(min_size=size, max_size=size))
    return Tensor(data=data, dtype=dtype, shape=shape)


@given(tensors())
def test_any_tensor_round_trips_through_the_codec(t):
    assert TEST.decode(TEST.encode(Blob(t=t))) == Blob(t=t)
    assert t.to_numpy().tobytes() == t.data


# --------------------------------------------------------------------------- codec errors


def test_codec_round_trips_each_type():
    for msg in (Ping(seq=1, tokens=[1, 2]), Shape(name="a", at=Point(x=1, y=-2)), Rejected(kind="x", detail="y")):
        assert TEST.decode(TEST.encode(msg)) == msg
    assert TEST.encode(Shape(name="a", at=Point(x=0, y=0)))[:12].find(b"shape") > 0  # short tag


def test_garbage_bytes_are_malformed():
    err = bad(b"\xc1\xc1garbage")
    assert err.kind == "malformed" and "invalid opcode" in err.detail
    assert "9-byte frame" in str(err) and "'test'" in str(err)
    assert bad(b"").detail == "empty frame"
    assert "trailing characters" in bad(TEST.encode(Ping(seq=1)) + b"\x00").detail


def test_truncated_msgpack_is_malformed():
    data = TEST.encode(Ping(seq=1, tokens=list(range(50))))
    err = bad(data[:-7])
    assert err.kind == "malformed" and "truncated" in err.detail
    assert err.frame_len == len(data) - 7


def test_wrong_type_field_names_path_expected_and_got():
    err = bad(ENC.encode({"type": "Ping", "seq": 1, "tokens": [1, 2, 3, "x"]}))
    assert err.kind == "invalid" and err.path == "$.tokens[3]"
    assert "Expected `int`, got `str`" in err.detail and "Ping" in err.detail
    err = bad(ENC.encode({"type": "shape", "name": "n", "at": {"x": 1, "y": 2.5}}))
    assert err.path == "$.at.y" and "Expected `int`, got `float`" in err.detail


def test_missing_field_is_invalid():
    err = bad(ENC.encode({"type": "shape", "name": "n"}))
    assert err.kind == "invalid" and "missing required field `at`" in err.detail


def test_unknown_tag_names_the_tag_and_what_is_accepted():
    err = bad(ENC.encode({"type": "Pong", "seq": 1}))
    assert err.kind == "unknown_type" and err.path == "$.type"
    assert "unknown message type 'Pong'" in err.detail
    assert "Ping, shape, Blob, Rejected" in err.detail
    assert bad(ENC.encode({"type": "Shape"})).kind == "unknown_type"  # the tag, not the class name


def test_untagged_and_non_map_frames_are_invalid():
    assert "no 'type' field" in bad(ENC.encode({"seq": 1})).detail
    err = bad(ENC.encode([1, 2]))
    assert err.kind == "invalid" and "map with a 'type' field" in err.detail


def test_codec_refuses_to_encode_foreign_types_and_to_build_bad_unions():
    with pytest.raises(TypeError, match="Shape is not a message of conversation 'quiet'"):
        NO_REPLY.encode(Shape(name="a", at=Point(x=0, y=0)))

    class Other(Message, tag="shape"):
        pass

    with pytest.raises(ValueError, match="share the tag 'shape'"):
        Codec("clash", [Shape, Other])
    with pytest.raises(TypeError, match="not a Message type"):
        Codec("records", [Point])  # type: ignore[list-item]


def test_bad_message_pickles():
    err = bad(ENC.encode({"type": "Ping", "seq": "one"}))
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.kind, copy.detail, copy.path, copy.frame_len, str(copy)) == (
        err.kind, err.detail, err.path, err.frame_len, str(err)
    )


def test_messages_are_frozen():
    msg = Ping(seq=1)
    with pytest.raises(AttributeError):
        msg.seq = 2  # type: ignore[misc]


# --------------------------------------------------------------------------- schema evolution


class ThingV1(Message, tag="thing"):
    a: int
    b: str


class ThingV2(Message, tag="thing"):
    a: int
    b: str
    c: list[int] = []
    d: Point | None = None


OLD, NEW = Codec("evo", [ThingV1, Ping]), Codec("evo", [ThingV2, Ping])


def test_old_decoder_accepts_a_message_with_appended_fields():
    msg = ThingV2(a=1, b="x", c=[1, 2], d=Point(x=3, y=4))
    assert OLD.decode(NEW.encode(msg)) == ThingV1(a=1, b="x")


def test_new_decoder_fills_defaults_of_an_old_message():
    assert NEW.decode(OLD.encode(ThingV1(a=1, b="x"))) == ThingV2(a=1, b="x", c=[], d=None)


def test_a_new_message_type_is_rejected_by_an_old_decoder():
    class Added(Message):
        z: int

    err = bad(Codec("evo", [Added]).encode(Added(z=1)), OLD)
    assert err.kind == "unknown_type" and "'Added'" in err.detail


def snapshot_as(cls: type, name: str) -> dict:
    """Snapshot of ``cls`` filed under ``name`` (two versions of one struct in one test)."""
    snap = schema_snapshot([cls])
    snap[name] = snap.pop(cls.__name__)
    return snap


def test_evolution_check_allows_appending_with_defaults():
    old = schema_snapshot([ThingV1])
    assert evolution_problems(old, snapshot_as(ThingV2, "ThingV1")) == []
    assert evolution_problems(old, old) == []


def test_evolution_check_reports_each_breaking_change():
    old = schema_snapshot([ThingV1])

    class Removed(Message, tag="thing"):
        a: int

    class Retyped(Message, tag="thing"):
        a: int
        b: int

    class Required(Message, tag="thing"):
        a: int
        b: str
        c: int

    class Reordered(Message, tag="thing"):
        b: str
        a: int

    def problems(cls):
        return evolution_problems(old, snapshot_as(cls, "ThingV1"))

    assert any("fields removed or renamed: ['b']" in p for p in problems(Removed))
    assert any("ThingV1.b: retyped" in p for p in problems(Retyped))
    assert problems(Required) == ["ThingV1.c: appended field has no default"]
    assert any("fields reordered" in p for p in problems(Reordered))
    assert evolution_problems(old, {}) == ["ThingV1: struct removed or renamed"]


# --------------------------------------------------------------------------- dtype names


def test_dtype_names_map_config_names_to_wire_names_and_back():
    assert dict(DTYPE_NAMES) == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
                                 "fp8": "float8_e4m3fn"}
    for short, wire in DTYPE_NAMES.items():
        assert wire in DTYPES
        assert wire_dtype(short) == wire_dtype(wire) == wire
        assert config_dtype(wire) == config_dtype(short) == short
    with pytest.raises(ValueError, match="unknown dtype 'fp4'"):
        wire_dtype("fp4")
    with pytest.raises(ValueError, match="dtype 'int8' has no config name"):
        config_dtype("int8")
