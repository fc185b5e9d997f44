"""Two speed paths of the torch backend that must not change what it samples:
identical prompts prefilled once (`share_prefill`), and low-precision projections
multiplied with fp32 accumulation (`matmul = "fp32"`, the CPU default)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.actors.samplers.llama_forward import projection
from fleetrl.daemon.messages import SamplingParams

from .conftest import PROMPTS


def backend(model_dir, dtype="fp32", **kw) -> TorchBackend:
    return TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype, **kw))


def first_step_distribution(be: TorchBackend) -> torch.Tensor:
    """Each prompt's full next-token log-distribution (top_p 1), ordered by token id."""
    gens = be.generate(PROMPTS, SamplingParams(max_tokens=1, top_p=1.0, seed=0))
    rows = []
    for g in gens:
        ids, lps = g.support.ids.to_torch(), g.support.logprobs.to_torch()
        rows.append(lps[torch.argsort(ids)])
    return torch.stack(rows)


# -- shared prefill ----------------------------------------------------------------------

GROUPED = [PROMPTS[0]] * 4 + [PROMPTS[2]] * 3 + [PROMPTS[1]] + [PROMPTS[0]] * 2


def test_identical_prompts_are_prefilled_once(model_dir):
    run = backend(model_dir).start(GROUPED, SamplingParams(max_tokens=4, seed=1))
    run.step()
    assert run.prefill_rows == 3
    unshared = backend(model_dir, share_prefill=False).start(GROUPED, SamplingParams(max_tokens=4, seed=1))
    unshared.step()
    assert unshared.prefill_rows == len(GROUPED)


def test_shared_prefill_samples_what_an_unshared_one_does(model_dir):
    params = SamplingParams(max_tokens=20, top_p=0.95, seed=7)
    shared = backend(model_dir).generate(GROUPED, params)
    plain = backend(model_dir, share_prefill=False).generate(GROUPED, params)
    for s, p in zip(shared, plain):
        assert s.token_ids == p.token_ids and s.support.ids == p.support.ids
        assert float((s.support.logprobs.to_torch() - p.support.logprobs.to_torch()).abs().max()) < 1e-5
    # the rows of one prompt share the prefill but not their samples
    assert len({g.token_ids for g in shared[:4]}) > 1


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=9), st.integers(0, 2**31))
def test_any_sharing_pattern_matches_rows_run_alone(fp32_backend, picks, seed):
    """Greedy rows of a batch with repeated prompts equal each prompt decoded alone."""
    prompts = [PROMPTS[i] for i in picks]
    params = SamplingParams(max_tokens=6, temperature=0.0, seed=seed)
    together = fp32_backend.generate(prompts, params)
    for prompt, gen in zip(prompts, together):
        (alone,) = fp32_backend.generate([prompt], params)
        assert gen.token_ids == alone.token_ids
        assert float((gen.logprobs.to_torch() - alone.logprobs.to_torch()).abs().max()) < 1e-5


# -- fp32 accumulation -------------------------------------------------------------------

def test_projection_with_fp32_accumulation_is_the_rounded_fp32_product():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g).bfloat16()
    w = torch.randn(80, 96, generator=g).bfloat16()
    got = projection(x, {"w": w}.__getitem__, {"w": w.float()}.__getitem__, "w")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(x.float(), w.float()).to(torch.bfloat16))
    native = F.linear(x, w)
    # the native bf16 matmul differs at most by its own output rounding (one bf16 ulp)
    rel = (native.float() - got.float()).abs() / got.float().abs().clamp(min=1e-3)
    assert float(rel.max()) <= 2**-7


def test_auto_matmul_is_fp32_for_low_precision_on_cpu(model_dir):
    assert backend(model_dir, "bf16").fp32_matmul
    assert backend(model_dir, "fp8").fp32_matmul
    assert not backend(model_dir, "bf16", matmul="native").fp32_matmul
    assert not backend(model_dir, "fp32").fp32_matmul  # nothing to emulate
    assert backend(model_dir, "bf16").stored_dtypes()["lm_head.weight"] == "bfloat16"  # values stay bf16


def test_fp32_accumulation_keeps_the_low_precision_mismatch(model_dir):
    """The emulated sampler is as far from fp32 as the native one and close to it."""
    exact = first_step_distribution(backend(model_dir))
    for dtype in ("bf16", "fp8"):
        native = first_step_distribution(backend(model_dir, dtype, matmul="native"))
        emulated = first_step_distribution(backend(model_dir, dtype, matmul="fp32"))
        gap = float((native - exact).abs().max())
        assert gap > 1e-3, dtype  # a real low-precision mismatch
        assert float((emulated - native).abs().max()) <= 0.1 * gap, dtype
        assert 0.5 * gap <= float((emulated - exact).abs().max()) <= 1.5 * gap, dtype
