"""Validate `fleetrl simulate` against a measured fleet: the same topology run for real on
this machine, then simulated, figure by figure.

    sudo .venv/bin/python bench/fleet_validate.py [--versions 3] [--origin-mbps 64]
        [--mbps 4 8 16 32] [--rtt-ms 10 20 40 80] [--per-host 2] [--params 8e6] [--density 0.3]
        [--strategies direct cache] [--local-mbps 64] [--local-rtt-ms 1] [--lock-s 600]

The measured fleet: the trainer's delta store (``blob_app`` over a ``MemoryStore`` fed by a
real ``Publisher``) served over HTTP on this host; one network namespace per "cloud" (a
sampler host, ``tests/common/netns.py``) holding ``--per-host`` followers, each with its
own HTTP connection. Every namespace reaches the store through its own fault proxy in
link mode (``tests/common/faultproxy.py``): a pipelined one-way delay of rtt / 2 each way
and a per-connection cap (the sampler's link), all proxies sharing one ``Uplink`` of
``--origin-mbps`` (the trainer's uplink). Strategy direct: every follower pulls from the
trainer's store.

Per version v+1 the trainer publishes, then tells every follower (over stdin); each reads
the version pointer, the manifest, then the one-step delta blob from v (hash checked:
``HttpBlobSource``), and reports when it holds it.

Strategy cache (``--strategies cache``): per namespace a real nginx inside it, configured
as fleetrl documents it (tests/weights/test_fanout.py: immutable blobs cached with
``proxy_cache_lock``, the version pointer not cached, a new upstream connection per
request; ``proxy_cache_lock_timeout`` and ``_age`` at ``--lock-s``, 600 s rather than
nginx's 5 s). It pulls from the store through the namespace's proxy (the round trip, a
cap of ``--mbps``, the shared uplink, a TCP handshake per connection); the namespace's
followers reach it through a second proxy (``--local-rtt-ms``, ``--local-mbps`` each,
the cache's ``--mbps`` shared by them: a cache's link both ways, as the model has it)
and read pointer, manifest and delta through it. The origin counts its requests. The
simulator is given a cloud per namespace with that cache, ``sync_round_trips`` 2,
``cache_lock_poll_s`` 0.5 and ``cache_origin_round_trips`` 2 (nginx), and is also shown
as the ideal cache it had before. The figures are the seconds from
publication until p50 / p99 / all followers hold v+1. Applying the delta is not measured
(CPU, not network: the simulator is given an infinite apply rate).

The simulator is given a `Fleet` with the same topology: a cloud per namespace with
``--per-host`` samplers at ``--mbps``, its round trip ``--rtt-ms``, the trainer's uplink
``--origin-mbps``, no failures, the measured delta size, and the round trips a follower
spends before its transfer (pointer and manifest: 2). Printed: measured, simulated and
their ratio per figure and version, the medians over versions, whether each is within
``--tolerance``; the last line is one JSON object. Runs as root (namespaces).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "common"))

FIGURES = ("p50_s", "p99_s", "all_s")
SYNC_ROUND_TRIPS = 2  # the version pointer and the manifest, before the delta
NGINX_LOCK_POLL_S = 0.5  # nginx: a request waiting on proxy_cache_lock re-checks every 500 ms


# ----------------------------------------------------------------------- the follower host

async def _follower_host(base_url: str, n: int) -> None:
    """`n` followers (one HTTP connection each) in this process: per line on stdin
    ``{"version": v}`` each fetches v's one-step delta and the host prints when each held it."""
    import httpx
    import trio

    from fleetrl.actors.weights.http import HttpBlobSource

    async def read_line(buf: bytearray) -> bytes:
        while b"\n" not in buf:
            data = await trio.to_thread.run_sync(os.read, 0, 4096)
            if not data:
                return b""
            buf += data
        line, _, rest = bytes(buf).partition(b"\n")
        buf[:] = rest
        return line

    clients = [httpx.AsyncClient(timeout=120) for _ in range(n)]
    sources = [HttpBlobSource(c, base_url) for c in clients]
    try:
        for s in sources:  # open each connection before any timing
            await s.ref("manifest")
        print(json.dumps({"ready": n}), flush=True)
        buf = bytearray()
        while line := await read_line(buf):
            version = json.loads(line)["version"]
            done: list[float] = [0.0] * n
            sizes: list[int] = [0] * n

            async def fetch(i: int) -> None:
                m = await sources[i].manifest()
                if m.version != version:
                    raise RuntimeError(f"follower {i}: expected version {version}, the store has {m.version}")
                (ref,) = [r for r in m.catchup if r.base_version == version - 1]
                sizes[i] = len(await sources[i].get(ref.key))
                done[i] = time.time()

            async with trio.open_nursery() as group:
                for i in range(n):
                    group.start_soon(fetch, i)
            print(json.dumps({"version": version, "done": done, "bytes": sizes}), flush=True)
    finally:
        for c in clients:
            await c.aclose()


# ----------------------------------------------------------------------- the measured fleet

class _Lines:
    def __init__(self, stream) -> None:
        self.stream, self.buf = stream, b""

    async def next(self) -> dict:
        while b"\n" not in self.buf:
            data = await self.stream.receive_some(65536)
            if not data:
                raise RuntimeError("a follower host exited")
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)


def _weights(params: int, seed: int):
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    return rng, torch.from_numpy((rng.standard_normal(params) * 0.02).astype(np.float32)).to(torch.bfloat16)


def _step(rng, w, density: float):
    """A step that moves a `density` fraction of the bf16 weights by one or two ulps."""
    import numpy as np
    import torch

    bits = w.view(torch.int16).numpy().copy()
    changed = rng.random(bits.size) < density
    bits[changed] += rng.choice(np.array([-2, -1, 1, 2], dtype=np.int16), size=int(changed.sum()))
    return torch.from_numpy(bits).view(torch.bfloat16)


async def _announce(procs: list, lines: list, version: int, timeout_s: float) -> tuple[list[float], int]:
    """Tell every follower process that `version` is out; the seconds until each of its
    followers held it, and the delta's size (all followers must agree on it)."""
    import trio

    t0 = time.time()
    for p in procs:
        await p.stdin.send_all(json.dumps({"version": version}).encode() + b"\n")
    done: list[float] = []
    sizes: set[int] = set()
    with trio.fail_after(timeout_s):
        for ln in lines:
            r = await ln.next()
            done += [t - t0 for t in r["done"]]
            sizes.update(r["bytes"])
    (size,) = sizes
    return done, size


def _percentiles(times: list[float]) -> dict[str, float]:
    import numpy as np

    t = np.sort(np.asarray(times))
    return {"p50_s": float(np.percentile(t, 50)), "p99_s": float(np.percentile(t, 99)), "all_s": float(t[-1])}


async def measure(args: argparse.Namespace) -> list[dict]:
    """Run the namespace fleet; per version: the delta's bytes and the measured figures."""
    import trio
    from faultproxy import FaultProxy, Uplink
    from netns import netns

    from fleetrl.actors.weights import MemoryStore, Publisher, PublisherConfig
    from fleetrl.actors.weights.http import blob_app
    from fleetrl.daemon.control import serve_control

    store = MemoryStore()
    pub = Publisher(store, PublisherConfig(run="validate", window=4, anchor_every=1 << 20))
    rng, w = _weights(int(args.params), args.seed)
    pub.publish({"w": w})
    stop = trio.Event()
    rows: list[dict] = []
    procs: list[trio.Process] = []
    with ExitStack() as stack:
        hosts = [stack.enter_context(netns(i)) for i in range(len(args.mbps))]
        async with trio.open_nursery() as n:
            _, port = await n.start(lambda task_status: serve_control(
                blob_app(store), "127.0.0.1", 0, shutdown_trigger=stop.wait, task_status=task_status))
            uplink = Uplink(args.origin_mbps * 1e6)
            lines = []
            try:
                for ns, mbps, rtt_ms in zip(hosts, args.mbps, args.rtt_ms, strict=True):
                    proxy = FaultProxy("127.0.0.1", port, listen_host=ns.host_ip, delay_s=rtt_ms / 2e3,
                                       bandwidth_bps=mbps * 1e6, uplink=uplink)
                    _, pport = await n.start(proxy.serve)
                    argv = ns.argv(sys.executable, str(Path(__file__).resolve()), "--follower-host",
                                   f"http://{ns.host_ip}:{pport}", str(args.per_host))
                    p = await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                         env=dict(os.environ, OMP_NUM_THREADS="1"))
                    procs.append(p)
                    lines.append(_Lines(p.stdout))
                with trio.fail_after(120):
                    for ln in lines:
                        await ln.next()  # ready
                for _ in range(args.versions):
                    w = _step(rng, w, args.density)
                    await trio.to_thread.run_sync(pub.publish, {"w": w})
                    done, size = await _announce(procs, lines, pub.version, args.timeout_s)
                    rows.append({"version": pub.version, "delta_bytes": size, **_percentiles(done)})
            finally:
                for p in procs:
                    await p.stdin.aclose()
                with trio.move_on_after(10):
                    for p in procs:
                        await p.wait()
                for p in procs:
                    if p.returncode is None:
                        p.kill()
                stop.set()
                n.cancel_scope.cancel()
    return rows


NGINX = shutil.which("nginx") or "/usr/sbin/nginx"  # scripts/setup.sh installs it

# fleetrl's documented cache (docs/guides/fleet.md, tests/weights/test_fanout.py): immutable
# blobs cached with proxy_cache_lock (concurrent misses: one origin request, the others wait
# and re-check every 500 ms), the version pointer never cached. The blob app is served at
# the root here, so /blobs/ and /refs/ rather than /weights/blobs/ and /weights/refs/.
NGINX_CONF = """
daemon off;
user root;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
    proxy_cache_path {d}/cache levels=1:2 keys_zone=weights:10m max_size=1g inactive=7d use_temp_path=off;
    server {{
        listen {listen};
        proxy_http_version 1.1;
        location /blobs/ {{
            proxy_pass http://{origin};
            proxy_cache weights;
            proxy_cache_key $uri;
            proxy_cache_lock on;             # concurrent misses of one blob: one origin request
            proxy_cache_lock_timeout {lock_s}s;
            proxy_cache_lock_age {lock_s}s;
            proxy_cache_valid 200 365d;
        }}
        location / {{                         # refs: the version pointer, never cached
            proxy_pass http://{origin};
            proxy_cache off;
        }}
    }}
}}
"""


class _Counting:
    """ASGI middleware: the origin's requests by path."""

    def __init__(self, app) -> None:
        self.app, self.paths = app, collections.Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.paths[scope["path"]] += 1
        await self.app(scope, receive, send)


async def _nginx_up(url: str, proc: subprocess.Popen, log: Path) -> None:
    import httpx
    import trio

    async with httpx.AsyncClient(timeout=5) as client:
        with trio.fail_after(20):
            while True:
                try:
                    if (await client.get(f"{url}/refs/manifest")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"nginx exited: {log.read_text()}")
                await trio.sleep(0.1)


async def measure_cache(args: argparse.Namespace) -> list[dict]:
    """The namespace fleet through a cache per namespace (module docstring, strategy
    cache); per version: the delta's bytes, the measured figures and the origin's requests."""
    import tempfile

    import trio
    from faultproxy import FaultProxy, Uplink
    from netns import netns

    from fleetrl.actors.weights import MemoryStore, Publisher, PublisherConfig
    from fleetrl.actors.weights.http import blob_app
    from fleetrl.daemon.control import serve_control

    if not os.path.exists(NGINX):
        raise RuntimeError(f"nginx not found ({NGINX}): scripts/setup.sh installs it")
    store = MemoryStore()
    pub = Publisher(store, PublisherConfig(run="validate", window=4, anchor_every=1 << 20))
    rng, w = _weights(int(args.params), args.seed)
    pub.publish({"w": w})
    origin = _Counting(blob_app(store))
    stop = trio.Event()
    rows: list[dict] = []
    procs: list[trio.Process] = []
    caches: list[subprocess.Popen] = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-validate-")))
        hosts = [stack.enter_context(netns(i)) for i in range(len(args.mbps))]
        async with trio.open_nursery() as n:
            _, port = await n.start(lambda task_status: serve_control(
                origin, "127.0.0.1", 0, shutdown_trigger=stop.wait, task_status=task_status))
            uplink = Uplink(args.origin_mbps * 1e6)
            lines = []
            try:
                for i, (ns, mbps, rtt_ms) in enumerate(zip(hosts, args.mbps, args.rtt_ms, strict=True)):
                    # the cloud's WAN: the cache's pulls from the trainer (its cap, the trainer's
                    # uplink, the round trip; nginx opens a connection per origin request)
                    wan = FaultProxy("127.0.0.1", port, listen_host=ns.host_ip, delay_s=rtt_ms / 2e3,
                                     bandwidth_bps=mbps * 1e6, uplink=uplink, handshake=True)
                    _, wan_port = await n.start(wan.serve)
                    d = tmp / f"nginx{i}"
                    d.mkdir()
                    (d / "nginx.conf").write_text(NGINX_CONF.format(
                        d=d, listen=f"{ns.ns_ip}:8080", origin=f"{ns.host_ip}:{wan_port}", lock_s=args.lock_s))
                    with open(d / "stderr.log", "wb") as err:
                        caches.append(subprocess.Popen(
                            ns.argv(NGINX, "-c", str(d / "nginx.conf"), "-p", str(d)),
                            stdout=subprocess.DEVNULL, stderr=err))
                    # the cloud's local network: followers to their cache (each follower's link,
                    # the cache's NIC shared by its followers, the local round trip)
                    local = FaultProxy(ns.ns_ip, 8080, listen_host=ns.host_ip, delay_s=args.local_rtt_ms / 2e3,
                                       bandwidth_bps=args.local_mbps * 1e6, uplink=Uplink(mbps * 1e6))
                    _, local_port = await n.start(local.serve)
                    url = f"http://{ns.host_ip}:{local_port}"
                    await _nginx_up(url, caches[-1], d / "stderr.log")
                    argv = ns.argv(sys.executable, str(Path(__file__).resolve()), "--follower-host", url,
                                   str(args.per_host))
                    p = await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                         env=dict(os.environ, OMP_NUM_THREADS="1"))
                    procs.append(p)
                    lines.append(_Lines(p.stdout))
                with trio.fail_after(120):
                    for ln in lines:
                        await ln.next()  # ready
                for _ in range(args.versions):
                    w = _step(rng, w, args.density)
                    await trio.to_thread.run_sync(pub.publish, {"w": w})
                    before = collections.Counter(origin.paths)
                    done, size = await _announce(procs, lines, pub.version, args.timeout_s)
                    (ref,) = [r for r in pub.manifest.catchup if r.base_version == pub.version - 1]
                    asked = origin.paths - before
                    rows.append({"version": pub.version, "delta_bytes": size, **_percentiles(done),
                                 "origin_requests": {"delta": asked[f"/blobs/{ref.key}"],
                                                     "refs": sum(c for k, c in asked.items() if k.startswith("/refs/")),
                                                     "all": sum(asked.values())}})
            finally:
                for p in procs:
                    await p.stdin.aclose()
                with trio.move_on_after(10):
                    for p in procs:
                        await p.wait()
                for p in procs:
                    if p.returncode is None:
                        p.kill()
                for c in caches:
                    c.terminate()
                for c in caches:
                    try:
                        c.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        c.kill()
                stop.set()
                n.cancel_scope.cancel()
    return rows


# ----------------------------------------------------------------------- the model of it

def simulated(args: argparse.Namespace, delta_bytes: float, sync_round_trips: int = SYNC_ROUND_TRIPS,
              ) -> dict[str, float]:
    from fleetrl.simulate.engine import simulate
    from fleetrl.simulate.fleet import Cloud, Fleet

    clouds = [Cloud(name="trainer", samplers=0, rtt_ms=0.0)]
    clouds += [Cloud(name=f"host{i}", samplers=args.per_host, gbps=mbps / 1e3, rtt_ms=rtt_ms)
               for i, (mbps, rtt_ms) in enumerate(zip(args.mbps, args.rtt_ms, strict=True))]
    fleet = Fleet(clouds=tuple(clouds), origin=0, origin_gbps=args.origin_mbps / 1e3, tcp_window_mib=1024.0,
                  apply_gbps=1e9, sync_round_trips=sync_round_trips)
    r = simulate(fleet, "direct", delta_bytes, seed=args.seed)
    return {"p50_s": r.p50_s, "p99_s": r.p99_s, "all_s": r.all_s}


def simulated_cache(args: argparse.Namespace, delta_bytes: float, nginx: bool = True) -> dict[str, float]:
    """The cache topology: per host a cache whose link is ``--mbps`` (both ways: its pulls from
    the trainer, what it serves its followers), followers at ``--local-mbps`` one local round
    trip from it. `nginx`: the model of nginx's cache lock and of the sync through the cache
    (`Fleet.cache_lock_poll_s` 0.5 s, `cache_origin_round_trips` 2, `sync_round_trips` 2);
    without: the ideal cache the model had before (no sync round trips)."""
    from fleetrl.simulate.engine import simulate
    from fleetrl.simulate.fleet import Cloud, Fleet

    clouds = [Cloud(name="trainer", samplers=0, rtt_ms=0.0)]
    clouds += [Cloud(name=f"host{i}", samplers=args.per_host, gbps=args.local_mbps / 1e3, cache_gbps=mbps / 1e3,
                     rtt_ms=rtt_ms) for i, (mbps, rtt_ms) in enumerate(zip(args.mbps, args.rtt_ms, strict=True))]
    kw = dict(sync_round_trips=SYNC_ROUND_TRIPS, cache_lock_poll_s=NGINX_LOCK_POLL_S,
              cache_origin_round_trips=2) if nginx else {}
    fleet = Fleet(clouds=tuple(clouds), origin=0, origin_gbps=args.origin_mbps / 1e3, tcp_window_mib=1024.0,
                  apply_gbps=1e9, local_rtt_ms=args.local_rtt_ms, **kw)
    r = simulate(fleet, "cache", delta_bytes, seed=args.seed)
    return {"p50_s": r.p50_s, "p99_s": r.p99_s, "all_s": r.all_s}


def compare(args: argparse.Namespace, rows: list[dict], strategy: str = "direct") -> dict:
    """Print measured vs simulated per version and figure (and the model as it was before
    this validation: without the follower's sync round trips for direct, the ideal cache
    for cache); the medians."""
    if strategy == "direct":
        print(f"measured fleet: {len(args.mbps)} namespaces x {args.per_host} followers, direct pulls; trainer uplink "
              f"{args.origin_mbps:g} Mbit/s; per host Mbit/s {args.mbps}, round trips ms {args.rtt_ms}")
        model, before_model, before_name = simulated, partial(simulated, sync_round_trips=0), "sim, 0 sync RT"
        before_key = "without_sync_round_trips"
    else:
        print(f"measured fleet: {len(args.mbps)} namespaces x {args.per_host} followers, an nginx cache per namespace; "
              f"trainer uplink {args.origin_mbps:g} Mbit/s; per cache Mbit/s {args.mbps}, its round trips ms "
              f"{args.rtt_ms}; followers {args.local_mbps:g} Mbit/s, {args.local_rtt_ms:g} ms from their cache")
        model, before_model, before_name = simulated_cache, partial(simulated_cache, nginx=False), "sim, ideal"
        before_key = "ideal_cache"
    print(f"{'version':>7} {'delta MB':>9} {'figure':>6} {'measured s':>10} {'simulated s':>11} {'sim/meas':>8} "
          f"{before_name:>14} {'sim/meas':>8}")
    for row in rows:
        row["sim"] = model(args, row["delta_bytes"])
        row[f"sim_{before_key}"] = before_model(args, row["delta_bytes"])
        for f in FIGURES:
            print(f"{row['version']:>7} {row['delta_bytes'] / 1e6:>9.2f} {f[:-2]:>6} {row[f]:>10.2f} "
                  f"{row['sim'][f]:>11.2f} {row['sim'][f] / row[f]:>8.3f} {row[f'sim_{before_key}'][f]:>14.2f} "
                  f"{row[f'sim_{before_key}'][f] / row[f]:>8.3f}")
        if "origin_requests" in row:
            print(f"{row['version']:>7} origin requests: delta {row['origin_requests']['delta']} ({len(args.mbps)} caches), "
                  f"refs {row['origin_requests']['refs']}, all {row['origin_requests']['all']}")
    summary = {}
    for f in FIGURES:
        meas = statistics.median(r[f] for r in rows)
        sim = statistics.median(r["sim"][f] for r in rows)
        ratio = statistics.median(r["sim"][f] / r[f] for r in rows)
        before = statistics.median(r[f"sim_{before_key}"][f] / r[f] for r in rows)
        ok = abs(ratio - 1) <= args.tolerance
        summary[f] = {"measured_s": round(meas, 3), "simulated_s": round(sim, 3),
                      "ratio_sim_over_measured": round(ratio, 3), f"ratio_{before_key}": round(before, 3), "within": ok}
        print(f"median {f}: measured {meas:.2f} s, simulated {sim:.2f} s, simulated/measured {ratio:.3f} "
              f"({'within' if ok else 'NOT within'} {100 * args.tolerance:g}%; "
              f"{'without the sync round trips' if strategy == 'direct' else 'the ideal cache'} {before:.3f})")
    return summary


def _rounded(x):
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return round(x, 3) if isinstance(x, float) else x


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--follower-host"]:
        import trio

        trio.run(_follower_host, argv[1], int(argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=3, help="versions published and measured (default 3)")
    p.add_argument("--origin-mbps", type=float, default=64.0, help="the trainer's uplink, Mbit/s (default 64)")
    p.add_argument("--mbps", type=float, nargs="+", default=[4.0, 8.0, 16.0, 32.0],
                   help="each host's link, Mbit/s; one namespace per value (default 4 8 16 32)")
    p.add_argument("--rtt-ms", type=float, nargs="+", default=[10.0, 20.0, 40.0, 80.0],
                   help="each host's round trip to the trainer, ms (default 10 20 40 80)")
    p.add_argument("--per-host", type=int, default=2, help="followers per namespace (default 2)")
    p.add_argument("--params", type=float, default=8e6, help="bf16 weights of the model (default 8e6)")
    p.add_argument("--density", type=float, default=0.3, help="fraction of weights a step moves (default 0.3)")
    p.add_argument("--tolerance", type=float, default=0.2, help="|simulated / measured - 1| allowed (default 0.2)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per version (default 120)")
    p.add_argument("--strategies", nargs="+", choices=("direct", "cache"), default=["direct", "cache"],
                   help="what to measure (default both)")
    p.add_argument("--local-mbps", type=float, default=64.0,
                   help="cache: each follower's link to its cache, Mbit/s (default 64)")
    p.add_argument("--local-rtt-ms", type=float, default=1.0,
                   help="cache: a follower's round trip to its cache, ms (default 1)")
    p.add_argument("--lock-s", type=int, default=600,
                   help="cache: nginx's proxy_cache_lock_timeout and _age, s (default 600; nginx's default 5)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if len(args.mbps) != len(args.rtt_ms):
        p.error("--mbps and --rtt-ms need one value per namespace each")
    if os.geteuid() != 0:
        p.error("network namespaces need root")
    import trio

    t = time.monotonic()
    out: dict = {"bench": "fleet_validate", "strategies": args.strategies, "namespaces": len(args.mbps),
                 "followers": len(args.mbps) * args.per_host, "origin_mbps": args.origin_mbps,
                 "mbps": args.mbps, "rtt_ms": args.rtt_ms, "tolerance": args.tolerance}
    if "cache" in args.strategies:
        out.update(local_mbps=args.local_mbps, local_rtt_ms=args.local_rtt_ms, nginx_lock_s=args.lock_s)
    for strategy in args.strategies:
        rows = trio.run(measure if strategy == "direct" else measure_cache, args)
        summary = compare(args, rows, strategy)
        out[strategy] = {"versions": [_rounded(r) for r in rows], "median": summary,
                         "all_within": all(s["within"] for s in summary.values())}
    out["all_within"] = all(out[s]["all_within"] for s in args.strategies)
    out["wall_s"] = round(time.monotonic() - t, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
