"""The doctor's checks of a loaded config's settings alone (pure).

`check_config(cfg)` looks at how the actors fit together (`wiring`): names that point
at no actor, harness sampling settings, staleness bounds and pacing, pools paced by two
workers, missing version announcements, endpoint refuse ranges, evaluators and trainers
sampling otherwise than the trained calls, and each trainer's corrections and alarms.
Each finding is a `Hazard` (`hazards.HAZARDS`); docs/guides/doctor.md states every rule.
"""

from __future__ import annotations

import math
from typing import Any

from fleetrl.actors.envworker.config import PoolModel
from fleetrl.actors.trainer.config import TrainerConfig
from fleetrl.daemon.config import Config
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT

from .hazards import _DEFAULT_ALARMS, BAND_NEAR_ONE, Hazard, _Found, _key, _same
from .wiring import Feed, KeyPath, Wiring, wiring

__all__ = ["check_config"]


def check_config(config: Config) -> list[Hazard]:
    """The hazards of ``config``'s settings (module docstring; docs/guides/doctor.md)."""
    w = wiring(config)
    found = _Found(config.source)
    _references(w, found)
    for feed in w.feeds:
        _harness(w, feed, found)
        _staleness(w, feed, found)
    _shared_pools(w, found)
    _announcements(w, found)
    _endpoints(w, found)
    _evaluators(w, found)
    _trainer_temperature(w, found)
    for name, pool in w.pools.items():
        if pool.max_support == 1:
            found.add("single-token-support", ("actors", name, "config", "max_support"),
                      "max_support = 1: every sampler of the pool draws each token from a support of one "
                      "token, whose replayed probability is 1 whatever the weights: the loss has no gradient",
                      "remove max_support (the default is 512) or set it to at least the nucleus the "
                      "harness's top_p needs")
    for name, trainer in w.trainers.items():
        _corrections(name, trainer, found)
        _alarms(name, trainer, found)
    return found.out


def _references(w: Wiring, found: _Found) -> None:
    names = set(w.names)
    listing = ", ".join(w.names)

    checked: set[tuple[KeyPath, str]] = set()

    def need(path: KeyPath, value: str | None, kind: dict[str, Any] | None = None, what: str = "") -> None:
        if value is None or (path, value) in checked:
            return
        checked.add((path, value))
        if value not in names:
            found.add("unknown-actor", path, f"{_key(path)} = {value!r} names no actor of this config "
                      f"(its actors: {listing})", f"name one of its actors, or add [actors.{value}]")
        elif kind is not None and value not in kind:
            found.add("unknown-actor", path, f"{_key(path)} = {value!r} is not {what}",
                      f"name {what} of this config ({', '.join(kind) or 'it has none'})")

    for feed in w.feeds:
        base = ("actors", feed.name, "config")
        need(base + ("target",), feed.cfg.target)
        need(base + ("failures_to",), feed.cfg.failures_to)
        if not feed.remote:
            need(base + ("endpoint",), feed.cfg.endpoint, w.endpoints, "an endpoint actor (fleetrl.actors.endpoint)")
        if feed.pool_model is not None:
            need(feed.pool_model_at + ("pool",), feed.pool_model.pool, w.pools,
                 "a sampler pool actor (fleetrl.actors.pool)")
    for name, ep in w.endpoints.items():
        if isinstance(ep.model, PoolModel):
            need(("actors", name, "config", "model", "pool"), ep.model.pool, w.pools,
                 "a sampler pool actor (fleetrl.actors.pool)")
    for name, t in w.trainers.items():
        base = ("actors", name, "config")
        need(base + ("stale_reports_to",), t.stale_reports_to)
        for target in t.announce_to:
            need(base + ("announce_to",), target)
    for name, e in w.evaluators.items():
        need(("actors", name, "config", "trainer"), e.trainer, w.trainers, "a trainer actor (fleetrl.actors.trainer)")


def _harness(w: Wiring, feed: Feed, found: _Found) -> None:
    at = ("actors", feed.name, "config", "harness_config")
    if feed.harness_problem is not None:
        found.add("harness-config-invalid", at, f"harness_config for {feed.cfg.harness}: {feed.harness_problem}: "
                  f"the worker {feed.name!r} fails when it starts (the config loader does not check a "
                  "harness's own settings)", "correct harness_config (docs/reference/envworkers.md)")
    s = feed.sampling
    if s is None:
        return
    if s.how == "harness" and s.temperature == 0:
        found.add("greedy-harness", s.at + ("temperature",),
                  f"the harness of {feed.name!r} samples every call greedily (temperature 0): the trainer "
                  "excludes greedy calls from the loss (there is no distribution to correct), so this worker's "
                  "groups train nothing", "set temperature > 0 in harness_config (the run's temperature, e.g. 1.0)")
    if s.how == "harness" and s.top_k == 1:
        found.add("greedy-harness", s.at + ("top_k",),
                  f"the harness of {feed.name!r} asks for top_k = 1: every token is drawn from a support of "
                  "one token, whose replayed probability is 1 whatever the weights, so the trainer excludes "
                  "these calls from the loss: the worker trains nothing",
                  "remove top_k from harness_config (or set it to at least 2)")
    cap = w.cap(feed)
    if s.top_k is not None and s.top_k > cap:
        where = (f"the pool's max_support ({_key(('actors', feed.pool, 'config', 'max_support'))})"
                 if feed.pool is not None else "the local sampler's max_support")
        found.add("top-k-above-cap", s.at + ("top_k",),
                  f"top_k = {s.top_k} is above {where} = {cap}: every call of {feed.name!r} is cut to {cap} "
                  "members, a policy other than the one asked for (and than an evaluator without the cap "
                  "measures)", f"set top_k <= {cap}, or raise max_support to {s.top_k}")


def _staleness(w: Wiring, feed: Feed, found: _Found) -> None:
    if feed.trainer is None or feed.pool is None:
        return
    t, p = w.trainers[feed.trainer], w.pools[feed.pool]
    tkey, pkey = ("actors", feed.trainer, "config"), ("actors", feed.pool, "config")
    if p.max_staleness > t.max_staleness:
        found.add("pool-staleness-above-trainer", pkey + ("max_staleness",),
                  f"the pool {feed.pool!r} serves calls from samplers up to {p.max_staleness} versions behind"
                  f"{' and paces attempts to that bound' if feed.paced else ''}, but the trainer {feed.trainer!r} "
                  f"refuses groups more than "
                  f"{t.max_staleness} versions stale ({_key(tkey + ('max_staleness',))}): groups generated within "
                  "the pool's bound are thrown away", f"set the pool's max_staleness to {t.max_staleness} (at most "
                  "the trainer's)")
    if not feed.paced:
        return
    g, b, aps = feed.cfg.group_size, t.groups_per_step, p.attempts_per_step
    need = b * g
    if aps != need:
        if aps % g:
            why = (f"{aps} is not a multiple of group_size = {g}: the worker {feed.name!r} refuses to start")
        elif aps > need:
            why = (f"the pacer expects the trainer to take {aps} attempts per version, it takes {need} "
                   f"(groups_per_step {b} x group_size {g}): attempts are trained at later versions than the "
                   "pacer predicts, past its staleness bound, and the trainer refuses them as too stale")
        elif (p.max_staleness + 1) * aps < need:
            why = (f"the pacer admits at most (max_staleness + 1) x attempts_per_step = "
                   f"{(p.max_staleness + 1) * aps} attempts ahead of the fleet, fewer than the {need} a step takes "
                   f"(groups_per_step {b} x group_size {g}): the run stalls")
        else:
            why = (f"the pacer expects the trainer to move every {aps} attempts, it moves every {need} "
                   f"(groups_per_step {b} x group_size {g}): it admits fewer attempts ahead than the bound allows "
                   "(idle samplers)")
        found.add("pacing-step-size", pkey + ("attempts_per_step",), f"attempts_per_step = {aps}: {why}",
                  f"set attempts_per_step = {need} (the trainer's groups_per_step x the worker's group_size)")
    assert feed.pool_model is not None  # paced
    mirror, skips = feed.pool_model.trainer_skips_zero_variance, t.skip_zero_variance
    at = feed.pool_model_at + ("trainer_skips_zero_variance",)
    if skips and not mirror:
        found.add("pacing-zero-variance-mirror", at,
                  f"trainer_skips_zero_variance = false, but the trainer {feed.trainer!r} skips zero-variance groups: "
                  "the pacer counts their attempts as trained, the trainer never takes them, and when the admitted "
                  "attempts hold too few groups with reward variance to fill a step the run stalls",
                  "set trainer_skips_zero_variance = true (it mirrors the trainer's skip_zero_variance)")
    elif mirror and not skips and b > 1:
        found.add("pacing-zero-variance-mirror", at,
                  f"trainer_skips_zero_variance = true (the default), but the trainer {feed.trainer!r} has "
                  f"skip_zero_variance = false and takes {b} groups per step: zero-variance groups give their "
                  "slots back to the pacer yet fill the trainer's steps, so attempts train at later versions than "
                  "predicted, past the staleness bound",
                  "set trainer_skips_zero_variance = false (it mirrors the trainer's skip_zero_variance)")


def _shared_pools(w: Wiring, found: _Found) -> None:
    pacing: dict[str, list[Feed]] = {}
    for feed in w.feeds:
        if feed.paced:
            assert feed.pool is not None
            pacing.setdefault(feed.pool, []).append(feed)
    for pool, feeds in pacing.items():
        if len(feeds) > 1:
            names = ", ".join(repr(f.name) for f in feeds)
            for f in feeds[1:]:
                found.add("pacing-shared-pool", f.pool_model_at + ("pacing",),
                          f"the workers {names} all pace through the pool {pool!r}, whose release stream has one "
                          "consumer: the second to see a release it did not admit stops with an error",
                          "set pacing = false on every worker but one (their groups then rely on the trainer's "
                          "own staleness check)")


def _announcements(w: Wiring, found: _Found) -> None:
    needed: dict[tuple[str, str], str] = {}  # (trainer, listener) -> why it needs the versions
    for feed in w.feeds:
        if feed.trainer is not None and feed.pool is not None:
            needed.setdefault((feed.trainer, feed.pool), (
                f"the pool {feed.pool!r} serves {feed.name!r} and learns of new versions only from these "
                "announcements: its samplers (and its pacer) stay at the first version, and once the trainer is "
                "max_staleness versions ahead every group is too stale"))
    for name, e in w.evaluators.items():
        if e.trainer in w.trainers:
            needed.setdefault((e.trainer, name), (
                f"the evaluator {name!r} hears of no new version: it evaluates the first version and, when the "
                "daemon drains, the final one, and none between"))
    for (trainer, listener), why in needed.items():
        if listener not in w.trainers[trainer].announce_to:
            found.add("announce-missing", ("actors", trainer, "config", "announce_to"),
                      f"the trainer {trainer!r} does not announce its versions to {listener!r}: {why}",
                      f"add {listener!r} to announce_to")


def _endpoints(w: Wiring, found: _Found) -> None:
    seen: set[KeyPath] = set()
    for feed in w.feeds:
        if feed.policy is not None and feed.policy_at not in seen:
            seen.add(feed.policy_at)
            _refuse_range(feed.policy, feed.policy_at, found)
    for name, ep in w.endpoints.items():  # endpoints no worker of this config calls
        at = ("actors", name, "config", "sampling")
        if at not in seen:
            _refuse_range(ep.sampling, at, found)


def _refuse_range(policy: Any, at: KeyPath, found: _Found) -> None:
    if policy.policy != "refuse":
        return
    lo = policy.temperature_range[0]
    if lo == 0:
        found.add("endpoint-admits-greedy", at + ("temperature_range",),
                  f"policy = \"refuse\" with temperature_range = {list(policy.temperature_range)}: calls at "
                  "temperature 0 (greedy) pass, and the trainer excludes them from the loss",
                  "raise the range's low end above 0 (the default is [0.1, 2.0])")
    if policy.min_top_k <= 1:
        found.add("endpoint-admits-greedy", at + ("min_top_k",),
                  "policy = \"refuse\" with min_top_k = 1: calls with top_k = 1 pass, each token drawn from a "
                  "support of one token (no gradient)", "set min_top_k = 2 (the default)")


def _evaluators(w: Wiring, found: _Found) -> None:
    for name, e in w.evaluators.items():
        base = ("actors", name, "config")
        own = f"the evaluator {name!r} samples at temperature {e.temperature:g}, top_p {e.top_p:g} (no top_k)"
        for feed in w.feeds:
            if feed.trainer != e.trainer:
                continue
            s = feed.sampling
            differ: list[str] = []
            if s is not None:
                if not _same(e.temperature, s.temperature):
                    differ.append("temperature")
                if not _same(e.top_p, s.top_p):
                    differ.append("top_p")
                if s.top_k is not None and s.top_k < DEFAULT_MAX_SUPPORT:
                    differ.append("top_k")
                trained = f"{feed.name!r} samples at {s.describe()} ({_key(s.at)})"
            elif feed.policy is not None and feed.policy.policy == "refuse":
                (tlo, thi), (plo, phi) = feed.policy.temperature_range, feed.policy.top_p_range
                if not tlo <= e.temperature <= thi:
                    differ.append("temperature")
                if not plo <= e.top_p <= phi:
                    differ.append("top_p")
                trained = (f"the endpoint of {feed.name!r} refuses calls outside temperature [{tlo:g}, {thi:g}], "
                           f"top_p [{plo:g}, {phi:g}] ({_key(feed.policy_at)})")
            else:
                continue
            if differ:
                field = differ[0] if differ[0] != "top_k" else "top_p"
                found.add("evaluator-sampling-mismatch", base + (field,),
                          f"{own}; {trained}: the evaluator measures a policy other than the one trained "
                          f"({', '.join(differ)} differ)",
                          "give the evaluator the training calls' temperature and top_p (or the harness the "
                          "evaluator's); a harness top_k has no counterpart in the evaluator: remove it")


def _trainer_temperature(w: Wiring, found: _Found) -> None:
    for feed in w.feeds:
        s = feed.sampling
        if feed.trainer is None or s is None or s.temperature == 0:
            continue
        t = w.trainers[feed.trainer]
        if not _same(t.temperature, s.temperature):
            found.add("trainer-temperature-mismatch", ("actors", feed.trainer, "config", "temperature"),
                      f"the trainer's temperature is {t.temperature:g}, the calls of {feed.name!r} are sampled at "
                      f"{s.temperature:g} ({_key(s.at)}): every row whose record carries no sampling settings is "
                      "scored at the trainer's temperature, so its ratios compare two different distributions",
                      f"set the trainer's temperature = {s.temperature:g}")


def _corrections(name: str, t: TrainerConfig, found: _Found) -> None:
    c = t.corrections
    base = ("actors", name, "config", "corrections")
    if c.weighting == "none":
        found.add("corrections-weighting-none", base + ("weighting",),
                  "weighting = \"none\": every token weighs 1, so tokens of stale or lower-precision samplers are "
                  "trained as if on-policy (plain GRPO); the mismatch is measured but nothing corrects it",
                  "remove weighting (the default \"mask\") or set \"tis+mask\"")
    full_ratios = c.weighting == "mask" and c.mask_low == 0 and math.isinf(c.mask_high)
    if not c.centering and not full_ratios:
        found.add("corrections-centering-off", base + ("centering",),
                  "centering = false: the bias of the weighted score under the sampler's support is not "
                  "subtracted, and it compounds (the trainer moves toward the samplers' errors, the samplers "
                  "copy the trainer)", "remove centering (the default true)")
    if c.weighting in ("mask", "tis+mask"):
        lo, hi = BAND_NEAR_ONE
        if c.mask_low >= 1 or c.mask_high <= 1:
            edge = "mask_low" if c.mask_low >= 1 else "mask_high"
            found.add("corrections-mask-band", base + (edge,),
                      f"the mask band [{c.mask_low:g}, {c.mask_high:g}] has no ratio on one side of 1: the tokens "
                      "of a sampler that matches the trainer, half of them at least, are dropped",
                      "use a band around 1 (the default [0.5, 5.0])")
        elif c.mask_low > lo or c.mask_high < hi:
            edge = "mask_low" if c.mask_low > lo else "mask_high"
            found.add("corrections-mask-band", base + (edge,),
                      f"the mask band [{c.mask_low:g}, {c.mask_high:g}] is tighter than [{lo:g}, {hi:g}]: it drops "
                      "tokens whose ratio ordinary staleness and 16-bit rounding move that far, most of a step",
                      "widen the band (the default [0.5, 5.0])")
    if c.seq_mask is not None and (c.seq_mask[0] >= 1 or c.seq_mask[1] <= 1):
        found.add("corrections-mask-band", base + ("seq_mask",),
                  f"seq_mask = {list(c.seq_mask)} does not hold 1 inside: sequences whose tokens match the "
                  "trainer exactly (geometric mean ratio 1) are dropped", "use an interval around 1, e.g. [0.99, 1.01]")
    uncapped = {"tis": ("tis_cap",), "mask": ("mask_high",), "tis+mask": ("tis_cap", "mask_high")}
    caps = uncapped.get(c.weighting, ())
    if caps and all(math.isinf(getattr(c, f)) for f in caps):
        said = " and ".join(f"{f} = inf" for f in caps)
        found.add("corrections-uncapped-weights", base + (caps[0],),
                  f"weighting = \"{c.weighting}\" with {said}: a token's weight is its ratio without an upper "
                  "bound, so a few tokens with large ratios dominate a step's gradient",
                  f"a finite {caps[0]} (the default {2.0 if caps[0] == 'tis_cap' else 5.0:g})")


def _alarms(name: str, t: TrainerConfig, found: _Found) -> None:
    base = ("actors", name, "config", "alarms")
    what = {"masked_tokens": "a step that masks most of its tokens",
            "masked_sequences": "a step that masks most of its sequences",
            "excluded_rows": "a step whose rows are mostly excluded (greedy calls)"}
    for field, thing in what.items():
        if getattr(t.alarms, field) >= 1.0:
            found.add("alarms-off", base + (field,),
                      f"alarms.{field} = 1.0 never raises its alarm: {thing} trains on silently",
                      f"remove it (the default {getattr(_DEFAULT_ALARMS, field):g}) or set a threshold below 1")

