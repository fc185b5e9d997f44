"""Model clients (local torch backend, and the sampler pool's in-process client) and
the worker's configuration / harness loading. No Docker needed."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import trio

from fleetrl.actors.envworker import EnvWorkerConfig, LocalModelClient, PoolModelClient, load_harness, sandbox_limits
from fleetrl.actors.envworker.sources import open_task_source
from fleetrl.actors.envworker.config import JsonlTasks, SyntheticTasks
from fleetrl.actors.model import BOS_ID, EOS_ID
from fleetrl.actors.pool import SamplerPool
from fleetrl.actors.pool.local import LocalSampler
from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig
from fleetrl.daemon.config import ConfigError, load_config_text
from fleetrl.daemon.messages import SamplingParams
from fleetrl.harness.builtin import CompletionHarness
from fleetrl.harness.model import HFChatTokenizer, ModelUnavailable
from fleetrl.harness.tasks import Limits as TaskLimits
from fleetrl.harness.synthetic import make_task


@pytest.fixture(scope="module")
def backend_and_tok(tiny_model_dir):
    return TorchBackend(TorchBackendConfig(model_dir=str(tiny_model_dir))), HFChatTokenizer.from_pretrained(
        tiny_model_dir)


PARAMS = SamplingParams(max_tokens=6, temperature=1.0, seed=7)


async def test_local_client_gives_the_backends_tokens_as_wire_generation(backend_and_tok):
    backend, tok = backend_and_tok
    client = LocalModelClient(backend, tok, sampler_id="s0")
    with trio.fail_after(60):
        gen = await client.generate([BOS_ID, 104, 105], PARAMS)
    (ref,) = backend.generate([[BOS_ID, 104, 105]], SamplingParams(max_tokens=6, temperature=1.0, seed=7))
    assert gen.token_ids.to_numpy().tolist() == ref.token_ids.to_numpy().tolist()
    np.testing.assert_array_equal(gen.logprobs.to_numpy(), ref.logprobs.to_numpy())
    assert gen.support.ids.to_numpy().tolist() == ref.support.ids.to_numpy().tolist()
    assert gen.support.offsets.to_numpy().tolist() == ref.support.offsets.to_numpy().tolist()
    assert gen.versions.to_numpy().tolist() == ref.versions.to_numpy().tolist() and gen.finish_reason == ref.finish_reason
    assert gen.sampler.sampler_id == "s0" and gen.sampler.backend == "torch" and gen.sampler.dtype == "float32"
    assert gen.support.positions == gen.token_ids.shape[0] <= 6


async def test_local_client_turns_bad_requests_into_model_unavailable(backend_and_tok):
    backend, tok = backend_and_tok
    client = LocalModelClient(backend, tok)
    with trio.fail_after(60), pytest.raises(ModelUnavailable, match="not a token id") as info:
        await client.generate([BOS_ID, 10**6], PARAMS)
    assert info.value.retryable is False


async def test_pool_client_routes_through_the_sampler_pool_and_reports_failures(backend_and_tok):
    backend, tok = backend_and_tok
    pool = SamplerPool(max_tries=2)
    sampler = LocalSampler("p0", backend)
    pool.add(sampler, sampler.identity, price_per_hour=0.0, capacity=1, remote=False)
    client = PoolModelClient(pool, tok).for_attempt("g/0.1")
    with trio.fail_after(60):
        gen = await client.generate([BOS_ID, 104], PARAMS)
        direct = await LocalModelClient(backend, tok).generate([BOS_ID, 104], PARAMS)
        assert gen.sampler.sampler_id == "p0"
        assert gen.token_ids == direct.token_ids  # same seed, same weights: same tokens
        np.testing.assert_array_equal(gen.logprobs.to_numpy(), direct.logprobs.to_numpy())
        assert pool.answered == 1
        with pytest.raises(ModelUnavailable, match="sampler pool: .*not a token id") as info:
            await client.generate([BOS_ID, 10**6], PARAMS)
        assert info.value.retryable is False


async def test_completion_harness_runs_against_the_local_client(backend_and_tok):
    """The default harness, end to end minus Docker: the record is token-exact."""
    backend, tok = backend_and_tok
    client = LocalModelClient(backend, tok)

    class Files:
        def __init__(self):
            self.files = {}

        async def write_files(self, files):
            self.files.update(files)

    sb = Files()
    task = make_task(3, "train", 0)
    with trio.fail_after(60):
        ep = await CompletionHarness(max_tokens=8).run(task, sb, client)
    (call,) = ep.record.calls
    assert call.prompt_ids == [BOS_ID, *task.prompt.encode()]
    assert sb.files[f"{task.workdir}/solution.py"] == task.prompt + call.text
    assert EOS_ID in ep.record.calls[0].segment.token_ids.to_numpy().tolist() or len(call.token_ids) == 8


# -- configuration ----------------------------------------------------------------------------

def load(body: str):
    return load_config_text('[actors.env]\nfactory = "fleetrl.actors.envworker:run"\n'
                            '[actors.env.config]\n' + body, source="run.toml")


@pytest.mark.parametrize("body, message", [
    ("", r"run.toml:3: actors.env.config: missing required key 'model'"),
    ('model = {kind = "local", model_dir = "m"}\ntasks = {kind = "s3"}',
     r"run.toml:5: actors.env.config.tasks.kind: invalid value 's3'"),
    ('model = {kind = "local", model_dir = "m"}\ngroup_siz = 3', r"actors.env.config.group_siz: unknown key"),
    ('model = {kind = "local", model_dir = "m"}\nretry = {max_failed_per_group = 5}',
     r"max_failed_per_group=5 exceeds group_size=4"),
    ('model = {kind = "local", model_dir = "m"}\nretry = {max_tries = {timout = 2}}', r"unknown failure kind.*timout"),
])
def test_config_errors_name_file_line_and_key(body, message):
    with pytest.raises(ConfigError, match=message):
        load(body)


def test_config_defaults():
    cfg = load('model = {kind = "pool", tokenizer_dir = "t"}\nmax_concurrent_attempts = 6').actors[0].config
    assert isinstance(cfg, EnvWorkerConfig) and cfg.group_size == 4
    assert cfg.groups_in_flight == 3 and cfg.target == "trainer"


def test_load_harness_builds_structs_checks_config_and_names_the_path():
    h = load_harness("fleetrl.harness.builtin:CompletionHarness", {"max_tokens": 9})
    assert h == CompletionHarness(max_tokens=9)
    with pytest.raises(ValueError, match="harness_config for fleetrl.harness.builtin:CompletionHarness: unknown key"):
        load_harness("fleetrl.harness.builtin:CompletionHarness", {"max_tokenz": 9})
    with pytest.raises(ValueError, match="harness_config for .*max_tokens"):
        load_harness("fleetrl.harness.builtin:CompletionHarness", {"max_tokens": "many"})
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_harness("fleetrl.harness.builtin:NoSuchHarness", {})
    with pytest.raises(ValueError, match="no async run"):
        load_harness("fleetrl.harness.builtin:extract_code", {"text": "x"})


def test_sandbox_limits_follow_the_task():
    from fleetrl.actors.envworker import SandboxSettings

    task = make_task(1, "train", 0)
    lim = sandbox_limits(task, SandboxSettings(memory_mb=300, cpus=0.5))
    assert lim.memory_bytes == 300 << 20 and lim.cpus == 0.5 and lim.workdir == task.workdir
    own = msgspec.structs.replace(task, limits=TaskLimits(memory_mb=128, cpus=2.0))
    lim = sandbox_limits(own, SandboxSettings())
    assert lim.memory_bytes == 128 << 20 and lim.cpus == 2.0


def test_task_sources_number_tasks_and_report_invalid_records(tmp_path):
    import structlog

    assert open_task_source(SyntheticTasks(seed=4), None).get(5) == make_task(4, "train", 5)
    f = tmp_path / "t.jsonl"
    f.write_text('{"id": "a", "prompt": "p", "evaluator": {"command": "true"}}\n{"id": 3}\n')
    with structlog.testing.capture_logs() as logs:
        src = open_task_source(JsonlTasks(path=str(f), repeat=False), structlog.get_logger())
    assert [src.get(i) and src.get(i).id for i in range(2)] == ["a", None]
    assert any(e["event"] == "invalid task record skipped" and "t.jsonl:2" in e["error"] for e in logs)
    assert open_task_source(JsonlTasks(path=str(f)), structlog.get_logger()).get(7).id == "a"  # epochs
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{nope\n")
    with pytest.raises(ValueError, match="no valid task"):
        open_task_source(JsonlTasks(path=str(bad)), structlog.get_logger())
