"""Weight versions: the model layout, its fingerprint, chunk hashes and the version digest.

A published version is the model's canonical bf16 tensors in a fixed order. Every
tensor is cut into chunks of ``chunk_elems`` elements (the last chunk of a tensor may
be shorter; an empty tensor has no chunk). Each chunk is hashed with xxh3-128 over its
little-endian bytes; the version *digest* is xxh3-128 over the concatenated chunk
hashes, in tensor order then chunk order. The *fingerprint* is xxh3-128 over a canonical
text of the ordered (name, shape, dtype) triples, so two processes agree on it without
sharing anything but the model definition.

Pure: numpy and xxhash only, no I/O.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import TypeVar

import msgspec
import numpy as np
import torch
import xxhash

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "NO_VERSION",
    "version_label",
    "TensorSpec",
    "Layout",
    "fingerprint_of",
    "chunk_hashes",
    "digest_of",
    "u16_view",
    "specs_of",
    "DEFAULT_THREADS",
    "resolve_threads",
    "parallel_map",
]

DEFAULT_CHUNK_ELEMS = 1 << 20
"""Elements per chunk (2 MiB of bf16): the unit of verification, hashing and undo."""

NO_VERSION = (1 << 64) - 1
"""Version number of "no weights" (the all-zero model an anchor is a delta from)."""


def version_label(v: int) -> str:
    """``v`` as error messages name it: ``"none"`` for :data:`NO_VERSION`."""
    return "none" if v == NO_VERSION else str(v)


_MAX_CHUNK_ELEMS = 1 << 31

DEFAULT_THREADS = max(1, min(2, os.cpu_count() or 1))
"""Worker threads per-chunk work (diff, gaps, scatter-XOR, hashing) uses by default.

numpy's ufuncs and fancy indexing, the numba kernels, xxhash and blosc2 (the codec turns
on blosc2's GIL release, which is off by default) release the GIL on large buffers, so
chunks run truly in parallel; 2 is the deployment target (a trainer or sampler host
leaves the other cores to the model)."""

_T = TypeVar("_T")
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def resolve_threads(threads: int | None) -> int:
    """``threads`` if given (must be >= 1), else :data:`DEFAULT_THREADS`."""
    if threads is None:
        return DEFAULT_THREADS
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return threads


def parallel_map(fn: Callable[[int], _T], items: Sequence[int], threads: int | None = None) -> list[_T]:
    """``[fn(i) for i in items]``, run on a shared pool of ``threads`` workers.

    Results are in ``items`` order. ``fn`` must not itself call :func:`parallel_map`
    (the shared pool's workers would wait on each other). With one thread, or one item,
    it runs inline, so single-threaded callers pay nothing. Many items go out in at most
    ``8 * threads`` contiguous batches (a task costs tens of microseconds; a model with
    tiny chunks has thousands), still enough batches to even out uneven chunks.
    """
    n = resolve_threads(threads)
    items = list(items)
    if n == 1 or len(items) < 2:
        return [fn(i) for i in items]
    pool = _pool(n)
    size = -(-len(items) // (8 * n))
    if size == 1:
        return list(pool.map(fn, items))
    batches = [items[i : i + size] for i in range(0, len(items), size)]
    out: list[_T] = []
    for part in pool.map(lambda b: [fn(i) for i in b], batches):
        out.extend(part)
    return out


def _pool(n: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = ThreadPoolExecutor(n, thread_name_prefix=f"fleetrl-weights-{n}")
    return pool


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of the model: name, shape and dtype name (always ``"bfloat16"`` here)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def specs_of(weights: Mapping[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
    """The ordered specs of a name -> bf16 tensor mapping (mapping order is model order)."""
    out = []
    for name, t in weights.items():
        if t.dtype != torch.bfloat16:
            raise TypeError(f"tensor {name!r}: published weights must be bfloat16, got {t.dtype}")
        out.append(TensorSpec(name, tuple(int(s) for s in t.shape)))
    return tuple(out)


def fingerprint_of(specs: Sequence[TensorSpec]) -> bytes:
    """xxh3-128 of the ordered names, shapes and dtypes (16 bytes)."""
    h = xxhash.xxh3_128()
    for s in specs:
        h.update(f"{s.name}\x00{s.dtype}\x00{','.join(map(str, s.shape))}\n".encode())
    return h.digest()


class Layout:
    """Chunk geometry of a model: which tensor and element range every chunk covers.

    Chunk ``c`` covers elements ``[starts[c], stops[c])`` of tensor ``tensor_of[c]``.
    """

    def __init__(self, specs: Sequence[TensorSpec], chunk_elems: int = DEFAULT_CHUNK_ELEMS):
        if not 1 <= chunk_elems <= _MAX_CHUNK_ELEMS:
            raise ValueError(f"chunk_elems must be in [1, 2**31], got {chunk_elems}")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique")
        for s in specs:
            if s.dtype != "bfloat16":
                raise ValueError(f"tensor {s.name!r}: dtype must be bfloat16, got {s.dtype!r}")
            if s.numel >= 1 << 40:
                raise ValueError(f"tensor {s.name!r}: too many elements ({s.numel})")
        self.specs = tuple(specs)
        self.chunk_elems = chunk_elems
        tensor_of, starts, stops = [], [], []
        for i, s in enumerate(self.specs):
            for start in range(0, s.numel, chunk_elems):
                tensor_of.append(i)
                starts.append(start)
                stops.append(min(start + chunk_elems, s.numel))
        self.tensor_of = np.asarray(tensor_of, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.stops = np.asarray(stops, dtype=np.int64)
        self.lengths = self.stops - self.starts
        self.n_chunks = len(starts)
        first = np.zeros(len(self.specs) + 1, dtype=np.int64)
        np.cumsum([-(-s.numel // chunk_elems) for s in self.specs], out=first[1:])
        self.first_chunk = first  # tensor i owns chunks [first[i], first[i+1])

    @cached_property
    def fingerprint(self) -> bytes:
        return fingerprint_of(self.specs)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    def chunk_name(self, c: int) -> str:
        """Human-readable location of chunk ``c`` for error messages."""
        s = self.specs[int(self.tensor_of[c])]
        return f"tensor {s.name!r} elements [{self.starts[c]}, {self.stops[c]}) (chunk {c})"

    def check_arrays(self, arrays: Sequence[np.ndarray], what: str = "weights") -> None:
        """Raise ValueError unless ``arrays`` are 1-D uint16 arrays matching the specs."""
        if len(arrays) != len(self.specs):
            raise ValueError(f"{what}: expected {len(self.specs)} tensors, got {len(arrays)}")
        for s, a in zip(self.specs, arrays):
            if a.dtype != np.uint16 or a.ndim != 1 or a.size != s.numel:
                raise ValueError(
                    f"{what}: tensor {s.name!r} must be a 1-D uint16 view of {s.numel} "
                    f"elements, got {a.dtype} {a.shape}"
                )

    def zero_digest(self) -> bytes:
        """Digest of the all-zero model (the base of an anchor)."""
        cache: dict[int, bytes] = {}
        hashes = []
        for n in self.lengths.tolist():
            if n not in cache:
                cache[n] = xxhash.xxh3_128_digest(np.zeros(n, dtype=np.uint16))
            hashes.append(cache[n])
        return xxhash.xxh3_128_digest(b"".join(hashes))


def u16_view(t: torch.Tensor) -> np.ndarray:
    """A flat uint16 numpy view sharing memory with a contiguous CPU bf16 tensor."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {t.dtype}")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("expected a contiguous CPU tensor")
    return t.view(torch.int16).reshape(-1).numpy().view(np.uint16)


def chunk_hashes(layout: Layout, arrays: Sequence[np.ndarray], *, threads: int | None = None) -> list[bytes]:
    """xxh3-128 of every chunk, in layout order (chunks hashed on ``threads`` workers)."""
    layout.check_arrays(arrays)
    tensor_of, starts, stops = layout.tensor_of.tolist(), layout.starts.tolist(), layout.stops.tolist()

    def one(c: int) -> bytes:
        return xxhash.xxh3_128_digest(arrays[tensor_of[c]][starts[c] : stops[c]])

    return parallel_map(one, range(layout.n_chunks), threads)


def digest_of(hashes: Sequence[bytes]) -> bytes:
    """The version digest: xxh3-128 over the concatenated chunk hashes."""
    return xxhash.xxh3_128_digest(b"".join(hashes))
