"""What a train step measures, in forms that add up over micro-batches and ranks.

`_Sums` holds one rank's sums over its micro-batches (the loss's numerator and
normalisers, the counts and sums behind every mean of `StepMetrics`, the maxima, the
mismatch per sampler kind and id); ranks add theirs (`_Sums.add`) and `stats` turns the
total into `StepMetrics` fields (`metrics_fields`). `_Mismatch` is the sampler-trainer mismatch of a set of
tokens (`MismatchFigures` once combined, `combine_figures`); `RowDetail` is what the step
saw of one row, for the rollout log. `fleetrl.actors.trainer.step` documents what each
figure means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import torch

from fleetrl.daemon.messages import MismatchFigures, SamplerIdentity
from fleetrl.grpo import CorrectionConfig
from fleetrl.grpo.weights import in_band, kept_tokens

from .batch import Batch

__all__ = ["SUM_KEYS", "MismatchFigures", "RowDetail", "combine_figures", "metrics_fields", "mismatch_sums"]


def _nanmax(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


class _Mismatch(msgspec.Struct):
    """The mismatch of a set of tokens, in a form that combines exactly over a union of
    disjoint sets (`add`): counts and sums add, the mean and the sum of squared
    deviations combine by Chan, Golub and LeVeque's pairwise update, maxima by max."""

    tokens: int = 0
    k3_sum: float = 0.0
    out_of_band: int = 0
    mean: float = 0.0
    """Mean log-ratio."""
    m2: float = 0.0
    """Sum of squared deviations of the log-ratio from ``mean``."""
    max_abs: float = 0.0

    @staticmethod
    def of(log_ratio: torch.Tensor, out_of_band: torch.Tensor) -> _Mismatch:
        """The figures of the tokens whose log-ratios (any shape) are given, with the
        flags of those outside the band."""
        r = log_ratio.double().reshape(-1)
        n = int(r.numel())
        if n == 0:
            return _Mismatch()
        mean = float(r.mean())
        return _Mismatch(tokens=n, k3_sum=float((torch.expm1(r) - r).sum()), out_of_band=int(out_of_band.sum()),
                         mean=mean, m2=float(((r - mean) ** 2).sum()), max_abs=float(r.abs().max()))

    def add(self, other: _Mismatch) -> None:
        if other.tokens == 0:
            return
        if self.tokens == 0:
            for f in self.__struct_fields__:
                setattr(self, f, getattr(other, f))
            return
        n = self.tokens + other.tokens
        delta = other.mean - self.mean
        self.m2 = self.m2 + other.m2 + delta * delta * self.tokens * other.tokens / n
        self.mean = self.mean + delta * other.tokens / n
        self.tokens = n
        self.k3_sum += other.k3_sum
        self.out_of_band += other.out_of_band
        self.max_abs = _nanmax(self.max_abs, other.max_abs)

    def figures(self) -> MismatchFigures:
        n = self.tokens
        if n == 0:
            return MismatchFigures(tokens=0, kl_k3=0.0, frac_out_of_band=0.0, log_ratio_mean=0.0, log_ratio_std=0.0,
                                   log_ratio_max_abs=0.0)
        return MismatchFigures(tokens=n, kl_k3=self.k3_sum / n, frac_out_of_band=self.out_of_band / n,
                               log_ratio_mean=self.mean, log_ratio_std=math.sqrt(self.m2 / n) if self.m2 >= 0
                               else math.nan, log_ratio_max_abs=self.max_abs)

    @staticmethod
    def from_figures(f: MismatchFigures) -> _Mismatch:
        return _Mismatch(tokens=f.tokens, k3_sum=f.kl_k3 * f.tokens, out_of_band=round(f.frac_out_of_band * f.tokens),
                         mean=f.log_ratio_mean, m2=f.log_ratio_std ** 2 * f.tokens, max_abs=f.log_ratio_max_abs)


def combine_figures(parts: Sequence[MismatchFigures]) -> MismatchFigures:
    """The figures of the union of disjoint token sets, from each set's figures (exact up
    to float rounding: token-weighted means, the pooled standard deviation, the maximum)."""
    total = _Mismatch()
    for f in parts:
        total.add(_Mismatch.from_figures(f))
    return total.figures()


class RowDetail(msgspec.Struct, frozen=True, array_like=True):
    """What the step saw of one row's generated tokens (the rollout log, `train_step`'s
    ``detail``): where the row came from (`Batch.row_origin`), the trainer's replayed log
    p^S of each token (temperature applied, over the sampler's support), and the
    positions the corrections masked (loss-mask tokens the loss did not keep)."""

    origin: tuple[int, int, int]
    trainer_logprobs: list[float]
    masked: list[int]


class _Details(msgspec.Struct):
    rows: list[RowDetail] = []


class _Sums(msgspec.Struct):
    """A rank's sums over its micro-batches, combined over ranks by adding."""

    numerator: float = 0.0
    tokens_counted: float = 0.0
    sequences_counted: float = 0.0
    tokens_in_loss: float = 0.0
    tokens_masked: float = 0.0
    sequences_in_loss: float = 0.0
    sequences_masked: float = 0.0
    log_ratio_sum: float = 0.0
    weight_sum: float = 0.0
    centering_norm_sum: float = 0.0
    vocabulary_tokens: float = 0.0
    vocabulary_tokens_counted: float = 0.0
    tail_mass_sum: float = 0.0
    tail_mass_max: float = 0.0
    centering_bound_sum: float = 0.0
    centering_bound_max: float = 0.0
    fleet: _Mismatch = msgspec.field(default_factory=_Mismatch)
    by_kind: dict[str, _Mismatch] = {}
    by_id: dict[str, _Mismatch] = {}
    identities: dict[str, SamplerIdentity] = {}

    def add(self, other: _Sums) -> None:
        for f in self.__struct_fields__:
            a, b = getattr(self, f), getattr(other, f)
            if f == "identities":
                self.identities = {**b, **a}  # the first seen wins
            elif isinstance(a, _Mismatch):
                a.add(b)
            elif f.endswith("_max"):
                setattr(self, f, max(a, b))
            elif isinstance(a, dict):
                merged = {k: (msgspec.structs.replace(v) if isinstance(v, _Mismatch) else v) for k, v in a.items()}
                for k, v in b.items():
                    if isinstance(v, _Mismatch):
                        merged.setdefault(k, _Mismatch()).add(v)
                    else:
                        merged[k] = merged.get(k, 0) + v
                setattr(self, f, merged)
            else:
                setattr(self, f, a + b)


@torch.no_grad()
def mismatch_sums(lp: torch.Tensor, batch: Batch, sums: _Sums, corrections: CorrectionConfig,
                   detail: list[RowDetail] | None) -> None:
    """The mismatch of ``batch``'s loss tokens (``lp`` [B, T]: the replayed log p^S of each
    sampled token, vs the reported log q^S) overall, per sampler kind and per sampler id,
    added to ``sums``; with ``detail``, each row's `RowDetail` appended to it."""
    m = batch.loss_mask
    lr = lp.double() - batch.sampler_logprobs.double()
    out = ~in_band(lr, corrections.mask_low, corrections.mask_high)
    if detail is not None:
        masked = (m & ~kept_tokens(torch.where(m, lr, 0.0), m, corrections)).cpu()
        lengths, lp_cpu = m.sum(-1).tolist(), lp.float().cpu()
        for b, n in enumerate(lengths):
            detail.append(RowDetail(origin=batch.row_origin[b], trainer_logprobs=lp_cpu[b, :n].tolist(),
                                    masked=masked[b, :n].nonzero().reshape(-1).tolist()))
    sums.fleet.add(_Mismatch.of(lr[m], out[m]))
    for owner, names, into in ((batch.token_sampler, batch.sampler_keys, sums.by_kind),
                               (batch.token_identity, [s.sampler_id for s in batch.sampler_identities], sums.by_id)):
        for i, name in enumerate(names):
            sel = m & (owner == i)
            if bool(sel.any()):
                into.setdefault(name, _Mismatch()).add(_Mismatch.of(lr[sel], out[sel]))
    for ident in batch.sampler_identities:
        sums.identities.setdefault(ident.sampler_id, ident)


SUM_KEYS = ("tokens_counted", "sequences_counted", "tokens_in_loss", "tokens_masked", "sequences_in_loss",
             "sequences_masked", "log_ratio_sum", "weight_sum", "centering_norm_sum", "vocabulary_tokens", "vocabulary_tokens_counted",
             "tail_mass_sum", "tail_mass_max", "centering_bound_sum", "centering_bound_max")


def metrics_fields(t: _Sums) -> dict:
    n_loss, n_keep = t.tokens_in_loss, t.tokens_counted
    fleet = t.fleet.figures()
    by_kind = {k: v.figures() for k, v in sorted(t.by_kind.items()) if v.tokens}
    by_id = {k: v.figures() for k, v in sorted(t.by_id.items()) if v.tokens}
    return dict(
        frac_masked_tokens=t.tokens_masked / n_loss if n_loss else 0.0,
        frac_masked_sequences=t.sequences_masked / t.sequences_in_loss if t.sequences_in_loss else 0.0,
        mismatch_kl_k3=fleet.kl_k3,
        mismatch_kl_by_sampler={k: f.kl_k3 for k, f in by_kind.items()},
        tokens_by_sampler={k: f.tokens for k, f in by_kind.items()},
        frac_out_of_band=fleet.frac_out_of_band,
        log_ratio_std=fleet.log_ratio_std,
        log_ratio_max_abs=fleet.log_ratio_max_abs,
        mismatch_by_kind=by_kind,
        mismatch_by_sampler_id=by_id,
        sampler_identities=tuple(t.identities[k] for k in by_id),
        log_ratio_mean=t.log_ratio_sum / n_loss if n_loss else 0.0,
        centering_norm=t.centering_norm_sum / n_keep if n_keep else 0.0,
        weight_mean=t.weight_sum / n_keep if n_keep else 0.0,
        **_vocabulary_stats(t),
    )


def _vocabulary_stats(t: _Sums) -> dict:
    """The whole-vocabulary figures of `StepMetrics` from the summed ones."""
    n = t.vocabulary_tokens
    if not n:
        return {}
    kept = t.vocabulary_tokens_counted
    return dict(vocabulary_tokens=int(n), tail_mass_mean=t.tail_mass_sum / n, tail_mass_max=t.tail_mass_max,
                centering_bound_mean=t.centering_bound_sum / kept if kept else 0.0,
                centering_bound_max=t.centering_bound_max)
