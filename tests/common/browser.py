"""Headless Chromium (Debian's package) driven over the DevTools protocol, for tests that
look at a page as a person would: open a URL, type, click, wait for what the page shows,
take screenshots. Only trio and trio-websocket: no driver to install.

    async with chromium(tmp_path) as page:
        await page.goto("http://127.0.0.1:8080/ui/")
        await page.wait_for("document.body.dataset.state === 'login'")
        png = await page.screenshot()
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from trio_websocket import open_websocket_url

__all__ = ["Page", "chromium", "chromium_binary"]


def chromium_binary() -> str:
    """The Chromium executable (scripts/setup.sh installs Debian's ``chromium``)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no chromium on PATH: scripts/setup.sh installs Debian's chromium package")


class Page:
    """One tab, over its DevTools WebSocket."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self._ids)
        await self.ws.send_message(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.ws.get_message())
            if msg.get("id") == n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises awaited)."""
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r} threw: {r['exceptionDetails'].get('text')} "
                               f"{r['exceptionDetails'].get('exception', {}).get('description', '')}")
        return r["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def wait_for(self, expression: str, timeout_s: float = 30.0, poll_s: float = 0.1) -> Any:
        """Poll until `expression` is truthy; its value."""
        with trio.fail_after(timeout_s):
            while True:
                try:
                    value = await self.eval(expression)
                except RuntimeError:  # the page is (re)loading
                    value = None
                if value:
                    return value
                await trio.sleep(poll_s)

    async def screenshot(self, path: Path | None = None) -> bytes:
        png = base64.b64decode((await self.call("Page.captureScreenshot", format="png",
                                                captureBeyondViewport=True))["data"])
        if path is not None:
            path.write_bytes(png)
        return png


@asynccontextmanager
async def chromium(profile_dir: Path, *, width: int = 1400, height: int = 1100) -> AsyncIterator[Page]:
    """A headless Chromium with a fresh profile in `profile_dir`; one page."""
    profile_dir.mkdir(parents=True, exist_ok=True)
    log = profile_dir / "chromium.log"  # a file, not a pipe: nobody has to keep reading it
    with log.open("w") as err:
        proc = subprocess.Popen([chromium_binary(), "--headless=new", "--no-sandbox", "--disable-gpu",
                                 "--disable-dev-shm-usage", "--no-first-run", "--remote-debugging-port=0",
                                 f"--user-data-dir={profile_dir / 'profile'}", f"--window-size={width},{height}",
                                 "about:blank"], stdout=subprocess.DEVNULL, stderr=err)
    try:
        with trio.fail_after(60):
            while (url := _devtools_url(log)) is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"chromium exited ({proc.returncode}): {log.read_text()[-2000:]}")
                await trio.sleep(0.1)
        port = int(re.search(r":(\d+)/", url).group(1))  # type: ignore[union-attr]
        targets = await trio.to_thread.run_sync(_json, f"http://127.0.0.1:{port}/json/list")
        page_url = next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")
        async with open_websocket_url(page_url, max_message_size=64 << 20) as ws:
            page = Page(ws)
            await page.call("Page.enable")
            await page.call("Runtime.enable")
            yield page
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _devtools_url(log: Path) -> str | None:
    m = re.search(r"DevTools listening on (ws://\S+)", log.read_text(errors="replace"))
    return m.group(1) if m else None


def _json(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())
