"""Trainer side: publish each version as a step delta, catch-up deltas, anchors and a manifest.

Per published version v the publisher writes to its store:

* the step delta v-1 -> v (verified by applying it to its own bf16 shadow of v-1,
  which is how that shadow becomes v: a round trip on every step, at no extra copy);
* one combined catch-up delta u -> v for each u in [v - window, v - 1] (built by
  composing the previous catch-up deltas with the new step, never by re-diffing);
* a full anchor every ``anchor_every`` versions (and at version 0), and the combined
  delta anchor -> v otherwise;
* the manifest naming all of these, then the ref ``manifest`` pointing at it (last, so
  a reader never sees a manifest whose blobs are missing).

Blobs no longer named by the current or the previous manifest are deleted, so a
follower that has just read the previous manifest still finds its blobs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import msgspec
import numpy as np
import torch

from . import codec
from .manifest import MANIFEST_REF, BlobRef, Manifest, encode_manifest
from .metrics import VersionMetrics, entropy_bound_bytes
from .store import BlobStore
from .version import DEFAULT_CHUNK_ELEMS, NO_VERSION, Layout, chunk_hashes, digest_of, specs_of, u16_view

__all__ = ["PublisherConfig", "Publisher"]


class PublisherConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run: str
    window: int = 8  # versions a follower may lag and still get one combined delta
    anchor_every: int = 32
    chunk_elems: int = DEFAULT_CHUNK_ELEMS
    params: codec.CodecParams = codec.CodecParams()
    gc: bool = True

    def __post_init__(self) -> None:
        if not self.run:
            raise ValueError("PublisherConfig.run must be a non-empty run id")
        if self.window < 1:
            raise ValueError(f"PublisherConfig.window must be >= 1, got {self.window}")
        if self.anchor_every < 1:
            raise ValueError(f"PublisherConfig.anchor_every must be >= 1, got {self.anchor_every}")


def _ref(key: str, blob_len: int, d: codec.Delta) -> BlobRef:
    base = None if d.base_version == NO_VERSION else d.base_version
    return BlobRef(key, blob_len, base, d.base_digest.hex(), d.target_version)


class Publisher:
    """Publishes bf16 versions of one model (fixed names, shapes) into a BlobStore."""

    def __init__(self, store: BlobStore, cfg: PublisherConfig) -> None:
        self.store = store
        self.cfg = cfg
        self.layout: Layout | None = None
        self.version: int | None = None
        self.digest: bytes | None = None
        self._shadow: list[np.ndarray] = []
        self._catchup: dict[int, codec.Delta] = {}  # base version -> delta base -> current
        self._steps: dict[int, tuple[BlobRef, codec.Delta]] = {}
        self._anchor: BlobRef | None = None
        self._resync = False  # a publish failed half-way: the next one starts afresh
        self._since_anchor: codec.Delta | None = None
        self._live: list[set[str]] = []  # blob keys of the last manifests
        self.manifest: Manifest | None = None

    def resume_after(self, version: int) -> None:
        """Continue a sequence this publisher did not write: the next :meth:`publish` is
        ``version + 1`` and, with no shadow of ``version`` here, a full anchor (its
        manifest names no step or catch-up delta older than the anchor, so followers of
        the earlier sequence take the anchor route). Call it when restarting on a store
        whose manifest is at ``version`` (the trainer after a crash or restart)."""
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < NO_VERSION - 1:
            raise ValueError(f"resume_after: version must be an int in [0, 2**64 - 2), got {version!r}")
        self.version, self.digest = version, None
        self._shadow, self._catchup, self._steps, self._since_anchor = [], {}, {}, None
        self._resync = True

    def publish(self, weights: Mapping[str, torch.Tensor]) -> VersionMetrics:
        """Publish ``weights`` (name -> bf16 tensor, model order) as the next version.

        If publishing fails half-way (e.g. the store cannot be written), the exception
        propagates and the next call publishes a fresh anchor (no step delta from a
        shadow that may be half-updated); the manifest keeps naming the last good version.
        """
        specs = specs_of(weights)
        if self.layout is None:
            self.layout = Layout(specs, self.cfg.chunk_elems)
        elif specs != self.layout.specs:
            raise ValueError(
                "published weights do not match the model's names/shapes "
                f"(fingerprint {self.layout.fingerprint.hex()}); a new model needs a new run"
            )
        try:
            return self._publish(weights)
        except BaseException:
            self._resync = True
            raise

    def _publish(self, weights: Mapping[str, torch.Tensor]) -> VersionMetrics:
        t_start = time.perf_counter()
        layout = self.layout
        arrays = [u16_view(t.detach().cpu().contiguous()) for t in weights.values()]
        hashes = chunk_hashes(layout, arrays)
        digest = digest_of(hashes)
        v = 0 if self.version is None else self.version + 1
        total = layout.numel
        run, params = self.cfg.run, self.cfg.params

        fresh = self.version is None or self._resync
        if fresh:
            step_bytes, changed, bound, enc_s, app_s = 0, total, 0.0, 0.0, 0.0
            self._shadow = [a.copy() for a in arrays]
            self._catchup, self._steps, self._since_anchor = {}, {}, None
        else:
            t0 = time.perf_counter()
            step = codec.build(layout, self._shadow, arrays, run=run, base_version=self.version,
                               base_digest=self.digest, target_version=v, target_hashes=hashes,
                               params=params)
            blob = codec.serialize(step, params)
            enc_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            codec.apply(self._shadow, blob, layout, current_version=self.version,
                        current_digest=self.digest, run=run)
            app_s = time.perf_counter() - t0
            step_bytes = len(blob)
            values = step.xor_words()
            changed = int(values.size)
            bound = entropy_bound_bytes(total, values)
            key = self.store.put(blob)
            self._steps[v] = (_ref(key, len(blob), step), step)
            self._catchup = {u: codec.compose(d, step, layout, params)
                             for u, d in self._catchup.items() if u >= v - self.cfg.window}
            self._catchup[self.version] = step

        anchor_bytes = 0
        if fresh or v % self.cfg.anchor_every == 0:
            anchor = codec.build(layout, None, arrays, run=run, base_version=NO_VERSION,
                                 base_digest=layout.zero_digest(), target_version=v,
                                 target_hashes=hashes, params=params)
            blob = codec.serialize(anchor, params)
            anchor_bytes = len(blob)
            self._anchor = _ref(self.store.put(blob), len(blob), anchor)
            self._since_anchor = None
        else:
            self._since_anchor = step if self._since_anchor is None else codec.compose(
                self._since_anchor, step, layout, params)

        step_ref, step_delta = self._steps.get(v, (None, None))
        catchup_refs = []
        for u in sorted(self._catchup):
            d = self._catchup[u]
            if d is step_delta:
                catchup_refs.append(step_ref)
            else:
                blob = codec.serialize(d, params)
                catchup_refs.append(_ref(self.store.put(blob), len(blob), d))
        since_ref = None
        if self._since_anchor is step_delta and step_delta is not None:
            since_ref = step_ref
        elif self._since_anchor is not None:
            blob = codec.serialize(self._since_anchor, params)
            since_ref = _ref(self.store.put(blob), len(blob), self._since_anchor)
        self._steps = {u: s for u, s in self._steps.items() if u > v - self.cfg.window}

        self.version, self.digest, self._resync = v, digest, False
        self.manifest = Manifest(
            format=1, run=run, fingerprint=layout.fingerprint.hex(), chunk_elems=layout.chunk_elems,
            tensors=layout.specs, version=v, digest=digest.hex(), window=self.cfg.window,
            anchor_every=self.cfg.anchor_every, anchor=self._anchor, since_anchor=since_ref,
            catchup=tuple(catchup_refs), steps=tuple(s[0] for _, s in sorted(self._steps.items())),
        )
        mkey = self.store.put(encode_manifest(self.manifest))
        self.store.set_ref(MANIFEST_REF, mkey)
        keys = {mkey, self._anchor.key, *(r.key for r in catchup_refs),
                *(r.key for r in self.manifest.steps)}
        if since_ref is not None:
            keys.add(since_ref.key)
        self._collect(keys)

        bf16_bytes = 2 * total
        return VersionMetrics(
            version=v, anchor=fresh, total_elements=total, changed_elements=changed,
            changed_fraction=changed / total if total else 0.0, delta_bytes=step_bytes,
            ratio_vs_bf16=bf16_bytes / step_bytes if step_bytes else 0.0,
            entropy_bound_bytes=bound, bound_ratio=bf16_bytes / bound if bound else 0.0,
            pct_of_bound=100.0 * bound / step_bytes if step_bytes else 0.0,
            encode_s=enc_s, apply_s=app_s, anchor_bytes=anchor_bytes,
            publish_s=time.perf_counter() - t_start,
        )

    def _collect(self, keys: set[str]) -> None:
        self._live.append(keys)
        if len(self._live) > 2:
            old = self._live.pop(0)
            if self.cfg.gc:
                for k in old - self._live[0] - self._live[1]:
                    self.store.delete(k)
