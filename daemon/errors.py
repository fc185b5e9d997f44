"""The exceptions fleetrl raises on purpose.

Every error that fleetrl raises deliberately derives from one root, `FleetrlError`, so
a caller can tell "fleetrl refused this, and said why" from a bug (a plain
`TypeError`, `KeyError`, ...), which should crash the actor that hit it. The packages
that import nothing else of fleetrl, so that they can be embedded alone (`sandboxes`,
`grpo`), keep roots of their own (`SandboxError`, `BadLossInput`); every other package's
root derives from this one (tests/test_errors.py). Errors are
named after who broke things: `BadMessage` means a *peer* sent something we cannot
accept; it is a fact about the input, never about our own state.

Other parts add their own subclasses of `FleetrlError` next to the code that raises
them; this module holds only the root and the errors of the message protocol.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["BadMessage", "BadMessageKind", "FleetrlError"]


class FleetrlError(Exception):
    """Root of every error fleetrl raises on purpose (bad input, refused work)."""


BadMessageKind = Literal["malformed", "invalid", "unknown_type", "oversized", "truncated"]
"""Why a frame was rejected.

- ``malformed``: the frame's bytes are not one complete MessagePack value.
- ``invalid``: valid MessagePack, but not a valid message of the conversation (a
  field of the wrong type, a missing field, a value out of range, arrays whose
  lengths disagree).
- ``unknown_type``: the ``type`` tag names no message of this conversation.
- ``oversized``: the frame is longer than the connection's maximum frame size.
- ``truncated``: the stream ended in the middle of a frame.
"""


class BadMessage(FleetrlError):
    """A peer sent a frame that is not an acceptable message.

    Attributes:
        kind: the category of the problem (see `BadMessageKind`).
        detail: what exactly is wrong, e.g. "Expected `int`, got `str` at
            `$.stop_ids[3]`".
        conversation: name of the conversation (codec) that rejected it.
        frame_len: size in bytes of the offending frame, when known.
        path: where in the message the problem is (msgspec's ``$.a.b[3]``), when known.
        recoverable: True when the connection's framing is still intact, so the
            receiver can go on reading the next frame; False when it cannot (the
            stream ended mid-frame, or a length header is too absurd to skip).
    """

    def __init__(
        self,
        detail: str,
        *,
        kind: BadMessageKind,
        conversation: str = "",
        frame_len: int | None = None,
        path: str | None = None,
        recoverable: bool = True,
    ) -> None:
        self.detail = detail
        self.kind: BadMessageKind = kind
        self.conversation = conversation
        self.frame_len = frame_len
        self.path = path
        self.recoverable = recoverable
        super().__init__(self._render())

    def _render(self) -> str:
        where = f" on conversation {self.conversation!r}" if self.conversation else ""
        size = f" ({self.frame_len}-byte frame)" if self.frame_len is not None else ""
        return f"bad message{where}{size}: {self.kind}: {self.detail}"

    def __reduce__(self):  # keyword-only __init__: pickle through a helper
        return (
            _rebuild_bad_message,
            (
                self.detail,
                self.kind,
                self.conversation,
                self.frame_len,
                self.path,
                self.recoverable,
            ),
        )


def _rebuild_bad_message(detail, kind, conversation, frame_len, path, recoverable):
    return BadMessage(
        detail,
        kind=kind,
        conversation=conversation,
        frame_len=frame_len,
        path=path,
        recoverable=recoverable,
    )
