"""Scoped credentials: bearer tokens with a role, stored hashed, revocable.

The daemon's own token (``<state>/token``) is the ``admin`` credential: everything.
Further tokens are issued for one role each (`fleetrl token create --role R`, or
``POST /tokens``) and kept in ``<state>/tokens.json`` as SHA-256 digests only; the token
itself is printed once. Roles:

- ``admin``: every endpoint, token management included;
- ``sampler``: join the sampler fleet (``/fleet/join``) and read weights (``/weights``);
- ``worker``: join as an environment worker and read weights;
- ``weights-read``: read weights, nothing else.

A token looks like ``frl_<id>_<secret>``: the id (8 hex digits) finds the entry, the
whole token's digest is compared in constant time. Revoking (`fleetrl token revoke ID`,
``DELETE /tokens/ID``) marks the entry; the daemon reads the file again when it changes
(one ``stat`` per check), so a revoked token is refused at its next request, and a
joined sampler's connection is refused at its next heartbeat.

Writers (the CLI and the daemon) take ``tokens.lock`` and replace the file atomically.
A file that does not decode is an error naming it; a daemon whose file turns unreadable
refuses every issued token (the admin token still works) until it is fixed.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import os
import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, get_args

import msgspec

from .errors import FleetrlError

__all__ = ["ADMIN", "ROLES", "Credential", "CredentialError", "CredentialStore", "Role", "UnknownCredential",
           "new_token", "parse_token", "permits"]

Role = Literal["admin", "sampler", "worker", "weights-read"]
ROLES: tuple[str, ...] = get_args(Role)
ADMIN = "admin"
_TOKEN = re.compile(r"^frl_([0-9a-f]{8})_([A-Za-z0-9_-]{20,})$")
_NAME = re.compile(r"^[A-Za-z0-9._@-]{0,64}$")


class CredentialError(FleetrlError, ValueError):
    """A credential operation that cannot be done (unknown role or id, a bad file)."""


class UnknownCredential(CredentialError):
    """No issued token has the id or name asked for."""


class Credential(msgspec.Struct, frozen=True, kw_only=True):
    """One issued token: never the token itself, only its digest."""

    id: str
    role: Role
    name: str = ""
    sha256: str
    created: float
    revoked: float | None = None

    @property
    def active(self) -> bool:
        return self.revoked is None

    def public(self) -> dict[str, object]:
        """What listings show (no digest)."""
        return {"id": self.id, "role": self.role, "name": self.name, "created": self.created,
                "revoked": self.revoked}


class _File(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: Literal[1] = 1
    tokens: list[Credential] = []


_ADMIN_CREDENTIAL = Credential(id="admin", role="admin", name="the daemon's token", sha256="", created=0.0)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(token_id: str) -> str:
    """A fresh token for the entry `token_id`."""
    return f"frl_{token_id}_{secrets.token_urlsafe(32)}"


def parse_token(token: str) -> str | None:
    """The entry id a token names, or None when it does not look like an issued token."""
    found = _TOKEN.match(token)
    return found.group(1) if found else None


def permits(role: str, allowed: frozenset[str] | tuple[str, ...]) -> bool:
    """Whether `role` may use a route open to the `allowed` roles (admin: every route)."""
    return role == ADMIN or role in allowed


class CredentialStore:
    """The issued tokens of one state directory, and the admin token beside them."""

    def __init__(self, state_dir: str | os.PathLike[str], admin_token: str | None = None) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / "tokens.json"
        self.admin_token = admin_token
        self._seen: tuple[int, int, int] | None = None
        self._by_id: dict[str, Credential] = {}
        self._error: str | None = None

    # -- reading ----------------------------------------------------------------------
    def _read(self) -> list[Credential]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        try:
            return list(msgspec.json.decode(data, type=_File).tokens)
        except msgspec.DecodeError as exc:
            raise CredentialError(f"{self.path}: not a token file: {exc}") from None

    def _refresh(self) -> None:
        try:
            st = self.path.stat()
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            key = (0, 0, 0)
        if key == self._seen:
            return
        try:
            self._by_id = {c.id: c for c in self._read()}
            self._error = None
        except (CredentialError, OSError) as exc:
            self._by_id, self._error = {}, str(exc)  # fail closed: no issued token is accepted
        self._seen = key

    @property
    def error(self) -> str | None:
        """Why the token file could not be read at the last check (None: it could)."""
        return self._error

    def identify(self, token: str) -> Credential | None:
        """The live credential `token` is (the admin token: role admin), or None."""
        if self.admin_token and hmac.compare_digest(token.encode(), self.admin_token.encode()):
            return _ADMIN_CREDENTIAL
        token_id = parse_token(token)
        if token_id is None:
            return None
        self._refresh()
        found = self._by_id.get(token_id)
        if found is None or not found.active:
            return None
        return found if hmac.compare_digest(_digest(token), found.sha256) else None

    def list(self) -> list[Credential]:
        """Every issued credential, revoked ones included, oldest first."""
        return sorted(self._read(), key=lambda c: (c.created, c.id))

    # -- writing ----------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[list[Credential]]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "tokens.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = self._read()
            yield entries
            tmp = self.path.with_name(f".tokens.json.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(msgspec.json.format(msgspec.json.encode(_File(tokens=entries)), indent=2))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)

    def create(self, role: str, name: str = "") -> tuple[Credential, str]:
        """Issue a token for `role`: its entry and the token (shown once, never stored)."""
        if role not in ROLES or role == ADMIN:
            issuable = ", ".join(r for r in ROLES if r != ADMIN)
            raise CredentialError(f"role {role!r} cannot be issued (roles: {issuable}; admin is the daemon's "
                                  "own token)")
        if not _NAME.match(name):
            raise CredentialError(f"token name {name!r} must be at most 64 of A-Z a-z 0-9 . _ @ -")
        with self._locked() as entries:
            taken = {c.id for c in entries}
            token_id = secrets.token_hex(4)
            while token_id in taken:
                token_id = secrets.token_hex(4)
            token = new_token(token_id)
            cred = Credential(id=token_id, role=role, name=name, sha256=_digest(token),  # type: ignore[arg-type]
                              created=time.time())
            entries.append(cred)
        return cred, token

    def revoke(self, key: str) -> list[Credential]:
        """Revoke the credential with id `key`, or every active one named `key`; the
        revoked entries. An unknown key is an error; revoking twice is not."""
        with self._locked() as entries:
            hits = [i for i, c in enumerate(entries) if c.id == key] or \
                   [i for i, c in enumerate(entries) if c.name == key and c.name and c.active]
            if not hits:
                raise UnknownCredential(f"no issued token has id or name {key!r} (in {self.path})")
            now = time.time()
            for i in hits:
                if entries[i].active:
                    entries[i] = msgspec.structs.replace(entries[i], revoked=now)
            done = [entries[i] for i in hits]
        return done
