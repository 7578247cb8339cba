"""The esopt_mp package's import graph, read from the source with ``ast`` (nothing is imported).

Every import counts: module level and inside functions (a lazy import is still a dependency); only
``if TYPE_CHECKING:`` blocks are skipped. A package's ``__init__.py`` is a node of its own:
``from esopt_mp.es import X`` is an edge to ``esopt_mp.es`` (the ``__init__``), unless ``X`` is a submodule of
``esopt_mp.es``, which makes it an edge to that submodule.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PKG = "esopt_mp"
ROOT = Path(__file__).resolve().parents[2] / PKG


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes anywhere in the tree, except under ``if TYPE_CHECKING:`` (its ``else`` branch counts)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies in (``esopt_mp.es.noise.X`` -> ``esopt_mp.es.noise``)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


def _lazy_exports(tree: ast.Module, mod: str) -> list[str]:
    """A package ``__init__``'s PEP 562 table ``_EXPORTS = {"name": "submodule", ...}``: each value is an import
    of ``mod.submodule`` made on first attribute access (invisible as an import statement, a dependency all the
    same)."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            return [f"{mod}.{v.value}" for v in node.value.values
                    if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return []


def _string_tables(tree: ast.Module) -> list[str]:
    """Modules named by the string values of a module-level dict (a lazy registry: ``{"sudoku":
    "esopt_mp.envs.sudoku:SPEC"}``, imported with ``importlib`` when the key is asked for: a dependency all the
    same). A lone string constant (an entry-point group's name, say) is not a table and does not count."""
    out = []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Dict):
            out += [v.value.partition(":")[0] for v in value.values
                    if isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.startswith(PKG + ".")]
    return out


def _import_module_calls(tree: ast.AST) -> list[str]:
    """Modules named by a constant string given to ``importlib.import_module`` anywhere (a lazy import by name)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and node.args[0].value.startswith(PKG + "."):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
                    (isinstance(f, ast.Name) and f.id == "import_module"):
                out.append(node.args[0].value)
    return out


@functools.lru_cache(maxsize=None)
def import_graph(root: Path = ROOT) -> dict[str, frozenset[str]]:
    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        if is_pkg:
            graph[mod].update(m for m in _lazy_exports(tree, mod) if m in modules)
        graph[mod].update(m for m in _string_tables(tree) if m in modules)
        graph[mod].update(m for m in _import_module_calls(tree) if m in modules)
        for node in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name == PKG or a.name.startswith(PKG + ".")]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                if src != PKG and not src.startswith(PKG + "."):
                    continue
                for alias in node.names:
                    sub = f"{src}.{alias.name}"
                    targets.append(sub if sub in modules else src)
            for t in targets:
                dst = _resolve(t, modules)
                if dst is not None:
                    graph[mod].add(dst)
    return {m: frozenset(d) for m, d in graph.items()}


def strongly_connected(graph) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in no particular order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(sorted(comp))
    return comps


def _cycle_in(comp: list[str], graph) -> list[str]:
    """One cycle through the component's first module (for the failure message)."""
    members = set(comp)
    start = comp[0]
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def test_graph_sees_known_edges():
    """The reader resolves absolute, relative, package and submodule imports (a broken reader finds no cycle)."""
    g = import_graph()
    assert "esopt_mp.es.philox" in g["esopt_mp.es.noise"]  # module level, absolute
    assert "esopt_mp.es.triton_noise" in g["esopt_mp.es.noise"]  # inside a function: from esopt_mp.es import <module>
    assert "esopt_mp.parallel.dims" in g["esopt_mp.models.loading"]
    assert sum(len(v) for v in g.values()) > 200


def test_reader_resolves_each_import_form(tmp_path):
    pkg = tmp_path / PKG
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from .x import f\n")
    (pkg / "a" / "x.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from esopt_mp import b\n"
                                    "def f():\n    from esopt_mp.a import y\n")
    (pkg / "a" / "y.py").write_text("from .. import b\nfrom esopt_mp.a import f\n")
    (pkg / "b.py").write_text("import esopt_mp.a.x\n")
    (pkg / "c").mkdir()
    (pkg / "c" / "__init__.py").write_text('_EXPORTS = {"g": "z"}\n')
    (pkg / "c" / "z.py").write_text("import os\nimport esopt_mp\n")
    g = import_graph(pkg)
    assert g["esopt_mp.a"] == {"esopt_mp.a.x"}
    assert g["esopt_mp.a.x"] == {"esopt_mp.a.y"}
    assert g["esopt_mp.a.y"] == {"esopt_mp.b", "esopt_mp.a"}
    assert g["esopt_mp.b"] == {"esopt_mp.a.x"}
    assert g["esopt_mp.c"] == {"esopt_mp.c.z"} and g["esopt_mp.c.z"] == {"esopt_mp"}
    assert sorted(map(sorted, (c for c in strongly_connected(g) if len(c) > 1))) == [
        ["esopt_mp.a", "esopt_mp.a.x", "esopt_mp.a.y", "esopt_mp.b"]]


def test_no_import_cycles():
    g = import_graph()
    self_loops = sorted(m for m, deps in g.items() if m in deps)
    cycles = [c for c in strongly_connected(g) if len(c) > 1]
    lines = [" -> ".join(_cycle_in(c, g)) + (f"  (component of {len(c)}: {', '.join(c)})" if len(c) > 2 else "")
             for c in sorted(cycles)]
    assert not self_loops, f"modules that import themselves: {self_loops}"
    assert not cycles, "import cycles in esopt_mp:\n" + "\n".join(lines)


def _edges_into(prefix_from: str, forbidden: tuple[str, ...]) -> list[str]:
    g = import_graph()
    return sorted(f"{m} -> {d}" for m, deps in g.items() if m == prefix_from or m.startswith(prefix_from + ".")
                  for d in deps if any(d == f or d.startswith(f + ".") for f in forbidden))


def test_models_import_neither_agent_nor_envs():
    bad = _edges_into("esopt_mp.models", ("esopt_mp.agent", "esopt_mp.envs"))
    assert not bad, "esopt_mp.models must not depend on agent/ or envs/:\n" + "\n".join(bad)


def test_envs_import_no_layer_above():
    above = tuple(f"esopt_mp.{p}" for p in ("agent", "models", "engine", "parallel", "trainer", "config"))
    bad = _edges_into("esopt_mp.envs", above)
    assert not bad, "esopt_mp.envs must not depend on the layers above it:\n" + "\n".join(bad)


# The package layers, bottom to top, read from the one table that states them (docs/design.md, "Dependency
# rules"). A package may import its own layer and the layers below it, never one above, and the package graph has
# no cycle. A new package or top-level module must be placed there.
DESIGN = ROOT.parent / "docs" / "design.md"


def read_layers(text: str) -> tuple[tuple[str, ...], ...]:
    """The rows of the ``| layer | packages and top-level modules |`` table, in order: the backquoted names of each
    (``the package root`` is the root module)."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| layer | packages"))
    layers = []
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        cell = line.split("|")[2]
        names = [n for n in cell.split("`")[1::2]] + ([PKG] if "the package root" in cell else [])
        layers.append(tuple(names))
    return tuple(layers)


LAYERS = read_layers(DESIGN.read_text())


def package_of(module: str) -> str:
    """The layer node of a module: its subpackage or top-level module under esopt_mp (the root is its own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        a = package_of(mod)
        out.setdefault(a, set())
        for d in deps:
            b = package_of(d)
            out.setdefault(b, set())
            if a != b:
                out[a].add(b)
    return out


def layer_violations(graph, layers=LAYERS) -> set[str]:
    """Every unplaced package, upward import (``a -> b``) and package cycle (``cycle: a, b``) of ``graph``."""
    rank = {name: i for i, names in enumerate(layers) for name in names}
    pkgs = package_graph(graph)
    out = {f"unplaced: {p}" for p in pkgs if p not in rank}
    out |= {f"{a} -> {b}" for a, deps in pkgs.items() for b in deps if a in rank and b in rank and rank[b] > rank[a]}
    out |= {"cycle: " + ", ".join(sorted(c)) for c in strongly_connected(pkgs) if len(c) > 1}
    return out


def test_layer_rule_catches_a_planted_upward_import_a_cycle_and_an_unplaced_package(tmp_path):
    pkg = tmp_path / PKG
    for sub in ("es", "envs", "agent"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "agent" / "loop.py").write_text("from esopt_mp.envs import base\nfrom esopt_mp.es import noise\n")
    (pkg / "envs" / "base.py").write_text("import esopt_mp.es.noise\n")
    (pkg / "es" / "noise.py").write_text("import os\n")
    assert layer_violations(import_graph.__wrapped__(pkg)) == set()  # uncached: the tree changes below
    (pkg / "es" / "noise.py").write_text("def f():\n    from esopt_mp.agent import loop\n")  # lazy counts too
    (pkg / "wild.py").write_text("")
    assert layer_violations(import_graph.__wrapped__(pkg)) == {"es -> agent", "cycle: agent, envs, es", "unplaced: wild"}
    (pkg / "es" / "noise.py").write_text("import importlib\n\ndef f():\n    return importlib.import_module("
                                          "'esopt_mp.envs.base')\n")  # an import by name counts too
    (pkg / "wild.py").unlink()
    assert layer_violations(import_graph.__wrapped__(pkg)) == {"es -> envs", "cycle: envs, es"}


def test_packages_keep_their_layers():
    found = sorted(layer_violations(import_graph()))
    assert not found, ("imports against the package layers (a package imports only its own layer and those below; "
                       "no package cycle; a new package is placed in docs/design.md's layer table):\n" + "\n".join(found))


MAX_LINES = 400  # a file a newcomer reads in one sitting; a longer one is split by concern


def test_no_python_file_is_longer_than_a_sitting():
    top = ROOT.parent
    long = sorted(f"{p.relative_to(top)}: {n} lines" for folder in (PKG, "tools", "launch", "tests")
                  for p in (top / folder).rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert not long, f"files over {MAX_LINES} lines (split them by concern):\n" + "\n".join(long)
