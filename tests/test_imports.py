"""Layering: every module of mini_grpo imports alone in a fresh interpreter, and the import
graph (imports inside functions and type-checking ones included) has no cycle."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mini_grpo"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
        or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, top_level_only: bool = False,
            type_checking: bool = False) -> set[str]:
    """Modules `name` imports: the absolute names, `from X import submodule` as the submodule;
    `if TYPE_CHECKING:` blocks in only with `type_checking`, function bodies in unless
    top_level_only."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                for stmt in child.body if type_checking else child.orelse:
                    visit_stmt(stmt)
            elif not (top_level_only and isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
                visit_stmt(child)

    def visit_stmt(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                up = package.rsplit(".", node.level - 1)[0]
                base = f"{up}.{base}" if base else up
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
        visit(node)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    return {name: {m for m in imports(name, path, type_checking=type_checking)
                   if m in MODULES and m != name}
            for name, path in MODULES.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:  # shortest way from the component's first module back to it
        members, start = set(component), min(component)
        paths, seen = {start: [start]}, {start}
        frontier = [start]
        while frontier and start not in {w for v in frontier for w in graph[v]}:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members - seen):
                    seen.add(w)
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        cycles.append(paths[last] + [start])
    return cycles


def test_imports_inside_functions_count_and_type_checking_ones_do_not(tmp_path):
    path = tmp_path / "mini_grpo" / "tasks" / "x.py"
    path.parent.mkdir(parents=True)
    path.write_text("from typing import TYPE_CHECKING\n"
                    "from . import jsonl\n"
                    "from ..fields import ConfigError\n"
                    "if TYPE_CHECKING:\n"
                    "    from mini_grpo.config import GRPOConfig\n"
                    "def f():\n"
                    "    import mini_grpo.run\n")
    found = imports("mini_grpo.tasks.x", path)
    assert found == {"typing", "mini_grpo.tasks.jsonl", "mini_grpo.fields", "mini_grpo.run"}
    assert imports("mini_grpo.tasks.x", path, top_level_only=True) == found - {"mini_grpo.run"}
    assert imports("mini_grpo.tasks.x", path, type_checking=True) == found | {
        "mini_grpo.config"}


def test_find_cycles_reports_each_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("type_checking", [False, True], ids=["run", "type-checking"])
def test_import_graph_has_no_cycle(type_checking):
    """Not at run time, nor for a reader or a type checker: an import made only for a type
    hint is still a dependency (engines once imported Run back for their hints)."""
    cycles = find_cycles(import_graph(type_checking))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# Preloads the third-party modules mini_grpo imports at module level (torch: ~1 s), then
# forks one child per module, two at a time: each child starts with no mini_grpo module
# loaded, so a cycle that breaks only for a particular first import shows there.
_FORK_EACH = """
import importlib, os, sys, traceback
names, preload = sys.argv[1].split(","), sys.argv[2].split(",")
for m in preload:
    try:
        importlib.import_module(m)
    except Exception:
        pass
assert not [m for m in sys.modules if m.split(".")[0] == "mini_grpo"]
running, failed = {}, 0
for name in names + [None]:
    while running and (name is None or len(running) >= 2):
        pid, status = os.wait()
        if status:
            failed += 1
            print(f"FAILED {running[pid]}", flush=True)
        del running[pid]
    if name is None:
        break
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            print(f"{name}: {traceback.format_exc().strip().splitlines()[-1]}", flush=True)
            os._exit(1)
        os._exit(0)
    running[pid] = name
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone_in_a_fresh_interpreter():
    third_party = sorted({m for name, path in MODULES.items()
                          for m in imports(name, path, top_level_only=True)
                          if m.split(".")[0] != "mini_grpo"})
    r = subprocess.run([sys.executable, "-c", _FORK_EACH, ",".join(MODULES),
                        ",".join(third_party)], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
