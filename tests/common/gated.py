"""A torch sampler backend that holds each generation after its first decode step
until the test opens a gate: a chunk that arrives while the gate is shut arrived before
the generation ended (no wall-clock assertions: without streaming, a test waits at the
gate until its ``fail_after``)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetrl.actors.samplers import TorchBackend

__all__ = ["GatedBackend", "GatedRun", "WrappedBackend"]


class WrappedBackend:
    """A real sampler backend under a test's control: what the pool reads of a sampler
    (its identity and weight version) is the inner backend's; subclasses override the
    calls they fake."""

    def __init__(self, inner) -> None:
        self.inner = inner

    @property
    def identity(self):
        return self.inner.identity

    @property
    def weight_version(self):
        return self.inner.weight_version


class GatedBackend(WrappedBackend):
    """The real torch backend; each generation waits at `gate` before its second decode
    step (a test fake of a slow device), and `finished` is set when a generation has
    ended. `finishes` records ``(prompt index, finish reason, tokens)`` as prompts end."""

    streams_tokens = True

    def __init__(self, inner: TorchBackend) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.finished = threading.Event()
        self.finishes: list[tuple[int, str, int]] = []

    def check_generate(self, prompts, params):
        return self.inner.check_generate(prompts, params)

    def health(self):
        return self.inner.health()

    def start(self, prompts, params, *, on_tokens=None):
        return GatedRun(self, self.inner.start(prompts, params, on_tokens=on_tokens))

    def generate(self, prompts, params, *, on_tokens=None):
        run = self.start(prompts, params, on_tokens=on_tokens)
        while not run.done:
            run.step()
        return run.results()


class GatedRun:
    """A `DecodeRun` that waits at its backend's gate before its second step."""

    def __init__(self, backend: GatedBackend, run) -> None:
        self.backend = backend
        self.run = run

    @property
    def done(self) -> bool:
        return self.run.done

    def step(self) -> None:
        if self.run.steps == 1 and not self.backend.gate.wait(60):
            raise RuntimeError("the gate was never opened")
        self.run.step()
        if self.run.done:
            self.backend.finished.set()

    def abort(self, i: int) -> bool:
        return self.run.abort(i)

    def take_finished(self):
        out = self.run.take_finished()
        self.backend.finishes.extend((i, g.finish_reason, g.num_tokens) for i, g in out)
        return out

    def results(self):
        return self.run.results()
