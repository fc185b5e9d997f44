"""Per-token arrays on the wire: `Tensor` (raw bytes) vs MessagePack lists of numbers.

Encodes and decodes the typical trajectory of `fleetrl.daemon.examples.example_trajectory`
(2,000 generated tokens, support K=20, 4 model calls) two ways in the same run:
- baseline: the same fields as plain lists of ints / floats (a schema without Tensor),
  converted from / to NumPy at the edges as a consumer would;
- ours: the ROLLOUTS codec, with Tensor fields and full validation on decode.
Prints each, the ratio, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import msgspec
import numpy as np

from fleetrl.daemon import messages
from fleetrl.daemon.examples import example_trajectory


class ListSegment(msgspec.Struct, frozen=True, kw_only=True):
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    support_ids: list[int]
    support_logprobs: list[float]
    support_offsets: list[int]
    versions: list[int]
    sampler: messages.SamplerIdentity
    finish_reason: str


class ListTrajectory(msgspec.Struct, frozen=True, kw_only=True, tag=True, tag_field="type"):
    attempt_id: str
    task_id: str
    group_id: str
    segments: tuple[ListSegment, ...]
    reward: float
    metrics: dict[str, float] = {}


def as_lists(t: messages.Trajectory) -> ListTrajectory:
    def seg(s: messages.TokenSegment) -> ListSegment:
        return ListSegment(
            prompt_ids=s.prompt_ids.to_numpy().tolist(),
            token_ids=s.token_ids.to_numpy().tolist(),
            logprobs=s.logprobs.to_numpy().tolist(),
            support_ids=s.support.ids.to_numpy().tolist(),
            support_logprobs=s.support.logprobs.to_numpy().tolist(),
            support_offsets=s.support.offsets.to_numpy().tolist(),
            versions=s.versions.to_numpy().tolist(),
            sampler=s.sampler,
            finish_reason=s.finish_reason,
        )

    return ListTrajectory(
        attempt_id=t.attempt_id, task_id=t.task_id, group_id=t.group_id,
        segments=tuple(seg(s) for s in t.segments), reward=t.reward, metrics=t.metrics,
    )


def best_of(fn, repeat: int, number: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--number", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()

    traj = example_trajectory(a.tokens, a.k)
    lists = as_lists(traj)
    enc = msgspec.msgpack.Encoder()
    list_dec = msgspec.msgpack.Decoder(ListTrajectory)
    list_bytes = enc.encode(lists)
    ours_bytes = messages.ROLLOUTS.encode(traj)
    assert messages.ROLLOUTS.decode(ours_bytes) == traj

    def baseline():  # what a consumer of the list schema pays: lists <-> numpy
        msg = list_dec.decode(enc.encode(as_lists(traj)))
        for s in msg.segments:
            np.asarray(s.support_ids, dtype=np.int32)
            np.asarray(s.support_logprobs, dtype=np.float32)

    def ours():
        msg = messages.ROLLOUTS.decode(messages.ROLLOUTS.encode(traj))
        for s in msg.segments:
            s.support.ids.to_numpy()
            s.support.logprobs.to_numpy()

    def baseline_wire():  # lists without the numpy conversions
        list_dec.decode(enc.encode(lists))

    t_base = best_of(baseline, a.repeat, a.number)
    t_wire = best_of(baseline_wire, a.repeat, a.number)
    t_ours = best_of(ours, a.repeat, a.number)
    print(f"trajectory: {a.tokens} tokens, K={a.k}, {len(traj.segments)} segments")
    print(f"lists  : {len(list_bytes):>8} bytes  encode+decode+numpy {t_base * 1e6:9.0f} us"
          f"  (wire only {t_wire * 1e6:.0f} us)")
    print(f"Tensor : {len(ours_bytes):>8} bytes  encode+decode+numpy {t_ours * 1e6:9.0f} us")
    print(f"speed-up x{t_base / t_ours:.1f} (wire only x{t_wire / t_ours:.1f}), "
          f"size ratio {len(ours_bytes) / len(list_bytes):.2f}")
    print(json.dumps({
        "bench": "protocol_arrays", "tokens": a.tokens, "k": a.k,
        "lists_us": round(t_base * 1e6, 1), "lists_wire_only_us": round(t_wire * 1e6, 1),
        "tensor_us": round(t_ours * 1e6, 1), "speedup": round(t_base / t_ours, 2),
        "speedup_wire_only": round(t_wire / t_ours, 2),
        "lists_bytes": len(list_bytes), "tensor_bytes": len(ours_bytes),
    }))


if __name__ == "__main__":
    main()
