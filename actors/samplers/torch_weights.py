"""The weights a torch sampler holds: stored in its dtype (fp8 with scales), swapped per version.

`TorchWeights` keeps an immutable mapping of named tensors (Hugging Face names) and
swaps in a new mapping (copy on write) when a version arrives, so a decode step that
took a `snapshot` keeps consistent weights while another thread installs the next
version. Values arrive in fp32, bf16 or fp16 and are checked (names, shapes, finite),
then cast to the compute dtype, or, for an fp8 sampler's seven projection matrices per
layer, quantised to ``float8_e4m3fn`` with fp32 scales (`fleetrl.actors.weights.quant`)
and optionally dequantised once per version. An fp8 sampler's projections may also
arrive already quantised (`base.Fp8Values`, from a delta follower): they are checked
(scheme, shapes, finite positive scales, no NaN codes) and stored as given, byte for
byte. With ``matmul = "fp32"`` it also keeps fp32 copies of the projection matrices'
rounded values, with ``"fp16_accumulate"`` the same values laid out in inner-dimension
blocks (`llama_forward.Fp16AccWeight`; see `torch_backend`, ``matmul``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from fleetrl.actors.samplers.base import Fp8Values, WeightValue, WeightVersion, check_weights, compute_dtype
from fleetrl.actors.samplers.errors import BadWeightUpdate
from fleetrl.actors.samplers.llama_forward import Fp16AccWeight, WeightReader, fp16_accumulate_weight
from fleetrl.actors.weights.quant import dequantize_fp8, quantize_fp8
from fleetrl.daemon.protocol import DTypeName

__all__ = ["FP8_SUFFIXES", "MATMULS", "Fp8Weight", "Matmul", "MatmulCopy", "Stored", "TorchWeights"]

Matmul = Literal["native", "fp32", "fp16_accumulate"]
"""How projections multiply (the resolved `TorchBackendConfig.matmul`, never ``"auto"``)."""
MATMULS: tuple[str, ...] = get_args(Matmul)

MatmulCopy = torch.Tensor | Fp16AccWeight
"""A projection matrix as the matmul emulation reads it."""

FP8_SUFFIXES = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
"""The weights an fp8 sampler stores in fp8 (every decoder layer's projections)."""


@dataclass(frozen=True)
class Fp8Weight:
    """An fp8 weight: e4m3 values, their fp32 scales, and (optionally) the dequantised
    bf16 tensor, computed once when the version is installed."""

    q: torch.Tensor
    scale: torch.Tensor
    dense: torch.Tensor | None


Stored = torch.Tensor | Fp8Weight
"""A stored weight: a dense tensor in the compute dtype, or an fp8 weight."""


class TorchWeights:
    """Named weights and their version, read and replaced together (module docstring)."""

    def __init__(self, expected: Mapping[str, tuple[int, ...]], *, dtype: DTypeName, device: torch.device,
                 fp8_scheme: str, fp8_dequantize_once: bool, matmul: Matmul, lm_head_name: str,
                 version: WeightVersion) -> None:
        if matmul not in MATMULS:
            raise ValueError(f"TorchWeights matmul must be one of {MATMULS}, got {matmul!r}")
        if matmul == "fp16_accumulate" and dtype != "fp16":
            raise ValueError(f"matmul 'fp16_accumulate' needs dtype fp16, not {dtype}")
        self.expected = dict(expected)
        self.dtype = dtype
        self.compute_dtype = compute_dtype(dtype)
        self.device = device
        self.fp8_scheme = fp8_scheme
        self.fp8_dequantize_once = fp8_dequantize_once
        self.matmul: Matmul = "native" if dtype == "fp32" and matmul == "fp32" else matmul
        self.lm_head_name = lm_head_name
        self._swap = threading.Lock()  # makes (weights, version) change and read as one
        self._weights: dict[str, Stored] = {}
        self._mm: dict[str, MatmulCopy] | None = None  # projection matrices for the matmul emulation
        self._version = version

    @property
    def fp32_matmul(self) -> bool:
        """Whether projections multiply in fp32 from the rounded operands."""
        return self.matmul == "fp32"

    @property
    def fp8_names(self) -> tuple[str, ...]:
        """The weights stored in fp8 (none unless the dtype is fp8)."""
        if self.dtype != "fp8":
            return ()
        return tuple(n for n in self.expected if n.endswith(FP8_SUFFIXES))

    @property
    def version(self) -> WeightVersion:
        """The version of the weights the next snapshot returns."""
        return self._version

    def snapshot(self) -> tuple[dict[str, Stored], dict[str, MatmulCopy] | None, WeightVersion]:
        """The weights, their matmul copies and their version, read together (a swap
        never lands in between)."""
        with self._swap:
            return self._weights, self._mm, self._version

    def load(self, tensors: Mapping[str, WeightValue], version: WeightVersion) -> None:
        """Replace every weight (an anchor). All names of the model must be present."""
        missing = sorted(set(self.expected) - set(tensors))
        if missing:
            raise BadWeightUpdate(
                f"version {version.version}: a full load needs every weight; missing {len(missing)}: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            )
        stored = self._convert(tensors, version)
        mm = self._matmul_copies(stored)
        with self._swap:
            self._weights, self._mm, self._version = stored, mm, version

    def apply(self, tensors: Mapping[str, WeightValue], version: WeightVersion) -> None:
        """Replace the named weights and move to `version` (newer than the current one)."""
        self._check_newer(version)
        stored = self._convert(tensors, version)  # the slow part, outside the lock
        mm_new = self._matmul_copies(stored)
        with self._swap:
            self._check_newer(version)  # another thread may have moved on meanwhile
            new = dict(self._weights)
            new.update(stored)
            mm = None
            if mm_new is not None:
                mm = dict(self._mm or {})
                mm.update(mm_new)
            self._weights, self._mm, self._version = new, mm, version

    def stored_dtypes(self) -> dict[str, str]:
        """How each weight is held, e.g. ``"float8_e4m3fn+scale"`` or ``"bfloat16"``."""
        weights, _, _ = self.snapshot()
        return {
            name: f"{str(v.q.dtype).removeprefix('torch.')}+scale" if isinstance(v, Fp8Weight)
            else str(v.dtype).removeprefix("torch.")
            for name, v in weights.items()
        }

    def reader(self, weights: Mapping[str, Stored]) -> WeightReader:
        """Reads a weight of ``weights`` (a snapshot's) in the compute dtype."""
        dtype = self.compute_dtype
        scheme = self.fp8_scheme

        def read(name: str) -> torch.Tensor:
            value = weights[name]
            if isinstance(value, Fp8Weight):
                if value.dense is not None:
                    return value.dense
                return dequantize_fp8(value.q, value.scale, scheme, dtype)
            return value

        return read

    def _check_newer(self, version: WeightVersion) -> None:
        current = self._version
        if version.version <= current.version:
            raise BadWeightUpdate(
                f"update to version {version.version} is not newer than the current version {current.version}"
            )

    def _matmul_copies(self, stored: Mapping[str, Stored]) -> dict[str, MatmulCopy] | None:
        """The projection matrices of `stored` for the matmul emulation: fp32 copies of
        their rounded values, or their fp16 values in blocks (`fp16_accumulate_weight`);
        None when the sampler multiplies natively."""
        if self.matmul == "native":
            return None
        read = self.reader(stored)
        names = [n for n in stored if n.endswith(FP8_SUFFIXES) or n == self.lm_head_name]
        if self.matmul == "fp16_accumulate":
            return {n: fp16_accumulate_weight(read(n)) for n in names}
        return {n: read(n).to(torch.float32) for n in names}

    def _convert(self, tensors: Mapping[str, WeightValue], version: WeightVersion) -> dict[str, Stored]:
        """Check names, shapes and values, then cast or quantise into the storage
        (pre-quantised fp8 values are copied as they are)."""
        fp8 = self.dtype == "fp8"
        check_weights(tensors, self.expected, version, fp8_scheme=self.fp8_scheme if fp8 else None)
        where = f"version {version.version}"
        out: dict[str, Stored] = {}
        for name, t in tensors.items():
            if isinstance(t, Fp8Values):
                if not name.endswith(FP8_SUFFIXES):
                    raise BadWeightUpdate(f"{where}: {name} is pre-quantised fp8, but this sampler keeps it "
                                          f"in {self.compute_dtype}; send its bf16 values")
                q = t.q.detach().to(self.device, copy=True)
                scale = t.scale.detach().to(self.device, copy=True)
                dense = dequantize_fp8(q, scale, self.fp8_scheme, self.compute_dtype) if self.fp8_dequantize_once else None
                out[name] = Fp8Weight(q, scale, dense)
                continue
            t = t.detach()
            if fp8 and name.endswith(FP8_SUFFIXES):
                q, scale = quantize_fp8(t.to(self.device), self.fp8_scheme)
                dense = None
                if self.fp8_dequantize_once:
                    dense = dequantize_fp8(q, scale, self.fp8_scheme, self.compute_dtype)
                out[name] = Fp8Weight(q, scale, dense)
            else:
                cast = t.to(device=self.device, dtype=self.compute_dtype, copy=True)
                # finite values (checked above) overflow only into a narrower range: fp16
                narrows = self.compute_dtype == torch.float16 and t.dtype != torch.float16
                if narrows and not bool(torch.isfinite(cast).all()):
                    raise BadWeightUpdate(f"{where}: {name} overflows {self.dtype} (values beyond its range)")
                out[name] = cast
        return out
