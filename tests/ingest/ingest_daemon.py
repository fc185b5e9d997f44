"""A real `fleetrl serve` subprocess running the ingest actor, for the ingest tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
from helpers import wait_until

CONFIG = """
[daemon]
grace_s = 10.0
checkpoint_interval_s = 1000.0
[logging]
format = "json"
console = "none"
[actors.ingest]
factory = "fleetrl.actors.ingest:run"
[actors.ingest.config]
poll_s = 0.2
{extra}
"""


class IngestDaemon:
    """`fleetrl serve` over ``tmp/state`` with the ingest actor; `post` talks to it."""

    def __init__(self, tmp: Path, bin_: str, extra: str = "") -> None:
        self.tmp, self.bin = tmp, bin_
        self.state = tmp / "state"
        self.config = tmp / "ingest.toml"
        self.config.write_text(CONFIG.format(extra=extra))
        self.proc: subprocess.Popen | None = None
        self.n = 0

    def start(self) -> IngestDaemon:
        self.n += 1
        self.err = self.tmp / f"stderr-{self.n}.txt"
        with self.err.open("wb") as fh:
            self.proc = subprocess.Popen([self.bin, "serve", "--config", str(self.config), "--state-dir",
                                          str(self.state)], stdout=subprocess.DEVNULL, stderr=fh,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wait_until(self._ready, "the ingest actor to run", 120, proc=self.proc, stderr=self.err, interval=0.1)
        return self

    def _ready(self) -> bool:
        try:
            inst = json.loads((self.state / "instance.json").read_text())
            if inst["pid"] != self.proc.pid:
                return False
            status = self.get("/status").json()
        except (OSError, ValueError, KeyError, httpx.HTTPError):
            return False
        return status.get("instance_id") == inst["instance_id"] and \
            status["actors"]["ingest"]["state"] == "running"

    @property
    def url(self) -> str:
        data = json.loads((self.state / "control.json").read_text())
        return f"http://127.0.0.1:{data['port']}"

    @property
    def token(self) -> str:
        return (self.state / "token").read_text().strip()

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def post(self, body: bytes, *, token: bool = True, content_type: str | None = None,
             **params: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} if token else {}
        if content_type is not None:
            headers["Content-Type"] = content_type
        return httpx.post(self.url + "/v1/traces", content=body, params=params, headers=headers, timeout=60)

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 60) -> int:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)  # only the daemon this test started
        return self.proc.wait(timeout) if self.proc is not None else 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGTERM)
