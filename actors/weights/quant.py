"""Deterministic fp8 (float8_e4m3fn) quantizer shared by the trainer and fp8 samplers.

Every fp8 sampler of a weight version must hold identical bytes, whatever machine it
runs on, so the quantizer uses only operations that are exact or correctly rounded
under IEEE 754 on every backend:

* ``amax`` is a maximum (order-independent, exact);
* ``scale = max(amax / 448, FP8_SCALE_FLOOR)`` is one correctly rounded fp32 division;
* ``q = clamp(x / scale, -448, 448)`` is a correctly rounded fp32 division followed by a
  clamp (fp32 rounding of ``amax / 448`` may push ``|x / scale|`` a hair above 448, and a
  cast to e4m3fn does not saturate), then a round-to-nearest-even cast to e4m3fn.

No reciprocal-multiply, no fused ops, no reductions whose order matters.

Schemes (the tensor is first viewed in 2-D, see :func:`as_2d_shape`):

``"tensor"``
    one scale for the whole tensor, scale shape ``()``.
``"row"``
    one scale per row of the 2-D view, scale shape ``(R,)``.
``"block128"``
    one scale per 128x128 block of the 2-D view, scale shape ``(ceil(R/128), ceil(C/128))``.
    Shapes that are not multiples of 128 are padded *logically* with zeros: the last
    block row/column is smaller, and zeros never raise an ``amax``. A 1-D tensor of n
    elements is the 2-D view ``(1, n)``, so its blocks are runs of 128 elements.

The 2-D view: a 0-D tensor is ``(1, 1)``, a 1-D tensor of n elements is ``(1, n)``, and an
N-D tensor is ``(prod(shape[:-1]), shape[-1])`` (rows are the last dimension, as in a
``Linear`` weight).

All-zero tensors, rows or blocks get the floor scale ``FP8_SCALE_FLOOR`` (2**-126, the
smallest normal fp32), so dividing never produces inf/NaN and they dequantize to exact
zeros. Non-finite input is rejected with ``ValueError``.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_SCALE_FLOOR",
    "BLOCK",
    "Scheme",
    "as_2d_shape",
    "scale_shape",
    "quantize_fp8",
    "dequantize_fp8",
]

Scheme = Literal["tensor", "row", "block128"]
SCHEMES: tuple[str, ...] = get_args(Scheme)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_SCALE_FLOOR = 2.0**-126
BLOCK = 128

_INPUT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def as_2d_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """Return the (rows, cols) view the row and block schemes work on."""
    shape = tuple(shape)
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return (math.prod(shape[:-1]), shape[-1])


def scale_shape(shape: torch.Size | tuple[int, ...], scheme: Scheme) -> tuple[int, ...]:
    """Shape of the fp32 scale tensor that ``quantize_fp8`` returns for ``shape``."""
    _check_scheme(scheme)
    rows, cols = as_2d_shape(shape)
    if scheme == "tensor":
        return ()
    if scheme == "row":
        return (rows,)
    return (-(-rows // BLOCK), -(-cols // BLOCK))


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"fp8 scheme must be one of {SCHEMES}, got {scheme!r}")


def _amax_to_scale(amax: torch.Tensor, where: str) -> torch.Tensor:
    amax = amax.to(torch.float32)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"quantize_fp8: {where} contains NaN or Inf")
    return torch.clamp(amax / FP8_MAX, min=FP8_SCALE_FLOOR)


def _expand_scale(scale: torch.Tensor, rows: int, cols: int, scheme: Scheme) -> torch.Tensor:
    """Broadcast a scale tensor to the (rows, cols) 2-D view."""
    if scheme == "tensor":
        return scale.reshape(1, 1)
    if scheme == "row":
        return scale.reshape(rows, 1)
    full = scale.repeat_interleave(BLOCK, dim=0)[:rows]
    return full.repeat_interleave(BLOCK, dim=1)[:, :cols]


def quantize_fp8(t: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``t`` (bf16, fp16 or fp32) to ``float8_e4m3fn`` with fp32 scales.

    Returns ``(q, scale)`` where ``q`` has ``t``'s shape and ``scale`` has
    ``scale_shape(t.shape, scheme)``; ``q * scale`` (broadcast as in
    :func:`dequantize_fp8`) approximates ``t``. Same input, same bytes, on any device.
    """
    _check_scheme(scheme)
    if t.dtype not in _INPUT_DTYPES:
        raise TypeError(f"quantize_fp8: expected bf16, fp16 or fp32 tensor, got {t.dtype}")
    rows, cols = as_2d_shape(t.shape)
    x = t.detach().to(torch.float32).reshape(rows, cols)
    sshape = scale_shape(t.shape, scheme)
    if x.numel() == 0:
        scale = torch.full(sshape, FP8_SCALE_FLOOR, dtype=torch.float32, device=t.device)
        return torch.empty(t.shape, dtype=FP8_DTYPE, device=t.device), scale

    absx = x.abs()
    if scheme == "tensor":
        scale = _amax_to_scale(absx.amax(), "tensor")
    elif scheme == "row":
        scale = _amax_to_scale(absx.amax(dim=1), "row")
    else:
        rb, cb = sshape
        pad = torch.nn.functional.pad(absx, (0, cb * BLOCK - cols, 0, rb * BLOCK - rows))
        amax = pad.reshape(rb, BLOCK, cb, BLOCK).amax(dim=(1, 3))
        scale = _amax_to_scale(amax, "block")
    full = _expand_scale(scale, rows, cols, scheme)
    q = torch.clamp(x / full, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(t.shape), scale.reshape(sshape)


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    scheme: Scheme,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``q * scale`` in fp32, cast to ``dtype``."""
    _check_scheme(scheme)
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"dequantize_fp8: expected {FP8_DTYPE}, got {q.dtype}")
    want = scale_shape(q.shape, scheme)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"dequantize_fp8: scale shape {tuple(scale.shape)} does not match {want} "
            f"for a {tuple(q.shape)} tensor with scheme {scheme!r}"
        )
    rows, cols = as_2d_shape(q.shape)
    x = q.to(torch.float32).reshape(rows, cols)
    full = _expand_scale(scale.to(torch.float32), rows, cols, scheme)
    return (x * full).to(dtype).reshape(q.shape)
