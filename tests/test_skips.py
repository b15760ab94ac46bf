"""The CI skip check (tests/skips.py): unexpected skips and wrong counts are problems."""
import json

from tests.skips import skip_problems


def test_skip_problems_name_unexpected_skips_and_wrong_counts(tmp_path):
    path = tmp_path / "expected.json"
    path.write_text(json.dumps({"skips": [{"reason": "no Ascend NPU", "count": 2, "why": "Ascend"}]}))
    npu = ("t::a", "no Ascend NPU: torch_npu cannot import")
    assert skip_problems([npu, ("t::b", "no Ascend NPU: x")], path) == []
    problems = skip_problems([npu, ("t::c", "needs data: ML-1M (grf data fetch ml-1m)")], path)
    assert problems == ["unexpected skip: t::c: needs data: ML-1M (grf data fetch ml-1m)",
                        "expected 2 skip(s) for 'no Ascend NPU' (Ascend), got 1"]
