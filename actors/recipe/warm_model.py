"""The cached warm-start model of the embedded default.

`ensure_warm_model(cache_dir, recipe)` returns the directory of the tiny model built
with `recipe.init_seed`, warmed up on the synthetic task format (`warmup.run_warmup`)
and saved with transformers next to its byte tokenizer, so transformers, vLLM and the
torch sampler backend all load it. The first call trains it (about 9 CPU-minutes;
3 to 6 minutes on two idle cores, by machine); later calls find it in `cache_dir` and return at once.

Cache layout: `cache_dir/warm-<key>/`, where `<key>` is derived from everything
that determines the weights: the model spec, the init seed, the warm-up config
(steps, lr, batch, seeds, ...), a digest of the synthetic task family (prompts,
reference solutions and hidden tests of a fixed probe of tasks, so a change in the
families or their format invalidates the cache without anyone bumping a version)
and the cache format. The directory holds the model files and `warm.json`, a
manifest with the recipe, the key, the sha256 of every file and the warm-up's
losses. A directory is reused only when its manifest is readable, names the same key
and every file it lists has the listed digest; anything else (a partial copy, a
corrupted weight file, an old format) is rebuilt.

Writes are atomic: the model is written and fsynced in a temporary sibling
directory that is renamed into place, so a crash never leaves a directory that
passes the check. A lock file per key makes concurrent callers (two daemons sharing
a cache) build once: the second waits and then reuses the first's result.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, Literal

import msgspec
import torch

from fleetrl.actors.model import TinyLlamaSpec, build_tiny_llama, read_state_dict, save_tiny_llama
from fleetrl.actors.recipe.warmup import WarmupConfig, run_warmup
from fleetrl.harness.synthetic import SPLITS, generate_tasks, reference_solution
from fleetrl.harness.synthetic_tools import TOOL_SPLITS, generate_tool_tasks, reference_messages

__all__ = [
    "CACHE_FORMAT",
    "DEFAULT_RECIPE",
    "MANIFEST",
    "TOOL_RECIPE",
    "WarmManifest",
    "WarmRecipe",
    "check_warm_dir",
    "ensure_warm_model",
    "recipe_key",
    "task_family_digest",
    "weights_digest",
]

CACHE_FORMAT: Final = 2
"""Version of the cache layout and manifest; part of the key."""
MANIFEST: Final = "warm.json"
_PROBE_TASKS: Final = 16
_REQUIRED: Final = ("config.json", "tokenizer.json", "tokenizer_config.json")


class WarmRecipe(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything that determines the warm model's weights."""

    model: TinyLlamaSpec = TinyLlamaSpec()
    """Shape of the tiny Llama (hidden 192, 4 layers, ~1.8M parameters by default)."""
    init_seed: int = 0
    """Seed of the random initialisation."""
    warmup: WarmupConfig = WarmupConfig()
    """The supervised warm-up (steps, lr, batch size, task seed, ...)."""
    tasks: Literal["synthetic", "tool_lookup"] = "synthetic"
    """The task family whose reference solutions the warm-up trains on: the synthetic
    coding tasks (completions), or the tool-lookup family (reference conversations
    rendered with the chat template, loss on the assistant's tokens:
    `tool_warmup`)."""
    plain_steps: int = 0
    """Tool-lookup only: the first ``plain_steps`` of ``warmup.steps`` render the
    conversations without the tools list (no system turn: about 90 tokens instead of
    400), the rest with it. The short context is where the tiny model learns the
    lookups (from the request into the call, from the tool's result into the answer) in
    a few hundred cheap steps; with the tools list from the start it stays on the prior
    for 400 steps and more (docs/results/warmup.md)."""
    stop_after: int | None = None
    """Tool-lookup only: run only the first ``stop_after`` steps of the learning-rate
    schedule of ``warmup.steps`` (None: all of them). The model reads the tool prompt
    within a few dozen steps once it has the lookups, so this is where "weak but not
    hopeless" is set."""
    lookup_share: float = 1.0
    """Tool-lookup only: the share of the warm-up's conversations that look the code up
    (the others answer at once with a guessed code: `tool_warmup.guess_messages`). Below
    1 the warm model uses its tool only part of the time, a habit reinforcement learning
    can change within a few dozen steps."""

    def __post_init__(self) -> None:
        last = self.warmup.steps if self.stop_after is None else self.stop_after
        if self.plain_steps < 0 or self.plain_steps >= last:
            raise ValueError(f"WarmRecipe.plain_steps must be in [0, {last}) (the steps run), got {self.plain_steps}")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.warmup.steps:
            raise ValueError(f"WarmRecipe.stop_after must be in [1, warmup.steps={self.warmup.steps}], "
                             f"got {self.stop_after}")
        if not 0.0 < self.lookup_share <= 1.0:
            raise ValueError(f"WarmRecipe.lookup_share must be in (0, 1], got {self.lookup_share}")
        if (self.plain_steps or self.stop_after is not None or self.lookup_share != 1.0) and self.tasks != "tool_lookup":
            raise ValueError('WarmRecipe.plain_steps, stop_after and lookup_share are only used with '
                             'tasks = "tool_lookup"')


DEFAULT_RECIPE: Final = WarmRecipe()
TOOL_RECIPE: Final = WarmRecipe(tasks="tool_lookup", plain_steps=500, lookup_share=0.4,
                                warmup=WarmupConfig(steps=700, prompt_loss_weight=0.0))
"""The tool-lookup family's warm start (configs/agent-tools.toml): the default model
and optimizer settings on conversations of the training stream, loss on the assistant's
tokens only; 500 steps without the tools list (the lookups are learnt there), then 200
with it (the real prompt). Four conversations in ten look the code up (call, result,
answer), the others answer at once with a guess: the warm model calls its tool in about
40% of the attempts and guesses otherwise (fresh pass@1 about 5%), a habit the RL phase
changes within 20 steps (docs/results/warmup.md)."""


class WarmManifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`warm.json`: what a cached warm model is and how to check it is whole."""

    format: int
    key: str
    recipe: WarmRecipe
    task_family: str
    files: dict[str, str]
    """File name -> "sha256:<hex>" of every file of the model directory but this one."""
    weights: str
    """`weights_digest` of the saved tensors."""
    losses: tuple[float, ...]
    """Completion loss of every warm-up step."""
    prompt_losses: tuple[float, ...]
    """Prompt loss of every warm-up step (format 2 on)."""
    warmup_seconds: float
    created_at: float


def task_family_digest(tasks: str = "synthetic") -> str:
    """A digest of a task family as the warm-up sees it. Synthetic: the prompt,
    reference completion and hidden tests of the first tasks of every split.
    Tool-lookup: the first tasks of every split and their reference conversations as
    the chat template renders them (so a change of the template invalidates the cache)."""
    h = hashlib.sha256()
    if tasks == "tool_lookup":
        from fleetrl.actors.model.byte_tokenizer import build_byte_tokenizer
        from fleetrl.actors.recipe.tool_warmup import encode_tool_example

        tok = build_byte_tokenizer()
        for tool_split in TOOL_SPLITS:
            for task in generate_tool_tasks(_PROBE_TASKS, split=tool_split, seed=0):
                example = encode_tool_example(task, tok)
                record = [msgspec.to_builtins(task), reference_messages(task), example.ids, example.targets]
                h.update(json.dumps(record, sort_keys=True, default=str).encode())
        return "sha256:" + h.hexdigest()
    for split in SPLITS:
        for task in generate_tasks(_PROBE_TASKS, split=split, seed=0):
            record = [task.id, task.prompt, reference_solution(task), sorted(task.metadata.items()),
                      sorted(task.setup.files.items()), task.evaluator.command]
            h.update(json.dumps(record, sort_keys=True, default=str).encode())
    return "sha256:" + h.hexdigest()


def recipe_key(recipe: WarmRecipe, *, task_family: str | None = None) -> str:
    """The cache key of a recipe (24 hex digits): recipe, task family, cache format."""
    family = task_family if task_family is not None else task_family_digest(recipe.tasks)
    fields = msgspec.to_builtins(recipe)
    if recipe.tasks == "synthetic":  # keys of recipes made before these fields existed stay valid
        del fields["tasks"], fields["plain_steps"], fields["stop_after"], fields["lookup_share"]
    payload = msgspec.json.encode({"format": CACHE_FORMAT, "recipe": fields, "task_family": family})
    return hashlib.sha256(payload).hexdigest()[:24]


def weights_digest(model_dir: str | os.PathLike[str]) -> str:
    """sha256 over the saved tensors (name, dtype, shape, bytes) in name order."""
    h = hashlib.sha256()
    for name, tensor in sorted(read_state_dict(model_dir).items()):
        t = tensor.contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def check_warm_dir(directory: str | os.PathLike[str], key: str) -> str | None:
    """Why `directory` is not a whole warm model of cache key `key`, or None if it is."""
    path = Path(directory)
    if not path.is_dir():
        return f"{path}: not a directory"
    try:
        manifest = msgspec.json.decode((path / MANIFEST).read_bytes(), type=WarmManifest)
    except FileNotFoundError:
        return f"{path}: no {MANIFEST} (partial or foreign directory)"
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        return f"{path}/{MANIFEST}: unreadable: {exc}"
    if manifest.format != CACHE_FORMAT:
        return f"{path}/{MANIFEST}: format {manifest.format}, expected {CACHE_FORMAT}"
    if manifest.key != key:
        return f"{path}/{MANIFEST}: key {manifest.key}, expected {key}"
    missing = [name for name in _REQUIRED if name not in manifest.files]
    if missing or not any(name.endswith(".safetensors") for name in manifest.files):
        return f"{path}/{MANIFEST}: does not list {', '.join(missing) or 'a *.safetensors file'}"
    for name, digest in sorted(manifest.files.items()):
        file = path / name
        if Path(name).name != name or not file.is_file():
            return f"{path}: {name} is missing"
        if _file_digest(file) != digest:
            return f"{path}: {name} does not match its digest (corrupted or modified)"
    return None


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """Run with `threads` intra-op threads (None: unchanged), restoring the setting."""
    if threads is None:
        yield
        return
    if threads < 1:
        raise ValueError(f"threads must be >= 1 or None, got {threads!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fsync_tree(directory: Path) -> None:
    for file in directory.iterdir():
        if file.is_file():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _build(final: Path, key: str, family: str, recipe: WarmRecipe, log: Callable[[str], None],
           on_step: Callable[[int, int, float], None] | None = None) -> None:
    """Train the warm model and move it into `final` atomically (caller holds the lock)."""
    parent = final.parent
    for stale in parent.glob(f".{final.name}.*"):  # work dirs left by a build that crashed
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=parent))
    try:
        model = build_tiny_llama(recipe.model, seed=recipe.init_seed)
        steps = recipe.warmup.steps if recipe.stop_after is None else recipe.stop_after

        def progress(step: int, loss: float) -> None:
            if on_step is not None:
                on_step(step + 1, steps, loss)
            if step == 0 or (step + 1) % 25 == 0 or step + 1 == steps:
                log(f"warm-up step {step + 1}/{steps}: completion loss {loss:.3f}")

        batches = None
        if recipe.tasks == "tool_lookup":
            from fleetrl.actors.model.byte_tokenizer import build_byte_tokenizer
            from fleetrl.actors.recipe.tool_warmup import tool_training_batches

            batches = tool_training_batches(recipe.warmup, build_byte_tokenizer(), plain_steps=recipe.plain_steps,
                                            lookup_share=recipe.lookup_share)
        result = run_warmup(model, recipe.warmup, on_step=progress, batches=batches, stop_after=recipe.stop_after)
        staging = save_tiny_llama(model, work / "model")
        files = {
            file.name: _file_digest(file) for file in sorted(staging.iterdir()) if file.is_file()
        }
        manifest = WarmManifest(
            format=CACHE_FORMAT,
            key=key,
            recipe=recipe,
            task_family=family,
            files=files,
            weights=weights_digest(staging),
            losses=result.losses,
            prompt_losses=result.prompt_losses,
            warmup_seconds=result.seconds,
            created_at=time.time(),
        )
        (staging / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")
        _fsync_tree(staging)
        if final.exists() or final.is_symlink():
            os.replace(final, work / "old")
        os.replace(staging, final)
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        log(f"warm model saved to {final} ({result.seconds:.1f} s of warm-up)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure_warm_model(
    cache_dir: str | os.PathLike[str],
    recipe: WarmRecipe = DEFAULT_RECIPE,
    *,
    log: Callable[[str], None] | None = None,
    threads: int | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
) -> Path:
    """The directory of the warm model of `recipe` under `cache_dir`, built if absent.

    Reuses `cache_dir/warm-<key>` when `check_warm_dir` accepts it; otherwise trains
    the model and writes it there atomically (replacing an invalid directory).
    `log` receives progress lines (default: none); `on_step(done, steps, loss)` is called
    after every warm-up step of a build (a progress bar). `threads` sets torch's intra-op
    threads for the build (None: as configured); on a CPU shared with samplers and
    sandboxes, 1 thread is often faster than oversubscribing the cores. The thread
    count is not part of the cache key: it can change the last bits of the weights,
    not the recipe.
    """
    if threads is not None and (isinstance(threads, bool) or threads < 1):
        raise ValueError(f"threads must be >= 1 or None, got {threads!r}")
    say = log if log is not None else (lambda _line: None)
    root = Path(cache_dir).absolute()
    root.mkdir(parents=True, exist_ok=True)
    family = task_family_digest(recipe.tasks)
    key = recipe_key(recipe, task_family=family)
    final = root / f"warm-{key}"
    with _locked(root / f".warm-{key}.lock"):
        why = check_warm_dir(final, key)
        if why is None:
            say(f"warm model found in cache: {final}")
            return final
        if final.exists():
            say(f"rebuilding the warm model: {why}")
        else:
            say(f"building the warm model (cache key {key})")
        with _torch_threads(threads):
            _build(final, key, family, recipe, say, on_step)
        why = check_warm_dir(final, key)
        if why is not None:  # pragma: no cover - would be a bug in _build
            raise RuntimeError(f"the freshly built warm model does not pass its check: {why}")
    return final
