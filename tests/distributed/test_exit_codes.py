"""`grf train --nproc N` exits with the failing rank's own code, not torchrun's 1.

Each rank runs through ``gr_functional.rank``, which records its exit code (or only
"started" when it was killed); ``job_exit_code`` maps them: 2 (user error) > 3 (NaN abort) >
another code (1: an unexpected error, 5: a failed write) > 4 (a rank exited 4, was killed or
ended without a code).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from backends.dist_torch import EXIT_DIR_ENV, job_exit_code

from .common import ROOT, subprocess_env


def _job(tmp_path, launcher_code: int, recorded: dict) -> tuple[int, str]:
    for rank, text in recorded.items():
        (tmp_path / f"rank-{rank}").write_text(text)
    return job_exit_code(launcher_code, tmp_path, nproc=2)


@pytest.mark.parametrize("recorded, want", [
    ({0: "4", 1: "started"}, 4),        # rank 1 killed (SIGKILL), rank 0 named it
    ({0: "started", 1: "started"}, 4),  # rank 1 killed, torchrun stopped rank 0 first
    ({0: "4", 1: "4"}, 4),              # a hung rank and its peer
    ({0: "4", 1: "2"}, 2),              # rank 1's user error (data), rank 0 stopped because of it
    ({0: "2", 1: "started"}, 2),        # rank 0's user error, torchrun stopped rank 1
    ({0: "3", 1: "3"}, 3),              # NaN abort: every rank aborts at the same step
    ({0: "4", 1: "1"}, 1),              # rank 1's unexpected error (traceback)
    ({0: "5", 1: "4"}, 5),              # rank 0 could not write OUT, rank 1 stopped because of it
    ({0: "4"}, 4),                      # rank 1 never started
])
def test_job_exit_code_reports_the_root_cause(tmp_path, recorded, want):
    code, why = _job(tmp_path, 1, recorded)
    assert code == want, why
    assert "rank 0" in why and "rank 1" in why


def test_job_exit_code_success_and_launcher_failures(tmp_path):
    assert job_exit_code(0, tmp_path, 2)[0] == 0
    assert job_exit_code(1, tmp_path, 2) == (1, "no rank started: torchrun failed before starting them")
    assert _job(tmp_path, 1, {0: "0", 1: "0"})[0] == 1   # every rank fine, torchrun itself failed


def test_rank_main_records_the_exit_code(tmp_path):
    """A rank's user error (an unknown config) is recorded as 2 in $GRF_RANK_EXIT_DIR/rank-RANK."""
    env = subprocess_env(**{EXIT_DIR_ENV: str(tmp_path), "RANK": "1"})
    r = subprocess.run([sys.executable, "-m", "gr_functional.rank", "train", "--config", "no-such-config",
                        "--out", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert (tmp_path / "rank-1").read_text() == "2"
