"""Which tests are the suite's slow tier: measured, not guessed.

    python -m pytest -q -n 2 --dist loadfile --junitxml=junit.xml      # the whole suite, durations
    python tools/slow_tests.py junit.xml --budget 240                    # what it would mark
    python tools/slow_tests.py junit.xml --budget 240 --apply            # add @pytest.mark.slow

A test function (all its parametrized cases together) is slow when its measured seconds (setup,
call and teardown, as the JUnit report counts them) are among the largest: functions are marked,
largest first, until the unmarked rest sums to at most ``--budget`` seconds of one worker's time
(the fast tier, ``pytest -m "not slow" -n 2``, runs on two workers: its wall time is about half,
plus start-up). Every test file keeps its cheapest function in the fast tier when that one takes at
most ``--unit`` seconds (a unit-level test: the fast tier touches every module that has one; files
made only of whole runs, fingerprints and launched processes, are all slow). ``--apply`` inserts
``@pytest.mark.slow`` above each chosen function that does not carry it (and ``import pytest``
where a file lacks it) and removes it from each file's kept cheapest function.
"""
from __future__ import annotations

import argparse
import ast
import collections
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def durations(junit: Path) -> dict[tuple[str, str], float]:
    """``{(test file, function name): seconds}`` summed over parametrized cases."""
    out: dict[tuple[str, str], float] = collections.defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        # classname is "tests.pkg.test_mod" or "tests.pkg.test_mod.TestClass"
        while parts and not (ROOT / Path(*parts)).with_suffix(".py").is_file():
            parts = parts[:-1]
        if not parts:
            continue
        name = case.get("name", "").split("[", 1)[0]
        out[(str(Path(*parts).with_suffix(".py")), name)] += float(case.get("time", 0.0))
    return dict(out)


def kept(times: dict, unit: float) -> set[tuple[str, str]]:
    """Each file's cheapest function, when it takes at most ``unit`` seconds: never marked slow."""
    cheapest: dict[str, tuple[str, str]] = {}
    for key, seconds in times.items():
        if seconds <= unit and (key[0] not in cheapest or seconds < times[cheapest[key[0]]]):
            cheapest[key[0]] = key
    return set(cheapest.values())


def choose(times: dict, budget: float, keep: set = frozenset()) -> list[tuple[str, str]]:
    """The functions to mark: largest first (``keep`` excepted) until the rest sums to ``budget``
    seconds or less."""
    order = sorted((k for k in times if k not in keep), key=times.get, reverse=True)
    rest = sum(times.values())
    chosen = []
    for key in order:
        if rest <= budget:
            break
        chosen.append(key)
        rest -= times[key]
    return chosen


def unmark(keep: set[tuple[str, str]]) -> int:
    """Remove ``@pytest.mark.slow`` from the kept functions; returns how many were removed."""
    removed = 0
    for file, name in keep:
        path = ROOT / file
        lines = path.read_text().splitlines(keepends=True)
        drop = []
        for node in ast.walk(ast.parse("".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                drop += [d.lineno - 1 for d in node.decorator_list if ast.unparse(d) == "pytest.mark.slow"]
        for at in sorted(drop, reverse=True):
            del lines[at]
            removed += 1
        if drop:
            path.write_text("".join(lines))
    return removed


def apply(chosen: list[tuple[str, str]]) -> int:
    """Insert ``@pytest.mark.slow`` above each chosen function; returns how many were added."""
    by_file = collections.defaultdict(set)
    for file, name in chosen:
        by_file[file].add(name)
    added = 0
    for file, names in by_file.items():
        path = ROOT / file
        lines = path.read_text().splitlines(keepends=True)
        inserts = []
        for node in ast.walk(ast.parse("".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
                marks = [ast.unparse(d) for d in node.decorator_list]
                if any(m.startswith("pytest.mark.slow") for m in marks):
                    continue
                first = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
                indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
                inserts.append((first, f"{indent}@pytest.mark.slow\n"))
        for at, text in sorted(inserts, reverse=True):
            lines.insert(at, text)
            added += 1
        text = "".join(lines)
        if inserts and "import pytest" not in text:
            tree = ast.parse(text)
            last_import = max((n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))),
                              default=0)
            lines = text.splitlines(keepends=True)
            lines.insert(last_import, "import pytest\n")
            text = "".join(lines)
        path.write_text(text)
    return added


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", type=Path)
    p.add_argument("--budget", type=float, default=240.0, help="seconds of one worker the fast tier may take")
    p.add_argument("--unit", type=float, default=5.0,
                   help="a file's cheapest function stays fast when it takes at most this many seconds")
    p.add_argument("--apply", action="store_true", help="add @pytest.mark.slow to the chosen functions")
    args = p.parse_args(argv)
    times = durations(args.junit)
    keep = kept(times, args.unit)
    chosen = choose(times, args.budget, keep)
    total = sum(times.values())
    rest = total - sum(times[k] for k in chosen)
    for key in chosen:
        print(f"{times[key]:8.1f}s  {key[0]}::{key[1]}")
    print(f"{len(chosen)} of {len(times)} functions slow; the rest: {rest:.0f} s of {total:.0f} s")
    if args.apply:
        print(f"added {apply(chosen)} marks, removed {unmark(keep)} from the files' cheapest functions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
