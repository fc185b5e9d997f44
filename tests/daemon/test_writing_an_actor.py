"""The example of docs/guides/daemon.md, "Writing an actor", runs as written: its two code
blocks become a package, the template check accepts it, and under the real supervisor
it counts what a producer sends, shows that in /status, and checkpoints it."""

from __future__ import annotations

import random
import re
import sys
import textwrap
from functools import partial
from pathlib import Path

import msgspec
import pytest
import trio

from fleetrl.daemon.checkpoint import CheckpointStore
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor, run_inline

REPO = Path(__file__).resolve().parents[2]

HEADER = """
from __future__ import annotations
from typing import Annotated
import msgspec
import trio
from fleetrl.daemon.actor import ActorContext
"""
MESSAGES = """
class Item(msgspec.Struct, frozen=True):
    n: int
class Flush(msgspec.Struct, frozen=True):
    pass
class SinkState(msgspec.Struct, frozen=True):
    items: int = 0
"""
PRODUCER = """
class ProducerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    count: int = 5
async def produce(cfg: ProducerConfig, ctx: ActorContext, *, task_status=trio.TASK_STATUS_IGNORED):
    task_status.started()
    async with ctx.sender("sink") as out:
        for i in range(cfg.count):
            await out.send(Item(n=i))
        await out.send(Flush())
        await ctx.wait_draining()
"""


def doc_blocks() -> list[str]:
    text = (REPO / "docs" / "guides" / "daemon.md").read_text(encoding="utf-8")
    section = text[text.index("## Writing an actor"):text.index("### Asking the kernel")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.fixture
def sink_package(tmp_path, monkeypatch):
    config, actor = doc_blocks()
    pkg = tmp_path / "docsink"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text(HEADER + config)
    (pkg / "messages.py").write_text(HEADER + MESSAGES + PRODUCER)
    (pkg / "actor.py").write_text(HEADER + "from .config import SinkConfig\n"
                                  "from .messages import Flush, Item, SinkState\n" + actor)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m == "docsink" or m.startswith("docsink.")]:
        del sys.modules[name]


def test_the_example_is_about_forty_lines():
    config, actor = doc_blocks()
    assert len((config + actor).strip().splitlines()) <= 45


def test_the_example_follows_the_template(sink_package):
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from test_actor_template import template_problems
    finally:
        sys.path.remove(str(REPO / "tests"))
    from docsink.actor import run

    assert template_problems(run) == []


async def test_the_example_runs_under_the_supervisor(sink_package, tmp_path, autojump_clock):
    cfg = load_config_text(textwrap.dedent("""
        [daemon]
        checkpoint_interval_s = 1000.0
        [http]
        enabled = false
        [actors.sink]
        factory = "docsink.actor:run"
        config = { batch = 4 }
        [actors.producer]
        factory = "docsink.messages:produce"
        after = ["sink"]
        config = { count = 5 }
        """), source="test.toml")
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(cfg, state, rng=random.Random(0), run_blocking=run_inline)
    with state, trio.fail_after(60):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await trio.sleep(1)
            stats = sup.status()["actors"]["sink"]["statistics"]
            sup.request_shutdown("test")
    assert stats == {"items": 5, "flushes": 1}
    ckpt, _ = CheckpointStore(state.checkpoints).load_latest()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ckpt.actors["sink"])) == {"items": 5}
