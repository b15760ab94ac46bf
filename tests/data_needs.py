"""Tests that need real data: skip on a user's machine without it, fail under CI.

A test names the registered data files it reads (``gr_functional/data/registry.py``: ``ml-1m``,
``kuairand-27k-lengths``, ``kuairand-pure-log``, ...) with ``@pytest.mark.data("ml-1m")`` or calls
``data_file("ml-1m")``. When a file is missing from the data folder (``GRF_DATA_DIR``, else
``../shared/data`` beside the checkout, else ``~/.cache/gr-functional/data``), the test is skipped
with one line naming the data and the command that gets it. With ``GRF_REQUIRE_DATA=1`` (set by
``.ci/run``) the data is part of the test environment and a missing file fails the test instead.

A test that reads data without declaring it and meets ``DataMissing`` is turned into the same skip
(tests/conftest.py), so a user never sees a failure for data they were not told to get; under
``GRF_REQUIRE_DATA=1`` it fails as any error does.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REQUIRE_ENV = "GRF_REQUIRE_DATA"
# what every data skip's reason starts with: the session check under CI counts them apart
SKIP_PREFIX = "needs data:"


def data_required() -> bool:
    """True when missing data must fail (``GRF_REQUIRE_DATA`` set to anything but "" or "0")."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def missing_reason(exc) -> str:
    """One line: which data and how to get it (a ``DataMissing``)."""
    how = exc.how_to_get or f"put it under the data folder ({exc})"
    return f"{SKIP_PREFIX} {exc.label or exc.name} ({how}; or set GRF_DATA_DIR)"


def missing(exc) -> None:
    """Skip (a user's machine) or fail (``GRF_REQUIRE_DATA=1``) for the ``DataMissing`` ``exc``."""
    reason = missing_reason(exc)
    if data_required():
        pytest.fail(f"{reason}: {REQUIRE_ENV}=1 makes missing data a failure. {exc}", pytrace=False)
    pytest.skip(reason)


def data_file(name: str) -> Path:
    """The registered data file ``name`` under the data folder, or a skip/failure (``missing``)."""
    from gr_functional.data.paths import dataset_path
    from gr_functional.errors import DataMissing

    try:
        return dataset_path(name)
    except DataMissing as exc:
        missing(exc)
        raise  # unreachable: skip and fail raise


def data_root(*names: str) -> Path:
    """The data folder, after checking that each of ``names`` is there (``data_file``)."""
    from gr_functional.data.paths import data_dir

    for name in names:
        data_file(name)
    return data_dir()
