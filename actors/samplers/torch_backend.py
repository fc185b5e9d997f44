"""The torch reference sampler backend: batched KV-cache decoding in fp32, bf16, fp16 or fp8.

It runs our own decoder forward (`llama_forward`: the llama, qwen2, qwen3 and mistral
families, docs/reference/models.md) over weights it holds by Hugging Face name, samples
with fleetrl.grpo's support definition (`sampler_support`, `sample_from_support`), and
reports every token's support and weight version. It never draws from more than
``max_support`` tokens (`base.bounded_params`), so its record is bounded at any
vocabulary; a whole-vocabulary request (``SamplingParams.whole_vocabulary``) draws from
all of q and lists the ``max_support`` most likely tokens with the tail mass
(`vocabulary_listing`, `sample_from_vocabulary`).

Precisions:

* ``fp32``, ``bf16``, ``fp16``: every weight and the activations in that dtype (RMSNorm
  statistics and attention softmax in fp32, as in transformers); logits upcast to fp32.
* ``fp8``: the seven projection matrices of every decoder layer are stored as
  ``torch.float8_e4m3fn`` with fp32 scales (`fleetrl.actors.weights.quant`, scheme
  configurable) and dequantised to bf16 for each matmul; embeddings, norms and the
  LM head stay bf16, as fp8 inference engines usually keep them.

Matmuls (``matmul``): a bf16/fp16/fp8 sampler multiplies either natively in its compute
dtype or, with ``"fp32"``, in fp32 from the same rounded operands, rounding each result
back to the compute dtype: the arithmetic of a bf16 matmul with fp32 accumulation (GPU
tensor cores, oneDNN), run at fp32 speed. ``"auto"`` (the default) picks ``"fp32"`` on
CPU, where torch's native bf16/fp16 matmuls are several times slower than fp32 ones on
processors without bf16 units (measured 4-5x here), and ``"native"`` elsewhere. The
weights' values, the activations' dtype between matmuls and so the sampler's numerical
mismatch against the fp32 trainer stay those of the low precision (tests/samplers).
``"fp16_accumulate"`` (fp16 samplers only) emulates an fp16 matmul that also
*accumulates* in fp16, as cuBLAS does with ``CUBLAS_COMPUTE_16F`` (and fast fp16
inference kernels choose for speed): every projection and the LM head sum their inner
dimension in blocks of `llama_forward.FP16_ACC_BLOCK` (16, one tensor-core MMA step)
and round the running sum to fp16 after each block (`llama_forward.fp16_accumulate_linear`).
CPUs accumulate in fp32, so this is the only way to reproduce that sampler's larger
mismatch here; it costs one small fp32 matmul and one rounding pass over the output per
block (several times slower than ``"fp32"``) and keeps an fp32 copy of each projection.

Weights may be handed over as what the backend stores (`weight_format`): an fp8
sampler takes its projections pre-quantised (`base.Fp8Values`) from a delta follower,
which keeps them equal to a fresh quantisation, and stores those bytes as they are.

Shared prompts: identical prompts in one batch (a GRPO group's attempts) are prefilled
once; their rows then copy that key/value cache and sample independently from it
(``share_prefill``). Only the prefill's batch shape changes, so logits equal an
unshared prefill to float rounding.

Weight versions: the backend holds an immutable mapping of named tensors
(`torch_weights.TorchWeights`) and swaps in a new mapping (copy on write) when a
version arrives. Every decode step takes the mapping
and version at its start, so an update that arrives from another thread during a step
takes effect at the next step: tokens after it carry the new version and come from the
new weights. As in PipelineRL-style in-flight updates, the key/value cache of tokens
already processed is kept (it was computed by the old weights); the trainer's
recomputation and the importance weights correct for that.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec
import torch

from fleetrl.actors.model.families import read_model_config
from fleetrl.actors.model.loading import read_state_dict
from fleetrl.actors.samplers.base import (
    BackendBase,
    Health,
    TokenLog,
    TokenSink,
    WeightFormat,
    WeightValue,
    WeightVersion,
    backend_identity,
    bounded_params,
    check_prompts,
    files_digest,
)
from fleetrl.actors.samplers.errors import BadGenerateRequest, NumericalFailure
from fleetrl.actors.samplers.llama_forward import (
    DecoderShape,
    KVCache,
    MatmulReader,
    RopeTable,
    WeightReader,
    attention_mask,
    decoder_forward,
    lm_logits,
)
from fleetrl.actors.samplers.torch_weights import Fp8Weight, Matmul, MatmulCopy, Stored, TorchWeights
from fleetrl.daemon.messages import Generation, SamplingParams
from fleetrl.daemon.protocol import DTypeName
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT
from fleetrl.grpo import sample_from_support, sample_from_vocabulary, sampler_support, vocabulary_listing

__all__ = ["DecodeRun", "Fp8Weight", "TorchBackend", "TorchBackendConfig"]

_INITIAL_CACHE_COLUMNS = 64


class TorchBackendConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Configuration of one torch sampler."""

    model_dir: str
    """A saved model directory of a supported family (config.json + *.safetensors), e.g.
    from create_tiny_model or `fleetrl model init`."""
    dtype: DTypeName = "fp32"
    device: str = "cpu"
    """A torch device string: "cpu", "cuda", "cuda:1", ..."""
    fp8_scheme: Literal["tensor", "row", "block128"] = "block128"
    """Scale granularity of fp8 weights (only used when dtype is fp8)."""
    fp8_dequantize_once: bool = True
    """Dequantise each fp8 weight once per version and keep the bf16 result (faster,
    +2 bytes per weight of memory) instead of before every matmul. Either way the
    matmuls see the same bf16 values, so generations are bit-identical."""
    matmul: Literal["auto", "native", "fp32", "fp16_accumulate"] = "auto"
    """How bf16/fp16/fp8 samplers multiply (module docstring): ``"native"`` in the compute
    dtype; ``"fp32"`` with fp32 accumulation from the rounded operands (keeps an fp32
    copy of each projection matrix: +4 bytes per weight); ``"fp16_accumulate"`` (dtype
    fp16 only) emulates fp16 accumulation (+4 bytes per weight too); ``"auto"``: fp32
    on CPU, native elsewhere. ``"auto"``/``"native"``/``"fp32"`` make no difference to an
    fp32 sampler."""
    share_prefill: bool = True
    """Prefill identical prompts of one batch once (module docstring)."""
    max_support: int = DEFAULT_MAX_SUPPORT
    """The most tokens one token is drawn from, whatever the request's top_k (which
    lowers it): the bound on the record of every generated token (and, for a
    whole-vocabulary request, how many most likely tokens are listed)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_support, bool) or not isinstance(self.max_support, int) or self.max_support < 1:
            raise ValueError(f"TorchBackendConfig.max_support must be an int >= 1, got {self.max_support!r}")
        if self.matmul not in _MATMULS:
            raise ValueError(f"TorchBackendConfig.matmul must be one of {_MATMULS}, got {self.matmul!r}")
        if self.matmul == "fp16_accumulate" and self.dtype != "fp16":
            raise ValueError(f"TorchBackendConfig.matmul = 'fp16_accumulate' emulates fp16 accumulation and "
                             f"needs dtype = 'fp16', not {self.dtype!r}")


_MATMULS = ("auto", "native", "fp32", "fp16_accumulate")

class TorchBackend(BackendBase):
    """Reference sampler backend (see the module docstring). Implements SamplerBackend."""

    streams_tokens = True
    """``generate`` and ``start`` take an ``on_tokens`` sink, called every decode step."""

    def __init__(self, config: TorchBackendConfig, *, version: WeightVersion | None = None) -> None:
        """Load the weights of `config.model_dir` as `version`.

        Without `version`, the weights are version 0 and the digest is the sha256 of the
        weight files (the pool normally passes the version and digest it knows).
        """
        self.config = config
        try:
            self._device = torch.device(config.device)
        except RuntimeError as exc:
            raise ValueError(f"TorchBackendConfig.device {config.device!r} is not a torch device: {exc}") from exc
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"TorchBackendConfig.device is {config.device!r} but CUDA is not available")
        matmul: Matmul = "native" if config.matmul == "native" else "fp32"
        if config.matmul == "auto":
            matmul = "fp32" if self._device.type == "cpu" else "native"
        elif config.matmul == "fp16_accumulate":
            matmul = "fp16_accumulate"
        hf_config = read_model_config(config.model_dir)  # ModelDirError: unsupported architecture
        self.shape = DecoderShape.from_config(hf_config)  # UnsupportedModel: a feature the forward lacks
        self._rope = RopeTable(self.shape, self._device)
        tensors = read_state_dict(config.model_dir)
        if version is None:
            version = WeightVersion(0, files_digest(config.model_dir))
        self.weights = TorchWeights(
            self.shape.parameter_shapes(), dtype=config.dtype, device=self._device,
            fp8_scheme=config.fp8_scheme, fp8_dequantize_once=config.fp8_dequantize_once,
            matmul=matmul, lm_head_name=self.shape.lm_head_name,
            version=version,
        )
        self._compute_dtype = self.weights.compute_dtype
        self.weights.load(tensors, version)
        if self._device.type == "cuda":
            kind = f"cuda:{torch.cuda.get_device_name(self._device)}"
        else:
            kind = self._device.type
        self._identity = backend_identity("torch", kind, config.dtype)

    @property
    def weight_version(self) -> WeightVersion:
        """The version the next decode step will use."""
        return self.weights.version

    # -- SamplerBackend ---------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 on_tokens: TokenSink | None = None) -> list[Generation]:
        """Generate for every prompt; versions may change between steps (see apply_update).
        ``on_tokens(i, ids)`` gets each step's new token of prompt ``i`` (`DecodeRun`)."""
        run = self.start(prompts, params, on_tokens=on_tokens)
        while not run.done:
            run.step()
        return run.results()

    def load_version(self, tensors: Mapping[str, WeightValue], version: WeightVersion) -> None:
        """Replace every weight (an anchor). All names of the model must be present.
        An fp8 sampler takes its projections as tensors or `base.Fp8Values`."""
        self.weights.load(tensors, version)

    def apply_update(self, tensors: Mapping[str, WeightValue], version: WeightVersion) -> None:
        """Replace the named weights (none: only the version moves) and move to `version`
        (newer than the current one). An fp8 sampler takes its projections as tensors or
        `base.Fp8Values`.

        Safe to call from another thread while a generation runs: the running decode step
        finishes with the old weights; the next one uses these.
        """
        self.weights.apply(tensors, version)

    def weight_format(self) -> WeightFormat:
        """What a delta follower should hand over: casts to this sampler's dtype, or for
        fp8 the projections pre-quantised with its scheme (`base.WeightFormat`)."""
        if self.config.dtype == "fp8":
            return WeightFormat(dtype="fp8", fp8_scheme=self.config.fp8_scheme, fp8_names=self.weights.fp8_names)
        return WeightFormat(dtype=self.config.dtype)

    def health(self) -> Health:
        """A one-token forward with the current weights; ok when it ends with finite logits."""
        weights, mm, version = self._snapshot()
        try:
            with torch.inference_mode():
                cache = KVCache(self.shape, 1, 1, self._compute_dtype, self._device)
                ids = torch.zeros((1, 1), dtype=torch.long, device=self._device)
                pads = torch.zeros(1, dtype=torch.long, device=self._device)
                read, mm_read = self.weights.reader(weights), None if mm is None else mm.__getitem__
                hidden = decoder_forward(
                    read, self.shape, self._rope, ids, torch.zeros_like(ids),
                    attention_mask(pads, 0, 1), cache, self._compute_dtype, mm_read,
                )
                logits = lm_logits(read, self.shape, hidden[:, -1], mm_read)
            finite = bool(torch.isfinite(logits).all())
        except Exception as exc:  # a health check reports failures instead of raising them
            return Health(ok=False, identity=self._identity, version=version,
                          detail=f"forward failed: {type(exc).__name__}: {exc}")
        detail = "one-token forward: logits finite" if finite else "one-token forward: non-finite logits"
        return Health(ok=finite, identity=self._identity, version=version, detail=detail)

    def stored_dtypes(self) -> dict[str, str]:
        """How each weight is held, e.g. ``"float8_e4m3fn+scale"`` or ``"bfloat16"``."""
        return self.weights.stored_dtypes()

    # -- stepwise decoding ----------------------------------------------------------

    def start(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
              on_tokens: TokenSink | None = None) -> DecodeRun:
        """Begin a generation that the caller advances with `DecodeRun.step()`."""
        return DecodeRun(self, prompts, params, on_tokens=on_tokens)

    def check_generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[int]:
        """Check prompts and params as `generate` would, without running anything.

        Returns each prompt's token budget (``max_tokens``, or less where the context
        length ends it sooner); raises BadGenerateRequest naming the first bad prompt or
        stop id. Cheap: the sampler pool calls it per request before batching requests
        together, so a bad request fails alone.
        """
        shape = self.shape
        rows = check_prompts(prompts, shape.vocab_size)
        for i, stop in enumerate(params.stop_ids):
            if stop >= shape.vocab_size:
                raise BadGenerateRequest(f"stop_ids[{i}] = {stop} is not a token id in [0, {shape.vocab_size})")
        limit = shape.max_position_embeddings
        budgets = []
        for i, row in enumerate(rows):
            room = limit - len(row)
            if room < 1:
                raise BadGenerateRequest(
                    f"prompts[{i}] has {len(row)} tokens; the context holds {limit}, leaving no room to generate"
                )
            budgets.append(min(params.max_tokens, room))
        return budgets

    # -- internals --------------------------------------------------------------------

    @property
    def fp32_matmul(self) -> bool:
        """Whether projections multiply in fp32 from the rounded operands (``matmul``)."""
        return self.weights.fp32_matmul

    @property
    def matmul(self) -> Matmul:
        """How projections multiply: ``"native"``, ``"fp32"`` or ``"fp16_accumulate"``
        (``config.matmul`` with ``"auto"`` resolved)."""
        return self.weights.matmul

    def _snapshot(self) -> tuple[dict[str, Stored], dict[str, MatmulCopy] | None, WeightVersion]:
        """The weights, their matmul copies and their version, read together."""
        return self.weights.snapshot()


class DecodeRun:
    """One batch in generation. `step()` runs one forward pass and samples one token per
    unfinished prompt (the first step is the prefill of all prompts).

    Prompts are left-padded into one cache; rows that finish (a stop id, their token
    budget, or the context length) leave the batch, so later steps compute only for the
    rows still running.

    ``on_tokens(i, [token])``, when given, is called in every step for every prompt ``i``
    that step sampled a token for, in prompt order, before the step returns (so before
    `take_finished` hands out a prompt that the step finished).
    """

    def __init__(self, backend: TorchBackend, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 on_tokens: TokenSink | None = None) -> None:
        self._on_tokens = on_tokens
        shape = backend.shape
        self._backend = backend
        params = bounded_params(params, backend.config.max_support)
        self._params = params
        budgets = backend.check_generate(prompts, params)
        rows = [[int(t) for t in p] for p in prompts]
        device = backend._device
        self._device = device
        self._n = len(rows)
        self._width = max(len(r) for r in rows)
        self._prompts = rows
        self._budget = budgets
        self._stop = torch.tensor(sorted(set(params.stop_ids)), dtype=torch.long, device=device)
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator = torch.Generator(device=device).manual_seed(self.seed)
        self._active = torch.arange(self._n, device=device)
        self._pads = torch.tensor([self._width - len(r) for r in rows], dtype=torch.long, device=device)
        self._budget_t = torch.tensor(budgets, dtype=torch.long, device=device)
        # The prefill computes one row per distinct prompt (`share_prefill`): `_owner[i]`
        # is row i's prompt among them, `_firsts` the first row holding each.
        if backend.config.share_prefill:
            index: dict[tuple[int, ...], int] = {}
            self._owner = [index.setdefault(tuple(row), len(index)) for row in rows]
            self._firsts = [self._owner.index(k) for k in range(len(index))]
        else:
            self._owner = self._firsts = list(range(self._n))
        self._cache = KVCache(
            shape, len(self._firsts), self._width + min(max(budgets), _INITIAL_CACHE_COLUMNS),
            backend._compute_dtype, device,
        )
        self._next: torch.Tensor | None = None
        self._count = torch.zeros(self._n, dtype=torch.long, device=device)
        self._logs = [TokenLog("vocabulary" if params.whole_vocabulary else "listed") for _ in rows]
        self._fresh: list[int] = []  # rows finished since the last take_finished()
        self.steps = 0

    @property
    def prefill_rows(self) -> int:
        """Rows the prefill computes (the distinct prompts with `share_prefill`)."""
        return len(self._firsts)

    @property
    def done(self) -> bool:
        return self._active.numel() == 0

    def step(self) -> None:
        """One forward pass and one sampled token for every unfinished prompt."""
        if self.done:
            raise RuntimeError("DecodeRun.step() called after every prompt finished")
        backend = self._backend
        weights, mm, version = backend._snapshot()
        read = backend.weights.reader(weights)
        mm_read = None if mm is None else mm.__getitem__
        shape, cache, dtype = backend.shape, self._cache, backend._compute_dtype
        with torch.inference_mode():
            if self._next is None:
                logits = self._prefill(read, mm_read)
            else:
                ids = self._next[:, None]
                positions = (cache.length - self._pads)[:, None]
                mask = attention_mask(self._pads, cache.length, 1)
                hidden = decoder_forward(read, shape, backend._rope, ids, positions, mask, cache, dtype, mm_read)
                logits = lm_logits(read, shape, hidden[:, -1], mm_read)
            if not bool(torch.isfinite(logits).all()):
                row = int(self._active[(~torch.isfinite(logits)).any(-1).nonzero()[0, 0]])
                raise NumericalFailure(
                    f"prompts[{row}]: non-finite logits at decode step {self.steps} "
                    f"(dtype {backend.config.dtype}, weight version {version.version})"
                )
            p = self._params
            tail = None
            if p.whole_vocabulary:
                support_ids, support_lps, tail = vocabulary_listing(logits, temperature=p.temperature,
                                                                    k=backend.config.max_support)
                tokens, token_lps = sample_from_vocabulary(logits, temperature=p.temperature,
                                                           generator=self._generator)
            else:
                support_ids, support_lps = sampler_support(logits, temperature=p.temperature, top_p=p.top_p,
                                                           top_k=p.top_k)
                tokens, token_lps = sample_from_support(support_ids, support_lps, generator=self._generator)
        self.steps += 1
        self._record(tokens, token_lps, support_ids, support_lps, tail, version.version)

    def _prefill(self, read: WeightReader, mm_read: MatmulReader | None) -> torch.Tensor:
        """The first forward: each distinct prompt once (`share_prefill`), then every row
        gets its prompt's cache and last logits. Returns the logits [n, vocab]."""
        backend, cache, width = self._backend, self._cache, self._width
        ids = torch.zeros((len(self._firsts), width), dtype=torch.long)  # pad id 0, masked out
        for i, row in enumerate(self._firsts):
            prompt = self._prompts[row]
            ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        ids = ids.to(self._device)
        pads = self._pads[torch.tensor(self._firsts, dtype=torch.long, device=self._device)]
        positions = (torch.arange(width, device=self._device)[None] - pads[:, None]).clamp(min=0)
        hidden = decoder_forward(read, backend.shape, backend._rope, ids, positions,
                                 attention_mask(pads, 0, width), cache, backend._compute_dtype, mm_read)
        logits = lm_logits(read, backend.shape, hidden[:, -1], mm_read)
        if len(self._firsts) < self._n:
            rows = torch.tensor(self._owner, dtype=torch.long, device=self._device)
            cache.keep_rows(rows)  # each row copies its prompt's keys and values
            logits = logits.index_select(0, rows)
        return logits

    def _record(self, tokens, token_lps, support_ids, support_lps, tail, version: int) -> None:
        self._count += 1
        stopped = torch.isin(tokens, self._stop) if self._stop.numel() else torch.zeros_like(tokens, dtype=torch.bool)
        out_of_budget = self._count >= self._budget_t
        finished = stopped | out_of_budget
        sizes = (support_ids >= 0).sum(-1).tolist()
        ids_rows = support_ids.cpu().numpy()
        lps_rows = support_lps.cpu().numpy()
        tails = [None] * len(sizes) if tail is None else tail.tolist()
        for j, (row, tok, lp, size) in enumerate(zip(self._active.tolist(), tokens.tolist(), token_lps.tolist(), sizes)):
            self._logs[row].add(tok, lp, ids_rows[j, :size], lps_rows[j, :size], version, tails[j])
            if self._on_tokens is not None:
                self._on_tokens(row, [tok])
        if bool(finished.any()):
            for j in finished.nonzero().flatten().tolist():
                row = int(self._active[j])
                self._logs[row].finish = "stop" if bool(stopped[j]) else "length"
                self._fresh.append(row)
            keep = (~finished).nonzero().flatten()
            self._keep(keep)
            tokens = tokens[keep]
        self._next = tokens

    def _keep(self, keep: torch.Tensor) -> None:
        """Only the running rows at positions `keep` decode on."""
        self._active = self._active[keep]
        self._pads = self._pads[keep]
        self._budget_t = self._budget_t[keep]
        self._count = self._count[keep]
        self._cache.keep_rows(keep)

    def abort(self, i: int) -> bool:
        """Stop decoding prompt ``i`` (nobody waits for it any more): it finishes now, with
        the tokens it has and finish reason ``"abort"``, and `take_finished` hands it out;
        later steps compute only for the other rows. Returns whether it was still running.
        Before the first step (the prefill) nothing is aborted: returns False."""
        if self._next is None or self.done:
            return False
        running = self._active != i
        if bool(running.all()):
            return False
        self._logs[i].finish = "abort"
        self._fresh.append(i)
        keep = running.nonzero().flatten()
        self._keep(keep)
        self._next = self._next[keep]
        return True

    def take_finished(self) -> list[tuple[int, Generation]]:
        """``(prompt index, generation)`` of the prompts that finished since the last call
        (a caller can hand each one on while the rest of the batch still decodes)."""
        fresh, self._fresh = self._fresh, []
        return [(i, self._generation(i)) for i in sorted(fresh)]

    def results(self) -> list[Generation]:
        """The generations, in prompt order (only once every prompt has finished)."""
        if not self.done:
            raise RuntimeError("DecodeRun.results() called before every prompt finished")
        return [self._generation(i) for i in range(self._n)]

    def _generation(self, i: int) -> Generation:
        return self._logs[i].generation(self._backend.identity, self.seed, params=self._params)
