"""How a delta is written: stream compression (blosc2) and when a chunk goes dense.

The decoder needs none of this: blosc2 frames describe themselves and the chunk table
says each chunk's kind. Pure; see :mod:`.codec`.
"""

from __future__ import annotations

import blosc2
import msgspec

from . import streams

__all__ = ["CodecParams", "DEFAULT_PARAMS"]


class CodecParams(msgspec.Struct, frozen=True):
    """How streams are compressed. The decoder needs none of this (blosc2 frames say it)."""

    codec: str = "zstd"
    clevel: int = 1
    # "shuffle" | "bitshuffle" | "none"; shuffle applies to the dense words only (on the
    # byte streams it is the identity, which blosc2 would still pay a copy per block for)
    filter: str = "shuffle"
    split: bool = True  # compress each byte plane separately (dense words)
    # 0: one block per byte-stream part of >= streams.ONE_BLOCK_FROM raw bytes, blosc2's
    # choice otherwise; -1: blosc2's choice everywhere; > 0: that block size everywhere
    blocksize: int = 0
    part_bytes: int = streams.PART_BYTES  # raw bytes per stored part (any size reads back)
    dense_threshold: float = 0.25  # changed fraction above which a chunk goes dense
    # blosc2 threads per stream part; 0: one (parts already run on the codec's worker
    # threads, and one thread keeps the bytes reproducible, see docs/reference/delta-format.md)
    nthreads: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.dense_threshold <= 1.0:
            raise ValueError(f"CodecParams.dense_threshold must be in [0, 1], got {self.dense_threshold}")
        if self.blocksize < -1:
            raise ValueError(f"CodecParams.blocksize must be -1, 0 or a size in bytes, got {self.blocksize}")
        if not 2 <= self.part_bytes <= 1 << 30:
            raise ValueError(f"CodecParams.part_bytes must be in [2, 2**30], got {self.part_bytes}")

    def cparams(self, typesize: int, nbytes: int = 0) -> dict:
        """blosc2 settings for a part of ``nbytes`` raw bytes of ``typesize``-byte items."""
        codecs = {"zstd": blosc2.Codec.ZSTD, "lz4": blosc2.Codec.LZ4, "zlib": blosc2.Codec.ZLIB,
                  "blosclz": blosc2.Codec.BLOSCLZ, "lz4hc": blosc2.Codec.LZ4HC}
        filters = {"shuffle": blosc2.Filter.SHUFFLE, "bitshuffle": blosc2.Filter.BITSHUFFLE,
                   "none": blosc2.Filter.NOFILTER}
        if self.codec not in codecs:
            raise ValueError(f"CodecParams.codec must be one of {sorted(codecs)}, got {self.codec!r}")
        if self.filter not in filters:
            raise ValueError(f"CodecParams.filter must be one of {sorted(filters)}, got {self.filter!r}")
        byte_stream = typesize == 1
        filt = blosc2.Filter.NOFILTER if byte_stream and self.filter == "shuffle" else filters[self.filter]
        blocksize = max(self.blocksize, 0)
        if self.blocksize == 0 and byte_stream and nbytes >= streams.ONE_BLOCK_FROM:
            blocksize = nbytes
        return dict(
            typesize=typesize,
            codec=codecs[self.codec],
            clevel=self.clevel,
            filters=[filt],
            filters_meta=[0],
            splitmode=blosc2.SplitMode.ALWAYS_SPLIT if self.split and not byte_stream
            else blosc2.SplitMode.NEVER_SPLIT,
            blocksize=blocksize,
            nthreads=self.nthreads or 1,
        )


DEFAULT_PARAMS = CodecParams()
