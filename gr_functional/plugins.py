"""User modules imported before a config is checked: where losses, datasets and attention kernels
of one's own get registered without editing the package.

``train.plugins`` (``grf train --plugin FILE_OR_MODULE``, repeatable) lists ``.py`` files or
importable module names. ``configure.load_config`` imports them before it checks the registry
names (``loss.name``, ``data.dataset``, ``ops.attention``); the list is saved in
config.toml and in every checkpoint (files as absolute paths), so a resume or ``grf eval``
imports the same ones.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from pathlib import Path

from .errors import ConfigError


def normalise(entry: str) -> str:
    """A ``.py`` file as its absolute path (a resume from another folder finds it); a module
    name unchanged."""
    if entry.endswith(".py"):
        return str(Path(entry).expanduser().resolve())
    return entry


def _module_name(path: Path) -> str:
    # one module per file, whatever the cwd: a second import of the same file is a no-op
    return f"grf_plugin_{path.stem}_{abs(hash(str(path))) % 10**8}"


def import_plugins(entries, where: str = "train.plugins") -> None:
    """Import each entry (a ``.py`` file or a module name) once; errors name the entry and the
    plugin's own failing line."""
    for entry in entries:
        try:
            if entry.endswith(".py"):
                path = Path(entry).expanduser().resolve()
                if not path.is_file():
                    raise ConfigError(f"{where}: plugin file {entry} does not exist")
                name = _module_name(path)
                if name in sys.modules:
                    continue
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
            else:
                importlib.import_module(entry)
        except ConfigError:
            raise
        except Exception as exc:
            at = _where_in_plugin(exc, entry)
            raise ConfigError(f"{where}: importing plugin {entry!r} failed{at}: {type(exc).__name__}: {exc}") from exc


def _where_in_plugin(exc: BaseException, entry: str) -> str:
    """`` at FILE:LINE`` of the plugin's own failing line (a SyntaxError's position, else the
    deepest frame inside the plugin file or module), or "" when none is the plugin's."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f" at {exc.filename}:{exc.lineno}"
    mine = (lambda f: Path(f).resolve() == Path(entry).expanduser().resolve()) if entry.endswith(".py") else (
        lambda f: entry.replace(".", "/") in f.replace("\\", "/"))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if mine(f.filename)]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
