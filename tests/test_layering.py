"""Layering of the packages, checked statically (ast; nothing is imported).

The graph holds every package of the project (``PACKAGES``): leaf utilities (errors, tree,
jagged, flops, time_buckets) -> config -> registries -> ops & array runtime (backends; npu_ops,
the fast kernels and vendor adapters, beside and below backends' op layer) -> model / losses /
optimizers -> step -> tasks -> run loop -> CLI -> experiments, benchmarks (which may import
everything).

- ``gr_functional/errors.py`` is a leaf: it imports nothing from the project, so any module can
  import the error classes without creating a cycle.
- No import cycle among the module-level imports (``if TYPE_CHECKING:`` blocks, which never run,
  are ignored).
- Counting imports inside functions and ``importlib.import_module`` calls too (``LOADS_UP``
  aside), no cycle beyond the ones listed in ``KNOWN_CYCLES`` (a ratchet; a function-level
  import is not a way around the layers), and no more function-level imports of project modules
  in the library (gr_functional, backends, npu_ops) than ``MAX_FUNCTION_LEVEL``.
- ``npu_ops`` imports nothing of ``backends``, and of ``gr_functional`` only its leaves (``LEAVES``);
  the library imports no experiment or benchmark.
- ``gr_functional/config.py`` (the schema) imports nothing of the project but the leaf errors.
- ``gr_functional`` imports no array library (torch, torch_npu, jax) at module level: device math
  goes through a Backend object, and ``import gr_functional`` must work without them.

An edge ``a -> b`` means module ``a`` imports module ``b`` when ``a`` is imported: ``import x.y``
and ``from x import y`` (``y`` a submodule) give ``x.y``; ``from x import name`` gives ``x``.
Parent packages' ``__init__`` are not edges of their own (Python runs them first, but a package
``__init__`` importing its submodules, which import their siblings, is the normal layout).
``importlib.import_module(NAME)`` (``NAME`` a literal, an f-string of literals, ``__name__`` /
``__package__`` and loop variables over literal tuples, relative to its ``package=``) is an edge
to ``NAME``; a site whose name the test cannot read is listed in ``DYNAMIC_IMPORTS``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gr_functional", "backends", "npu_ops", "experiments", "benchmarks")
LIBRARY = ("gr_functional", "backends", "npu_ops")  # below experiments and benchmarks
# gr_functional's leaf utilities: all of the project that npu_ops may import
LEAVES = ("gr_functional.errors", "gr_functional.tree", "gr_functional.jagged", "gr_functional.flops",
          "gr_functional.time_buckets")
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
                t = _project_module(t, modules)
                if t and t != name:
                    project.add(t)
            else:
                external.add(t.split(".")[0])
    return project, external


def _project_module(t: str, modules) -> str:
    """``import a.b.c`` of a name that is not a module (an attribute): its longest module prefix."""
    while t and t not in modules:
        t = t.rpartition(".")[0]
    return t


def _constants(tree: ast.Module) -> dict:
    """The module-level ``NAME = <literal>`` assignments."""
    out = {}
    for node in tree.body:
        one = isinstance(node, ast.Assign) and len(node.targets) == 1
        target = node.targets[0] if one else getattr(node, "target", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(target, ast.Name) and node.value is not None:
            try:
                out[target.id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def _strings(node, name: str, package: str, consts: dict, parents: dict) -> list[str] | None:
    """The strings expression ``node`` can be, or None where the source does not tell."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in ("__name__", "__package__"):
        return [name if node.id == "__name__" else package]
    if isinstance(node, ast.Name):  # the variable of an enclosing loop over a literal tuple (or a constant's)
        up = parents.get(id(node))
        while up is not None and not (isinstance(up, ast.For) and getattr(up.target, "id", None) == node.id):
            up = parents.get(id(up))
        if up is None:
            return None
        try:
            seq = ast.literal_eval(up.iter)
        except ValueError:
            seq = consts.get(up.iter.id) if isinstance(up.iter, ast.Name) else None
        ok = isinstance(seq, (tuple, list)) and all(isinstance(x, str) for x in seq)
        return list(seq) if ok else None
    if isinstance(node, ast.JoinedStr):
        out = [""]
        for part in node.values:
            got = _strings(part.value if isinstance(part, ast.FormattedValue) else part, name, package, consts, parents)
            if got is None:
                return None
            out = [a + b for a in out for b in got]
        return out
    return None


def _dynamic_imports(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], list[str]]:
    """``(project modules, unread sites)`` of the ``importlib.import_module`` calls in the file:
    the modules they load, where the source tells, and ``"LINE: CALL"`` for each site it does not."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    consts = _constants(tree)
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    project, unread = set(), []
    for node in ast.walk(tree):
        f = getattr(node, "func", None)
        if not (isinstance(node, ast.Call) and isinstance(f, ast.Attribute) and f.attr == "import_module"
                and isinstance(f.value, ast.Name) and f.value.id == "importlib" and node.args):
            continue
        names = _strings(node.args[0], name, package, consts, parents)
        pkg = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "package"), None)
        bases = [""] if pkg is None else _strings(pkg, name, package, consts, parents)
        if names is None or bases is None:
            unread.append(f"{node.lineno}: {ast.unparse(node)}")
            continue
        for n in names:
            for base in bases:
                if n.startswith("."):  # importlib's resolution of a relative name against package=
                    dots = len(n) - len(n.lstrip("."))
                    n = ".".join(base.split(".")[:len(base.split(".")) - dots + 1] + [n.lstrip(".")])
                if n.split(".")[0] in PACKAGES and _project_module(n, modules) not in ("", name):
                    project.add(_project_module(n, modules))
    return project, unread


def _registered_backends(_consts: dict) -> list[str]:
    """The modules of the backends backends/catalog.py registers (``register_backend(name, module, cls)``)."""
    tree = ast.parse((REPO / "backends" / "catalog.py").read_text())
    return [n.value.args[1].value for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
            and getattr(n.value.func, "id", None) == "register_backend"]


# The importlib.import_module sites whose module name the source does not tell (not a literal,
# an f-string of literals or a loop over a literal tuple): module -> what its sites load, from
# the module's literal constants. Each site must be listed, and each entry have a site.
DYNAMIC_IMPORTS = {
    # __getattr__: the lazy attributes' modules (_LAZY) and the submodules reachable as attributes
    "gr_functional": lambda c: [f"gr_functional.{m}" for m, _ in c["_LAZY"].values()]
                               + [f"gr_functional.{m}" for m in c["_SUBMODULES"]],
    # cmd_bench: the benchmark `grf bench NAME` names (BENCHMARKS)
    "gr_functional.cli": lambda c: list(c["BENCHMARKS"].values()),
    # __getattr__: the readers' old import paths, moved to data/sources (_MOVED)
    "gr_functional.data.loaders": lambda c: [f"gr_functional.data.sources.{m}" for m in c["_MOVED"].values()],
    # import_plugins: the user's --plugin / train.plugins modules, none of the project's
    "gr_functional.plugins": lambda c: [],
    # get_backend, backend_class: the registered backends' modules (and plugins' backends)
    "backends": _registered_backends,
    "backends.catalog": _registered_backends,
    # load_api: the vendor package, fbgemm_ascend or fbgemm_gpu
    "npu_ops.fbgemm_tbe": lambda c: [],
}

# importlib sites that load modules of a higher layer by name, which import the loader back (a
# registry's shipped entries register themselves with it; benchmarks use the CLI's helpers):
# their edges count for every rule but the cycles. An entry whose loads no longer come back fails.
LOADS_UP = {
    "gr_functional.task": "_load_shipped: the shipped tasks, which register_task",
    "gr_functional.data.registry": "_load_shipped: the shipped datasets (data/sources), which register_dataset",
    "gr_functional.data.loaders": "__getattr__: the readers moved to data/sources, which use loaders' parsers",
    "backends.catalog": "backend_class: the registered backends, which import the op registry",
    "gr_functional.cli": "cmd_bench: benchmarks.NAME, which use the CLI's config helpers",
}


def _all_dynamic(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules its importlib sites load (DYNAMIC_IMPORTS for unread sites)."""
    out = {}
    for name, path in modules.items():
        project, unread = _dynamic_imports(name, path, modules)
        if unread and name in DYNAMIC_IMPORTS:
            consts = _constants(ast.parse(path.read_text(), filename=str(path)))
            project |= {_project_module(t, modules) for t in DYNAMIC_IMPORTS[name](consts)} - {"", name}
        out[name] = project
    return out


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
    """Every import statement (function bodies included) and importlib site, LOADS_UP's aside."""
    modules = _modules()
    dynamic = _all_dynamic(modules)
    return {name: _imports(name, path, modules, everywhere=True)[0] | (set() if name in LOADS_UP else dynamic[name])
            for name, path in modules.items()}


# Cycles that remain when imports inside functions count, each listed by its modules.
# A new cycle fails; a listed one that is gone fails too, so the list only shrinks.
KNOWN_CYCLES = ()  # none left: the last (backends <-> npu_ops.triton_hstu) went with time_buckets' move
# Function-level imports of project modules in the library (gr_functional, backends, npu_ops): only lowered.
# 57: gr_functional and backends' 49 (the bound before npu_ops counted) and npu_ops' 8.
MAX_FUNCTION_LEVEL = 57


@pytest.mark.slow
def test_no_import_cycles_counting_function_level_imports(full_graph):
    got = {frozenset(c) for c in _components(full_graph)}
    new = [sorted(c) for c in got - set(KNOWN_CYCLES)]
    assert not new, _message(full_graph, "import cycles counting function-level imports and importlib sites "
                                         "(import from a lower layer, or move what both need down)") \
        + "\n(new since KNOWN_CYCLES)"
    gone = [sorted(c) for c in set(KNOWN_CYCLES) - got]
    assert not gone, f"cycles removed: {gone}; take them out of KNOWN_CYCLES"


@pytest.mark.slow
def test_function_level_project_imports_only_go_down():
    modules = _modules()
    count = 0
    for name, path in modules.items():
        if name.split(".")[0] not in LIBRARY:
            continue
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


def test_the_leaves_import_only_leaves(full_graph):
    bad = {leaf: sorted(full_graph[leaf] - set(LEAVES)) for leaf in LEAVES if full_graph[leaf] - set(LEAVES)}
    assert not bad, f"gr_functional's leaf utilities import above the leaves: {bad}"


def _message(edges: dict[str, set[str]],
             what: str = "module-level import cycles (move one import into the function that needs it)") -> str:
    return f"{what}:\n" + "\n".join(
        f"{' -> '.join(cycle)}   (modules on cycles with them: {', '.join(comp)})"
        for cycle, comp in zip(_cycles(edges), _components(edges)))


def test_no_module_level_import_cycles(graph):
    edges, _ = graph
    assert not _components(edges), _message(edges)


def test_gr_functional_imports_no_array_library_at_module_level(graph):
    # gr_functional.interop wraps the models for another library's users (flax.nnx): imported by
    # user code only (next test), so it may import that library
    _, external = graph
    bad = {m: sorted(set(ext) & set(ARRAY_LIBRARIES)) for m, ext in external.items()
           if m.split(".")[0] == "gr_functional" and not m.startswith("gr_functional.interop")
           and set(ext) & set(ARRAY_LIBRARIES)}
    assert not bad, f"gr_functional modules importing an array library at module level: {bad}"


def test_nothing_in_the_project_imports_the_interop_modules(full_graph):
    users = {m: sorted(t for t in targets if t.startswith("gr_functional.interop"))
             for m, targets in full_graph.items()
             if m.split(".")[0] in LIBRARY and not m.startswith("gr_functional.interop")}
    assert not {m: t for m, t in users.items() if t}, "gr_functional.interop is for user code (experiments) only"


@pytest.mark.slow
def test_every_importlib_site_is_read_or_listed():
    modules = _modules()
    unread = {name: _dynamic_imports(name, path, modules)[1] for name, path in modules.items()}
    unread = {name: sites for name, sites in unread.items() if sites}
    missing = {name: sites for name, sites in unread.items() if name not in DYNAMIC_IMPORTS}
    assert not missing, f"importlib sites the test cannot read: list what they load in DYNAMIC_IMPORTS: {missing}"
    stale = sorted(set(DYNAMIC_IMPORTS) - set(unread))
    assert not stale, f"DYNAMIC_IMPORTS entries without an unread importlib site: {stale}"
    for name in DYNAMIC_IMPORTS:
        consts = _constants(ast.parse(modules[name].read_text()))
        wrong = [t for t in DYNAMIC_IMPORTS[name](consts) if t.split(".")[0] in PACKAGES and t not in modules]
        assert not wrong, f"DYNAMIC_IMPORTS[{name!r}] names modules that do not exist: {wrong}"


@pytest.mark.slow
def test_loads_up_are_needed_and_come_back(full_graph):
    """Each LOADS_UP site loads a module that imports the loader back (else it is no exception)."""
    modules = _modules()
    dynamic = _all_dynamic(modules)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = {start}, [start]
        while todo:
            for w in full_graph[todo.pop()]:
                if w == goal:
                    return True
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return False

    idle = sorted(m for m in LOADS_UP if not any(reaches(t, m) for t in dynamic[m]))
    assert not idle, f"LOADS_UP entries whose loads no longer import them back: {idle}; take them out"


@pytest.mark.slow
def test_npu_ops_imports_nothing_of_backends():
    """npu_ops sits below backends' op layer: the error classes and the time buckets both need
    live in gr_functional's leaves (counting function-level imports and every importlib site)."""
    modules = _modules()
    dynamic = _all_dynamic(modules)
    bad = {name: sorted(t for t in _imports(name, path, modules, everywhere=True)[0] | dynamic[name]
                        if t.split(".")[0] != "npu_ops" and t not in LEAVES)
           for name, path in modules.items() if name.split(".")[0] == "npu_ops"}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"npu_ops imports from above gr_functional's leaves (LEAVES): {bad}"


def test_the_library_imports_no_experiment_or_benchmark(full_graph):
    bad = {name: sorted(t for t in targets if t.split(".")[0] not in LIBRARY)
           for name, targets in full_graph.items() if name.split(".")[0] in LIBRARY}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"library modules importing experiments / benchmarks (the top layers): {bad}"


def test_the_checker_reads_importlib_sites(tmp_path):
    pkg = tmp_path / "gr_functional"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for m in ("a", "b", "c", "sub/__init__", "sub/x", "sub/y"):
        (pkg / f"{m}.py").write_text("")
    (pkg / "a.py").write_text(
        "import importlib\nNAMES = ('x', 'y')\n\ndef f(entry):\n"
        "    importlib.import_module('gr_functional.b')\n"
        "    importlib.import_module('.c', __package__)\n"
        "    for n in NAMES:\n        importlib.import_module(f'{__package__}.sub.{n}')\n"
        "    importlib.import_module(entry)\n    importlib.import_module('numpy')\n")
    mods = {"gr_functional": pkg / "__init__.py", "gr_functional.sub": pkg / "sub" / "__init__.py",
            **{f"gr_functional.{m}": pkg / f"{m}.py" for m in "abc"},
            **{f"gr_functional.sub.{m}": pkg / "sub" / f"{m}.py" for m in "xy"}}
    project, unread = _dynamic_imports("gr_functional.a", mods["gr_functional.a"], mods)
    assert project == {"gr_functional.b", "gr_functional.c", "gr_functional.sub.x", "gr_functional.sub.y"}
    assert unread == ["9: importlib.import_module(entry)"]


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
