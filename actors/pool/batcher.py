"""Generate requests on one blocking backend, concurrent ones decoded as batches.

Backends are synchronous (CPU/GPU bound) and decode a batch of prompts faster than the
same prompts one by one. `Batcher` turns the concurrent requests waiting for one
backend into batches (one backend call for many requests with the same sampling
parameters, each answered with its own `Generation`), runs them in worker threads, and
turns backend errors into answers: a bad request is a non-retryable `GenerateFailed`
for that request alone (another sampler would refuse it too); numerical trouble is
retryable elsewhere; anything else means the sampler itself is broken and raises
`SamplerLost`, so the pool re-routes the request and restarts the sampler. Each answer
is the backend's own `Generation` stamped (``samplers.base.stamp``) with the request id and the
sampler identity it is served under.

Streaming: a request with ``stream=True`` served through `Batcher.stream` also gets its
tokens as the backend produces them (a backend with ``streams_tokens``, see
``samplers.base``: its sink posts each step's ids to the Trio thread), as lists of ids
before its answer. Requests that do not stream cost nothing extra: the backend gets a
sink only when its batch holds a streamed request, and the sink posts only theirs.

``capacity`` is the number of requests a sampler serves at once (what the pool routes
against); ``max_batch`` the most requests in one backend call. See `Batcher` for the
rules, and `fleetrl.actors.samplers.batching` for which requests may share a call
(seeded requests run alone).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import msgspec
import trio

from fleetrl.actors.samplers.base import SamplerBackend, TokenSink, stamp, streams_tokens
from fleetrl.actors.samplers.batching import batch_key, take_batch
from fleetrl.actors.samplers.errors import BadGenerateRequest, NumericalFailure
from fleetrl.daemon import messages as m
from .errors import SamplerLost

__all__ = ["BatchStatistics", "Batcher", "SamplerLost", "decode_batch", "run_generate"]



def _too_old(backend: SamplerBackend, identity: m.SamplerIdentity,
             request: m.GenerateRequest) -> m.GenerateFailed | None:
    held = backend.weight_version.version
    if held < request.min_version:
        return m.GenerateFailed(request_id=request.request_id, retryable=True, cause="weight_version",
                                reason=f"sampler {identity.sampler_id} holds version {held} < "
                                       f"min_version {request.min_version}")
    return None


def _request_error(request_id: str, identity: m.SamplerIdentity, exc: Exception) -> m.GenerateFailed:
    """The answer to an error that a request's own input caused (or numerical trouble)."""
    retryable = isinstance(exc, NumericalFailure)
    return m.GenerateFailed(request_id=request_id, reason=f"sampler {identity.sampler_id}: {exc}",
                            retryable=retryable)


_REQUEST_ERRORS = (BadGenerateRequest, ValueError, NumericalFailure)


def run_generate(backend: SamplerBackend, identity: m.SamplerIdentity,
                 request: m.GenerateRequest) -> m.Generation | m.GenerateFailed:
    """Blocking: one request alone through `backend` (a batch of one)."""
    old = _too_old(backend, identity, request)
    if old is not None:
        return old
    try:
        gens = backend.generate([request.prompt_ids.to_numpy().tolist()], request.params)
    except _REQUEST_ERRORS as exc:
        return _request_error(request.request_id, identity, exc)
    return stamp(gens[0], request.request_id, identity)


def decode_batch(backend: SamplerBackend, prompts: list[list[int]], params: m.SamplingParams,
                 emit: Callable[[int, m.Generation], None], on_tokens: TokenSink | None = None,
                 given_up: Callable[[], list[int]] | None = None) -> None:
    """Blocking: one backend call for `prompts`; ``emit(i, generation)`` for each prompt.

    A backend that decodes step by step (``start(prompts, params)`` returning a run with
    ``step()``, ``done`` and ``take_finished()``, as `TorchBackend`) has each prompt
    emitted as soon as it finishes; any other backend's are emitted when its
    ``generate`` returns. ``on_tokens(i, ids)`` is handed to a backend that streams
    (``streams_tokens``): it gets prompt ``i``'s new tokens as they are decoded, all of
    them before ``emit(i, ...)``; other backends ignore it. ``given_up()``, asked between
    steps, names prompts nobody waits for any more: a run with ``abort(i)`` (`DecodeRun`)
    stops decoding them (they are emitted with finish reason ``"abort"``).
    """
    kw: dict[str, Any] = {}
    if on_tokens is not None and streams_tokens(backend):
        kw["on_tokens"] = on_tokens
    start = getattr(backend, "start", None)
    if start is None:
        for i, gen in enumerate(backend.generate(prompts, params, **kw)):
            emit(i, gen)
        return
    run = start(prompts, params, **kw)
    abort = getattr(run, "abort", None) if given_up is not None else None
    while not run.done:
        run.step()
        if abort is not None:
            for i in given_up():
                abort(i)
        for i, gen in run.take_finished():
            emit(i, gen)


class BatchStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What a `Batcher` has done so far."""

    requests: int
    """Requests that reached the backend (in a batch)."""
    calls: int
    """Backend calls (batches) started."""
    largest: int
    """Most requests in one call."""
    queued: int
    """Requests waiting for a batch now."""
    running: int
    """Requests in running batches now."""


class _Job:
    __slots__ = ("abandoned", "answer", "done", "lost", "params", "prompt", "request", "started", "tokens",
                 "wake")

    def __init__(self, request: m.GenerateRequest, params: m.SamplingParams, prompt: list[int],
                 started: Callable[[], None], *, streamed: bool) -> None:
        self.request = request
        self.params = params
        self.prompt = prompt
        self.started = started
        self.done = trio.Event()
        self.wake = trio.Event()
        """Set when tokens or the answer arrive (replaced by the reader after each wait)."""
        self.tokens: list[int] | None = [] if streamed else None
        """Tokens not yet handed to the reader; None: the request does not stream."""
        self.abandoned = False
        """Its reader gave up while its batch ran (read by the batch's thread)."""
        self.answer: m.Generation | m.GenerateFailed | None = None
        self.lost: str | None = None


class Batcher:
    """Serves generate requests on one backend, concurrent requests as batches.

    Requests wait in a FIFO queue. Whenever fewer than ``ceil(capacity / max_batch)``
    backend calls run and fewer than ``capacity`` requests are in them, the next batch
    leaves the queue (`fleetrl.actors.samplers.batching.take_batch`: the oldest request
    and the compatible ones behind it, at most ``max_batch`` and the free capacity) and
    runs as one backend call in a worker thread. Nothing waits on purpose: batches form
    at the end of the Trio scheduling round in which requests arrive (requests that
    arrive together, e.g. a group of attempts started at once, share a call), and
    requests that arrive while the sampler's calls run form the next batch. With
    ``max_batch = 1`` every request is its own call, at most ``capacity`` at once (the
    behaviour before batching).

    Per request:

    * it is checked alone before it joins a batch (its parameters; the backend's
      ``check_generate`` when it has one; ``min_version`` against the weights when its
      batch forms), so a bad request is answered alone (`GenerateFailed`, not
      retryable) and never reaches the others' call. If a batch of several still fails
      with a request error (a bad request the check did not catch, or non-finite logits),
      its unanswered requests are re-run one by one, so the error lands only on the
      request that causes it;
    * ``started()`` is called when its batch starts, and its answer is handed back as soon
      as its own prompt finishes (backends that decode step by step, like the torch one,
      finish short generations before long ones of the same batch);
    * cancelling it (a caller's timeout, the pool taking the sampler out) takes it out of
      the queue, or, once its batch runs, drops its answer: the batch goes on for the
      other requests. A streamed request given up while its batch runs also stops
      decoding at the next step boundary when the backend's run can ``abort`` a row
      (the torch backend's can), freeing its slot;
    * any other backend error means the backend is broken: every unanswered request of
      that batch raises `SamplerLost`.

    Batches run in threads started with `trio.lowlevel.start_thread_soon`, owned by no
    task, so no single request's cancellation can cancel them; a hung backend call is
    left behind (its requests are answered `SamplerLost` by whoever takes the sampler
    out, e.g. the pool's ``request_timeout_s``).
    """

    def __init__(self, backend: SamplerBackend, identity: m.SamplerIdentity, *, capacity: int = 1,
                 max_batch: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"sampler {identity.sampler_id}: capacity must be >= 1, got {capacity}")
        if max_batch < 1:
            raise ValueError(f"sampler {identity.sampler_id}: max_batch must be >= 1, got {max_batch}")
        self.backend = backend
        self.identity = identity
        self.capacity = capacity
        self.max_batch = max_batch
        self.max_calls = -(-capacity // max_batch)
        self._queue: list[_Job] = []
        self._calls_running = 0
        self._in_service = 0
        self._closed: str | None = None
        self._requests = 0
        self._calls = 0
        self._largest = 0
        self._token: trio.lowlevel.TrioToken | None = None
        self._dispatch_due = False

    def statistics(self) -> BatchStatistics:
        return BatchStatistics(requests=self._requests, calls=self._calls, largest=self._largest,
                               queued=len(self._queue), running=self._in_service)

    async def submit(self, request: m.GenerateRequest, started: Callable[[], None]
                     ) -> m.Generation | m.GenerateFailed:
        """Answer `request` (see the class docstring). Raises SamplerLost. Its tokens
        are not streamed (``request.stream`` is ignored; see `stream`)."""
        answer: m.Generation | m.GenerateFailed | None = None
        async with aclosing(self._serve(request, started, streamed=False)) as items:
            async for item in items:
                assert not isinstance(item, list)
                answer = item
        assert answer is not None
        return answer

    def stream(self, request: m.GenerateRequest, started: Callable[[], None]
               ) -> AsyncIterator[list[int] | m.Generation | m.GenerateFailed]:
        """`submit`, streamed when ``request.stream``: lists of new token ids as the backend
        decodes them (when it streams, ``samplers.base.streams_tokens``), then the answer.
        The lists concatenate to the answer's ``token_ids`` (a prefix of it when the
        backend does not stream: then there are none). Raises SamplerLost.

        Closing the iterator early (``aclosing``) gives the request up: out of the queue,
        or, once its batch runs, its answer dropped and no more tokens posted for it."""
        return self._serve(request, started, streamed=request.stream)

    async def _serve(self, request: m.GenerateRequest, started: Callable[[], None], *, streamed: bool
                     ) -> AsyncIterator[list[int] | m.Generation | m.GenerateFailed]:
        if self._closed is not None:
            raise SamplerLost(f"sampler {self.identity.sampler_id} is {self._closed}")
        self._token = trio.lowlevel.current_trio_token()
        params = request.params
        try:
            prompt = request.prompt_ids.to_numpy().tolist()
            check = getattr(self.backend, "check_generate", None)
            if check is not None:
                check([prompt], params)
        except (BadGenerateRequest, ValueError) as exc:
            yield _request_error(request.request_id, self.identity, exc)
            return
        job = _Job(request, params, prompt, started, streamed=streamed)
        self._queue.append(job)
        if not self._dispatch_due:  # once the tasks runnable now have queued their requests too
            self._dispatch_due = True
            self._token.run_sync_soon(self._due)
        try:
            while True:  # tokens that came in while the reader held a chunk go out before the answer
                if job.tokens:
                    ids, job.tokens = job.tokens, []
                    yield ids  # outside any cancel scope: the reader's code runs here
                    continue
                if job.done.is_set():
                    break
                await job.wake.wait()
                job.wake = trio.Event()
        except BaseException:  # cancelled, or the reader closed the stream
            if job in self._queue:
                self._queue.remove(job)
            job.abandoned = True
            raise
        if job.lost is not None:
            raise SamplerLost(job.lost)
        assert job.answer is not None
        yield job.answer

    def close(self, reason: str = "closed") -> None:
        """Take no more requests; the waiting ones raise SamplerLost (running batches finish)."""
        if self._closed is not None:
            return
        self._closed = reason
        queued, self._queue = self._queue, []
        for job in queued:
            self._finish(job, None, f"sampler {self.identity.sampler_id} is {reason}")

    # -- in the Trio thread --------------------------------------------------------------
    def _due(self) -> None:
        self._dispatch_due = False
        self._dispatch()

    def _dispatch(self) -> None:
        while self._queue and self._calls_running < self.max_calls and self._in_service < self.capacity:
            limit = min(self.max_batch, self.capacity - self._in_service)
            jobs = take_batch(self._queue, lambda j: batch_key(j.params), limit)
            ready = []
            try:  # runs as a Trio callback: an exception here would end the whole Trio run
                for job in jobs:
                    old = _too_old(self.backend, self.identity, job.request)
                    if old is not None:
                        self._finish(job, old, None)
                    else:
                        ready.append(job)
                for job in ready:
                    job.started()
            except Exception as exc:  # noqa: BLE001 - a broken backend or caller: lose this batch
                for job in jobs:
                    self._finish(job, None, f"sampler {self.identity.sampler_id} failed: "
                                            f"{type(exc).__name__}: {exc}")
                continue
            if not ready:
                continue
            self._calls_running += 1
            self._in_service += len(ready)
            self._requests += len(ready)
            self._calls += 1
            self._largest = max(self._largest, len(ready))
            trio.lowlevel.start_thread_soon(
                functools.partial(self._run, ready),
                functools.partial(self._post, self._ended, ready))

    def _finish(self, job: _Job, answer: m.Generation | m.GenerateFailed | None, lost: str | None) -> None:
        if job.done.is_set():
            return
        job.answer, job.lost = answer, lost
        job.done.set()
        job.wake.set()

    def _tokens(self, job: _Job, ids: list[int]) -> None:
        if job.done.is_set() or job.tokens is None or job.abandoned:
            return
        job.tokens.extend(ids)
        job.wake.set()

    def _answered(self, job: _Job, answer: m.Generation | m.GenerateFailed | None, lost: str | None) -> None:
        if not job.done.is_set():
            self._in_service -= 1
        self._finish(job, answer, lost)

    def _ended(self, jobs: list[_Job], outcome: Any) -> None:
        """A batch's thread is over: whatever it left unanswered is lost."""
        self._calls_running -= 1
        error = getattr(outcome, "error", None)
        why = f"{type(error).__name__}: {error}" if error is not None else "the batch ended without an answer"
        for job in jobs:
            if not job.done.is_set():
                self._answered(job, None, f"sampler {self.identity.sampler_id} failed: {why}")
        self._dispatch()

    # -- in the batch's worker thread -----------------------------------------------------
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        token = self._token
        assert token is not None
        try:
            token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass  # the Trio run is over; nobody waits for the answer any more

    def _run(self, jobs: list[_Job]) -> None:
        identity = self.identity
        answered: set[int] = set()
        streamed: set[int] = set()  # jobs that were sent tokens

        def emit(i: int, gen: m.Generation) -> None:
            answered.add(i)
            self._post(self._answered, jobs[i], stamp(gen, jobs[i].request.request_id, identity), None)

        def on_tokens(i: int, ids: list[int]) -> None:
            job = jobs[i]
            if job.tokens is not None and not job.abandoned:
                streamed.add(i)
                self._post(self._tokens, job, ids)

        aborted: set[int] = set()

        def given_up() -> list[int]:  # streamed requests whose reader closed the stream
            out = [i for i, j in enumerate(jobs) if j.abandoned and i not in aborted and i not in answered]
            aborted.update(out)
            return out

        sink = on_tokens if any(j.tokens is not None for j in jobs) else None
        try:
            decode_batch(self.backend, [j.prompt for j in jobs], jobs[0].params, emit, sink,
                         given_up if sink is not None else None)
        except _REQUEST_ERRORS as exc:
            rest = [j for i, j in enumerate(jobs) if i not in answered]
            if len(jobs) == 1:
                for job in rest:
                    self._post(self._answered, job, _request_error(job.request.request_id, identity, exc), None)
                return
            for i, job in enumerate(jobs):  # find the culprit: each one alone
                if i in answered:
                    continue
                if i in streamed:  # its tokens went out: a run alone would contradict them
                    failed = m.GenerateFailed(request_id=job.request.request_id, retryable=True,
                                              reason=f"sampler {identity.sampler_id}: its batch failed after "
                                                     f"streaming tokens ({type(exc).__name__}: {exc})")
                    self._post(self._answered, job, failed, None)
                    continue
                try:
                    answer = run_generate(self.backend, identity, job.request)
                except Exception as alone:
                    self._post(self._answered, job, None,
                               f"sampler {identity.sampler_id} failed: {type(alone).__name__}: {alone}")
                else:
                    self._post(self._answered, job, answer, None)
        except Exception as exc:
            why = f"sampler {identity.sampler_id} failed: {type(exc).__name__}: {exc}"
            for i, job in enumerate(jobs):
                if i not in answered:
                    self._post(self._answered, job, None, why)
