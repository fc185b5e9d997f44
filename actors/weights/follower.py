"""Sampler side: follow the delta stream at any precision, and catch up when behind.

Every follower keeps the canonical bf16 weights (the *shadow*, CPU tensors) and applies
deltas to it bit-exactly; what differs is what it derives from the shadow after each
apply, for the elements the delta touched:

* :class:`Follower` - bf16 samplers use the shadow itself;
* :class:`CastFollower` - fp16 / fp32 samplers: the touched values are cast again;
* :class:`Fp8Follower` - fp8 samplers: the touched tensors, rows or 128-row block bands
  are re-quantized with :func:`.quant.quantize_fp8`, the trainer's own quantizer, so
  every fp8 sampler of a version holds exactly the bytes of a fresh quantization
  (of every tensor, or only of the ``only`` ones: an fp8 sampler keeps its embeddings
  and norms in bf16).

:meth:`Follower.take_touched` says which tensors changed since it was last called
(every tensor after an anchor reset, and at first): a sampler that follows a stream
hands its backend only those (`fleetrl.actors.pool.local.WeightSync`).

:meth:`Follower.sync` (and :meth:`Follower.sync_async` for HTTP) read the manifest,
plan with :func:`.manifest.plan_catchup`, fetch and apply; weights that fail a target
hash (corrupted) or a full :meth:`Follower.verify` fall back to the anchor route.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import msgspec
import numpy as np
import torch
import trio

from . import codec
from .errors import BlobIntegrityError, BlobNotFound, ManifestError
from .manifest import MANIFEST_REF, CatchupPlan, Manifest, decode_manifest, plan_catchup
from .quant import BLOCK, SCHEMES, Scheme, as_2d_shape, quantize_fp8
from .store import BlobStore, key_of
from .version import NO_VERSION, Layout, TensorSpec, chunk_hashes, digest_of, u16_view

__all__ = ["BlobSource", "AsyncBlobSource", "StoreSource", "SyncReport", "Touched", "Follower",
           "CastFollower", "Fp8Follower", "BlobIntegrityError"]


class BlobSource(Protocol):
    def manifest(self) -> Manifest: ...
    def get(self, key: str) -> bytes: ...


class AsyncBlobSource(Protocol):
    async def manifest(self) -> Manifest: ...
    async def get(self, key: str) -> bytes: ...


class StoreSource:
    """A BlobSource reading a BlobStore directly (same machine or a mounted volume)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store

    def manifest(self) -> Manifest:
        return decode_manifest(self.get(self.store.get_ref(MANIFEST_REF)))

    def get(self, key: str) -> bytes:
        data = self.store.read(key)
        if key_of(data) != key:
            raise BlobIntegrityError(f"blob {key} is corrupted in the store")
        return data


class SyncReport(msgspec.Struct, frozen=True):
    from_version: int | None
    to_version: int
    route: str  # "current" | "catchup" | "anchor"
    fallback: bool  # the cheap route failed verification and the anchor route was taken
    blobs: int
    bytes_fetched: int
    apply_s: float


class Touched(msgspec.Struct, frozen=True):
    """The tensors a follower changed since they were last taken (:meth:`Follower.take_touched`)."""

    names: tuple[str, ...]
    """Their names, in layout order (every name when ``full``)."""
    full: bool
    """An anchor reset the weights (or nothing was taken yet): every tensor is new."""


class Follower:
    """A bf16 follower: ``weights`` are the canonical bf16 tensors (CPU)."""

    def __init__(self, run: str, specs: Sequence[TensorSpec], chunk_elems: int) -> None:
        self.run = run
        self.layout = Layout(specs, chunk_elems)
        self.shadow: dict[str, torch.Tensor] = {
            s.name: torch.zeros(s.shape, dtype=torch.bfloat16) for s in self.layout.specs
        }
        self._arrays = [u16_view(t) for t in self.shadow.values()]
        self._zero_digest: bytes | None = None
        self.version: int | None = None
        self.digest: bytes | None = None
        self._touched: set[int] = set()  # tensor indices changed since take_touched
        self._full = True  # every tensor counts as changed (an anchor, or nothing taken yet)

    @classmethod
    def from_manifest(cls, m: Manifest, **kw) -> Follower:
        return cls(m.run, m.tensors, m.chunk_elems, **kw)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def zero_digest(self) -> bytes:
        if self._zero_digest is None:
            self._zero_digest = self.layout.zero_digest()
        return self._zero_digest

    def verify(self) -> bool:
        """Recompute the digest of the shadow; False if it is not the recorded one."""
        return self.version is not None and digest_of(chunk_hashes(self.layout, self._arrays)) == self.digest

    def take_touched(self) -> Touched:
        """The tensors changed by :meth:`apply` since the last call (all of them after an
        anchor, or on the first call), and forget them."""
        names = [s.name for s in self.layout.specs]
        if self._full:
            out = Touched(tuple(names), True)
        else:
            out = Touched(tuple(names[i] for i in sorted(self._touched)), False)
        self._touched, self._full = set(), False
        return out

    def apply(self, blob: bytes | codec.Delta | codec.PackedDelta) -> list[codec.ChangedRange]:
        """Apply one delta (or anchor) in place; raises codec.DeltaError, weights intact
        (an anchor's zeroed weights stay zero)."""
        d = blob if isinstance(blob, (codec.Delta, codec.PackedDelta)) else codec.read(blob)
        codec.check_fits(d, self.layout, run=self.run)
        reset = d.is_anchor
        if reset:
            self._full = True  # from here on every tensor differs from what was taken
            for a in self._arrays:
                a.fill(0)
            cur_v, cur_d = NO_VERSION, self.zero_digest()
            self.version, self.digest = None, None  # until the anchor lands
        else:
            cur_v = NO_VERSION if self.version is None else self.version
            cur_d = self.digest if self.digest is not None else b""
        ranges = codec.apply(self._arrays, d, self.layout, current_version=cur_v,
                             current_digest=cur_d, run=self.run)
        self.version, self.digest = d.target_version, d.target_digest
        self._touched.update(r.tensor for r in ranges)
        self._on_changed(ranges, reset)
        return ranges

    def _on_changed(self, ranges: list[codec.ChangedRange], reset: bool) -> None:
        """Hook for derived precisions; the bf16 follower has nothing to derive."""

    # ------------------------------------------------------------------ catch-up

    def _check_manifest(self, m: Manifest) -> None:
        if m.run != self.run or m.fingerprint != self.layout.fingerprint.hex():
            raise ManifestError(
                f"manifest is for run {m.run!r} model {m.fingerprint}, this follower follows "
                f"run {self.run!r} model {self.layout.fingerprint.hex()}"
            )

    def _plan(self, m: Manifest, verify: bool) -> CatchupPlan:
        self._check_manifest(m)
        trust = self.version is not None and (not verify or self.verify())
        return plan_catchup(m, self.version, self.digest.hex() if self.digest else None,
                            trust_weights=trust)

    def _run(self, plan: CatchupPlan, blobs: list[bytes]) -> float:
        t0 = time.perf_counter()
        for ref, blob in zip(plan.blobs, blobs):
            if key_of(blob) != ref.key:
                raise BlobIntegrityError(f"blob {ref.key} does not hash to its key")
            self.apply(blob)
        return time.perf_counter() - t0

    def sync(self, source: BlobSource, *, verify: bool = False) -> SyncReport:
        """Bring the weights to the source's current version (verify: recheck the digest first)."""
        return self._sync(source.manifest, source.get, verify)

    def _sync(self, get_manifest: Callable[[], Manifest], get: Callable[[str], bytes], verify: bool) -> SyncReport:
        for attempt in range(3):
            m = get_manifest()
            plan = self._plan(m, verify)
            try:
                return self._execute(m, plan, [get(r.key) for r in plan.blobs], get)
            except BlobNotFound:  # collected between reading the manifest and fetching
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _execute(self, m: Manifest, plan: CatchupPlan, blobs: list[bytes], get) -> SyncReport:
        start = self.version
        try:
            apply_s = self._run(plan, blobs)
            fallback = False
        except codec.DeltaVerifyError:
            plan = plan_catchup(m, None, None, trust_weights=False)
            blobs = [get(r.key) for r in plan.blobs]
            apply_s = self._run(plan, blobs)
            fallback = True
        return self._report(start, m, plan, blobs, apply_s, fallback)

    def _report(self, start, m, plan, blobs, apply_s, fallback) -> SyncReport:
        route = "current" if not plan.blobs else ("anchor" if plan.reset else "catchup")
        return SyncReport(from_version=start, to_version=m.version, route=route, fallback=fallback,
                          blobs=len(blobs), bytes_fetched=sum(len(b) for b in blobs), apply_s=apply_s)

    async def sync_async(self, source: AsyncBlobSource, *, verify: bool = False) -> SyncReport:
        """:meth:`sync` over an async source (HTTP); the CPU work runs in a worker thread."""
        for attempt in range(3):
            m = await source.manifest()
            plan = await trio.to_thread.run_sync(self._plan, m, verify)
            try:
                blobs = [await source.get(r.key) for r in plan.blobs]
                start = self.version
                try:
                    apply_s = await trio.to_thread.run_sync(self._run, plan, blobs)
                    fallback = False
                except codec.DeltaVerifyError:
                    plan = plan_catchup(m, None, None, trust_weights=False)
                    blobs = [await source.get(r.key) for r in plan.blobs]
                    apply_s = await trio.to_thread.run_sync(self._run, plan, blobs)
                    fallback = True
                return self._report(start, m, plan, blobs, apply_s, fallback)
            except BlobNotFound:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


class CastFollower(Follower):
    """An fp16 / fp32 follower: ``weights`` are casts of the bf16 shadow, updated where touched."""

    def __init__(self, run: str, specs: Sequence[TensorSpec], chunk_elems: int, *,
                 dtype: torch.dtype = torch.float16) -> None:
        if dtype not in (torch.float16, torch.float32, torch.bfloat16):
            raise ValueError(f"CastFollower dtype must be float16, float32 or bfloat16, got {dtype}")
        super().__init__(run, specs, chunk_elems)
        self.dtype = dtype
        self.cast = {n: t.to(dtype) for n, t in self.shadow.items()}

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.cast

    def _on_changed(self, ranges: list[codec.ChangedRange], reset: bool) -> None:
        names = list(self.shadow)
        if reset:
            for n in names:
                self.cast[n].copy_(self.shadow[n])
            return
        for r in ranges:
            name = names[r.tensor]
            src, dst = self.shadow[name].view(-1), self.cast[name].view(-1)
            if r.positions is None:
                dst[r.start : r.stop] = src[r.start : r.stop].to(self.dtype)
            else:
                idx = torch.from_numpy(r.positions) + r.start
                dst[idx] = src[idx].to(self.dtype)


class Fp8Follower(Follower):
    """An fp8 follower: ``q[name]`` (float8_e4m3fn) and ``scale[name]`` (fp32) are always
    exactly ``quantize_fp8(shadow[name], scheme)``; touched units are re-quantized.

    ``only``: the names to quantize (default: every tensor); the others are followed in
    bf16 only (``shadow``), so ``q`` and ``weights`` hold just the quantized ones.
    """

    def __init__(self, run: str, specs: Sequence[TensorSpec], chunk_elems: int, *,
                 scheme: Scheme = "block128", only: Collection[str] | None = None) -> None:
        super().__init__(run, specs, chunk_elems)
        if scheme not in SCHEMES:
            raise ValueError(f"Fp8Follower scheme must be one of {SCHEMES}, got {scheme!r}")
        self.scheme = scheme
        if only is None:
            quantized = list(self.shadow)
        else:
            unknown = sorted(set(only) - set(self.shadow))
            if unknown:
                raise ValueError(f"Fp8Follower only= names tensors the stream does not have: "
                                 f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
            wanted = set(only)
            quantized = [n for n in self.shadow if n in wanted]
        self.q: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor] = {}
        for n in quantized:
            self._requant_all(n)
        self.requantized_rows = 0  # statistics: rows re-quantized so far

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.q

    def _requant_all(self, name: str) -> None:
        q, s = quantize_fp8(self.shadow[name], self.scheme)
        if name in self.q:  # in place: a sampler may hold references to these tensors
            self.q[name].copy_(q)
            self.scale[name].copy_(s)
        else:
            self.q[name], self.scale[name] = q, s

    def _on_changed(self, ranges: list[codec.ChangedRange], reset: bool) -> None:
        names = list(self.shadow)
        if reset:
            for name in self.q:
                self._requant_all(name)
            return
        ranges = [r for r in ranges if names[r.tensor] in self.q]
        if self.scheme == "tensor":
            for t in sorted({r.tensor for r in ranges}):
                self._requant_all(names[t])
            return
        by_tensor: dict[int, list[np.ndarray]] = {}
        for r in ranges:
            rows, cols = as_2d_shape(self.shadow[names[r.tensor]].shape)
            if r.positions is None:
                touched = np.arange(r.start // cols, (r.stop - 1) // cols + 1)
            else:
                touched = (r.positions + r.start) // cols
            by_tensor.setdefault(r.tensor, []).append(touched)
        for t, parts in by_tensor.items():
            name = names[t]
            rows, cols = as_2d_shape(self.shadow[name].shape)
            touched = np.unique(np.concatenate(parts))
            src = self.shadow[name].view(rows, cols)
            q2 = self.q[name].view(rows, cols)
            if self.scheme == "row":
                idx = torch.from_numpy(touched)
                qr, sr = quantize_fp8(src[idx], "row")
                q2[idx] = qr
                self.scale[name][idx] = sr
                self.requantized_rows += len(touched)
                continue
            bands = np.unique(touched // BLOCK)
            if len(bands) * 2 > -(-rows // BLOCK):  # most bands touched: one pass is cheaper
                self._requant_all(name)
                self.requantized_rows += rows
                continue
            for b in bands.tolist():
                lo, hi = b * BLOCK, min((b + 1) * BLOCK, rows)
                qb, sb = quantize_fp8(src[lo:hi], "block128")
                q2[lo:hi] = qb
                self.scale[name][b] = sb[0]
                self.requantized_rows += hi - lo
