"""Settings of the ingest actor (``[actors.NAME.config]``; docs/guides/ingest.md)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = ["IngestConfig"]


class IngestConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Live trace ingestion: ``POST /v1/traces`` on the control plane, and a watched
    directory. Accepted tasks go to the store ``<state>/<store_dir>/tasks.jsonl``, which
    environment workers read with ``tasks = {kind = "ingested", ...}``."""

    store_dir: Annotated[str, msgspec.Meta(min_length=1)] = "ingest"
    """The store's directory, relative to the daemon's state directory (or absolute)."""
    watch_dir: str | None = None
    """A directory polled for trace files (relative to the working directory); each file
    is ingested like a POST body, then moved to ``done/`` or ``failed/`` beside an
    ``.errors.txt``. None: no watching."""
    poll_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 2.0
    """Seconds between two scans of ``watch_dir``; a file is taken once its size and
    modification time are unchanged over one scan (names ending in ``.tmp`` or starting
    with ``.`` are never taken: write there and rename)."""
    default_format: Literal["fleetrl", "atif", "mini-swe-agent", "openai-log", "auto"] = "auto"
    """The format of a POST without ``?format=`` or a telling Content-Type, and of watched
    files (unless their extension names one: ``.atif.json``, ``.traj.json``,
    ``.openai.jsonl``, ``.fleetrl.jsonl``)."""
    templates: dict[str, str] = {}
    """name -> template task of the session formats: ``FILE`` or ``FILE:ID`` (a task JSONL
    file) or ``harbor:DIR`` (a Harbor task directory); loaded at start."""
    default_template: str | None = None
    """The entry of ``templates`` used when a request names none."""
    image_map: dict[str, str] = {}
    """FROM image -> local image for the ``harbor:DIR`` templates, whose images are built
    at start (as ``fleetrl tasks import-harbor --map-image``)."""
    from_turn: Annotated[int, msgspec.Meta(ge=0)] | None = None
    at: Literal["first", "last", "every"] = "first"
    only_failed: bool = False
    fail_below: float = 1.0
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = 64 * 1024 * 1024
    """Larger POST bodies (and watched files) are refused (413 / failed)."""

    def __post_init__(self) -> None:
        if self.default_template is not None and self.default_template not in self.templates:
            raise ValueError(f"default_template = {self.default_template!r} is not a key of templates "
                             f"({', '.join(sorted(self.templates)) or 'none'})")
