"""A BlobStore in an S3-compatible object store (AWS S3, Cloudflare R2, GCS's XML API,
MinIO, ...) through boto3.

Layout under ``s3://BUCKET/PREFIX``: ``blobs/<2 hex>/<32 hex>`` (immutable, uploaded with
``Cache-Control: public, max-age=31536000, immutable``, so a CDN in front may keep them)
and ``refs/<name>`` (the mutable pointers, ``Cache-Control: no-cache``). Reads of a range
are ranged GETs. The endpoint and credentials come from boto3's own configuration
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles, instance roles) unless given.

boto3 is an optional dependency (``pip install 'fleetrl[s3]'``); importing this module
without it raises an ImportError that says so.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from .errors import BlobNotFound
from .store import check_key, check_ref_name, key_of

__all__ = ["S3Store", "parse_s3_url"]

_IMMUTABLE = "public, max-age=31536000, immutable"


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of ``s3://bucket/some/prefix`` (the prefix ends with '/' or is empty)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"S3 location {url!r} must look like s3://BUCKET or s3://BUCKET/PREFIX")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


class S3Store:
    """A BlobStore over one bucket and prefix (see the module docstring)."""

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None, endpoint_url: str | None = None) -> None:
        if client is None:
            try:
                import boto3
            except ImportError as exc:
                raise ImportError("the S3 weight store needs boto3: pip install 'fleetrl[s3]'") from exc
            client = boto3.client("s3", endpoint_url=endpoint_url)
        self.client = client
        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"

    @classmethod
    def from_url(cls, url: str, *, endpoint_url: str | None = None) -> S3Store:
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, endpoint_url=endpoint_url)

    def __repr__(self) -> str:
        return f"S3Store(s3://{self.bucket}/{self.prefix})"

    def _blob(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}blobs/{key[:2]}/{key}"

    def _ref(self, name: str) -> str:
        return f"{self.prefix}refs/{check_ref_name(name)}"

    @staticmethod
    def _missing(exc: Exception) -> bool:
        code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound")

    def put(self, data: bytes) -> str:
        key = key_of(data)
        if not self.has(key):
            self.client.put_object(Bucket=self.bucket, Key=self._blob(key), Body=bytes(data),
                                   ContentType="application/octet-stream", CacheControl=_IMMUTABLE)
        return key

    def read(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        name = self._blob(key)
        if start == 0 and stop is None:
            kw: dict[str, str] = {}
        else:
            size = self.size(key)
            stop = size if stop is None else stop
            if not 0 <= start <= stop <= size:
                raise ValueError(f"range [{start}, {stop}) outside a blob of {size} bytes")
            if start == stop:
                return b""
            kw = {"Range": f"bytes={start}-{stop - 1}"}
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=name, **kw)
        except Exception as exc:
            if self._missing(exc):
                raise BlobNotFound(key) from None
            raise
        return obj["Body"].read()

    def size(self, key: str) -> int:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._blob(key))["ContentLength"])
        except Exception as exc:
            if self._missing(exc):
                raise BlobNotFound(key) from None
            raise

    def has(self, key: str) -> bool:
        try:
            self.size(key)
        except BlobNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._blob(key))

    def set_ref(self, name: str, key: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._ref(name), Body=check_key(key).encode(),
                               ContentType="text/plain", CacheControl="no-cache")

    def get_ref(self, name: str) -> str:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._ref(name))
        except Exception as exc:
            if self._missing(exc):
                raise BlobNotFound(name) from None
            raise
        return check_key(obj["Body"].read().decode().strip())

    def keys(self) -> list[str]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                           Prefix=f"{self.prefix}blobs/"):
            out += [o["Key"].rsplit("/", 1)[-1] for o in page.get("Contents", [])]
        return sorted(out)
