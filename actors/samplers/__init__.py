"""fleetrl.actors.samplers: sampler backends behind one protocol.

`base` defines the protocol (`SamplerBackend`), `WeightVersion`, `Health` and
`TokenLog`, which builds the token record every backend returns: the wire
`fleetrl.daemon.messages.Generation`, sampled with the wire `SamplingParams`.
`errors` holds `SamplerError` and its kinds. `torch_backend` is the reference backend
(our own KV-cache Llama decode, fp32/bf16/fp16/fp8; its weight storage in
`torch_weights`); `mismatch` measures how far a sampler's log-probs are from the
trainer's; `batching` says which waiting requests may share one backend call (the
sampler pool's batcher uses it).
"""

from fleetrl.actors.samplers.base import (
    Health,
    SamplerBackend,
    TokenLog,
    WeightVersion,
    check_prompts,
)
from fleetrl.actors.samplers.errors import (
    BadGenerateRequest,
    BadWeightUpdate,
    NumericalFailure,
    SamplerError,
    UnsupportedModel,
    VllmSupportError,
)
from fleetrl.actors.samplers.mismatch import MismatchReport, measure_mismatch, trainer_logprobs
from fleetrl.actors.samplers.torch_backend import DecodeRun, TorchBackend, TorchBackendConfig

__all__ = [
    "BadGenerateRequest",
    "BadWeightUpdate",
    "DecodeRun",
    "Health",
    "MismatchReport",
    "NumericalFailure",
    "SamplerBackend",
    "SamplerError",
    "TokenLog",
    "TorchBackend",
    "TorchBackendConfig",
    "UnsupportedModel",
    "VllmSupportError",
    "WeightVersion",
    "check_prompts",
    "measure_mismatch",
    "trainer_logprobs",
]
