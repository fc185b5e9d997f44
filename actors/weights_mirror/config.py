"""Settings of the weights mirror actor (``[actors.NAME.config]``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["WeightsMirrorConfig"]


class WeightsMirrorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    #: the bucket and prefix to copy into, ``s3://BUCKET/PREFIX``
    to: Annotated[str, msgspec.Meta(pattern=r"^s3://[^/?#]+(/[^?#]*)?$")]
    #: the delta store to copy from; default: the trainer's (``<state>/actors/trainer/weights``)
    store_dir: str | None = None
    #: S3 endpoint (R2, GCS, MinIO, a test server); default: boto3's configuration (``AWS_ENDPOINT_URL``)
    endpoint_url: str | None = None
    #: seconds before a failed copy is tried again (without a newer announcement)
    retry_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
