"""Fakes shared by the harness, endpoint and external-harness tests.

`FakeModel` is a deterministic model client: a seeded random policy over a small set
of printable bytes and <eos>, or scripted replies (text, then <eos>; or exact token
ids), answering with valid wire
`Generation`s whose supports are real distributions (sorted, normalised, holding the
sampled token). `PairTokenizer` is a tokenizer that merges "ab" into one token, so a
re-tokenised answer can differ from the ids the model produced. `FakeSandbox` keeps
files in a dict and answers commands through a handler. `serving` serves an ASGI app
on 127.0.0.1; `TorchClient` is a model client over the real torch sampler backend.

tests/conftest.py puts ``tests/common`` on ``sys.path`` for every folder.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import asynccontextmanager

import numpy as np
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from fleetrl.daemon.messages import (
    Generation,
    SamplerIdentity,
    SamplingParams,
    SupportCSR,
)
from fleetrl.daemon.protocol import Tensor
from fleetrl.harness.model import ModelUnavailable
from fleetrl.sandboxes import ExecResult

IDENTITY = SamplerIdentity(sampler_id="fake-0", backend="fake", device_kind="cpu", dtype="float32")
ASCII = [*b"abcdefgh xyz\n"]
ALPHABET = [*ASCII, 0xC3, 0xA9]  # with the two bytes of "\u00e9": a cut may split it


class FakeModel:
    """A deterministic model client (see the module docstring)."""

    def __init__(self, tokenizer, *, replies: Sequence[str | list[int]] | None = None, seed: int = 0, version: int = 3,
                 k: int = 4, p_eos: float = 0.08, fail: bool = False, delay: float = 0.0,
                 alphabet: Sequence[int] = ALPHABET) -> None:
        self.alphabet = list(alphabet)
        self._tok = tokenizer
        self.replies = list(replies) if replies is not None else None
        self.seed = seed
        self.version = version
        self.k = k
        self.p_eos = p_eos
        self.fail = fail
        self.delay = delay
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    @property
    def tokenizer(self):
        return self._tok

    def _rng(self, prompt: Sequence[int]) -> np.random.Generator:
        h = hashlib.sha256(np.asarray(prompt, dtype=np.int64).tobytes()).digest()
        return np.random.default_rng([self.seed, int.from_bytes(h[:8], "little")])

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        if self.delay:
            await trio.sleep(self.delay)
        await trio.lowlevel.checkpoint()
        if self.fail:
            raise ModelUnavailable("no sampler is serving")
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        rng = self._rng(prompt_ids)
        eos = self._tok.eos_id
        forced: list[int] | None = None
        if self.replies is not None:
            if not self.replies:
                raise AssertionError("FakeModel ran out of scripted replies")
            reply = self.replies.pop(0)
            forced = list(reply) if isinstance(reply, list) else self._tok.encode(reply) + [eos]
        vocab = sorted({*self.alphabet, eos} if self.p_eos > 0 or forced is not None else set(self.alphabet))
        ids: list[int] = []
        lps: list[float] = []
        sup_ids: list[int] = []
        sup_lps: list[float] = []
        offsets = [0]
        finish = "length"
        for t in range(params.max_tokens):
            if forced is not None and t >= len(forced):
                break
            support = rng.choice(vocab, size=min(self.k, len(vocab)), replace=False).tolist()
            if forced is not None and forced[t] not in support:
                support[0] = forced[t]
            z = rng.standard_normal(len(support)) * 2
            if forced is None and eos in support:
                z[support.index(eos)] += np.log(self.p_eos * len(support))
            order = np.argsort(-z, kind="stable")
            support = [support[i] for i in order]
            z = z[order]
            lp = z - np.log(np.exp(z - z.max()).sum()) - z.max()
            j = support.index(forced[t]) if forced is not None else int(rng.choice(len(support), p=np.exp(lp) / np.exp(lp).sum()))
            ids.append(support[j])
            lps.append(lp[j])
            sup_ids.extend(support)
            sup_lps.extend(lp.tolist())
            offsets.append(len(sup_ids))
            if support[j] in params.stop_ids:
                finish = "stop"
                break
        n = len(ids)
        return Generation(
            request_id=f"fake-{len(self.prompts)}",
            token_ids=Tensor.from_numpy(np.asarray(ids, dtype=np.int64)),
            logprobs=Tensor.from_numpy(np.asarray(lps, dtype=np.float32)),
            support=SupportCSR(
                ids=Tensor.from_numpy(np.asarray(sup_ids, dtype=np.int64)),
                logprobs=Tensor.from_numpy(np.asarray(sup_lps, dtype=np.float32)),
                offsets=Tensor.from_numpy(np.asarray(offsets, dtype=np.int64)),
            ),
            versions=Tensor.from_numpy(np.full(n, self.version, dtype=np.int64)),
            sampler=IDENTITY,
            finish_reason=finish,
        )


class PairTokenizer:
    """Bytes 0..255, <bos> 256, <eos> 257, and 258 = "ab" (encode merges greedily;
    the text "<bos>"/"<eos>" encodes to its special id). ``render`` is the byte
    tokenizer's chat template (``CHAT_TEMPLATE``), rendered by transformers."""

    bos_id = 256
    eos_id = 257
    eos_token = "<eos>"
    vocab_size = 259
    _hf = None

    def render(self, messages, tools, add_generation_prompt: bool) -> str:
        from fleetrl.actors.model import build_byte_tokenizer
        from fleetrl.harness.chat import template_messages

        if PairTokenizer._hf is None:
            PairTokenizer._hf = build_byte_tokenizer()
        return PairTokenizer._hf.apply_chat_template(
            template_messages(messages), tools=list(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt, tokenize=False)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for part in re.split(r"(<bos>|<eos>)", text):
            if part in ("<bos>", "<eos>"):
                out.append(self.bos_id if part == "<bos>" else self.eos_id)
                continue
            data = part.encode()
            i = 0
            while i < len(data):
                if data[i:i + 2] == b"ab":
                    out.append(258)
                    i += 2
                else:
                    out.append(data[i])
                    i += 1
        return out

    def decode(self, ids: Sequence[int]) -> str:
        parts = []
        for i in ids:
            if i == 258:
                parts.append(b"ab")
            elif i < 256:
                parts.append(bytes([i]))
        return b"".join(parts).decode(errors="replace")


def _result(code: int | None, out: str, err: str = "", timed_out: bool = False) -> ExecResult:
    o, e = out.encode(), err.encode()
    return ExecResult(exit_code=code, stdout=o, stderr=e, stdout_truncated=False, stderr_truncated=False,
                      stdout_bytes=len(o), stderr_bytes=len(e), duration_s=0.0, timed_out=timed_out,
                      oom_killed=False)


class FakeSandbox:
    """Files in a dict; ``exec`` answers through ``handler(cmd, sandbox) -> ExecResult``
    (default: exit 0 and ``ran: <cmd>``)."""

    def __init__(self, handler: Callable[[str, "FakeSandbox"], ExecResult] | None = None, *,
                 exec_delay: float = 0.0) -> None:
        self.files: dict[str, bytes] = {}
        self.commands: list[tuple[str, str | None]] = []
        self.handler = handler or (lambda cmd, sb: _result(0, f"ran: {cmd}"))
        self.exec_delay = exec_delay

    async def exec(self, cmd, *, timeout=None, stdin=None, env=None, workdir=None):
        self.commands.append((cmd, workdir))
        if self.exec_delay:
            if timeout is not None and timeout < self.exec_delay:
                await trio.sleep(timeout)
                return _result(None, "", timed_out=True)
            await trio.sleep(self.exec_delay)
        await trio.lowlevel.checkpoint()
        return self.handler(cmd, self)

    async def write_files(self, files: Mapping[str, bytes | str]) -> None:
        await trio.lowlevel.checkpoint()
        for k, v in files.items():
            self.files[k] = v.encode() if isinstance(v, str) else bytes(v)

    async def read_file(self, path: str, *, max_bytes: int = 1 << 20) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.files[path]


result = _result


@asynccontextmanager
async def serving(app):
    """Serve ``app`` with hypercorn's Trio worker on a free port of 127.0.0.1; yields the base URL."""
    cfg = Config()
    cfg.bind = ["127.0.0.1:0"]
    cfg.accesslog = None
    cfg.errorlog = None
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: serve(app, cfg, shutdown_trigger=stop.wait, task_status=task_status))
        try:
            yield binds[0]
        finally:
            stop.set()


class TorchClient:
    """A ModelClient over the torch sampler backend: its blocking ``generate`` in a
    worker thread, its result as the wire `Generation`; keeps every request so a test
    can check the recorded tokens against the sampler."""

    def __init__(self, backend, tokenizer) -> None:
        self.backend = backend
        self._tok = tokenizer
        self.requests: list[tuple[list[int], object]] = []

    @property
    def tokenizer(self):
        return self._tok

    async def generate(self, prompt_ids, params: SamplingParams) -> Generation:
        self.requests.append((list(prompt_ids), params))
        (g,) = await trio.to_thread.run_sync(self.backend.generate, [list(prompt_ids)], params)
        from fleetrl.actors.samplers.base import served_identity, stamp

        return stamp(g, f"torch-{len(self.requests)}", served_identity(self.backend, "torch-test"))


class NullControlPlane:
    """The smallest `ControlPlane` for a control app whose mounts are what a test is
    about (the fleet join, the weights): nothing to report, nothing to pause."""

    def status(self):
        return {}

    def metrics_text(self):
        return b""

    def pause(self):
        pass

    def resume(self):
        pass

    def request_shutdown(self, reason):
        pass

    def halt(self, actor, reason):
        pass
