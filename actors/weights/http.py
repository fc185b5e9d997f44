"""Serve a BlobStore over HTTP (Starlette ASGI app) and fetch from it (httpx client).

Routes (relative to wherever the app is mounted):

``GET|HEAD /blobs/{key}``
    the immutable blob; ``ETag: "<key>"`` (its content hash), ``Cache-Control: public,
    max-age=31536000, immutable``, ``Accept-Ranges: bytes``. A single ``Range: bytes=a-b``,
    ``bytes=a-`` or ``bytes=-n`` gives 206 with ``Content-Range``; an unsatisfiable or
    malformed range gives 416 with ``Content-Range: bytes */size``; ``If-None-Match``
    with the key gives 304; an unknown key 404; a malformed key 400.
``GET /refs/{name}``
    the key a ref points at (text), ``Cache-Control: no-cache``.

Bodies are streamed from the store in 4 MiB reads in a worker thread, so a large anchor
neither blocks the event loop nor sits in memory whole.
"""

from __future__ import annotations

import re

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .errors import BlobIntegrityError, BlobNotFound, RangeError
from .manifest import MANIFEST_REF, Manifest, decode_manifest
from .store import BlobStore, check_key, check_ref_name, key_of

__all__ = ["blob_app", "HttpBlobSource", "parse_range"]

_READ = 4 << 20
_IMMUTABLE = "public, max-age=31536000, immutable"
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def parse_range(header: str, size: int) -> tuple[int, int]:
    """``[start, stop)`` of a single-range ``Range`` header; RangeError if unsatisfiable."""
    m = _RANGE.fullmatch(header.strip())
    if not m or (not m.group(1) and not m.group(2)):
        raise RangeError(f"unsupported Range header {header!r}: expected one 'bytes=a-b' range")
    a, b = m.group(1), m.group(2)
    if not a:  # suffix: the last n bytes
        n = int(b)
        if n == 0 or size == 0:
            raise RangeError(f"range {header!r} selects nothing of {size} bytes")
        return max(0, size - n), size
    start = int(a)
    stop = size if not b else min(int(b) + 1, size)
    if start >= size or (b and int(b) < start):
        raise RangeError(f"range {header!r} not satisfiable for {size} bytes")
    return start, stop


def blob_app(store: BlobStore) -> Starlette:
    """The ASGI app serving ``store`` (mount it under any prefix)."""

    async def blob(request: Request) -> Response:
        key = request.path_params["key"]
        try:
            check_key(key)
        except ValueError as e:
            return PlainTextResponse(str(e), status_code=400)
        try:
            size = await anyio.to_thread.run_sync(store.size, key)
        except BlobNotFound:
            return PlainTextResponse(f"no blob {key}", status_code=404)
        etag = f'"{key}"'
        headers = {"ETag": etag, "Cache-Control": _IMMUTABLE, "Accept-Ranges": "bytes"}
        inm = request.headers.get("if-none-match")
        if inm is not None and (inm.strip() == "*" or etag in [t.strip() for t in inm.split(",")]):
            return Response(status_code=304, headers=headers)
        start, stop, status = 0, size, 200
        rng = request.headers.get("range")
        if rng is not None:
            try:
                start, stop = parse_range(rng, size)
            except RangeError as e:
                return PlainTextResponse(str(e), status_code=416,
                                         headers={"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        headers["Content-Length"] = str(stop - start)
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers)

        async def body():
            at = start
            while at < stop:
                n = min(_READ, stop - at)
                chunk = await anyio.to_thread.run_sync(store.read, key, at, at + n)
                at += n
                yield chunk

        return StreamingResponse(body(), status_code=status, headers=headers,
                                 media_type="application/octet-stream")

    async def ref(request: Request) -> Response:
        name = request.path_params["name"]
        try:
            check_ref_name(name)
            key = await anyio.to_thread.run_sync(store.get_ref, name)
        except BlobNotFound:  # before ValueError: every error of the package is one
            return PlainTextResponse(f"no ref {name}", status_code=404)
        except ValueError as e:
            return PlainTextResponse(str(e), status_code=400)
        return PlainTextResponse(key, headers={"Cache-Control": "no-cache", "ETag": f'"{key}"'})

    return Starlette(routes=[
        Route("/blobs/{key}", blob, methods=["GET", "HEAD"]),
        Route("/refs/{name}", ref, methods=["GET"]),
    ])


class HttpBlobSource:
    """An AsyncBlobSource over :func:`blob_app`: every blob is checked against its key.

    A blob download that breaks (a reset, a dropped connection) or stalls (nothing read
    for ``stall_s`` seconds) is resumed where it stopped with a ranged GET, up to
    ``retries`` times with a doubling pause from ``backoff_s``; ``resumes`` counts them.
    A server that ignores the range (200 instead of 206) sends the whole blob again."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, *, retries: int = 5, stall_s: float = 30.0,
                 backoff_s: float = 0.5) -> None:
        self.client = client
        self.base = base_url.rstrip("/")
        self.retries, self.stall_s, self.backoff_s = retries, stall_s, backoff_s
        self.resumes = 0

    async def ref(self, name: str) -> str:
        r = await self.client.get(f"{self.base}/refs/{check_ref_name(name)}")
        if r.status_code == 404:
            raise BlobNotFound(name)
        r.raise_for_status()
        return check_key(r.text.strip())

    async def get(self, key: str) -> bytes:
        url = f"{self.base}/blobs/{check_key(key)}"
        timeout = httpx.Timeout(60.0, read=self.stall_s)
        buf = bytearray()
        tries = 0
        while True:
            headers = {"Range": f"bytes={len(buf)}-"} if buf else {}
            try:
                async with self.client.stream("GET", url, headers=headers, timeout=timeout) as r:
                    if r.status_code == 404:
                        raise BlobNotFound(key)
                    if r.status_code == 416 and buf:  # everything had arrived before the break
                        break
                    r.raise_for_status()
                    if buf and r.status_code != 206:  # the range was ignored: the whole blob again
                        buf.clear()
                    async for chunk in r.aiter_bytes():
                        buf += chunk
                break
            except httpx.TransportError:  # reset, dropped, or stalled past stall_s: resume
                tries += 1
                if tries > self.retries:
                    raise
                self.resumes += 1
                await anyio.sleep(min(self.backoff_s * 2 ** (tries - 1), 10.0))
        if key_of(buf) != key:
            raise BlobIntegrityError(f"blob {key} fetched from {self.base} does not hash to its key")
        return bytes(buf)

    async def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of a blob (a resumed or partial download)."""
        r = await self.client.get(f"{self.base}/blobs/{check_key(key)}",
                                  headers={"Range": f"bytes={start}-{stop - 1}"})
        if r.status_code == 404:
            raise BlobNotFound(key)
        r.raise_for_status()
        if r.status_code != 206 or len(r.content) != stop - start:
            raise BlobIntegrityError(f"blob {key}: asked for bytes [{start}, {stop}), got "
                                     f"{r.status_code} with {len(r.content)} bytes")
        return r.content

    async def manifest(self) -> Manifest:
        return decode_manifest(await self.get(await self.ref(MANIFEST_REF)))
