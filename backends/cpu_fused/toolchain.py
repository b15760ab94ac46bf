"""What both fronts of the fused CPU ops build with: the compiler flags, the shared core
(kernels.h) and the compiler check (the torch extension in ``backends.cpu_fused``, the XLA FFI
library in ``backends.cpu_fused.xla``)."""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
import threading

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.h")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fno-trapping-math", "-fopenmp"]


def compiler_reason() -> str | None:
    """Why no C++ compiler can build the ops, or None."""
    compiler = (shlex.split(os.environ.get("CXX", "")) or ["c++"])[0]  # CXX may carry a launcher or flags
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH; set CXX or install g++) to build it"
    return None


# a build or a wait for another process's build that takes longer than this is announced
NOTE_AFTER_S = 3.0


@contextlib.contextmanager
def note_if_slow(what: str, after_s: float = NOTE_AFTER_S):
    """Print one stderr line when the block (a compile, or a wait for another process's) runs
    longer than ``after_s``: a first ``grf train`` would otherwise be silent for a minute while
    the C++ ops compile. A cached build ends sooner and says nothing."""
    timer = threading.Timer(after_s, lambda: print(f"grf: building {what} (first use on this machine: about a "
                                                   f"minute; cached afterwards)", file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
