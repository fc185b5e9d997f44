"""What the vLLM backend makes of the engine's output (pure, no vLLM import).

vLLM returns, per decoded token, its processed log-probs ``{id: Logprob}`` (see
`vllm_backend`): the finite entries are the support. `support_from_logprobs` turns one
of those into fleetrl's support (renormalised, most likely first), `vocabulary_from_logprobs`
into the listing of a whole-vocabulary draw (the ``k`` most likely, log q unchanged, and
the tail mass), `Collected` gathers a request's tokens as engine steps deliver them and
builds its wire `Generation`, and `request_seeds` derives each prompt's seed from the
batch seed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fleetrl.actors.samplers.base import TokenLog
from fleetrl.actors.samplers.errors import SamplerError, VllmSupportError
from fleetrl.daemon.messages import Generation, SamplerIdentity, SamplingParams

__all__ = ["Collected", "request_seeds", "support_from_logprobs", "vocabulary_from_logprobs"]


def request_seeds(seed: int, n: int) -> list[int]:
    """Independent per-prompt seeds derived from one batch seed (prompt order matters).

    Every prompt needs its own stream: with one seed for all, G attempts of the same
    prompt would draw identical samples.
    """
    state = np.random.SeedSequence([seed, 0x666C656574726C]).generate_state(n, dtype=np.uint64)
    return [int(s >> np.uint64(1)) for s in state]


class Collected:
    """One request's tokens, supports and versions as engine steps deliver them;
    ``listing``: the number of most likely tokens a whole-vocabulary request lists
    (None: a listed support)."""

    def __init__(self, listing: int | None = None) -> None:
        self.listing = listing
        self.log = TokenLog("listed" if listing is None else "vocabulary")

    def add(self, out: Any, version: int, greedy: bool) -> None:
        [completion] = out.outputs
        token_ids = list(completion.token_ids)
        logprobs = completion.logprobs or []
        if len(logprobs) != len(token_ids):
            raise VllmSupportError(
                f"request {out.request_id}: vLLM returned {len(token_ids)} tokens but {len(logprobs)} log-prob entries"
            )
        for tok, entry in zip(token_ids, logprobs):
            t = len(self.log.tokens)
            where = f"request {out.request_id} token {t}"
            if self.listing is not None:
                ids, lps, lp_token, tail = vocabulary_from_logprobs(entry, int(tok), self.listing, where=where)
                self.log.add(int(tok), lp_token, ids, lps, version, tail)
                continue
            if greedy:
                ids, lps = np.array([int(tok)]), np.zeros(1)
            else:
                ids, lps = support_from_logprobs(entry, int(tok), where=where)
            self.log.add(int(tok), float(lps[int(np.argmax(ids == int(tok)))]), ids, lps, version)
        if out.finished:
            self.log.finish = "stop" if completion.finish_reason == "stop" else "length"

    def generation(self, i: int, identity: SamplerIdentity, seed: int, params: SamplingParams | None = None
                   ) -> Generation:
        """Prompt ``i``'s wire `Generation` (raises SamplerError if vLLM never finished it);
        ``params``: what it was drawn with (its ``sampling`` record)."""
        if self.log.finish is None:
            raise SamplerError(f"prompt {i}: vLLM ended without finishing the request")
        return self.log.generation(identity, seed, params=params, logprob_dtype=np.float64)  # renormalised in float64


def _entries(entry: Mapping[int, Any]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.fromiter((int(k) for k in entry), dtype=np.int64, count=len(entry))
    lps = np.fromiter((float(v.logprob) for v in entry.values()), dtype=np.float64, count=len(entry))
    return ids, lps


def support_from_logprobs(entry: Mapping[int, Any], token: int, *, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The support of one position from vLLM's processed log-probs ``{id: Logprob}``.

    The finite entries are the support; they are renormalised in float64 (vLLM computes
    them in float32) and ordered most likely first, ties lower id first. Raises
    VllmSupportError when the sampled token is not among them.
    """
    ids, lps = _entries(entry)
    finite = np.isfinite(lps)
    ids, lps = ids[finite], lps[finite]
    if token not in ids:
        raise VllmSupportError(f"{where}: sampled token {token} is not among vLLM's {len(ids)} finite log-probs")
    top = lps.max()
    lps = lps - (top + math.log(np.exp(lps - top).sum()))
    order = np.lexsort((ids, -lps))
    return ids[order], np.minimum(lps[order], 0.0)


def vocabulary_from_logprobs(entry: Mapping[int, Any], token: int, k: int, *,
                             where: str) -> tuple[np.ndarray, np.ndarray, float, float]:
    """The listing of one position of a whole-vocabulary draw from vLLM's processed
    log-probs ``{id: Logprob}`` (the ``k`` most likely tokens, plus the sampled one when
    it is not among them): ``(ids, log q, log q of the sampled token, tail mass)``. The
    ``k`` most likely finite entries are listed, most likely first (ties lower id
    first), with vLLM's log q over the vocabulary as they are; the tail is the mass
    outside them. Raises VllmSupportError when the sampled token has no finite log-prob."""
    ids, lps = _entries(entry)
    at = ids == token
    if not at.any() or not np.isfinite(lps[at][0]):
        raise VllmSupportError(f"{where}: vLLM returned no finite log-prob for the sampled token {token}")
    lp_token = min(float(lps[at][0]), 0.0)
    finite = np.isfinite(lps)
    ids, lps = ids[finite], np.minimum(lps[finite], 0.0)
    order = np.lexsort((ids, -lps))[:k]
    ids, lps = ids[order], lps[order]
    tail = max(0.0, 1.0 - float(np.exp(lps).sum()))
    return ids, lps, lp_token, tail
