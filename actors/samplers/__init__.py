"""fleetrl.actors.samplers: sampler backends behind one protocol.

`base` defines the protocol (`SamplerBackend`) and the structs that cross process
boundaries (`SamplingParams`, `Generation`, `WeightVersion`, ...); `torch_backend` is
the reference backend (our own KV-cache Llama decode, fp32/bf16/fp16/fp8); `mismatch`
measures how far a sampler's log-probs are from the trainer's; `batching` says which
waiting requests may share one backend call (the sampler pool's batcher uses it).
"""

from fleetrl.actors.samplers.base import (
    BadGenerateRequest,
    BadWeightUpdate,
    Generation,
    Health,
    NumericalFailure,
    SamplerBackend,
    SamplerError,
    SamplerIdentity,
    SamplingParams,
    WeightVersion,
    check_prompts,
)
from fleetrl.actors.samplers.mismatch import MismatchReport, measure_mismatch, trainer_logprobs
from fleetrl.actors.samplers.torch_backend import DecodeRun, TorchBackend, TorchBackendConfig

__all__ = [
    "BadGenerateRequest",
    "BadWeightUpdate",
    "DecodeRun",
    "Generation",
    "Health",
    "MismatchReport",
    "NumericalFailure",
    "SamplerBackend",
    "SamplerError",
    "SamplerIdentity",
    "SamplingParams",
    "TorchBackend",
    "TorchBackendConfig",
    "WeightVersion",
    "check_prompts",
    "measure_mismatch",
    "trainer_logprobs",
]
