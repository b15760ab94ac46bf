"""Behaviour fingerprints (tools/fingerprints.py): the runs recorded before the [onecore] refactor
give the same metrics, evaluation and checkpoint tensors today (bytes on the recording machine,
values within 2e-3 on another CPU), and runs stopped at that commit resume to the uninterrupted run."""
from __future__ import annotations

import importlib.util

import pytest

from .reliability.common import ROOT

_spec = importlib.util.spec_from_file_location("grf_fingerprints", ROOT / "tools" / "fingerprints.py")
fingerprints = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fingerprints)


# the real data a scenario's config reads (tests/data_needs.py: skipped without it, failed under CI)
_RANKING_DATA = ("kuairand-user-features", "kuairand-video-features", "kuairand-27k-lengths")
DATA = {"ml1m_torch": ("ml-1m",), "ml1m_jax": ("ml-1m",), "ranking": _RANKING_DATA}


def _with_data(names):
    return [pytest.param(name, marks=pytest.mark.data(*DATA[name])) if name in DATA else name for name in names]


@pytest.mark.slow
@pytest.mark.parametrize("name", _with_data(fingerprints.SCENARIOS))
def test_a_recorded_run_is_unchanged(name, tmp_path):
    exact, errors = fingerprints.check(name, "ci", tmp_path)
    assert not errors, f"{name} ({'bytes' if exact else 'values'}):\n" + "\n".join(errors[:30])


@pytest.mark.slow
@pytest.mark.parametrize("name", _with_data(fingerprints.LEGACY))
def test_a_run_stopped_before_the_change_resumes_to_the_uninterrupted_run(name, tmp_path):
    exact, errors = fingerprints.check_legacy(name, tmp_path)
    assert not errors, f"{name} ({'bytes' if exact else 'values'}):\n" + "\n".join(errors[:30])
