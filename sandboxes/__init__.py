"""fleetrl.sandboxes: hardened Docker sandboxes with a locally built image, a warm pool
and an orphan sweep. Embeddable alone: imports nothing else of fleetrl.

    from fleetrl.sandboxes import Ownership, open_sandbox_pool

    async with open_sandbox_pool(Ownership.for_state_dir(".fleetrl", owner=iid)) as pool:
        async with pool.lease() as sb:
            r = await sb.exec("python3 -c 'print(6*7)'", timeout=10)

See docs/reference/sandboxes.md for what is isolated and what is not.
"""

from .batch import ExecSpec
from .errors import ImageBuildError, PoolClosedError, SandboxError, SandboxGoneError, SandboxStartError
from .image import DEFAULT_IMAGE, BuildResult, ImageRecipe, ensure_image, recipe_hash
from .limits import DEFAULT_LIMITS, Limits, parse_size
from .metrics import PoolStatistics, SandboxMetrics
from .pool import SandboxPool, open_sandbox_pool
from .result import ExecResult
from .sandbox import Sandbox
from .start import open_sandbox, start_sandbox
from .sweep import Ownership, SweepReport, state_hash, sweep, sweep_blocking
from .transport import Engine
from .warm import WarmPolicy

__all__ = [
    "DEFAULT_IMAGE",
    "DEFAULT_LIMITS",
    "BuildResult",
    "Engine",
    "ExecResult",
    "ExecSpec",
    "ImageBuildError",
    "ImageRecipe",
    "Limits",
    "Ownership",
    "PoolClosedError",
    "PoolStatistics",
    "Sandbox",
    "SandboxError",
    "SandboxGoneError",
    "SandboxMetrics",
    "SandboxPool",
    "SandboxStartError",
    "SweepReport",
    "WarmPolicy",
    "ensure_image",
    "open_sandbox",
    "open_sandbox_pool",
    "parse_size",
    "recipe_hash",
    "start_sandbox",
    "state_hash",
    "sweep",
    "sweep_blocking",
]
