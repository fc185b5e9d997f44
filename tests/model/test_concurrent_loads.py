"""Models built and loaded from several threads at once (an in-process trainer's
replicas, a sampler beside it). transformers swaps `PreTrainedModel.tie_weights` and
`init_weights` out for the length of every `from_pretrained` and puts back what it found:
two loads that overlap can leave the empty stand-in in place for good, and every model
built after that has an untied, uninitialised head. Our loaders take one lock, so a
tied model stays tied however the loads interleave."""

from __future__ import annotations

import threading

import msgspec

from fleetrl.actors.model import load_master_weights
from fleetrl.actors.model.tiny_models import build_tiny_model, create_tiny_model, tiny_spec

THREADS = 6
ROUNDS = 4


def _tied(model) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def test_overlapping_loads_leave_tying_and_init_in_place(tmp_path):
    spec = msgspec.structs.replace(tiny_spec("qwen3"), tie_word_embeddings=True)
    path = create_tiny_model(tmp_path / "tied", "qwen3", spec, seed=3)
    built: list = []
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(ROUNDS):
                built.append(load_master_weights(path) if k % 2 else build_tiny_model("qwen3", spec, seed=k))
        except BaseException as exc:  # reported below, with the thread's own traceback
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(built) == THREADS * ROUNDS and all(_tied(m) for m in built)
    # and after the storm: a fresh model is tied and initialised, a saved one loads tied
    fresh = build_tiny_model("qwen3", spec, seed=9)
    assert _tied(fresh) and float(fresh.model.embed_tokens.weight.detach().std()) > 0.0
    assert _tied(load_master_weights(create_tiny_model(tmp_path / "again", "qwen3", spec, seed=5)))
