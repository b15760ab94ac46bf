"""Every error a user can hit, in one leaf module (imports nothing of the package).

Each carries a message naming the file, line or key and the fix; ``grf`` maps the class to its
exit code (docs/cli.md "Commands"): ConfigError / DataError / CheckpointError / RunLocked 2,
TrainingAborted / Diverged 3, DistributedError 4, WriteError 5, PluginError 6. Modules raise these; the old
import paths (``config.ConfigError``, ``data.loaders.DataError``, ``npu_ops.UnsupportedOnBackend``, ...)
still work.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and how to fix it."""


class DataError(ValueError):
    """A data file is missing or malformed; the message names the file (and line) and how to fix it."""


class DataMissing(DataError):
    """A registered data file is not under the data folder (``data.paths.dataset_path``).

    ``name`` is the registered file's name, ``label`` its human name and ``how_to_get`` how to get
    it (a command such as ``grf data fetch ml-1m``, or where to copy it from)."""

    def __init__(self, message: str, name: str = "", label: str = "", how_to_get: str = ""):
        super().__init__(message)
        self.name, self.label, self.how_to_get = name, label, how_to_get


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged or does not fit this run; the message names the file."""


class NonFiniteState(CheckpointError):
    """Params or optimizer state hold NaN/Inf: such a state is never written (it would poison
    every resume) and a checkpoint holding one is never resumed from."""


class WriteError(OSError):
    """A file under OUT could not be written (read-only folder, full disk, file-size limit); the
    message names the file and the OS's reason. No partial file is left that a resume trusts."""

    def __init__(self, code: int | None, message: str):
        super().__init__(code, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class RunLocked(RuntimeError):
    """Another live run holds the folder's lock; the message names it (``grf`` exits 2)."""


class TrainingAborted(RuntimeError):
    """Too many non-finite steps in a row; the message names the saved checkpoint and what to try."""


class Diverged(TrainingAborted):
    """Evaluation produced non-finite scores: the model diverged (``grf train``/``eval`` exit 3)."""


class PluginError(RuntimeError):
    """The user's code (a hook of ``train.hooks`` or ``grf.fit(hooks=...)``) raised, or called
    ``sys.exit``, during a run; the message names it, the method, the step and the checkpoint the
    same command resumes from (``grf train`` exits 6: the user's code, not the run, failed)."""


class DistributedError(RuntimeError):
    """A data-parallel rank died or hung, or a collective failed; the message names the rank
    (``grf train`` exits 4)."""


class JaggedError(ValueError):
    """A jagged array was malformed; the message says what and how to fix it."""


class ReportError(ValueError):
    """A path that is not a run directory, or a run file that cannot be read."""


class UnsupportedOnBackend(RuntimeError):
    """A kernel cannot run this call here: it is not installed or loaded, or a documented
    shape/dtype limit is violated. The message names the kernel, the limit or missing piece,
    and where the limit is documented. Callers never fall back silently on this error.

    Here, not in npu_ops, because both backends and npu_ops raise it (npu_ops re-exports it)."""
