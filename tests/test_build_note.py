"""A first build of the fused C++ ops is announced (round 4: a first `grf train` was silent for a
minute while they compiled); a cached one, which ends sooner, says nothing."""
import time

from backends.cpu_fused.toolchain import note_if_slow


def test_a_slow_build_is_announced_once_and_a_fast_one_not(capsys):
    with note_if_slow("the ops", after_s=0.05):
        time.sleep(0.3)
    assert capsys.readouterr().err.count("grf: building the ops (first use") == 1
    with note_if_slow("the ops", after_s=5):
        pass
    time.sleep(0.05)
    assert capsys.readouterr().err == ""
