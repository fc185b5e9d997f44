"""The discrete-event engine: chunked transfers over a tree of nodes (the origin, caches,
samplers), each link's bandwidth shared max-min fairly among the transfers on it, each
transfer also capped by its connection's window over its round trip; transfers break at
random and resume where they stopped. Pure (numpy), deterministic for a seed."""

from __future__ import annotations

import math
from collections import defaultdict

import msgspec
import numpy as np

from .fleet import Fleet, Strategy, chunks_of

__all__ = ["SimResult", "build_tree", "fair_rates", "simulate"]

_GBIT = 1e9 / 8  # bytes per second in a Gbit/s
_EPS = 1e-9
MAX_CHUNKS = 256


class SimResult(msgspec.Struct, frozen=True, kw_only=True):
    strategy: str
    delta_bytes: float
    samplers: int
    p50_s: float
    """Seconds from publication until half the samplers serve the new version."""
    p99_s: float
    all_s: float
    origin_egress_gb: float
    """GB the trainer's uplink sent."""
    egress_gb: dict[str, float]
    """GB that left each cloud for another (what clouds bill)."""
    egress_usd: float
    """The egress bill of this version."""
    breaks: int
    """Transfers that broke and resumed."""
    events: int


def build_tree(fleet: Fleet, strategy: Strategy) -> tuple[list[int], list[int], list[str]]:
    """(parent of each node, cloud of each node, kind of each node); node 0 is the origin
    (in the origin's cloud, parent -1). Samplers are ``kind == "sampler"``."""
    parent, cloud, kind = [-1], [fleet.origin], ["origin"]
    for ci, c in enumerate(fleet.clouds):
        if c.samplers == 0:
            continue
        if strategy == "cache":
            parent.append(0)
            cloud.append(ci)
            kind.append("cache")
            cache = len(parent) - 1
        first = len(parent)
        for i in range(c.samplers):
            if strategy == "direct":
                p = 0
            elif strategy == "cache":
                p = cache
            else:  # relay: a fanout-ary tree per cloud, its root fed by the origin
                p = 0 if i == 0 else first + (i - 1) // fleet.relay_fanout
            parent.append(p)
            cloud.append(ci)
            kind.append("sampler")
    return parent, cloud, kind


def fair_rates(up: np.ndarray, down: np.ndarray, src: np.ndarray, dst: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows ``src -> dst`` where node n sends at most ``up[n]`` and
    receives at most ``down[n]`` in all, and flow f runs at most ``cap[f]`` (progressive
    filling: every unfrozen flow is raised alike until a link fills or it reaches its cap)."""
    n_flows = len(src)
    rate = np.zeros(n_flows)
    if n_flows == 0:
        return rate
    left_up, left_down = up.astype(float).copy(), down.astype(float).copy()
    open_ = np.ones(n_flows, dtype=bool)
    level = 0.0
    n = len(up)
    while open_.any():
        n_up = np.bincount(src[open_], minlength=n)
        n_down = np.bincount(dst[open_], minlength=n)
        with np.errstate(divide="ignore", invalid="ignore"):
            inc_up = np.where(n_up > 0, left_up / np.maximum(n_up, 1), np.inf)
            inc_down = np.where(n_down > 0, left_down / np.maximum(n_down, 1), np.inf)
        inc = min(inc_up[src[open_]].min(), inc_down[dst[open_]].min(), (cap[open_] - level).min())
        inc = max(inc, 0.0)
        level += inc
        left_up -= inc * n_up
        left_down -= inc * n_down
        rate[open_] = level
        full = (left_up[src] <= _EPS * np.maximum(up[src], 1)) | (left_down[dst] <= _EPS * np.maximum(down[dst], 1)) \
            | (cap - level <= _EPS * np.maximum(cap, 1))
        still = open_ & ~full
        if still.sum() == open_.sum():  # numerical guard: nothing froze
            break
        open_ = still
    return rate


def _cache_timing(fleet: Fleet, parent: list[int], kind: list[str], rtt: np.ndarray, sync_until: np.ndarray,
                  holder: np.ndarray, streamed: np.ndarray, lock: bool) -> None:
    """Strategy cache (edges indexed by child - 1): the samplers' sync through their cache,
    and when the cache starts; with nginx's lock (`lock`) which sampler holds it and which
    transfers are one streamed response (`Fleet.cache_lock_poll_s`)."""
    local = fleet.local_rtt_ms / 1e3
    poll, k, s = fleet.cache_lock_poll_s, fleet.cache_origin_round_trips, fleet.sync_round_trips
    for cache in (i for i, kd in enumerate(kind) if kd == "cache"):
        wan = float(rtt[cache - 1])  # the cache's round trip to the origin
        via_origin = local + k * wan  # a request the cache passes to the origin
        samplers = [c for c in range(1, len(parent)) if parent[c] == cache]
        for j, c in enumerate(samplers):
            if s == 0:
                continue
            if lock and j > 0:  # the manifest: the first sampler's miss fills it, the others poll
                miss = local + poll * max(1, math.ceil(k * wan / poll - 1e-9))
            else:
                miss = via_origin
            sync_until[c - 1] = via_origin + (s - 1) * miss  # the pointer, then the blobs
        # the cache passes a request on at once; extra round trips (a new connection) first
        first_ask = sync_until[samplers[0] - 1] + local / 2 if lock and samplers else 0.0
        sync_until[cache - 1] = first_ask + (k - 1) * wan
        if lock and samplers:
            holder[samplers[0] - 1] = True
            streamed[cache - 1] = True
            streamed[[c - 1 for c in samplers]] = True


def simulate(fleet: Fleet, strategy: Strategy, delta_bytes: float, *, seed: int = 0,
             max_events: int = 2_000_000) -> SimResult:
    """How version v+1 (a delta of `delta_bytes`) spreads from the origin to every sampler."""
    if delta_bytes <= 0:
        raise ValueError("delta_bytes must be > 0")
    rng = np.random.default_rng(seed)
    parent, cloud, kind = build_tree(fleet, strategy)
    n = len(parent)
    clouds = fleet.clouds
    up = np.empty(n)
    down = np.empty(n)
    for i in range(n):
        c = clouds[cloud[i]]
        if kind[i] == "origin":
            up[i], down[i] = fleet.origin_gbps * _GBIT, math.inf
        elif kind[i] == "cache":
            up[i] = down[i] = c.cache_gbps * _GBIT
        else:
            up[i] = down[i] = c.gbps * _GBIT
    lock = strategy == "cache" and fleet.cache_lock_poll_s > 0
    # nginx streams one response per blob: fine chunks stand for its pipelining
    fine = delta_bytes / MAX_CHUNKS / (1 << 20)
    sizes = chunks_of(delta_bytes, fine if lock else max(fleet.chunk_mib, fine))
    n_chunks = len(sizes)
    # one edge per non-origin node: its transfer from its parent
    child = np.arange(1, n)
    src = np.asarray(parent[1:], dtype=np.int64)
    def to_origin_ms(ci: int) -> float:  # a cloud's round trip to the trainer's
        return 0.0 if ci == fleet.origin else clouds[ci].rtt_ms

    rtt = np.array([(fleet.local_rtt_ms if cloud[p] == cloud[c] else
                     max(to_origin_ms(cloud[p]) + to_origin_ms(cloud[c]), fleet.local_rtt_ms)) / 1e3
                    for p, c in zip(src.tolist(), child.tolist(), strict=True)])
    cap = fleet.tcp_window_mib * (1 << 20) / rtt
    # a sampler reads the version pointer and the manifest before its first request
    sync_until = np.array([fleet.sync_round_trips * r if kind[c] == "sampler" else 0.0
                           for r, c in zip(rtt.tolist(), child.tolist(), strict=True)])
    holder = np.zeros(n - 1, dtype=bool)  # a cloud's first sampler behind its cache
    streamed = np.zeros(n - 1, dtype=bool)  # one response: chunks after the first cost no round trip
    if strategy == "cache":
        _cache_timing(fleet, parent, kind, rtt, sync_until, holder, streamed, lock)
    local_s = fleet.local_rtt_ms / 1e3
    fail_gb = np.array([max(clouds[cloud[p]].failure_per_gb, clouds[cloud[c]].failure_per_gb)
                        for p, c in zip(src.tolist(), child.tolist(), strict=True)])
    held = np.zeros(n, dtype=np.int64)  # chunks each node holds (in order)
    held[0] = n_chunks
    nxt = np.zeros(n - 1, dtype=np.int64)  # the chunk each edge moves next
    remaining = np.zeros(n - 1)
    breaks_at = np.full(n - 1, -1.0)  # remaining bytes at which the transfer breaks (-1: it does not)
    ready = np.full(n - 1, np.inf)  # when the edge's current chunk request is answered
    moving = np.zeros(n - 1, dtype=bool)
    done_at = np.full(n, np.inf)
    done_at[0] = 0.0
    sent = defaultdict(float)  # (from cloud, to cloud) -> bytes
    origin_bytes = 0.0
    breaks = 0

    def draw_break(e: int, nbytes: float) -> float:
        p = 1.0 - math.exp(-fail_gb[e] * nbytes / 1e9)
        return float(rng.uniform(0, nbytes)) if p > 0 and rng.random() < p else -1.0

    def request(e: int, t: float) -> None:
        """Edge e asks for its next chunk if the parent holds it."""
        if nxt[e] < n_chunks and held[src[e]] > nxt[e] and not moving[e] and not np.isfinite(ready[e]):
            waiter = lock and kind[src[e]] == "cache" and not holder[e]
            if waiter and held[src[e]] < n_chunks:
                return  # nginx's lock: the cache serves it the whole delta or nothing
            remaining[e] = sizes[nxt[e]]
            breaks_at[e] = draw_break(e, remaining[e])
            if streamed[e] and nxt[e] > 0:
                ready[e] = t
            elif waiter and done_at[src[e]] > (arrive := sync_until[e] + local_s / 2):
                # it asked while the cache was filling: it re-checks every poll from its request
                waits = max(1, math.ceil((done_at[src[e]] - arrive) / fleet.cache_lock_poll_s - 1e-9))
                ready[e] = max(t, arrive + waits * fleet.cache_lock_poll_s + local_s / 2)
            else:
                ready[e] = max(t, sync_until[e]) + rtt[e]

    t = 0.0
    for e in range(n - 1):
        request(e, t)
    by_parent: dict[int, list[int]] = defaultdict(list)
    for e, p in enumerate(src.tolist()):
        by_parent[p].append(e)
    samplers = np.array([k == "sampler" for k in kind])
    events = 0
    while not np.isfinite(done_at[samplers]).all():
        events += 1
        if events > max_events:
            raise RuntimeError(f"simulation did not finish within {max_events} events")
        starting = ~moving & (ready <= t + _EPS)
        moving |= starting
        ready[starting] = np.inf
        act = np.flatnonzero(moving)
        rates = fair_rates(up, down, src[act], child[act], cap[act]) if act.size else np.zeros(0)
        dt = np.inf
        if act.size:
            to_go = remaining[act] - np.maximum(breaks_at[act], 0.0)
            with np.errstate(divide="ignore"):
                dt = float(np.min(np.where(rates > 0, to_go / rates, np.inf)))
        waiting = ready[np.isfinite(ready)]
        if waiting.size:
            dt = min(dt, float(waiting.min()) - t)
        if not np.isfinite(dt):
            raise RuntimeError("simulation stalled: no transfer can move")
        dt = max(dt, 0.0)
        t += dt
        if act.size:
            moved = rates * dt
            remaining[act] -= moved
            for e, b in zip(act.tolist(), moved.tolist(), strict=True):
                if b > 0:
                    pc, cc = cloud[src[e]], cloud[child[e]]
                    if pc != cc:
                        sent[(pc, cc)] += b
                    if src[e] == 0:
                        origin_bytes += b
            for e in act.tolist():
                if breaks_at[e] >= 0 and remaining[e] <= breaks_at[e] + 1e-6:
                    breaks += 1  # the connection broke: resume the rest after a reconnect
                    moving[e] = False
                    breaks_at[e] = draw_break(e, remaining[e])
                    ready[e] = t + fleet.reconnect_s + rtt[e]
                elif remaining[e] <= 1e-6 * sizes[min(nxt[e], n_chunks - 1)]:
                    moving[e] = False
                    remaining[e] = 0.0
                    c = int(child[e])
                    held[c] += 1
                    nxt[e] += 1
                    if held[c] == n_chunks:
                        done_at[c] = t
                    request(e, t)
                    for k in by_parent.get(c, ()):
                        request(k, t)
    apply_s = delta_bytes / (fleet.apply_gbps * _GBIT)
    serve = np.sort(done_at[samplers]) + apply_s
    egress = defaultdict(float)
    usd = 0.0
    for (pc, _cc), b in sent.items():
        egress[clouds[pc].name] += b / 1e9
        usd += b / 1e9 * clouds[pc].egress_usd_per_gb
    return SimResult(strategy=strategy, delta_bytes=delta_bytes, samplers=int(samplers.sum()),
                     p50_s=float(np.percentile(serve, 50)), p99_s=float(np.percentile(serve, 99)),
                     all_s=float(serve[-1]), origin_egress_gb=origin_bytes / 1e9,
                     egress_gb=dict(egress), egress_usd=usd, breaks=breaks, events=events)
