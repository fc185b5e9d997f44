"""The import rules of the layout (docs/reference/layout.md), read from the code's own imports.

daemon/, grpo/ and sandboxes/ import nothing else of fleetrl; harness/ imports only
daemon/ and sandboxes/; actors/ may import all four. No module imports itself back
through others (no cycles), counting imports placed inside functions, which is how a
cycle used to be hidden. The checker runs on the real tree, and on small made-up trees
that show it fails on a forbidden import and on a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "actors", "harness", "sandboxes", "grpo", "simulate")
ALLOWED: Mapping[str, frozenset[str]] = {
    "daemon": frozenset(),
    "grpo": frozenset(),
    "sandboxes": frozenset(),
    "harness": frozenset({"daemon", "sandboxes"}),
    "actors": frozenset({"daemon", "grpo", "sandboxes", "harness"}),
    "simulate": frozenset({"actors"}),
}


def modules_of(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """``fleetrl.<folder>.<...>`` module name -> file, for every .py under the folders."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(["fleetrl", *parts])] = path
    return out


def imports_of(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """Every fleetrl module `name` imports, at any depth (inside functions too)."""
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known and target.startswith("fleetrl."):
                target = target.rpartition(".")[0]  # `import fleetrl.a.b.c` names module fleetrl.a.b
            if target in known and target != name:
                found.add(target)
    return found


def top(module: str) -> str:
    return module.split(".")[1]


def problems(root: Path, packages: Iterable[str] = PACKAGES,
             allowed: Mapping[str, frozenset[str]] = ALLOWED) -> list[str]:
    """Every breach of the rules in the tree at `root`, in words (empty: none)."""
    known = modules_of(root, packages)
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    out = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if top(target) != top(name) and top(target) not in allowed[top(name)]:
                out.append(f"{name} imports {target}: {top(name)}/ may not import {top(target)}/")
    for cycle in cycles(graph):
        out.append("import cycle: " + " -> ".join([*cycle, cycle[0]]))
    return out


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each in a
    readable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_real_tree_keeps_the_rules():
    assert problems(REPO) == []


def _tree(tmp_path: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


def test_a_forbidden_import_is_reported_naming_both_modules(tmp_path):
    root = _tree(tmp_path, {
        "daemon/supervisor.py": "from fleetrl.actors.pool import core\n",
        "actors/pool/__init__.py": "",
        "actors/pool/core.py": "from fleetrl.daemon import supervisor\n",
        "harness/endpoint.py": "def f():\n    import fleetrl.grpo.loss\n",
        "grpo/loss.py": "import torch\n",
    })
    found = problems(root)
    assert "fleetrl.daemon.supervisor imports fleetrl.actors.pool.core: daemon/ may not import actors/" in found
    assert "fleetrl.harness.endpoint imports fleetrl.grpo.loss: harness/ may not import grpo/" in found
    assert not any("fleetrl.actors.pool.core imports" in p for p in found)  # actors may import daemon
    assert "import cycle: fleetrl.actors.pool.core -> fleetrl.daemon.supervisor -> fleetrl.actors.pool.core" in found


def test_a_cycle_hidden_inside_a_function_is_reported(tmp_path):
    root = _tree(tmp_path, {
        "actors/pool/__init__.py": "",
        "actors/pool/pool.py": "from .local import x\n\ndef run():\n    from .remote_server import app\n",
        "actors/pool/local.py": "x = 1\n",
        "actors/pool/remote_server.py": "from .pool import y\n",
    })
    assert problems(root) == [
        "import cycle: fleetrl.actors.pool.pool -> fleetrl.actors.pool.remote_server -> fleetrl.actors.pool.pool"]


@pytest.mark.parametrize("text, target", [
    ("from fleetrl.actors import pool\n", "fleetrl.actors.pool"),
    ("import fleetrl.actors.pool.core as c\n", "fleetrl.actors.pool.core"),
    ("from ..pool.core import SamplerPool\n", "fleetrl.actors.pool.core"),
    ("from fleetrl.actors.pool.core import SamplerPool, nothing\n", "fleetrl.actors.pool.core"),
])
def test_imports_resolve_to_the_module_they_load(tmp_path, text, target):
    root = _tree(tmp_path, {"actors/pool/__init__.py": "", "actors/pool/core.py": "",
                            "actors/env/__init__.py": "", "actors/env/worker.py": text})
    known = modules_of(root, PACKAGES)
    assert imports_of("fleetrl.actors.env.worker", known["fleetrl.actors.env.worker"], known) == {target}
