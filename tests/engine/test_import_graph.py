"""The package layering: no import cycles among engine/, server/, loadtests/ and metal_kernels/ modules
(imports inside functions and under `if TYPE_CHECKING:` count too: they are cycles that only hide), the
engine never imports the server, the load tests or the tools, the load tests reach the server over HTTP
only, and `import engine` leaves the process as it was."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "server", "loadtests", "metal_kernels")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(tree: ast.AST, modules: set[str]) -> set[str]:
    """The `modules` that `tree` imports, anywhere: in functions and under `if TYPE_CHECKING:` too."""
    deps: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for t in targets:
            # the longest project module the name refers to ("engine.kv.X" -> "engine.kv")
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t not in PACKAGES:  # a package's bare name: its empty __init__
                deps.add(t)
    return deps


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {name: imports_of(ast.parse(path.read_text(), str(path)), set(files)) - {name}
            for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def find_cycles(graph: dict[str, set[str]], limit: int = 20) -> list[list[str]]:
    """Cycles of `graph`, each found after cutting the last edge of the ones before (so one cycle does not
    hide the others)."""
    graph = {node: set(deps) for node, deps in graph.items()}
    cycles: list[list[str]] = []
    while len(cycles) < limit and (cycle := find_cycle(graph)):
        cycles.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])
    return cycles


def test_cycle_finder_finds_a_planted_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b", "a"], ["c", "d", "c"]]


def test_type_checking_and_lazy_imports_count() -> None:
    text = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from server.settings import X\n"
            "def f():\n    import engine.core\n")
    modules = {"server.settings", "engine.core"}
    assert imports_of(ast.parse(text), modules) == modules


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_engine_imports_no_server_loadtests_or_tools() -> None:
    bad = {(m, d) for m, deps in import_graph().items() if m.startswith("engine") for d in deps
           if d.split(".")[0] in ("server", "loadtests", "tools")}
    assert not bad, bad
    for path in (ROOT / "engine").rglob("*.py"):
        text = path.read_text()
        assert "import loadtests" not in text and "from tools" not in text, path


def test_loadtests_import_nothing_from_the_server() -> None:
    # They measure what any client sees: the server only through its HTTP API (a subprocess).
    bad = sorted((m, d) for m, deps in import_graph().items() if m.startswith("loadtests") for d in deps
                 if d.split(".")[0] == "server")
    assert not bad, bad


def test_import_engine_changes_nothing() -> None:
    # nothing loaded or compiled: no BLAS or kernel library mapped, no MLX
    probe = ("import os, sys, json; before = dict(os.environ); import engine, engine.llm, engine.sampling; "
             "maps = open('/proc/self/maps').read() if os.path.exists('/proc/self/maps') else ''; "
             "print(json.dumps({'env': dict(os.environ) == before, 'mlx': 'mlx.core' in sys.modules, "
             "'libs': any(n in maps for n in ('mkl', 'openblas', 'small_gemm', 'cpu_attention'))}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == {"env": True, "mlx": False, "libs": False}
