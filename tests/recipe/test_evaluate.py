"""Sampling completions with the torch backend and evaluating pass@1."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetrl.actors.model import build_tiny_llama, save_tiny_llama
from fleetrl.actors.recipe.evaluate import EvalSampling, evaluate_pass_at_1, sample_completions
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.harness.synthetic import generate_tasks

from .conftest import MICRO_SPEC


@pytest.fixture(scope="module")
def micro_backend(tmp_path_factory: pytest.TempPathFactory) -> TorchBackend:
    path = save_tiny_llama(build_tiny_llama(MICRO_SPEC, seed=3), tmp_path_factory.mktemp("micro") / "m")
    return TorchBackend(TorchBackendConfig(model_dir=str(path)))


def test_completions_are_text_before_eos_and_reproducible_by_seed(micro_backend: TorchBackend) -> None:
    tasks = generate_tasks(5, split="fresh", seed=0)
    sampling = EvalSampling(max_tokens=12, seed=7, batch_size=2)  # three backend batches
    a = sample_completions(micro_backend, tasks, sampling)
    b = sample_completions(micro_backend, tasks, sampling)
    assert a == b
    assert len(a) == 5
    for text, stopped in a:
        assert "<eos>" not in text
        assert isinstance(stopped, bool)
    c = sample_completions(micro_backend, tasks, EvalSampling(max_tokens=12, seed=8, batch_size=2))
    assert c != a


def test_greedy_sampling_of_a_random_model_is_the_same_whatever_the_seed(micro_backend: TorchBackend) -> None:
    tasks = generate_tasks(3, split="general", seed=0)
    a = sample_completions(micro_backend, tasks, EvalSampling(temperature=0.0, max_tokens=8, seed=1))
    b = sample_completions(micro_backend, tasks, EvalSampling(temperature=0.0, max_tokens=8, seed=2))
    assert a == b


def test_a_random_model_solves_nothing(micro_backend: TorchBackend) -> None:
    result = evaluate_pass_at_1("unused", split="fresh", n=12, task_seed=0,
                                sampling=EvalSampling(max_tokens=16), backend=micro_backend)
    assert result.pass_at_1.successes == 0 and result.pass_at_1.n == 12
    assert result.mean_reward == 0.0
    assert len(result.rewards) == len(result.completions) == 12
    assert result.split == "fresh" and result.task_seed == 0


def test_evaluation_loads_a_model_directory(tmp_path: Path) -> None:
    path = save_tiny_llama(build_tiny_llama(MICRO_SPEC, seed=4), tmp_path / "m")
    result = evaluate_pass_at_1(path, split="general", n=3, task_seed=2, sampling=EvalSampling(max_tokens=4))
    assert result.pass_at_1.n == 3 and result.stopped <= 1.0


@pytest.mark.parametrize(("split", "n", "match"), [("train", 5, "evaluation split"), ("fresh", 0, "n must be")])
def test_bad_evaluation_arguments(micro_backend: TorchBackend, split: str, n: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        evaluate_pass_at_1("unused", split=split, n=n, task_seed=0, backend=micro_backend)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"), [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("batch_size", 0), ("seed", -1)]
)
def test_sampling_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EvalSampling(**{field: value})
