"""Settings of the heartbeat actor (``[actors.NAME.config]``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["TickerConfig"]


class TickerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    #: seconds between ticks
    interval_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 1.0
    #: log one line every this many ticks (0: never)
    log_every: Annotated[int, msgspec.Meta(ge=0)] = 60
