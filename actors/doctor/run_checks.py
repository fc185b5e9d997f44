"""The doctor's checks of a run's recent figures (pure).

`check_run(cfg, figures)` looks at the `RunFigures` that `state.read_run` read from a
run's state directory: each trainer's recent ``metrics.jsonl`` lines (masked tokens and
sequences, excluded rows, out-of-band tokens trained at full weight, skipped steps,
unrecorded rows, the support's tail mass) against its alarms, and the support sizes of
the workers' ATIF files against ``max_support``. The thresholds are in `hazards`;
docs/guides/doctor.md ("Measured") states every rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from fleetrl.actors.trainer.config import TrainerConfig
from fleetrl.daemon.config import Config

from .hazards import _DEFAULT_ALARMS, ALL_MASKED, CAP_SHARE, TAIL_MASS, Hazard, MetricsLine, RunFigures, \
    SupportFigures, TrainerFigures, _key, _same
from .wiring import Feed, Wiring, wiring

__all__ = ["check_run"]


def _num(data: dict[str, Any], key: str) -> float | None:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _threshold(t: TrainerConfig, field: str) -> tuple[float, str]:
    """The alarm's threshold, or the default one where the config turned it off."""
    mine = getattr(t.alarms, field)
    if mine < 1.0:
        return mine, f"alarms.{field} = {mine:g}"
    default = getattr(_DEFAULT_ALARMS, field)
    return default, f"the default alarms.{field} = {default:g} (the config's is off)"


def check_run(config: Config, figures: RunFigures) -> list[Hazard]:
    """The hazards in a run's recent figures (docs/guides/doctor.md, "Measured")."""
    w = wiring(config)
    out: list[Hazard] = []
    for tf in figures.trainers:
        t = w.trainers.get(tf.trainer)
        if t is not None and tf.lines:
            out += _trainer_figures(w, tf, t)
    feeds = {f.name: f for f in w.feeds}
    for sf in figures.supports:
        feed = feeds.get(sf.worker)
        if feed is not None:
            out += _support_figures(w, feed, sf)
    return out


def _over(ratio: Iterable[tuple[MetricsLine, float | None]], limit: float) -> tuple[int, MetricsLine | None, float]:
    n, worst, top = 0, None, -1.0
    for ml, v in ratio:
        if v is not None and v > limit:
            n += 1
            if v > top:
                worst, top = ml, v
    return n, worst, top


def _trainer_figures(w: Wiring, tf: TrainerFigures, t: TrainerConfig) -> list[Hazard]:
    out: list[Hazard] = []
    lines = tf.lines
    span = f"{len(lines)} recent steps (lines {lines[0].line}-{lines[-1].line})"

    def add(hid: str, where: str, at: MetricsLine, message: str, fix: str) -> None:
        out.append(Hazard(id=hid, where=where, message=message, fix=fix, file=tf.path, line=at.line))

    def ratio_check(hid: str, field: str, alarm: str, values: Sequence[tuple[MetricsLine, float | None]],
                    what: str, fix: str) -> None:
        limit, said = _threshold(t, alarm)
        n, worst, top = _over(values, limit)
        if n and worst is not None:
            add(hid, field, worst, f"{n} of the {span} {what} above {said} (the most: {top:.3g} at step "
                f"{worst.data.get('step')})", fix)

    def masked(ml: MetricsLine, field: str) -> float | None:
        # as the trainer's own alarms (`alarms.step_alarms`): over steps with tokens; a step
        # that masked every token is a skipped step (below)
        if ml.data.get("skipped") is True and ml.data.get("skipped_reason") == ALL_MASKED:
            return None
        return _num(ml.data, field) if _num(ml.data, "tokens") else None

    ratio_check("masked-tokens-above-alarm", "frac_masked_tokens", "masked_tokens",
                [(ml, masked(ml, "frac_masked_tokens")) for ml in lines], "masked a share of their tokens",
                "find the sampler behind the mismatch (mismatch_by_sampler_id in the metrics, the report's "
                "mismatch table): a low-precision or stale sampler; lower the pool's max_staleness, or widen "
                "the mask band only if the mismatch is understood")
    ratio_check("masked-sequences-above-alarm", "frac_masked_sequences", "masked_sequences",
                [(ml, masked(ml, "frac_masked_sequences")) for ml in lines], "masked a share of their sequences",
                "as for masked tokens: find the sampler behind the mismatch; check that seq_mask is not tighter "
                "than the fleet's mismatch")

    def excluded(ml: MetricsLine) -> float | None:
        """``frac_excluded_rows``; from lines that have only the count (a number, or a
        dict of counts by reason): count / (count + rows), the excluded calls not being rows."""
        frac = _num(ml.data, "frac_excluded_rows")
        if frac is not None:
            return frac
        raw = ml.data.get("excluded_rows")
        n = sum(v for v in raw.values() if isinstance(v, (int, float))) if isinstance(raw, dict) else raw
        n, rows = (n if isinstance(n, (int, float)) and not isinstance(n, bool) else None), _num(ml.data, "rows")
        return None if not n or rows is None else n / (n + rows)

    ratio_check("excluded-rows-above-alarm", "frac_excluded_rows", "excluded_rows",
                [(ml, excluded(ml)) for ml in lines],
                "left a share of their model calls out of the loss (greedy, or top_k 1)",
                "make the harness sample at temperature > 0, or set the endpoint's sampling policy to "
                "\"override\" (or \"refuse\") so greedy calls are not made")
    if t.corrections.weighting == "none":
        ratio_check("out-of-band-unmasked", "frac_out_of_band", "masked_tokens",
                    [(ml, _num(ml.data, "frac_out_of_band")) for ml in lines],
                    f"trained at full weight a share of tokens whose ratio is outside "
                    f"[{t.corrections.mask_low:g}, {t.corrections.mask_high:g}]",
                    "set corrections.weighting = \"mask\" (the default): those tokens are then dropped and the "
                    "masked-token alarm watches them")
    skipped: dict[str, list[MetricsLine]] = {}
    for ml in lines:
        if ml.data.get("skipped") is True:
            reason = str(ml.data.get("skipped_reason") or "no reason given").split(" (")[0]  # counts aside
            skipped.setdefault(reason, []).append(ml)
    fixes = {"zero advantage": "no group of the batch had reward variance: keep skip_zero_variance = true (the "
                               "buffer then admits only groups with a signal), or give the tasks rewards that "
                               "tell attempts apart",
             ALL_MASKED: "every token's ratio was outside the mask band (the trainer halts on it): find the sampler "
                         "behind the mismatch (mismatch_by_sampler_id), check its weights follow the trainer",
             "non-finite gradient": "the loss or gradient overflowed: lower lr, check grad_clip, look at the "
                                    "step's loss and log_ratio_max_abs",
             "every model call excluded": "every call was sampled greedily (temperature 0 or top_k 1): sample at "
                                          "temperature > 0, or set the endpoint's sampling policy to \"override\""}
    for reason, where in skipped.items():
        steps = ", ".join(str(ml.data.get("step")) for ml in where[:5]) + (", ..." if len(where) > 5 else "")
        add("skipped-steps", "skipped_reason", where[-1],
            f"{len(where)} of the {span} took no optimizer step: {reason!r} (after optimizer "
            f"step{'s' if len(where) > 1 else ''} {steps})",
            next((fix for start, fix in fixes.items() if reason.startswith(start)),
                 "read the trainer's log around those steps"))
    unrecorded = [ml for ml in lines if (_num(ml.data, "unrecorded_rows") or 0) > 0]
    if unrecorded:
        temps = [f.sampling.temperature for f in w.feeds if f.trainer == tf.trainer and f.sampling is not None]
        unknown = any(f.sampling is None for f in w.feeds if f.trainer == tf.trainer)
        if unknown or not temps or any(not _same(x, t.temperature) for x in temps):
            n = sum(int(_num(ml.data, "unrecorded_rows") or 0) for ml in unrecorded)
            add("unrecorded-rows", "unrecorded_rows", unrecorded[-1],
                f"{n} rows in {len(unrecorded)} of the {span} carried no sampling settings and were scored at the "
                f"trainer's temperature {t.temperature:g}, which "
                + ("is not known to be theirs (a harness chooses its own)" if unknown or not temps
                   else "is not what the calls used"),
                "upgrade the samplers and workers of earlier releases (their records carry no settings), or set "
                "the trainer's temperature to the one the calls use")
    if t.corrections.centering:
        tokens = [(ml, _num(ml.data, "vocabulary_tokens") or 0.0, _num(ml.data, "tail_mass_mean")) for ml in lines]
        tokens = [(ml, n, m) for ml, n, m in tokens if n > 0 and m is not None]
        total = sum(n for _, n, _ in tokens)
        if total:
            mean = sum(n * m for _, n, m in tokens if m is not None) / total
            if mean > TAIL_MASS:
                pool = next((f.pool for f in w.feeds if f.trainer == tf.trainer and f.pool is not None), None)
                at = f" ({_key(('actors', pool, 'config', 'max_support'))})" if pool else ""
                add("support-tail-mass", "tail_mass_mean", tokens[-1][0],
                    f"over {int(total)} whole-vocabulary tokens of the {span}, the sampler's mass outside each "
                    f"token's listing averaged {mean:.3g} (above {TAIL_MASS:g}): score centering leaves that part "
                    "out (bound: centering_bound_mean)",
                    f"raise max_support{at} so the listing holds the mass, or set whole_vocabulary = false")
    return out


def _support_figures(w: Wiring, feed: Feed, sf: SupportFigures) -> list[Hazard]:
    s = feed.sampling
    cap = w.cap(feed)
    positions = sum(sf.listed.values())
    if s is None or s.top_p >= 1 or (s.top_k is not None and s.top_k <= cap) or not positions:
        return []
    at_cap = sf.listed.get(cap, 0)
    share = at_cap / positions
    if share <= CAP_SHARE:
        return []
    where = _key(("actors", feed.pool, "config", "max_support")) if feed.pool else "max_support"
    return [Hazard(
        id="support-cap-binds", where=where, file=sf.path,
        message=(f"{at_cap} of {positions} recorded positions ({share:.1%}) in {sf.files} ATIF files of "
                 f"{feed.name!r} have exactly max_support = {cap} members while the calls asked for top_p = "
                 f"{s.top_p:g} ({_key(s.at)}): there the cap, not top_p, chose the support (the nucleus needed "
                 f"more tokens), more than {CAP_SHARE:.0%} of the time"),
        fix=f"raise max_support above {cap} (the record grows by about 8 bytes a member), or lower top_p")]
