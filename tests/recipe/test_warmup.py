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
     ("weight_decay", -0.1), ("grad_clip", -1.0), ("task_start", -1), ("betas", (0.9, 1.0))],
)
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"WarmupConfig.{field}"):
        WarmupConfig(**{field: value})
