"""The architecture as a rule: every import points down a floor.

Floors (docs/design.md, "Layout"), lowest first:

    0  tandem          ground floor: config, server start-up, tensors, host facts,
                       the scheduler client, the generated contract (tandem.v1)
    1  scheduler, reward_service, search_service
                       the three servers; none imports another
    2  training        offline training and model tools
    3  stack           the command line, supervisor, co-located mode, doctor, play
    4  loadtest        load, soak and frame-scheduling tests
    5  bench           benchmarks (they drive the load tests too)

Every import counts, also one deferred into a function body: a deferred
import may save start-up time, never hide a cycle. Modules of one room may
import each other, but not in a circle. ``python tests/test_layers.py``
prints the rooms' import graph (Mermaid) for docs/design.md.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLOORS = {
    "tandem": 0,
    "scheduler": 1, "reward_service": 1, "search_service": 1,
    "training": 2,
    "stack": 3,
    "loadtest": 4,
    "bench": 5,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "protos":  # protos/tandem/v1/x.py is imported as tandem.v1.x
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    out = {}
    for room in FLOORS:
        for path in sorted((REPO / room).rglob("*.py")):
            out[_module_name(path)] = path
    for path in sorted((REPO / "protos" / "tandem").rglob("*.py")):
        out[_module_name(path)] = path
    return out


def _imports(path: Path, module: str, is_package: bool) -> set[str]:
    """Absolute names of the project's modules that ``path`` imports, anywhere in the file."""
    tree = ast.parse(path.read_text(), str(path))
    base = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.add(stem)
            found.update(f"{stem}.{a.name}" for a in node.names)
    return {name for name in found if name.split(".")[0] in FLOORS}


def module_graph() -> dict[str, set[str]]:
    """{module: project modules it imports (only those that exist as modules)}."""
    sources = _sources()
    graph = {}
    for module, path in sources.items():
        names = _imports(path, module, path.name == "__init__.py")
        graph[module] = {n for n in names if n in sources and n != module}
    return graph


def _room(module: str) -> str:
    return module.split(".")[0]


def room_graph(graph: dict[str, set[str]]) -> dict[tuple[str, str], int]:
    """{(from room, to room): number of distinct imported modules}, across rooms only."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for module, targets in graph.items():
        for t in targets:
            if _room(t) != _room(module):
                edges[(_room(module), _room(t))].add(t)
    return {k: len(v) for k, v in edges.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, 1972)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges to a package (``from pkg import mod``) point at the module instead;
    a package's ``__init__`` importing its own children is not a cycle."""
    packages = {m for m in graph if (REPO / m.replace(".", "/") / "__init__.py").exists()}
    return {m: {t for t in ts if t not in packages or not m.startswith(t + ".")} for m, ts in graph.items()}


def test_every_import_points_down():
    upward = []
    for module, targets in module_graph().items():
        for t in targets:
            a, b = _room(module), _room(t)
            if a != b and FLOORS[b] >= FLOORS[a]:
                upward.append(f"{module} -> {t} (floor {FLOORS[a]} -> {FLOORS[b]})")
    assert not upward, "imports that do not point down:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    cycles = _cycles(_without_package_inits(module_graph()))
    assert not cycles, f"import cycles: {cycles}"


def test_every_room_has_a_floor():
    rooms = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()}
    assert rooms - {"tests"} <= set(FLOORS), f"top-level packages without a floor: {rooms - set(FLOORS)}"


def test_the_checker_sees_a_deferred_upward_import(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from stack import cli\n    from . import sibling\n")
    assert _imports(src, "tandem.x", False) == {"stack", "stack.cli", "tandem", "tandem.sibling"}


def mermaid() -> str:
    lines = ["flowchart TD"]
    for (a, b), n in sorted(room_graph(module_graph()).items(), key=lambda e: (FLOORS[e[0][0]], e[0])):
        lines.append(f"    {a} -->|{n}| {b}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(mermaid())
