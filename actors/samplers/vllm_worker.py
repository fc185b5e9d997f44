"""Code that runs inside vLLM's engine: the weight-update extension and the support processor.

vLLM loads both by their qualified names (``worker_extension_cls``, ``logits_processors``),
in the engine process, so this module holds nothing the driver side needs besides the
names and the request argument the processor reads.

* `FleetrlWorkerExtension` is mixed into vLLM's worker. `VllmBackend` calls its methods
  with ``LLM.collective_rpc``: ``fleetrl_reload_weights`` replaces weights in place
  through ``model_runner.reload_weights`` with checkpoint (Hugging Face) names, so vLLM
  re-runs its own processing (fusing q/k/v and gate/up, CPU repacking, fp8 quantisation)
  and copies the result into the existing parameter storage: no engine reload, no new
  allocation, the KV cache and compiled graphs stay valid. Plain ``load_weights`` is not
  enough on the CPU build, which repacks weights after loading.
* `SupportProcessor` is a vLLM v1 logits processor that makes vLLM sample from exactly
  fleetrl's support (`fleetrl.grpo.sampler_support`): for every request that carries
  ``extra_args[SUPPORT_ARG] = [top_p, top_k or 0]`` it sets every logit outside the
  support to ``-inf``. vLLM applies "argmax-invariant" processors after dividing by
  the temperature and before its own top-k/top-p (which the backend leaves off), so the
  processed log-probs vLLM returns are ``log_softmax`` over the support: ``log q^S``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from fleetrl.actors.samplers.vllm_backend import SUPPORT_ARG
from fleetrl.grpo import sampler_support

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import BatchUpdate

try:  # the processor base class only exists where vLLM is installed
    from vllm.v1.sample.logits_processor import LogitsProcessor as _LogitsProcessorBase
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except ImportError:  # pragma: no cover - exercised only without vLLM
    _LogitsProcessorBase = object  # type: ignore[assignment,misc]
    process_dict_updates = None  # type: ignore[assignment]

__all__ = ["FleetrlWorkerExtension", "SupportProcessor", "parse_support_arg", "support_mask_"]


def parse_support_arg(extra_args: dict[str, Any] | None) -> tuple[float, int | None] | None:
    """``(top_p, top_k)`` from a request's extra args, None when it has none.

    Raises ValueError naming the bad value, so vLLM rejects such a request when it is
    added instead of failing inside a decode step.
    """
    if not extra_args or SUPPORT_ARG not in extra_args:
        return None
    value = extra_args[SUPPORT_ARG]
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"extra_args[{SUPPORT_ARG!r}] must be [top_p, top_k], got {value!r}")
    top_p, top_k = value
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"extra_args[{SUPPORT_ARG!r}][0] (top_p) must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"extra_args[{SUPPORT_ARG!r}][1] (top_k) must be an int >= 0 (0: no cap), got {top_k!r}")
    return float(top_p), (top_k or None)


def support_mask_(logits_NV: torch.Tensor, top_p: float, top_k: int | None) -> torch.Tensor:
    """Set every logit outside fleetrl's support of each row to ``-inf``, in place.

    ``logits_NV`` must already be divided by the temperature (the support is then
    computed at temperature 1, which is the same set).
    """
    ids, _ = sampler_support(logits_NV, temperature=1.0, top_p=top_p, top_k=top_k)
    # padding (-1) points at the row's first member, which is always real: no stray writes
    safe = torch.where(ids >= 0, ids, ids[:, :1]).to(logits_NV.device)
    keep = torch.zeros(logits_NV.shape, dtype=torch.bool, device=logits_NV.device)
    keep.scatter_(1, safe, True)
    return logits_NV.masked_fill_(~keep, -math.inf)


class SupportProcessor(_LogitsProcessorBase):  # type: ignore[misc,valid-type]
    """vLLM logits processor: restrict sampling to fleetrl's support (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, tuple[float, int | None]] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        parse_support_arg(sampling_params.extra_args)

    def is_argmax_invariant(self) -> bool:
        # Masking keeps the argmax, and it places the processor after temperature scaling.
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, lambda params, _prompt, _out: parse_support_arg(params.extra_args))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        groups: dict[tuple[float, int | None], list[int]] = {}
        for row, spec in self._rows.items():
            if row < logits.shape[0]:
                groups.setdefault(spec, []).append(row)
        for (top_p, top_k), rows in groups.items():
            index = torch.tensor(sorted(rows), dtype=torch.long, device=logits.device)
            logits[index] = support_mask_(logits[index], top_p, top_k)
        return logits


class FleetrlWorkerExtension:
    """Methods mixed into vLLM's worker class, called through ``LLM.collective_rpc``."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def fleetrl_packed_modules(self) -> dict[str, list[str]]:
        """vLLM's fused module names and the checkpoint shards each one packs
        (e.g. ``qkv_proj -> [q_proj, k_proj, v_proj]``). A reload must bring every shard
        of a fused module it touches, or vLLM would rebuild that module half empty."""
        model = self.model_runner.get_model()
        mapping = getattr(model, "packed_modules_mapping", None) or {}
        return {str(k): [str(s) for s in v] for k, v in mapping.items()}

    def fleetrl_reload_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load ``(checkpoint name, tensor)`` pairs into the running model in place."""
        self.model_runner.reload_weights(weights_iterator=iter(list(named)), is_checkpoint_format=True)
        return len(named)

    def fleetrl_parameter_storage(self) -> dict[str, int]:
        """The storage address of every parameter: equal before and after a reload shows
        the weights were replaced in place, not reallocated by a new engine."""
        model = self.model_runner.get_model()
        return {name: int(p.data_ptr()) for name, p in model.named_parameters()}
