"""fleetrl.actors.pool: the sampler pool (routing, pacing, health) and remote samplers.

Pure logic: `routing` (policies), `pacing` (staleness admission), `registry` (sampler
records and cost measurement). I/O around it: `local` (a backend in a worker thread),
`pool` (the routing core `SamplerPool` and the actor `run`), `remote_server` (the join
WebSocket endpoint), `remote_client` (the remote sampler process), `cli`
(``fleetrl sampler``). docs/fleet.md is the guide.
"""

from .pacing import Admission, Pacer, PacingError
from .pool import LocalSamplerConfig, PacedAttempt, PoolConfig, SamplerPool, pool_client, run
from .registry import Registry, SamplerRecord
from .routing import Bounds, SamplerView, cost_aware, least_loaded

__all__ = ["Admission", "Bounds", "LocalSamplerConfig", "PacedAttempt", "Pacer", "PacingError", "PoolConfig",
           "Registry", "SamplerPool", "SamplerRecord", "SamplerView", "cost_aware", "least_loaded",
           "pool_client", "run"]
