"""One way to tell the person running ``grf`` something: a ``grf: ...`` line on stderr.

    say("data ...")            progress and facts (what was loaded, what a resume continues)
    note("... remapped ...")   something they should know that is not a problem (an automatic remap)
    warn("... skipped ...")    something is off and the run goes on (a damaged checkpoint skipped)
    error("...")               why a command stops (the CLI, before it exits with its code)

stdout stays the command's result (``grf eval``'s JSON, ``grf report``'s table, the epoch lines).
Leaf module: imports nothing of the project, so every layer can use it.
"""
from __future__ import annotations

import sys


def _line(prefix: str, message: str) -> None:
    print(f"grf: {prefix}{message}", file=sys.stderr, flush=True)


def say(message: str) -> None:
    _line("", message)


def note(message: str) -> None:
    _line("note: ", message)


def warn(message: str) -> None:
    _line("warning: ", message)


def error(message: str) -> None:
    _line("error: ", message)
