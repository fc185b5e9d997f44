"""Errors of fleetrl.sandboxes, named for who broke what; ``SandboxError`` is the root
of every one of them, so ``except SandboxError`` catches all a sandbox can raise of its
own (argument checks still raise ``ValueError``/``TypeError``)."""

from __future__ import annotations

__all__ = ["SandboxError", "SandboxStartError", "SandboxGoneError", "PoolClosedError", "ImageBuildError"]


class SandboxError(Exception):
    """Root of sandbox errors: the engine or a container failed us."""


class SandboxStartError(SandboxError):
    """A container could not be created or started (bad image, engine refused)."""


class SandboxGoneError(SandboxError):
    """The container disappeared (removed, killed, engine restarted)."""


class PoolClosedError(SandboxError):
    """A lease was asked of a pool that is closing or closed."""


class ImageBuildError(SandboxError, RuntimeError):
    """The image could not be built; the message names the failing step. Also a
    ``RuntimeError``, as it always was."""
