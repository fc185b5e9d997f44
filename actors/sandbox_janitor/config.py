"""Settings of the sandbox janitor actor (``[actors.NAME.config]``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["JanitorConfig"]


class JanitorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    #: seconds between sweeps after the first one (0: sweep only at start)
    interval_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 0.0
