"""The sampler backend protocol: what every backend (torch, vLLM, remote) provides.

A backend turns a batch of token-id prompts into generations and reports, for every
generated token, exactly what it sampled from (refs/corrections.md):

* the token id and ``log q^S`` of it, under the distribution actually sampled (after
  temperature, top-p and the top-k cap, renormalised over the support ``S``);
* the support itself: its token ids and their ``log q^S``, in CSR form (flat ids, flat
  log-probs, offsets per position), most likely first;
* the weight version whose forward pass produced the token's logits. Versions can
  change *between decode steps* (in-flight updates), so one generation may carry
  several versions, non-decreasing along the sequence.

Backends are synchronous and CPU/GPU bound: an actor calls them from a worker thread
(``trio.to_thread.run_sync``). Weight updates may arrive from another thread while a
generation runs; a backend applies them between two decode steps, never inside one.

The structs here cross process and host boundaries (msgpack via msgspec) and check
themselves when built or decoded, so a malformed message names what is wrong.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import msgspec
import numpy as np
import torch

__all__ = [
    "BackendBase",
    "BadGenerateRequest",
    "BadWeightUpdate",
    "Generation",
    "Health",
    "NumericalFailure",
    "SamplerBackend",
    "SamplerError",
    "SamplerIdentity",
    "SamplingParams",
    "WeightVersion",
    "check_prompts",
    "files_digest",
]

DType = Literal["fp32", "bf16", "fp16", "fp8"]
FinishReason = Literal["stop", "length"]


class SamplerError(Exception):
    """Root of the errors raised by sampler backends."""


class BadGenerateRequest(SamplerError, ValueError):
    """A generate call's prompts or sampling parameters are invalid (the caller's fault)."""


class BadWeightUpdate(SamplerError, ValueError):
    """A weight version handed to a backend does not fit it (names, shapes, version order)."""


class NumericalFailure(SamplerError):
    """The model produced NaN/inf logits (e.g. fp16 overflow, or weights gone bad)."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample one batch. Invalid values raise ValueError naming the field."""

    max_tokens: int
    """Most tokens to generate per prompt (the context length may end it sooner)."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy (support = the argmax, lowest id on ties)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]: the support is the shortest most-likely-first prefix reaching it."""
    top_k: int | None = None
    """Cap on the support size (None: no cap). Bounds the memory of the reported support."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end a sequence; the stop token is generated and reported."""
    seed: int | None = None
    """Seed of the sampling RNG: same seed, weights, prompts and params give the same tokens."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise ValueError(f"SamplingParams.top_k must be >= 1 or None, got {self.top_k!r}")
        for i, stop in enumerate(self.stop_ids):
            if isinstance(stop, bool) or stop < 0:
                raise ValueError(f"SamplingParams.stop_ids[{i}] must be a token id >= 0, got {stop!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"SamplingParams.seed must be in [0, 2**63), got {self.seed!r}")


class SamplerIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """Which sampler produced a generation: backend name, device kind, weight dtype."""

    backend: str
    device: str
    dtype: DType


class WeightVersion(msgspec.Struct, frozen=True):
    """A weight version number and the digest of the weights it names."""

    version: int
    digest: str

    def __post_init__(self) -> None:
        if self.version < 0:
            raise ValueError(f"WeightVersion.version must be >= 0, got {self.version}")


class Health(msgspec.Struct, frozen=True, kw_only=True):
    """Result of a backend health check: a real forward pass, not a liveness flag."""

    ok: bool
    identity: SamplerIdentity
    version: WeightVersion
    detail: str
    """What was checked, or what failed."""


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt's generated tokens with everything the trainer needs to correct for them.

    Per generated token t (N tokens): ``token_ids[t]``, ``logprobs[t]`` (= log q^S of
    it), ``versions[t]``; its support is ``support_ids[o[t]:o[t+1]]`` with log-probs
    ``support_logprobs[o[t]:o[t+1]]`` where ``o = support_offsets`` (N + 1 entries,
    starting at 0), most likely first. Built or decoded, the struct checks that the
    CSR arrays agree, every support is non-empty and holds its sampled token with the
    same log-prob, and versions never decrease.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    support_ids: tuple[int, ...]
    support_logprobs: tuple[float, ...]
    support_offsets: tuple[int, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason
    sampler: SamplerIdentity
    seed: int
    """The RNG seed the batch was sampled with (drawn at random when the request had none)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        where = "Generation"
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"{where}: token_ids, logprobs and versions must have equal lengths, got "
                f"{n}, {len(self.logprobs)}, {len(self.versions)}"
            )
        if len(self.support_offsets) != n + 1:
            raise ValueError(f"{where}.support_offsets must have len(token_ids) + 1 = {n + 1} entries, "
                             f"got {len(self.support_offsets)}")
        if len(self.support_ids) != len(self.support_logprobs):
            raise ValueError(f"{where}: support_ids ({len(self.support_ids)}) and support_logprobs "
                             f"({len(self.support_logprobs)}) differ in length")
        offsets = np.asarray(self.support_offsets, dtype=np.int64)
        if offsets[0] != 0 or offsets[-1] != len(self.support_ids):
            raise ValueError(f"{where}.support_offsets must start at 0 and end at len(support_ids) = "
                             f"{len(self.support_ids)}, got {offsets[0]}..{offsets[-1]}")
        sizes = np.diff(offsets)
        if (sizes < 1).any():
            t = int(np.nonzero(sizes < 1)[0][0])
            raise ValueError(f"{where}: the support of token {t} is empty (offsets must strictly increase)")
        if n == 0:
            return
        versions = np.asarray(self.versions, dtype=np.int64)
        if (np.diff(versions) < 0).any():
            t = int(np.nonzero(np.diff(versions) < 0)[0][0]) + 1
            raise ValueError(f"{where}.versions decrease at token {t}: {versions[t - 1]} -> {versions[t]}")
        tokens = np.asarray(self.token_ids, dtype=np.int64)
        lp = np.asarray(self.logprobs, dtype=np.float64)
        sid = np.asarray(self.support_ids, dtype=np.int64)
        slp = np.asarray(self.support_logprobs, dtype=np.float64)
        if not np.isfinite(slp).all() or (slp > 1e-6).any():
            k = int(np.nonzero(~np.isfinite(slp) | (slp > 1e-6))[0][0])
            raise ValueError(f"{where}.support_logprobs[{k}] = {slp[k]} is not a finite log-probability")
        hit = sid == np.repeat(tokens, sizes)
        count = np.add.reduceat(hit.astype(np.int64), offsets[:-1])
        if (count != 1).any():
            t = int(np.nonzero(count != 1)[0][0])
            what = "is not in" if count[t] == 0 else "appears more than once in"
            raise ValueError(f"{where}: token {t} (id {tokens[t]}) {what} its reported support")
        bad = ~np.isclose(slp[hit], lp, rtol=0.0, atol=1e-6)
        if bad.any():
            t = int(np.nonzero(bad)[0][0])
            raise ValueError(f"{where}.logprobs[{t}] = {lp[t]} differs from its support's log-prob "
                             f"{slp[hit][t]} of the same token")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def support_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The support as padded tensors ``(ids_TK, logprobs_TK)`` (-1 / -inf padding),
        the layout ``fleetrl.grpo.replay_logprobs`` takes (add a batch dimension)."""
        n = self.num_tokens
        offsets = torch.tensor(self.support_offsets, dtype=torch.long)
        sizes = offsets.diff()
        k = int(sizes.max()) if n else 1
        ids = torch.full((n, k), -1, dtype=torch.long)
        lps = torch.full((n, k), -math.inf, dtype=torch.float32)
        if n:
            row = torch.repeat_interleave(torch.arange(n), sizes)
            col = torch.arange(len(self.support_ids)) - torch.repeat_interleave(offsets[:-1], sizes)
            ids[row, col] = torch.tensor(self.support_ids, dtype=torch.long)
            lps[row, col] = torch.tensor(self.support_logprobs, dtype=torch.float32)
        return ids, lps


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Validate a batch of token-id prompts; returns them as lists of ints.

    Raises BadGenerateRequest naming the first bad prompt and position.
    """
    if isinstance(prompts, (str, bytes)) or len(prompts) == 0:
        raise BadGenerateRequest("prompts must be a non-empty sequence of token-id sequences")
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)):
            raise BadGenerateRequest(f"prompts[{i}] is {type(prompt).__name__}; expected token ids (tokenize first)")
        ids = [int(t) for t in prompt]
        if not ids:
            raise BadGenerateRequest(f"prompts[{i}] is empty; a prompt needs at least one token (e.g. <bos>)")
        for j, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise BadGenerateRequest(f"prompts[{i}][{j}] = {t} is not a token id in [0, {vocab_size})")
        out.append(ids)
    return out


@runtime_checkable
class SamplerBackend(Protocol):
    """What the sampler pool needs from a backend. Blocking calls; thread-safe updates."""

    @property
    def identity(self) -> SamplerIdentity:
        """Backend name, device kind and weight dtype (for routing and mismatch metrics)."""
        ...

    @property
    def weight_version(self) -> WeightVersion:
        """The version the next decode step will use."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """Generate for each prompt (same order). Raises BadGenerateRequest on bad input."""
        ...

    def load_version(self, tensors: Mapping[str, torch.Tensor], version: WeightVersion) -> None:
        """Replace *all* weights (an anchor). Names are Hugging Face parameter names."""
        ...

    def apply_update(self, tensors: Mapping[str, torch.Tensor], version: WeightVersion) -> None:
        """Replace the named subset of weights and move to a newer version, between decode
        steps (in flight if a generation is running). Values in any float dtype are cast
        or re-quantised to the backend's own dtype."""
        ...

    def health(self) -> Health:
        """Run a small real forward pass and report whether the backend works."""
        ...


class BackendBase:
    """What every backend holds the same way: its identity, and the weight version the
    next decode step will use. A backend sets ``_identity`` and ``_version`` (replacing
    ``_version`` together with its weights, under its own lock)."""

    _identity: SamplerIdentity
    _version: WeightVersion

    @property
    def identity(self) -> SamplerIdentity:
        """Backend name, device kind and weight dtype."""
        return self._identity

    @property
    def weight_version(self) -> WeightVersion:
        """The version the next decode step will use."""
        return self._version


def files_digest(model_dir: str | Path) -> str:
    """sha256 over the weight files (``*.safetensors``) of a model directory, in name
    order: the digest of version 0 when a backend is started without one."""
    h = hashlib.sha256()
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(file.name.encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()
