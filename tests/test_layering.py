"""Layering of the packages, checked statically (ast; nothing is imported).

- ``gr_functional/errors.py`` is a leaf: it imports nothing from the project, so any module can
  import the error classes without creating a cycle.
- No import cycle among the module-level imports of ``gr_functional`` and ``backends`` (``if
  TYPE_CHECKING:`` blocks, which never run, are ignored).
- Counting imports inside functions too, no cycle beyond the ones listed in ``KNOWN_CYCLES`` (a
  ratchet: [onecore] removes them; a function-level import is not a way around the layers), and
  no more function-level imports of project modules than ``MAX_FUNCTION_LEVEL``.
- ``gr_functional/config.py`` (the schema) imports nothing of the project but the leaf errors.
- ``gr_functional`` imports no array library (torch, torch_npu, jax) at module level: device math
  goes through a Backend object, and ``import gr_functional`` must work without them.

An edge ``a -> b`` means module ``a`` imports module ``b`` when ``a`` is imported: ``import x.y``
and ``from x import y`` (``y`` a submodule) give ``x.y``; ``from x import name`` gives ``x``.
Parent packages' ``__init__`` are not edges of their own (Python runs them first, but a package
``__init__`` importing its submodules, which import their siblings, is the normal layout).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gr_functional", "backends")
ARRAY_LIBRARIES = ("torch", "torch_npu", "jax", "jaxlib")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported: the module body, class bodies,
    and ``if`` / ``try`` / ``with`` blocks among them; not function bodies, not TYPE_CHECKING."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            todo.extend(([] if _is_type_checking(node.test) else node.body) + node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            todo.extend(node.body)


def _all_imports(tree: ast.Module):
    """Every import statement, function bodies included (not TYPE_CHECKING blocks)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
            yield node


def _imports(name: str, path: Path, modules: dict[str, Path], everywhere: bool = False) -> tuple[set[str], set[str]]:
    """``(project modules, top-level names of other packages)`` imported at module level (or
    anywhere in the file, ``everywhere``)."""
    is_pkg = path.name == "__init__.py"
    project, external = set(), set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in (_all_imports(tree) if everywhere else _module_level_imports(tree)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            # ``from stem import x``: the submodule stem.x when there is one, else stem itself
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        for t in targets:
            if t.split(".")[0] in PACKAGES:
                # ``import a.b.c`` of a name that is not a module (an attribute): its longest module prefix
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    project.add(t)
            else:
                external.add(t.split(".")[0])
    return project, external


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    edges, external = {}, {}
    for name, path in modules.items():
        edges[name], external[name] = _imports(name, path, modules)
    return edges, external


def _components(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, comps = {}, {}, [], set(), []
    counter = [0]

    def visit(v):  # recursion depth is bounded by the number of modules (< 100)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return comps


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component (shortest from its first module)."""
    out = []
    for comp in _components(edges):  # one concrete cycle through the component, by breadth-first search
        members, start = set(comp), comp[0]
        prev, frontier = {start: None}, [start]
        cycle = None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for w in sorted(edges[v] & members):
                    if w == start:
                        path = [v]
                        while prev[path[-1]] is not None:
                            path.append(prev[path[-1]])
                        cycle = path[::-1] + [start]
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        out.append(cycle or comp + [comp[0]])
    return out


@pytest.fixture(scope="module")
def full_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, everywhere=True)[0] for name, path in modules.items()}


# Cycles that remain when imports inside functions count, each listed by its modules; [onecore]
# removes them (the Backend split into a runtime and an op registry).
# A new cycle fails; a listed one that is gone fails too, so the list only shrinks.
KNOWN_CYCLES = ()  # none left: [onecore] removed the last (backends <-> its kernel registries)
# Function-level imports of project modules (gr_functional, backends): only lowered.
MAX_FUNCTION_LEVEL = 49


def test_no_import_cycles_counting_function_level_imports(full_graph):
    got = {frozenset(c) for c in _components(full_graph)}
    new = [sorted(c) for c in got - set(KNOWN_CYCLES)]
    assert not new, _message({k: v for k, v in full_graph.items()}) + "\n(new since KNOWN_CYCLES)"
    gone = [sorted(c) for c in set(KNOWN_CYCLES) - got]
    assert not gone, f"cycles removed: {gone}; take them out of KNOWN_CYCLES"


def test_function_level_project_imports_only_go_down():
    modules = _modules()
    count = 0
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        level = {id(n) for n in _module_level_imports(tree)}
        for node in _all_imports(tree):
            if id(node) in level:
                continue
            target = node.module if isinstance(node, ast.ImportFrom) and node.module else ""
            if isinstance(node, ast.Import):
                target = node.names[0].name
            if getattr(node, "level", 0) or target.split(".")[0] in PACKAGES:
                count += 1
    assert count <= MAX_FUNCTION_LEVEL, (f"{count} function-level imports of project modules (at most "
                                         f"{MAX_FUNCTION_LEVEL}): import at module level, from a lower layer")


def test_the_config_schema_imports_nothing_of_the_project(graph):
    edges, _ = graph
    full = _imports("gr_functional.config", REPO / "gr_functional" / "config.py", _modules(), everywhere=True)[0]
    assert full <= {"gr_functional.errors"}, f"gr_functional/config.py imports {sorted(full)}"


def test_errors_module_is_a_leaf(graph):
    edges, _ = graph
    got = sorted(edges["gr_functional.errors"])
    assert not got, f"gr_functional/errors.py must import nothing from the project, imports {got}"


def _message(edges: dict[str, set[str]]) -> str:
    return "module-level import cycles (move one import into the function that needs it):\n" + "\n".join(
        f"{' -> '.join(cycle)}   (modules on cycles with them: {', '.join(comp)})"
        for cycle, comp in zip(_cycles(edges), _components(edges)))


def test_no_module_level_import_cycles(graph):
    edges, _ = graph
    assert not _components(edges), _message(edges)


def test_gr_functional_imports_no_array_library_at_module_level(graph):
    _, external = graph
    bad = {m: sorted(set(ext) & set(ARRAY_LIBRARIES)) for m, ext in external.items()
           if m.split(".")[0] == "gr_functional" and set(ext) & set(ARRAY_LIBRARIES)}
    assert not bad, f"gr_functional modules importing an array library at module level: {bad}"


def test_the_checker_sees_cycles_and_relative_imports(tmp_path):
    """The analysis itself: ``from . import x`` resolves to the submodule, ``from .a import f`` to
    the module, function-level and TYPE_CHECKING imports are ignored."""
    pkg = tmp_path / "gr_functional"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from .c import f\nimport typing\nif typing.TYPE_CHECKING:\n    from . import d\n")
    (pkg / "c.py").write_text("def f():\n    from . import a\n")
    (pkg / "d.py").write_text("from .a import b\n")
    mods = {"gr_functional": pkg / "__init__.py", **{f"gr_functional.{m}": pkg / f"{m}.py" for m in "abcd"}}
    edges = {n: _imports(n, p, mods)[0] for n, p in mods.items()}
    assert edges["gr_functional.a"] == {"gr_functional.b"}
    assert edges["gr_functional.b"] == {"gr_functional.c"}
    assert edges["gr_functional.c"] == set() and edges["gr_functional.d"] == {"gr_functional.a"}
    assert _cycles(edges) == []
    edges["gr_functional.b"].add("gr_functional.d")
    assert _cycles(edges) == [["gr_functional.a", "gr_functional.b", "gr_functional.d", "gr_functional.a"]]
