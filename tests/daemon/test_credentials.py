"""Scoped credentials (daemon/credentials.py): issued, stored hashed, identified, revoked,
seen by another store over the same directory, and a bad file refused."""

from __future__ import annotations

import json
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.daemon.credentials import (ROLES, CredentialError, CredentialStore, parse_token, permits)


def test_issued_token_identifies_its_role_and_only_its_digest_is_stored(tmp_path):
    store = CredentialStore(tmp_path, admin_token="the-admin-token")
    cred, token = store.create("sampler", "gpu-host-1")
    assert parse_token(token) == cred.id
    found = store.identify(token)
    assert found is not None and found.role == "sampler" and found.name == "gpu-host-1"
    text = (tmp_path / "tokens.json").read_text()
    assert token not in text and token.split("_", 2)[2] not in text
    assert json.loads(text)["tokens"][0]["sha256"] == cred.sha256
    assert stat.S_IMODE((tmp_path / "tokens.json").stat().st_mode) == 0o600
    assert store.identify("the-admin-token").role == "admin"
    # one character changed, or the right id with another secret: not a credential
    assert store.identify(token[:-1] + ("A" if token[-1] != "A" else "B")) is None
    assert store.identify(f"frl_{cred.id}_{'x' * 43}") is None
    assert store.identify("") is None and store.identify("frl_nothex00_abc") is None


def test_revocation_is_seen_by_another_store_on_the_same_directory(tmp_path):
    daemon = CredentialStore(tmp_path, admin_token="a")  # the daemon's view
    cli = CredentialStore(tmp_path)  # `fleetrl token ...` in another process
    _, t1 = cli.create("sampler", "h1")
    _, t2 = cli.create("weights-read", "cache")
    assert daemon.identify(t1).role == "sampler" and daemon.identify(t2).role == "weights-read"
    done = cli.revoke("h1")  # by name
    assert [c.name for c in done] == ["h1"] and done[0].revoked is not None
    assert daemon.identify(t1) is None and daemon.identify(t2) is not None
    cli.revoke(done[0].id)  # twice: no error, still revoked
    assert [c.active for c in cli.list()] == [False, True]
    with pytest.raises(CredentialError, match="no issued token has id or name 'nobody'"):
        cli.revoke("nobody")


def test_bad_requests_name_what_is_wrong(tmp_path):
    store = CredentialStore(tmp_path)
    with pytest.raises(CredentialError, match="role 'admin' cannot be issued"):
        store.create("admin")
    with pytest.raises(CredentialError, match="role 'root' cannot be issued"):
        store.create("root")
    with pytest.raises(CredentialError, match="token name"):
        store.create("sampler", "has space")
    assert store.list() == []


def test_an_unreadable_file_refuses_every_issued_token_but_not_the_admin(tmp_path):
    store = CredentialStore(tmp_path, admin_token="adm")
    _, token = store.create("sampler")
    assert store.identify(token) is not None
    (tmp_path / "tokens.json").write_text("{not json")
    assert store.identify(token) is None
    assert "tokens.json" in (store.error or "")
    assert store.identify("adm").role == "admin"
    with pytest.raises(CredentialError, match="not a token file"):
        store.list()
    with pytest.raises(CredentialError, match="not a token file"):
        store.create("sampler")  # nothing is written over a file it cannot read
    assert (tmp_path / "tokens.json").read_text() == "{not json"


def test_permits():
    assert all(permits("admin", ()) for _ in range(1))
    assert permits("sampler", ("sampler", "worker")) and not permits("sampler", ())
    assert not permits("weights-read", ("sampler",))
    assert set(ROLES) == {"admin", "sampler", "worker", "weights-read"}


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_no_guess_identifies(tmp_path_factory, guess):
    d = tmp_path_factory.mktemp("guess")
    store = CredentialStore(d, admin_token="admin-token-value")
    _, token = store.create("sampler")
    if guess not in (token, "admin-token-value"):
        assert store.identify(guess) is None
