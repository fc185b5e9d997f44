"""The measured sampler-trainer mismatch of a train step: k3 KL, the fraction of tokens
outside the correction band and the spread of the log-ratio, for all tokens, per sampler
kind and per sampler id; hand-computed values, and exact combination over any split."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.trainer.batch import build_batch, select_rows
from fleetrl.actors.trainer.step import MismatchFigures, combine_figures, train_step
from fleetrl.actors.trainer.step_figures import _Mismatch, _Sums
from fleetrl.daemon import messages as m
from fleetrl.grpo import CorrectionConfig, replay_logprobs

V = 16


def _ident(sid: str, dtype: str, device: str = "cpu") -> m.SamplerIdentity:
    return m.SamplerIdentity(sampler_id=sid, backend="torch", device_kind=device, dtype=dtype)


S1 = _ident("s1", "float32")
S2 = _ident("s2", "bfloat16")
S3 = _ident("s3", "bfloat16", "H100")

# (sampler, previous token, sampled token, other support token, q^S(sampled), p^S(sampled))
TOKENS = [
    (S1, 1, 2, 3, 0.5, 0.5),    # ratio 1
    (S2, 4, 5, 6, 0.4, 0.8),    # ratio 2
    (S2, 7, 8, 9, 0.8, 0.2),    # ratio 0.25: below the band [0.5, 5]
    (S3, 10, 11, 12, 0.1, 0.9),  # ratio 9: above it
]


class _OneHot(torch.nn.Module):
    """The base of `Bigram`: each input token's hidden state is its one-hot vector."""

    def forward(self, input_ids, **_):
        return types.SimpleNamespace(last_hidden_state=torch.nn.functional.one_hot(input_ids, V).float())


class Bigram(torch.nn.Module):
    """A causal LM whose logits at a position are a row of a table picked by the input
    token there: the trainer's p^S of every generated token is set by hand. Laid out like
    a Hugging Face causal LM (a base at ``model``, an ``lm_head`` whose weight is the
    table's transpose), which the trainer applies in chunks itself."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.model = _OneHot()
        self.lm_head = torch.nn.Linear(V, V, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(table.t())

    def forward(self, input_ids, attention_mask=None, use_cache=False, logits_to_keep=0, **_):
        hidden = self.model(input_ids).last_hidden_state
        if isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        return types.SimpleNamespace(logits=self.lm_head(hidden))


def _setup(groups):
    table = torch.full((V, V), -30.0)
    segs = []
    for ident, prev, tok, other, q, p in TOKENS:
        table[prev, tok], table[prev, other] = math.log(p), math.log(1 - p)
        segs.append(groups.segment([prev], [tok], [math.log(q)], [[(tok, math.log(q)), (other, math.log(1 - q))]],
                                   [0], sampler=ident))
    grp = groups.group_of("g", [([s], r) for s, r in zip(segs, [1.0, 0.0, 1.0, 0.0])])
    return Bigram(table), build_batch([grp])


def _step(model, batch, corrections=CorrectionConfig(), micro=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return train_step(model, opt, batch, corrections=corrections, temperature=1.0, grad_clip=1.0,
                      pass_threshold=1.0, step=0, trainer_version=0, share_prompts=False, micro_batch_tokens=micro)


def _expected(ratios):
    r = np.log(np.asarray(ratios, dtype=np.float64))
    return dict(tokens=len(r), kl_k3=float(np.mean(np.exp(r) - 1 - r)),
                frac_out_of_band=float(np.mean((np.exp(r) < 0.5) | (np.exp(r) > 5.0))),
                log_ratio_mean=float(r.mean()), log_ratio_std=float(r.std()), log_ratio_max_abs=float(np.abs(r).max()))


def _close(fig: MismatchFigures, want: dict) -> None:
    assert fig.tokens == want["tokens"]
    for name in ("kl_k3", "frac_out_of_band", "log_ratio_mean", "log_ratio_std", "log_ratio_max_abs"):
        assert getattr(fig, name) == pytest.approx(want[name], rel=1e-5, abs=1e-6), name


def test_figures_per_kind_and_per_sampler_by_hand(groups):
    model, batch = _setup(groups)
    assert [s.sampler_id for s in batch.sampler_identities] == ["s1", "s2", "s3"]
    met = _step(model, batch)
    assert not met.skipped
    # k3 of ratio 2: 2 - 1 - ln 2 = 0.30685; of 0.25: 0.63629; of 9: 5.80278
    assert met.mismatch_by_kind["torch/bfloat16"].kl_k3 == pytest.approx((0.306853 + 0.636294 + 5.802775) / 3,
                                                                          rel=1e-5)
    assert set(met.mismatch_by_kind) == {"torch/float32", "torch/bfloat16"}
    _close(met.mismatch_by_kind["torch/float32"], _expected([1.0]))
    _close(met.mismatch_by_kind["torch/bfloat16"], _expected([2.0, 0.25, 9.0]))
    assert set(met.mismatch_by_sampler_id) == {"s1", "s2", "s3"}
    _close(met.mismatch_by_sampler_id["s2"], _expected([2.0, 0.25]))
    s2 = met.mismatch_by_sampler_id["s2"]  # r = ln 2, -2 ln 2: mean -ln2/2, std 3 ln2/2
    assert s2.log_ratio_mean == pytest.approx(-math.log(2) / 2, rel=1e-5)
    assert s2.log_ratio_std == pytest.approx(1.5 * math.log(2), rel=1e-5)
    assert s2.frac_out_of_band == 0.5 and s2.log_ratio_max_abs == pytest.approx(math.log(4), rel=1e-5)
    _close(met.mismatch_by_sampler_id["s3"], _expected([9.0]))
    assert {s.sampler_id: s for s in met.sampler_identities} == {"s1": S1, "s2": S2, "s3": S3}
    # the whole fleet, and the older per-kind fields agree with the new ones
    whole = _expected([1.0, 2.0, 0.25, 9.0])
    assert met.mismatch_kl_k3 == pytest.approx(whole["kl_k3"], rel=1e-5)
    assert met.frac_out_of_band == 0.5
    assert met.log_ratio_std == pytest.approx(whole["log_ratio_std"], rel=1e-5)
    assert met.log_ratio_max_abs == pytest.approx(math.log(9), rel=1e-5)
    assert met.tokens_by_sampler == {"torch/float32": 1, "torch/bfloat16": 3}
    assert met.mismatch_kl_by_sampler["torch/bfloat16"] == met.mismatch_by_kind["torch/bfloat16"].kl_k3
    # with the default mask weighting, the out-of-band tokens are the masked ones
    assert met.frac_masked_tokens == met.frac_out_of_band


def test_out_of_band_is_measured_against_the_band_whatever_the_weighting(groups):
    model, batch = _setup(groups)
    met = _step(model, batch, CorrectionConfig(weighting="tis", mask_low=0.2, mask_high=10.0))
    assert met.frac_masked_tokens == 0.0  # TIS masks nothing...
    assert met.frac_out_of_band == 0.0  # ...and with [0.2, 10] every ratio is inside the band
    met = _step(model, batch, CorrectionConfig(weighting="tis", mask_low=0.3, mask_high=math.inf))
    assert met.frac_out_of_band == 0.25 and met.mismatch_by_sampler_id["s2"].frac_out_of_band == 0.5


def test_micro_batches_give_the_same_figures(groups):
    model, batch = _setup(groups)
    whole = _step(model, batch)
    parts = _step(model, batch, micro=2)  # one row per micro-batch
    for key, f in whole.mismatch_by_sampler_id.items():
        g = parts.mismatch_by_sampler_id[key]
        assert g.tokens == f.tokens and g.frac_out_of_band == f.frac_out_of_band
        for name in ("kl_k3", "log_ratio_mean", "log_ratio_std", "log_ratio_max_abs"):
            assert getattr(g, name) == pytest.approx(getattr(f, name), rel=1e-9, abs=1e-12)
    assert parts.mismatch_by_kind.keys() == whole.mismatch_by_kind.keys()
    assert parts.log_ratio_std == pytest.approx(whole.log_ratio_std, rel=1e-9)


def test_rank_parts_of_a_batch_combine_to_the_whole(groups):
    """What `_Sums.add` does over ranks: each rank's rows measured alone, then added."""
    from fleetrl.actors.trainer.step_figures import mismatch_sums

    model, batch = _setup(groups)
    band = CorrectionConfig(mask_low=0.5, mask_high=5.0)
    with torch.no_grad():
        def measure(b):
            s = _Sums()
            logits = model.lm_head.weight.t()[b.input_ids].gather(1, b.positions.unsqueeze(-1).expand(-1, -1, V))
            mismatch_sums(replay_logprobs(logits, b.tokens, b.support_ids)[0], b, s, band, None)
            return s

        whole = measure(batch)
        total = _Sums()
        for rows in ([2, 0], [3], [1]):
            total.add(measure(select_rows(batch, rows)))
    for key in whole.by_id:
        a, b = whole.by_id[key].figures(), total.by_id[key].figures()
        assert a.tokens == b.tokens and a.log_ratio_std == pytest.approx(b.log_ratio_std, abs=1e-12)
    assert total.fleet.figures().kl_k3 == pytest.approx(whole.fleet.figures().kl_k3, rel=1e-12)
    assert total.identities == whole.identities


log_ratios = st.lists(st.floats(-20, 20, allow_nan=False), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(log_ratios, st.lists(st.integers(0, 39), max_size=6))
def test_combining_any_partition_equals_the_whole(values, cuts):
    """Chan's update: figures of the parts, combined, equal the figures of all tokens."""
    r = torch.tensor(values, dtype=torch.float64)
    out = (r < math.log(0.5)) | (r > math.log(5.0))
    bounds = sorted({0, len(values), *[c for c in cuts if c < len(values)]})
    parts = [_Mismatch.of(r[a:b], out[a:b]) for a, b in zip(bounds, bounds[1:])]
    direct = _Mismatch.of(r, out).figures()
    total = _Mismatch()
    for p in parts:
        total.add(p)
    via_figures = combine_figures([p.figures() for p in parts])
    for got in (total.figures(), via_figures):
        assert got.tokens == direct.tokens and got.frac_out_of_band == direct.frac_out_of_band
        assert got.log_ratio_max_abs == direct.log_ratio_max_abs
        assert got.log_ratio_mean == pytest.approx(direct.log_ratio_mean, rel=1e-9, abs=1e-9)
        assert got.log_ratio_std == pytest.approx(direct.log_ratio_std, rel=1e-7, abs=1e-7)
        assert got.kl_k3 == pytest.approx(direct.kl_k3, rel=1e-9)
    assert direct.kl_k3 >= 0 and direct.log_ratio_std >= 0


def test_no_tokens_no_figures():
    assert _Mismatch.of(torch.zeros(0), torch.zeros(0, dtype=torch.bool)).figures().tokens == 0
    assert combine_figures([]).tokens == 0
    nan = _Mismatch.of(torch.tensor([0.1, math.nan]), torch.tensor([False, True]))
    f = nan.figures()
    assert math.isnan(f.kl_k3) and math.isnan(f.log_ratio_max_abs) and f.frac_out_of_band == 0.5


def test_the_pool_report_carries_what_was_measured(groups):
    from fleetrl.actors.trainer.actor import mismatch_report
    import msgspec

    model, batch = _setup(groups)
    met = msgspec.structs.replace(_step(model, batch), version=1, step=1)
    band = CorrectionConfig(mask_low=0.25, mask_high=8.0)
    msg = mismatch_report(met, band)
    assert (msg.step, msg.version, msg.mask_low, msg.mask_high) == (1, 1, 0.25, 8.0)
    assert {i.sampler_id: (i, f) for i, f in msg.by_sampler} == {
        s: (ident, met.mismatch_by_sampler_id[s]) for s, ident in (("s1", S1), ("s2", S2), ("s3", S3))}
    assert msg.by_kind == met.mismatch_by_kind
    assert m.FEEDBACK.decode(m.FEEDBACK.encode(msg)) == msg
    # an entry with a NaN figure (a diverged forward) is left out; nothing measured: no report
    bad = msgspec.structs.replace(met.mismatch_by_sampler_id["s3"], kl_k3=math.nan)
    partial = msgspec.structs.replace(met, mismatch_by_sampler_id={**met.mismatch_by_sampler_id, "s3": bad})
    assert [i.sampler_id for i, _ in mismatch_report(partial, band).by_sampler] == ["s1", "s2"]
    skipped = msgspec.structs.replace(met, mismatch_by_kind={}, mismatch_by_sampler_id={}, sampler_identities=())
    assert mismatch_report(skipped, band) is None


def test_a_report_with_impossible_figures_is_refused():
    fig = MismatchFigures(tokens=2, kl_k3=0.1, frac_out_of_band=0.5, log_ratio_mean=0.0, log_ratio_std=0.2,
                          log_ratio_max_abs=0.3)
    ok = dict(step=1, version=1, mask_low=0.5, mask_high=5.0, by_kind={"torch/float32": fig}, by_sampler=((S1, fig),))
    m.SamplerMismatch(**ok)
    import msgspec

    for change, match in (({"kl_k3": -1.0}, "kl_k3 must be >= 0"), ({"tokens": 0}, "tokens must be an int >= 1"),
                          ({"frac_out_of_band": 1.5}, r"frac_out_of_band must be in \[0, 1\]"),
                          ({"log_ratio_std": math.nan}, "log_ratio_std must be >= 0")):
        bad = msgspec.structs.replace(fig, **change)
        with pytest.raises(ValueError, match=match):
            m.SamplerMismatch(**{**ok, "by_kind": {"torch/float32": bad}})
    with pytest.raises(ValueError, match="names sampler 's1' twice"):
        m.SamplerMismatch(**{**ok, "by_sampler": ((S1, fig), (S1, fig))})
    with pytest.raises(ValueError, match="band"):
        m.SamplerMismatch(**{**ok, "mask_low": 5.0})
    # the same checks on decode, where the message crosses a boundary
    from fleetrl.daemon.errors import BadMessage

    raw = msgspec.to_builtins(m.SamplerMismatch(**ok))
    raw["by_sampler"][0][1]["frac_out_of_band"] = 2.0
    with pytest.raises(BadMessage, match="frac_out_of_band must be in"):
        m.FEEDBACK.decode(msgspec.msgpack.encode(raw))
