"""The fleet simulator (`fleetrl simulate`): a discrete-event model of how a new weight
version reaches a fleet of samplers spread over clouds, by direct pulls, a cache per
cloud, or a relay tree (docs/guides/simulate.md)."""

from .engine import SimResult, simulate
from .fleet import Cloud, Fleet, preset_fleet

__all__ = ["Cloud", "Fleet", "SimResult", "preset_fleet", "simulate"]
