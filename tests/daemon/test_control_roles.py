"""Scoped tokens and TLS on the control plane of a real supervisor (hypercorn on
127.0.0.1): every core endpoint is for admin; a mount is open to the roles it names; a
revoked token is refused at its next request; with a certificate the listener speaks
only TLS and clients verify it."""

from __future__ import annotations

import random
import ssl
import subprocess
import sys
from functools import partial

import httpx
import pytest
import trio
from tls import make_ca

from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.state import StateDir, control_cert, read_control
from fleetrl.daemon.supervisor import Supervisor

CONFIG = """
[daemon]
grace_s = 5.0
[http]
port = 0
{tls}
[actors.weights]
factory = "daemon_test_actors:mounter"
config = {{prefix = "/weights", roles = ["sampler", "worker", "weights-read"]}}
[actors.adminonly]
factory = "daemon_test_actors:mounter"
config = {{prefix = "/private"}}
"""

CORE = [("GET", "/status"), ("GET", "/metrics"), ("POST", "/pause"), ("POST", "/resume"),
        ("POST", "/shutdown"), ("GET", "/tokens"), ("POST", "/tokens"), ("DELETE", "/tokens/abc")]


def _daemon(tmp_path, tls_lines: str = ""):
    cfg = load_config_text(CONFIG.format(tls=tls_lines), source="roles.toml")
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(cfg, state, rng=random.Random(0))
    return cfg, state, sup


@pytest.fixture
async def plain(tmp_path, test_actors):
    cfg, state, sup = _daemon(tmp_path)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            host, port = read_control(state.path)
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                yield sup, state, client
            sup.request_shutdown("test over")
    state.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_roles_see_only_their_routes(plain):
    sup, state, client = plain
    admin = bearer(state.token)
    made = {}
    for role in ("sampler", "worker", "weights-read"):
        resp = await client.post("/tokens", json={"role": role, "name": f"{role}-1"}, headers=admin)
        assert resp.status_code == 201, resp.text
        made[role] = resp.json()
        assert made[role]["role"] == role and made[role]["token"].startswith("frl_")
    for role, body in made.items():
        h = bearer(body["token"])
        for method, path in CORE:
            resp = await client.request(method, path, headers=h, json={"role": "sampler"})
            assert resp.status_code == 403, (role, method, path, resp.text)
            assert resp.json()["error"] == "forbidden" and role in resp.json()["detail"]
        assert (await client.get("/weights/v1", headers=h)).status_code == 200
        assert (await client.get("/private/x", headers=h)).status_code == 403
    assert not sup.draining_event.is_set() and not sup.gate.closed  # no 403 did anything
    assert (await client.get("/private/x", headers=admin)).status_code == 200
    listed = (await client.get("/tokens", headers=admin)).json()["tokens"]
    assert sorted(t["role"] for t in listed) == ["sampler", "weights-read", "worker"]
    assert all("token" not in t and "sha256" not in t for t in listed)

    # revoked: refused at the very next request, with 401 (the token is no credential now)
    sampler = made["sampler"]
    resp = await client.delete(f"/tokens/{sampler['id']}", headers=admin)
    assert resp.status_code == 200 and resp.json()["revoked"][0]["revoked"] is not None
    resp = await client.get("/weights/v1", headers=bearer(sampler["token"]))
    assert resp.status_code == 401 and "revoked" in resp.json()["detail"]
    # the others keep working
    assert (await client.get("/weights/v1", headers=bearer(made["worker"]["token"]))).status_code == 200


async def test_token_management_errors_name_the_problem(plain):
    _sup, state, client = plain
    admin = bearer(state.token)
    resp = await client.post("/tokens", json={"role": "admin"}, headers=admin)
    assert resp.status_code == 400 and "cannot be issued" in resp.json()["detail"]
    resp = await client.post("/tokens", json={"role": "sampler", "colour": "red"}, headers=admin)
    assert resp.status_code == 400 and "colour" in resp.json()["detail"]
    resp = await client.post("/tokens", content=b"{", headers=admin)
    assert resp.status_code == 400
    resp = await client.delete("/tokens/nobody", headers=admin)
    assert resp.status_code == 404 and "nobody" in resp.json()["detail"]


async def test_a_token_revoked_by_the_cli_is_refused_by_the_running_daemon(plain, fleetrl_bin):
    _sup, state, client = plain
    out = subprocess.run([fleetrl_bin, "token", "create", "--role", "weights-read", "--name", "cache",
                          "--state-dir", str(state.path)], capture_output=True, text=True, check=True)
    token = out.stdout.strip()
    assert (await client.get("/weights/v1", headers=bearer(token))).status_code == 200
    subprocess.run([fleetrl_bin, "token", "revoke", "cache", "--state-dir", str(state.path)], check=True,
                   capture_output=True)
    assert (await client.get("/weights/v1", headers=bearer(token))).status_code == 401


async def test_tls_listener_refuses_plain_connections_and_clients_verify(tmp_path, test_actors):
    ca = make_ca(tmp_path / "pki")
    _cfg, state, sup = _daemon(tmp_path, f'tls_cert = "{ca.cert}"\ntls_key = "{ca.key}"')
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            host, port = read_control(state.path)
            assert control_cert(state.path) == str(ca.cert)
            # plain HTTP to the TLS port: no answer, the handshake fails and the server closes
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as plain_client:
                for path in ("/healthz", "/status", "/weights/v1"):
                    with pytest.raises(httpx.HTTPError):
                        await plain_client.get(path, headers=bearer(state.token))
            # a client that does not trust the CA refuses the server
            other = ssl.create_default_context(cafile=str(ca.other_ca_cert))
            async with httpx.AsyncClient(base_url=f"https://{host}:{port}", verify=other) as wrong:
                with pytest.raises(httpx.ConnectError) as info:
                    await wrong.get("/healthz")
                assert _caused_by(info.value, ssl.SSLCertVerificationError)
            trusted = ssl.create_default_context(cafile=str(ca.ca_cert))
            async with httpx.AsyncClient(base_url=f"https://{host}:{port}", verify=trusted) as client:
                assert (await client.get("/healthz")).status_code == 200
                assert (await client.get("/status", headers=bearer(state.token))).status_code == 200
                assert (await client.get("/status")).status_code == 401
                # the server is still serving after the failed handshakes
                assert (await client.get("/weights/v1", headers=bearer(state.token))).status_code == 200
            # `fleetrl status` finds https from control.json
            proc = await trio.run_process([sys.executable, "-m", "fleetrl.daemon.cli", "status", "--state-dir",
                                           str(state.path)], capture_stdout=True, capture_stderr=True, check=False)
            assert proc.returncode == 0, proc.stderr.decode()
            sup.request_shutdown("test over")
    state.close()


def _caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def test_tls_config_errors_name_the_setting(tmp_path):
    from fleetrl.daemon.config import ConfigError

    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        load_config_text('[http]\ntls_cert = "/x.pem"\n', source="t.toml")
    cfg = load_config_text(f'[http]\ntls_cert = "{tmp_path}/none.pem"\ntls_key = "{tmp_path}/none.key"\n',
                           source="t.toml")
    problem = cfg.http.tls_problem()
    assert problem is not None and "[http] tls_cert" in problem and "none.pem" in problem
