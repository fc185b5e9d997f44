"""The warm-up's pure pieces (encoding, batching, loss, schedule) and its config."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.model import BOS_ID, EOS_ID, PAD_ID, build_byte_tokenizer
from fleetrl.actors.recipe.warmup import (
    IGNORE,
    Example,
    WarmupConfig,
    collate,
    completion_loss,
    encode_example,
    lr_at,
    training_batches,
    warmup_loss,
)
from fleetrl.harness.synthetic import generate_tasks, is_eval_reserved, reference_solution

TOKENIZER = build_byte_tokenizer()


def test_example_is_bos_prompt_bytes_then_completion_bytes_and_eos() -> None:
    (task,) = generate_tasks(1, split="train", seed=0)
    ex = encode_example(task, TOKENIZER)
    assert task.prompt is not None
    prompt_bytes = task.prompt.encode()
    body = reference_solution(task).removesuffix("<eos>").encode()
    assert ex.ids == (BOS_ID, *prompt_bytes, *body, EOS_ID)
    assert ex.prompt_len == 1 + len(prompt_bytes)


def test_collate_labels_only_the_completion() -> None:
    a = Example(ids=(BOS_ID, 10, 11, 12, EOS_ID), prompt_len=3)
    b = Example(ids=(BOS_ID, 20, 21, EOS_ID), prompt_len=2)
    batch = collate([a, b])
    assert batch.input_ids_BT.tolist() == [[BOS_ID, 10, 11, 12, EOS_ID], [BOS_ID, 20, 21, EOS_ID, PAD_ID]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.labels_BT.tolist() == [[IGNORE, IGNORE, IGNORE, 12, EOS_ID], [IGNORE, IGNORE, 21, EOS_ID, IGNORE]]
    assert batch.num_target_tokens == 4
    # the prompt's own labels: every prompt token after <bos>, nothing of the completion
    assert batch.prompt_labels_BT.tolist() == [
        [IGNORE, 10, 11, IGNORE, IGNORE], [IGNORE, 20, IGNORE, IGNORE, IGNORE]
    ]


def test_collate_rejects_an_example_without_completion() -> None:
    with pytest.raises(ValueError, match="example 1: prompt_len 3 leaves no completion"):
        collate([Example(ids=(1, 2, 3), prompt_len=1), Example(ids=(1, 2, 3), prompt_len=3)])
    with pytest.raises(ValueError, match="at least one example"):
        collate([])


def test_loss_is_the_token_mean_over_completion_tokens() -> None:
    torch.manual_seed(0)
    batch = collate([Example(ids=(BOS_ID, 5, 6, 7, EOS_ID), prompt_len=2), Example(ids=(BOS_ID, 8, EOS_ID), prompt_len=2)])
    logits = torch.randn(2, 5, 300)
    got = completion_loss(logits, batch.labels_BT)
    # by hand: (row 0: predict 6 at t=1, 7 at t=2, EOS at t=3; row 1: EOS at t=1), mean of 4 terms
    terms = [
        -F.log_softmax(logits[0, 1], -1)[6],
        -F.log_softmax(logits[0, 2], -1)[7],
        -F.log_softmax(logits[0, 3], -1)[EOS_ID],
        -F.log_softmax(logits[1, 1], -1)[EOS_ID],
    ]
    assert got.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_loss_ignores_logits_that_predict_prompt_or_padding(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = collate([Example(ids=(BOS_ID, 5, 6, 7, EOS_ID), prompt_len=3), Example(ids=(BOS_ID, 8, EOS_ID), prompt_len=2)])
    logits = torch.randn(2, 5, 300, generator=g)
    changed = logits.clone()
    # positions whose next token is prompt or padding: row 0 t=0,1 and t=4 (last); row 1 t=0, t=2..4
    for b, t in [(0, 0), (0, 1), (0, 4), (1, 0), (1, 2), (1, 3), (1, 4)]:
        changed[b, t] = torch.randn(300, generator=g) * 10
    assert completion_loss(changed, batch.labels_BT).item() == completion_loss(logits, batch.labels_BT).item()
    assert not math.isclose(
        completion_loss(logits * 3, batch.labels_BT).item(), completion_loss(logits, batch.labels_BT).item()
    )


def test_warmup_loss_adds_the_weighted_prompt_loss() -> None:
    torch.manual_seed(1)
    batch = collate([Example(ids=(BOS_ID, 5, 6, 7, EOS_ID), prompt_len=3), Example(ids=(BOS_ID, 8, EOS_ID), prompt_len=2)])
    logits = torch.randn(2, 5, 300, requires_grad=True)
    lp = F.log_softmax(logits.detach(), -1)
    # prompt targets by hand: row 0 predicts 5 at t=0 and 6 at t=1; row 1 predicts 8 at t=0
    prompt = -(lp[0, 0, 5] + lp[0, 1, 6] + lp[1, 0, 8]) / 3
    completion = completion_loss(logits.detach(), batch.labels_BT).item()
    loss, c, p = warmup_loss(logits, batch, 0.5)
    assert c == pytest.approx(completion, rel=1e-6) and p == pytest.approx(prompt.item(), rel=1e-6)
    assert loss.item() == pytest.approx(completion + 0.5 * prompt.item(), rel=1e-6)
    loss.backward()
    assert logits.grad is not None and bool(logits.grad[1, 0].abs().sum() > 0)  # the prompt position learns
    off, c0, p0 = warmup_loss(logits, batch, 0.0)
    assert off.item() == pytest.approx(completion, rel=1e-6) and (c0, p0) == (c, p)
    only_bos = collate([Example(ids=(BOS_ID, 8, EOS_ID), prompt_len=1)])
    loss, _, p = warmup_loss(torch.randn(1, 3, 300), only_bos, 1.0)
    assert p == 0.0 and torch.isfinite(loss)


def test_loss_rejects_mismatched_shapes_and_unlabelled_batches() -> None:
    with pytest.raises(ValueError, match="disagree"):
        completion_loss(torch.zeros(2, 4, 10), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="no labelled"):
        completion_loss(torch.zeros(1, 3, 10), torch.full((1, 3), IGNORE))


def test_schedule_warms_up_linearly_then_decays_to_the_floor() -> None:
    cfg = WarmupConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lr_at(55, cfg) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))


def test_batches_come_from_the_training_stream_deterministically() -> None:
    cfg = WarmupConfig(batch_size=4, task_seed=3)
    first = [next(training_batches(cfg, TOKENIZER)) for _ in range(2)]
    assert torch.equal(first[0].input_ids_BT, first[1].input_ids_BT)
    stream = training_batches(cfg, TOKENIZER)
    b1, b2 = next(stream), next(stream)
    assert b1.input_ids_BT.tolist() != b2.input_ids_BT.tolist()
    for row, mask in zip(b1.input_ids_BT.tolist(), b1.attention_mask_BT.tolist()):
        text = bytes(t for t, m in zip(row, mask) if m and t < 256).decode()
        prompt = text[: text.index("def f(x):\n") + len("def f(x):\n")]
        assert not is_eval_reserved(prompt)  # never a fresh-evaluation prompt


@pytest.mark.parametrize(
    ("field", "value"),
    [("steps", 0), ("batch_size", 0), ("lr", 0.0), ("lr", math.inf), ("warmup_steps", -1), ("min_lr_ratio", 1.5),
     ("weight_decay", -0.1), ("grad_clip", -1.0), ("task_start", -1), ("betas", (0.9, 1.0)),
     ("prompt_loss_weight", -0.5), ("prompt_loss_weight", math.nan)],
)
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"WarmupConfig.{field}"):
        WarmupConfig(**{field: value})
