"""The type-check ratchet: mypy (pinned in the test extra, non-strict: pyproject.toml [tool.mypy])
over the installed packages finds no more errors than tests/type_errors.json records, per file.

A change that fixes errors lowers the record (``python tests/test_types.py --record``); one that adds
errors fails here, naming the files whose count grew and the new messages."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "tests" / "type_errors.json"
PACKAGES = ("gr_functional", "backends", "npu_ops")
_LINE = re.compile(r"^(?P<file>[^:]+\.py):(?P<line>\d+): error: (?P<message>.*)$")


def mypy_errors() -> list[tuple[str, str]]:
    """``(file, "line: message")`` of every mypy error over ``PACKAGES``."""
    done = subprocess.run([sys.executable, "-m", "mypy", *PACKAGES, "--no-error-summary", "--show-error-codes"],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1) or "error: " not in done.stdout and done.returncode == 1:
        raise RuntimeError(f"mypy did not run (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    errors = []
    for line in done.stdout.splitlines():
        match = _LINE.match(line)
        if match:
            errors.append((match["file"], f"{match['line']}: {match['message']}"))
    return errors


def record(errors) -> dict:
    import mypy.version

    by_file = Counter(file for file, _ in errors)
    return {"checker": f"mypy {mypy.version.__version__}", "errors": len(errors), "by_file": dict(sorted(by_file.items()))}


@pytest.mark.slow
def test_type_errors_do_not_grow():
    recorded = json.loads(RECORD.read_text())
    errors = mypy_errors()
    now = record(errors)
    assert now["checker"] == recorded["checker"], (f"the record was made with {recorded['checker']}, this is "
                                                    f"{now['checker']}: install the test extra's pin")
    grown = {f: (recorded["by_file"].get(f, 0), n) for f, n in now["by_file"].items() if n > recorded["by_file"].get(f, 0)}
    new = [f"{file}:{where}" for file, where in errors if file in grown]
    assert not grown, ("mypy errors grew in " + ", ".join(f"{f} ({a} -> {b})" for f, (a, b) in grown.items()) +
                       ":\n" + "\n".join(new[:40]) + "\nfix them (or, for a fix elsewhere, re-record with "
                       "python tests/test_types.py --record)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_types.py --record   (re-records tests/type_errors.json)")
    result = record(mypy_errors())
    RECORD.write_text(json.dumps(result, indent=1) + "\n")
    print(f"recorded {result['errors']} errors in {len(result['by_file'])} files ({result['checker']})")
