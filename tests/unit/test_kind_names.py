"""No code outside a kind's package branches on that kind's name (issue 26, "Kinds as whole plug-ins"):
what a kind does differently is a `Kind` attribute (runtime/kinds.py) declared in its own package and
read through the KindRegistry. This test reads src/inferd outside the built-in kinds' own packages (and
their registration tables) for comparisons of a kind with a
built-in kind's name (`rt.kind == "llm"`, `kind in ("batch", "llm")`, `raw.get("kind") == "search"`),
registry look-ups by a built-in name (`names("search")`) and sets of kind names (`LLM_KINDS = {"llm"}`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "inferd"
BUILTIN = frozenset({"batch", "llm", "upstream", "search"})

OWN = {
    # Each built-in kind's own package may name its own kind (what it says about itself), never another.
    "kinds/batch/": frozenset({"batch"}),
    "kinds/llm/": frozenset({"llm"}),
    "kinds/upstream/": frozenset({"upstream"}),
    "kinds/search/": frozenset({"search"}),
    # Registration tables: they name the built-in kinds to register them, as a kind's package would
    # register itself. builtin.py builds the built-in `Kind`s by name; worker_sides.py's WORKER_SIDES is
    # keyed by the kind ("search") whose workers serve a shard replica instead of a model.
    "kinds/builtin.py": BUILTIN,
    "kinds/worker_sides.py": BUILTIN,
}

ALLOWED = {
    # ModelConfig's own validator (a foundation layer, below the kinds): tensors and batching knobs are
    # refused on other kinds when the config is parsed (load_model_folder, a model.toml, a reload's
    # candidate, the fuzzed parser), before any KindRegistry exists; moving the check to
    # KindRegistry.check would refuse such a config later, and on fewer paths. `unread_fields` says the
    # same to the runner's config log.
    "config/__init__.py": "batch-only fields are refused when a ModelConfig is parsed, below runtime/",
    # The repository's table of built-in models: `builtin = "search"` (or a model.toml with kind = "search"
    # and no code) names the built-in search-index config, as `builtin = "sim"` names the sim model's;
    # "search" is there a built-in model's name that happens to be its kind's. Not yet moved into the
    # kinds' packages (each kind bringing its built-in models).
    "kinds/repository.py": "the built-in models' table: builtin / kind \"search\" names search's config",
}


def _names(node: ast.AST, own: frozenset[str] = frozenset()) -> set[str]:
    """The built-in kind names among a node's string constants (a name, a tuple or set of them), less
    `own` (the names the file may use)."""
    return {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in BUILTIN - own
    }


def _is_kind(node: ast.AST) -> bool:
    """`x.kind`, `kind`, `x["kind"]` or `x.get("kind", ...)`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "kind"
    if isinstance(node, ast.Name):
        return node.id == "kind"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "kind"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "kind"
    return False


def sites(tree: ast.AST, own: frozenset[str] = frozenset()) -> list[int]:
    """Lines that branch on a built-in kind's name (other than those in `own`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_kind(s) for s in sides) and any(_names(s, own) for s in sides if not _is_kind(s)):
                found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "names" and any(_names(a, own) for a in node.args):
                found.append(node.lineno)
        elif isinstance(node, ast.Assign):
            named = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if any("KIND" in n for n in named) and _names(node.value, own):
                found.append(node.lineno)
    return sorted(found)


def test_no_code_outside_the_kinds_branches_on_a_built_in_kinds_name() -> None:
    found: dict[str, list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        own = next((names for prefix, names in OWN.items() if rel.startswith(prefix)), frozenset())
        lines = sites(ast.parse(path.read_text(), str(path)), own)
        if lines:
            found[rel] = lines
    unexpected = {rel: lines for rel, lines in found.items() if rel not in ALLOWED}
    assert not unexpected, (
        f"these branch on a built-in kind's name: {unexpected}; give Kind (runtime/kinds.py) an "
        "attribute the kind declares in its package, and ask the KindRegistry instead"
    )
    gone = sorted(set(ALLOWED) - set(found))
    assert not gone, f"{gone} no longer branch on a kind's name: remove them from ALLOWED"


def test_the_check_finds_the_comparisons_it_is_about() -> None:
    source = 'a = rt.kind == "llm"\nb = kind in ("batch", "x")\nc = raw.get("kind") != "search"\n'
    source += 'd = registry.names("search")\nLLM_KINDS = frozenset({"llm"})\ne = rt.kind == other.kind\n'
    assert sites(ast.parse(source)) == [1, 2, 3, 4, 5]
