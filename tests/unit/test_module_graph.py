"""The shape of src/inferd: no import cycles (type-only and function-local imports included), no module
over 400 lines, and layers: no two top-level packages or modules (server.py, config/, kinds/, ...) import
each other, directly or through a longer circle. A cycle means two modules know each other's internals; a
circle of folders means the layers in docs/architecture.md ("Layers") are not layers. Split, move or
invert instead."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "inferd"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of src/inferd but generated protobuf code (*_pb2.py, *_pb2_grpc.py): not ours to size
    or layer."""
    paths = sorted(PACKAGE.rglob("*.py"))
    return {module_name(p): p for p in paths if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Every inferd module `path` imports, wherever the import statement is (top level, a function, an
    `if TYPE_CHECKING:` block). `from pkg import sub` counts as importing the submodule when it is one."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, name, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def top_level(name: str) -> str:
    """inferd.kinds.llm.engine -> inferd.kinds; inferd.server -> inferd.server (a top-level module counts
    like a folder)."""
    return ".".join(name.split(".")[:2])


def folder_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], set[tuple[str, str]]]:
    """(importing folder, imported folder) -> the module imports behind it. The package's own
    __init__ (inferd) is left out: it only re-exports the user model API."""
    edges: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for module, imported in graph.items():
        for target in imported:
            a, b = top_level(module), top_level(target)
            if a != b and PACKAGE.name not in (a, b):
                edges.setdefault((a, b), set()).add((module, target))
    return edges


def folder_circles(edges: dict[tuple[str, str], set[tuple[str, str]]]) -> list[str]:
    """One line per folder edge inside a circle of folders (two that import each other, or a longer
    circle), with the module imports behind it."""
    fgraph: dict[str, set[str]] = {}
    for a, b in edges:
        fgraph.setdefault(a, set()).add(b)
        fgraph.setdefault(b, set())
    lines = []
    for circle in cycles(fgraph):
        members = set(circle)
        pairs = sorted({tuple(sorted((a, b))) for a, b in edges if (b, a) in edges and a in members})
        named = ", ".join(f"{a} <-> {b}" for a, b in pairs) or "none (a longer circle)"
        lines.append(f"folders in a circle: {', '.join(circle)}; pairs that import each other: {named}")
        for (a, b), behind in sorted(edges.items()):
            if a in members and b in members:
                lines.append(f"  {a} -> {b}: " + ", ".join(f"{m} -> {t}" for m, t in sorted(behind)))
    return lines


def test_the_checker_finds_a_cycle_and_sees_type_only_and_local_imports(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    mod = tmp_path / "m.py"
    mod.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from inferd.x import Y\n"
        "def f():\n    import inferd.z\n    from inferd import w\n"
    )
    assert imports_of(mod, "inferd.m", {"inferd.x", "inferd.z", "inferd.w", "inferd"}) == {
        "inferd.x",
        "inferd.z",
        "inferd.w",
    }


def test_src_has_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (invert the dependency or split the module): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_no_module_is_over_400_lines() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by concern): {over}"


def test_the_checker_finds_folders_in_a_circle_and_names_the_imports_behind_it() -> None:
    graph = {
        "inferd.a.x": {"inferd.b.y"},
        "inferd.b.y": {"inferd.c"},
        "inferd.c": {"inferd.a.z"},  # a -> b -> c -> a: a circle with no pair in it
        "inferd.a.z": set(),
        "inferd.d.p": {"inferd.e.q", "inferd.a.x"},
        "inferd.e.q": {"inferd.d.r"},  # d <-> e: a pair
        "inferd.d.r": set(),
    }
    lines = folder_circles(folder_edges(graph))
    assert lines == [
        "folders in a circle: inferd.a, inferd.b, inferd.c; pairs that import each other: none (a longer circle)",
        "  inferd.a -> inferd.b: inferd.a.x -> inferd.b.y",
        "  inferd.b -> inferd.c: inferd.b.y -> inferd.c",
        "  inferd.c -> inferd.a: inferd.c -> inferd.a.z",
        "folders in a circle: inferd.d, inferd.e; pairs that import each other: inferd.d <-> inferd.e",
        "  inferd.d -> inferd.e: inferd.d.p -> inferd.e.q",
        "  inferd.e -> inferd.d: inferd.e.q -> inferd.d.r",
    ]
    assert folder_circles(folder_edges({"inferd.a.x": {"inferd.b.y"}, "inferd.b.y": set()})) == []


def test_no_two_top_level_packages_import_each_other() -> None:
    found = folder_circles(folder_edges(import_graph()))
    assert not found, (
        "top-level packages of src/inferd in a circle (a module imports only from its own layer's package "
        "or below: docs/architecture.md, Layers):\n" + "\n".join(found)
    )
