"""fleetrl.actors.pool: the sampler pool (routing, pacing, health) and remote samplers.

Pure logic: `routing` (policies), `pacing` (staleness admission), `registry` (sampler
records and cost measurement). I/O around it: `local` (a backend in a worker thread),
`core` (the routing core `SamplerPool`, the pool actor's handle; `handle`: `PoolHandle`,
what its holders may call), `config`
(`PoolConfig`), `actor` (the actor ``fleetrl.actors.pool:run``), `auth` (the fleet
token), `metrics` (per-sampler Prometheus series), `remote_server` (the join WebSocket
endpoint), `remote_client` (the remote sampler process), `cli` (``fleetrl sampler``),
`errors` (the `PoolError` root).
docs/guides/fleet.md is the guide.
"""

from .actor import Inbox, run
from .config import LocalSamplerConfig, PoolConfig
from .core import PacedAttempt, PoolStatistics, SamplerPool
from .errors import JoinRefused, PoolError, SamplerLost, UnknownSampler
from .handle import PoolHandle
from .pacing import Admission, Pacer, PacingError
from .registry import Registry, SamplerRecord
from .routing import Bounds, SamplerView, cost_aware, least_loaded

__all__ = [
    "Admission", "Bounds", "Inbox", "JoinRefused", "LocalSamplerConfig", "PacedAttempt", "Pacer",
    "PacingError", "PoolConfig", "PoolError", "PoolHandle", "PoolStatistics", "Registry", "SamplerLost",
    "SamplerPool", "SamplerRecord", "SamplerView", "UnknownSampler", "cost_aware", "least_loaded",
    "run",
]
