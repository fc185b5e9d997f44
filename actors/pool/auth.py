"""The fleet token: the credential a remote sampler joins with."""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

__all__ = ["read_fleet_token", "token_matches"]


def read_fleet_token(path: Path) -> str:
    """The fleet token in `path`, created (random, mode 0600) when missing."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        fd = path.open("x", encoding="utf-8")
        with fd:
            path.chmod(0o600)
            fd.write(token + "\n")
    token = path.read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"fleet token file {path} is empty")
    return token


def token_matches(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())
