"""The suite's skips under CI: each must be a known hardware skip, and their counts as expected.

``.ci/run`` sets ``GRF_EXPECTED_SKIPS=tests/expected_skips.json``; the session (tests/conftest.py)
then collects every skip's reason and, at its end, fails the run (exit 1, the problems printed) when
a skip matches no expected reason, or an expected reason was skipped another number of times. On
this machine, with no NPU and no GPU, the expected ones are the tests of Ascend and CUDA hardware;
data is never among them (under CI ``GRF_REQUIRE_DATA=1`` turns a missing file into a failure).

``expected_skips.json``: ``{"skips": [{"reason": "a substring of the skip's reason", "count": N,
"why": "what hardware it needs"}]}``.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

ENV = "GRF_EXPECTED_SKIPS"


def skip_problems(skipped: list[tuple[str, str]], expected_file: str | Path) -> list[str]:
    """Problems with ``skipped`` (``(test id, reason)`` of every skip) against ``expected_file``."""
    expected = json.loads(Path(expected_file).read_text())["skips"]
    counts: Counter = Counter()
    problems = []
    for test, reason in skipped:
        matches = [e["reason"] for e in expected if e["reason"] in reason]
        if not matches:
            problems.append(f"unexpected skip: {test}: {reason}")
        else:
            counts[matches[0]] += 1
    for e in expected:
        if counts[e["reason"]] != e["count"]:
            problems.append(f"expected {e['count']} skip(s) for {e['reason']!r} ({e['why']}), got {counts[e['reason']]}")
    return problems
