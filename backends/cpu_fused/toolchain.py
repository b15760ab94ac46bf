"""What both fronts of the fused CPU ops build with: the compiler flags, the shared core
(kernels.h) and the compiler check (the torch extension in ``backends.cpu_fused``, the XLA FFI
library in ``backends.cpu_fused.xla``)."""
from __future__ import annotations

import os
import shlex
import shutil

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.h")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fno-trapping-math", "-fopenmp"]


def compiler_reason() -> str | None:
    """Why no C++ compiler can build the ops, or None."""
    compiler = (shlex.split(os.environ.get("CXX", "")) or ["c++"])[0]  # CXX may carry a launcher or flags
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH; set CXX or install g++) to build it"
    return None
