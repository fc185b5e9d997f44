"""One lock for every transformers model this process builds or loads.

transformers replaces `PreTrainedModel.tie_weights` and `init_weights` with empty
functions for the length of each `from_pretrained` and then restores whatever it found
there. Two loads that overlap in threads (an in-process trainer's replicas, a sampler or
evaluator beside the trainer) can restore each other's stand-in, and from then on no
model in the process has its head tied or its weights initialised: a tied checkpoint then
loads with an untied random head, silently. The seeded builders also reseed the global
torch RNG. Every construction in `fleetrl.actors.model` holds `MODEL_CONSTRUCTION`
(tests/model/test_concurrent_loads.py).
"""

from __future__ import annotations

import threading

__all__ = ["MODEL_CONSTRUCTION"]

MODEL_CONSTRUCTION = threading.RLock()
