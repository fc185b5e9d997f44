"""The sampler backend protocol: what every backend (torch, vLLM, remote) provides.

A backend turns a batch of token-id prompts into generations and reports, for every
generated token, exactly what it sampled from (docs/reference/corrections.md):

* the token id and ``log q^S`` of it, under the distribution actually sampled (after
  temperature, top-p and the top-k cap, renormalised over the support ``S``);
* the support itself: its token ids and their ``log q^S``, in CSR form (flat ids, flat
  log-probs, offsets per position), most likely first;
* the weight version whose forward pass produced the token's logits. Versions can
  change *between decode steps* (in-flight updates), so one generation may carry
  several versions, non-decreasing along the sequence.

The record is the wire `fleetrl.daemon.messages.Generation` itself, built by
`TokenLog.generation` and checked with ``check_sampled_tokens`` at `SAMPLER_TOL`; its
``request_id`` is empty and its ``sampler`` the backend's own `identity` (sampler id =
backend name) until whoever serves the backend stamps its own. Backends take the wire
`fleetrl.daemon.messages.SamplingParams`, which checks itself.

Streaming: a backend may also report tokens *as it produces them*. Its ``generate`` (and
``start``, for a backend that decodes step by step) then takes a keyword
``on_tokens: TokenSink``, called from the decode loop with ``(prompt index, new token
ids)`` after each step that produced tokens for that prompt, before the prompt's
`Generation` is handed back; the ids of one prompt's calls concatenate to its
``Generation.token_ids``. A backend that can do this says so with a class attribute
``streams_tokens = True`` (`streams_tokens`); the torch backend calls the sink every
decode step, the vLLM backend every engine step. The sink runs in the backend's thread
and must be quick (the sampler pool posts the ids to the Trio thread).

Backends are synchronous and CPU/GPU bound: an actor calls them from a worker thread
(``trio.to_thread.run_sync``). Weight updates may arrive from another thread while a
generation runs; a backend applies them between two decode steps, never inside one.

Weights in: `load_version` / `apply_update` take Hugging Face names mapped to fp32,
bf16 or fp16 tensors, and a backend copies what it is given before returning (the
caller - a delta follower - changes its tensors in place at the next version). A
backend that stores some weights pre-converted may say how it wants them
(``weight_format() -> WeightFormat``, read through `weight_format`): an fp8 torch
sampler takes its projections as `Fp8Values` (e4m3 bytes and scales quantised by the
follower, the same bytes a fresh quantisation gives), so it never quantises on its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import msgspec
import numpy as np
import torch

from fleetrl.actors.samplers.errors import BadGenerateRequest, BadWeightUpdate
from fleetrl.actors.weights.quant import FP8_DTYPE, SCHEMES, scale_shape
from fleetrl.daemon.messages import FinishReason, Generation, SamplerIdentity, SamplingParams, SamplingRecord
from fleetrl.daemon.protocol import Tensor, wire_dtype
from fleetrl.daemon.tokens import SupportCSR, SupportRule, check_sampled_tokens

__all__ = [
    "SAMPLER_TOL",
    "BackendBase",
    "Fp8Values",
    "Health",
    "SamplerBackend",
    "TokenLog",
    "TokenSink",
    "WeightFormat",
    "WeightValue",
    "WeightVersion",
    "backend_identity",
    "bounded_params",
    "routed_params",
    "check_fp8_values",
    "check_prompts",
    "check_weights",
    "compute_dtype",
    "files_digest",
    "served_identity",
    "stamp",
    "streams_tokens",
    "weight_format",
]

SAMPLER_TOL = 1e-6
"""How far a backend's reported numbers may be from exact (`check_sampled_tokens`): a
token's log-prob equals its support entry, support log-probs are <= this."""


_COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,  # fp8 samplers store projections in fp8 and compute in bf16
}


TokenSink = Callable[[int, list[int]], None]
"""``sink(prompt index, new token ids)``: called by a streaming backend from its decode
loop (module docstring, "Streaming")."""


def streams_tokens(backend: object) -> bool:
    """Whether ``backend`` accepts an ``on_tokens`` sink (it sets ``streams_tokens = True``)."""
    return getattr(backend, "streams_tokens", False) is True


def compute_dtype(dtype: str) -> torch.dtype:
    """The torch dtype a sampler of config dtype ``dtype`` computes (and sends weights) in."""
    return _COMPUTE_DTYPES[dtype]


def backend_identity(backend: str, device_kind: str, dtype: str) -> SamplerIdentity:
    """A backend's own identity: sampler id = the backend name, dtype by its wire name
    (``"bf16"`` -> ``"bfloat16"``)."""
    return SamplerIdentity(sampler_id=backend, backend=backend, device_kind=device_kind, dtype=wire_dtype(dtype))


def served_identity(backend: SamplerBackend, sampler_id: str) -> SamplerIdentity:
    """``backend``'s identity as the sampler ``sampler_id`` that serves it."""
    return msgspec.structs.replace(backend.identity, sampler_id=sampler_id)


def stamp(gen: Generation, request_id: str, identity: SamplerIdentity) -> Generation:
    """A backend's ``gen`` as the answer to ``request_id`` from sampler ``identity``
    (the arrays are shared, not copied)."""
    return msgspec.structs.replace(gen, request_id=request_id, sampler=identity)


class TokenLog:
    """One prompt's generated tokens as decode steps deliver them.

    A step adds a token with its log-prob, its support listing and its weight version;
    listings are kept as the arrays a step hands over (never as Python numbers per
    member, which at a 512-member cap would cost more than the decode step) and joined
    once, by `generation`. ``rule`` is the support rule of every position
    (`fleetrl.daemon.tokens.SupportRule`); with ``"vocabulary"`` each token also brings
    the tail mass outside its listing."""

    __slots__ = ("_ids", "_lps", "_sizes", "_tails", "finish", "logprobs", "rule", "tokens", "versions")

    def __init__(self, rule: SupportRule = "listed") -> None:
        self.rule: SupportRule = rule
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self._ids: list[np.ndarray] = []
        self._lps: list[np.ndarray] = []
        self._sizes: list[int] = []
        self._tails: list[float] = []
        self.finish: FinishReason | None = None

    def add(self, token: int, logprob: float, ids: Sequence[int] | np.ndarray, lps: Sequence[float] | np.ndarray,
            version: int, tail: float | None = None) -> None:
        """One sampled token, its log-prob, its support listing (ids and log-probs) and
        weight version; ``tail``: the mass outside the listing (rule ``"vocabulary"`` only)."""
        if (tail is None) != (self.rule == "listed"):
            raise ValueError(f"TokenLog of rule {self.rule!r}: tail mass "
                             f"{'missing' if tail is None else 'given for a listed support'}")
        ids_a = np.asarray(ids, dtype=np.int32)
        self.tokens.append(int(token))
        self.logprobs.append(float(logprob))
        self._ids.append(ids_a)
        self._lps.append(np.asarray(lps))
        self._sizes.append(ids_a.size)
        self.versions.append(int(version))
        if tail is not None:
            self._tails.append(float(tail))

    def generation(self, identity: SamplerIdentity, seed: int, *, params: SamplingParams | None = None,
                   logprob_dtype: type = np.float32) -> Generation:
        """The wire `Generation` (``request_id`` empty), checked at `SAMPLER_TOL`; raises
        ValueError naming the first token that does not fit its support. Log-probs travel
        as ``logprob_dtype``: float32, or float64 for a backend that computes them in
        float64 (vLLM renormalises its supports so). ``params``: what the tokens were drawn
        with (after the backend's cap), recorded as the generation's ``sampling``."""
        token_ids = Tensor.from_numpy(np.asarray(self.tokens, dtype=np.int32))
        logprobs = Tensor.from_numpy(np.asarray(self.logprobs, dtype=logprob_dtype))
        offsets = np.zeros(len(self._sizes) + 1, dtype=np.int64)
        np.cumsum(self._sizes, out=offsets[1:])
        ids = np.concatenate(self._ids) if self._ids else np.zeros(0, dtype=np.int32)
        lps = np.concatenate(self._lps).astype(logprob_dtype) if self._lps else np.zeros(0, dtype=logprob_dtype)
        tail = None if self.rule == "listed" else Tensor.from_numpy(np.asarray(self._tails, dtype=np.float32))
        support = SupportCSR(ids=Tensor.from_numpy(ids), logprobs=Tensor.from_numpy(lps),
                             offsets=Tensor.from_numpy(offsets), rule=self.rule, tail_mass=tail)
        versions = Tensor.from_numpy(np.asarray(self.versions, dtype=np.int64))
        check_sampled_tokens(token_ids, logprobs, support, versions=versions, tol=SAMPLER_TOL)
        sampling = None if params is None else SamplingRecord.of(params, seed)
        return Generation(request_id="", token_ids=token_ids, logprobs=logprobs, support=support,
                          versions=versions, sampler=identity, finish_reason=self.finish or "length", seed=seed,
                          sampling=sampling)


def bounded_params(params: SamplingParams, max_support: int) -> SamplingParams:
    """The params a sampler of cap ``max_support`` draws with: ``top_k`` at most
    ``max_support`` (the cap itself when the caller set none), so the support it lists is
    the distribution it sampled from and its record stays bounded; a whole-vocabulary
    request (``whole_vocabulary``) is left as it is (the sampler lists its ``max_support``
    most likely tokens and the tail instead)."""
    if params.whole_vocabulary or (params.top_k is not None and params.top_k <= max_support):
        return params
    return msgspec.structs.replace(params, top_k=max_support)


def routed_params(params: SamplingParams, max_support: int, *, whole_vocabulary: bool) -> SamplingParams:
    """The params the sampler pool sends a request with (docs/reference/corrections.md,
    "Supports at real vocabularies"): with ``whole_vocabulary`` allowed, a call that asks
    for no truncation (``top_p = 1``, no ``top_k``, ``temperature > 0``) draws from the
    whole vocabulary; every other call is capped at ``max_support`` (`bounded_params`),
    a whole-vocabulary request included when the pool does not allow it."""
    untruncated = params.top_p == 1.0 and params.top_k is None and params.temperature > 0
    if whole_vocabulary and untruncated:
        return params if params.whole_vocabulary else msgspec.structs.replace(params, whole_vocabulary=True)
    if params.whole_vocabulary:
        params = msgspec.structs.replace(params, whole_vocabulary=False)
    return bounded_params(params, max_support)


class WeightVersion(msgspec.Struct, frozen=True):
    """A weight version number and the digest of the weights it names."""

    version: int
    digest: str

    def __post_init__(self) -> None:
        if self.version < 0:
            raise ValueError(f"WeightVersion.version must be >= 0, got {self.version}")


@dataclass(frozen=True)
class Fp8Values:
    """A weight handed over already quantised: ``q`` (float8_e4m3fn, the weight's shape)
    and its fp32 ``scale`` (shape ``quant.scale_shape(q.shape, scheme)``), as
    `fleetrl.actors.weights.quant.quantize_fp8` makes them. `check_weights` checks it."""

    q: torch.Tensor
    scale: torch.Tensor
    scheme: str


WeightValue = torch.Tensor | Fp8Values
"""What `load_version` / `apply_update` take per name (`Fp8Values` only where the
backend's `WeightFormat` asks for them)."""


class WeightFormat(msgspec.Struct, frozen=True, kw_only=True):
    """How a backend wants its weights handed over (module docstring, "Weights in")."""

    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    """``bf16``: the canonical bf16 values (the backend converts them itself);
    ``fp16`` / ``fp32``: casts of them; ``fp8``: `Fp8Values` for ``fp8_names``, bf16
    values for the other names."""
    fp8_scheme: str | None = None
    """The scale granularity of the `Fp8Values` (``dtype = "fp8"`` only)."""
    fp8_names: tuple[str, ...] = ()
    """The names the backend takes as `Fp8Values` (``dtype = "fp8"`` only)."""

    def __post_init__(self) -> None:
        if self.dtype == "fp8":
            if self.fp8_scheme not in SCHEMES:
                raise ValueError(f"WeightFormat.fp8_scheme must be one of {SCHEMES} for dtype fp8, "
                                 f"got {self.fp8_scheme!r}")
        elif self.fp8_scheme is not None or self.fp8_names:
            raise ValueError(f"WeightFormat: fp8_scheme and fp8_names are for dtype fp8, not {self.dtype}")


def weight_format(backend: object) -> WeightFormat:
    """``backend.weight_format()`` when it has one, else bf16 (every backend takes the
    canonical bf16 values and converts them itself)."""
    get = getattr(backend, "weight_format", None)
    if get is None:
        return WeightFormat()
    fmt = get()
    if not isinstance(fmt, WeightFormat):
        raise TypeError(f"{type(backend).__name__}.weight_format() returned {type(fmt).__name__}, "
                        "not a WeightFormat")
    return fmt


class Health(msgspec.Struct, frozen=True, kw_only=True):
    """Result of a backend health check: a real forward pass, not a liveness flag."""

    ok: bool
    identity: SamplerIdentity
    version: WeightVersion
    detail: str
    """What was checked, or what failed."""


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


def check_weights(tensors: Mapping[str, WeightValue], expected: Mapping[str, tuple[int, ...]],
                  version: WeightVersion, *, fp8_scheme: str | None = None) -> None:
    """Check weights handed to a backend: known names, tensors of the expected shapes,
    fp32/bf16/fp16 values, all finite; with `fp8_scheme`, `Fp8Values` of that scheme are
    accepted too (`check_fp8_values`). Raises BadWeightUpdate naming the version and weight."""
    where = f"version {version.version}"
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise BadWeightUpdate(f"{where}: unknown weight name(s) {', '.join(unknown[:5])}")
    for name, t in tensors.items():
        if isinstance(t, Fp8Values):
            if fp8_scheme is None:
                raise BadWeightUpdate(f"{where}: {name} is pre-quantised fp8; this backend takes fp32, bf16 "
                                      "or fp16 values")
            check_fp8_values(name, t, expected[name], fp8_scheme, where)
            continue
        if not isinstance(t, torch.Tensor):
            raise BadWeightUpdate(f"{where}: {name} is {type(t).__name__}, not a tensor")
        if tuple(t.shape) != expected[name]:
            raise BadWeightUpdate(f"{where}: {name} has shape {tuple(t.shape)}, expected {expected[name]}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise BadWeightUpdate(f"{where}: {name} has dtype {t.dtype}; expected fp32, bf16 or fp16 values")
        if not bool(torch.isfinite(t).all()):
            raise BadWeightUpdate(f"{where}: {name} contains NaN or Inf")


def check_fp8_values(name: str, v: Fp8Values, shape: tuple[int, ...], scheme: str, where: str) -> None:
    """Check one `Fp8Values`: the backend's scheme, an e4m3 ``q`` of the weight's shape
    holding no NaN code, and finite, positive fp32 scales of the scheme's shape. Raises
    BadWeightUpdate naming `where` and the weight."""
    if v.scheme != scheme:
        raise BadWeightUpdate(f"{where}: {name} is quantised with scheme {v.scheme!r}; this sampler's "
                              f"fp8 scheme is {scheme!r}")
    if not isinstance(v.q, torch.Tensor) or v.q.dtype != FP8_DTYPE:
        got = v.q.dtype if isinstance(v.q, torch.Tensor) else type(v.q).__name__
        raise BadWeightUpdate(f"{where}: {name} fp8 values are {got}, expected {FP8_DTYPE}")
    if tuple(v.q.shape) != shape:
        raise BadWeightUpdate(f"{where}: {name} has shape {tuple(v.q.shape)}, expected {shape}")
    want = scale_shape(shape, scheme)  # type: ignore[arg-type]  # scheme checked by the caller's config
    if not isinstance(v.scale, torch.Tensor) or v.scale.dtype != torch.float32 or tuple(v.scale.shape) != want:
        got = (v.scale.dtype, tuple(v.scale.shape)) if isinstance(v.scale, torch.Tensor) else type(v.scale).__name__
        raise BadWeightUpdate(f"{where}: {name} scales are {got}, expected float32 of shape {want} "
                              f"(scheme {scheme!r})")
    if not bool((torch.isfinite(v.scale) & (v.scale > 0)).all()):
        raise BadWeightUpdate(f"{where}: {name} has a scale that is not finite and positive")
    if bool(((v.q.view(torch.uint8) & 0x7F) == 0x7F).any()):  # e4m3fn's only NaN codes
        raise BadWeightUpdate(f"{where}: {name} fp8 values contain NaN")


@runtime_checkable
class SamplerBackend(Protocol):
    """What the sampler pool needs from a backend. Blocking calls; thread-safe updates."""

    @property
    def identity(self) -> SamplerIdentity:
        """Backend name, device kind and weight dtype (wire names; for routing and mismatch metrics)."""
        ...

    @property
    def weight_version(self) -> WeightVersion:
        """The version the next decode step will use."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """Generate for each prompt (same order). Raises BadGenerateRequest on bad input."""
        ...

    def load_version(self, tensors: Mapping[str, torch.Tensor], version: WeightVersion) -> None:
        """Replace *all* weights (an anchor). Names are Hugging Face parameter names. The
        backend copies the tensors before returning."""
        ...

    def apply_update(self, tensors: Mapping[str, torch.Tensor], version: WeightVersion) -> None:
        """Replace the named subset of weights (possibly none: only the version moves) and
        move to a newer version, between decode steps (in flight if a generation is
        running). Values in any float dtype are cast or re-quantised to the backend's own
        dtype; the backend copies them before returning."""
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
