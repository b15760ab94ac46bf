"""One rank of ``grf train --nproc N``: torchrun starts ``python -m gr_functional.rank train ...``
on every rank. It runs ``gr_functional.cli.main`` and records the rank's exit code ("started"
first) in ``$GRF_RANK_EXIT_DIR`` (``backends.dist_torch.record_exit``), so the launcher can tell a
rank's own error from a rank that was killed (torchrun itself only says 1).

Its own module, above the CLI, so that nothing below the CLI imports it back.
"""
from __future__ import annotations

import sys
from typing import Any

from backends.dist_torch import record_exit

from .cli import main


def rank_main(argv: list[str] | None = None) -> int:
    record_exit("started")
    code: Any = "started"  # stays so on KeyboardInterrupt: like a signal, no exit code of its own
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors (2), sys.exit elsewhere
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    except Exception:  # an unexpected error: Python prints the traceback and exits 1
        code = 1
        raise
    finally:
        record_exit(code)
    return code


if __name__ == "__main__":
    # run through the canonical module, not this __main__ copy
    from gr_functional.rank import rank_main as _rank_main

    sys.exit(_rank_main())
