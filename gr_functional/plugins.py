"""User modules imported before a config is checked: where losses, datasets and attention kernels
of one's own get registered without editing the package.

``train.plugins`` (``grf train --plugin FILE_OR_MODULE``, repeatable) lists ``.py`` files or
importable module names. ``configure.load_config`` imports them before it checks the registry
names (``loss.name``, ``data.dataset``, ``ops.attention``); the list is saved in
config.toml and in every checkpoint (files as absolute paths), so a resume or ``grf eval``
imports the same ones.

The files imported are recorded (``imported_files``): an exception raised later inside one of
them (a registered optimizer builder, model, loss or dataset loader) is the user's code failing,
not the run, and ``grf`` reports it as such (``plugin_failure``: exit 6, no traceback).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from pathlib import Path

from .errors import ConfigError
from .registry import Registry

TAKES = "--plugin (and train.plugins) takes a .py file's path or an importable module's name (e.g. my_pkg.my_loss)"

# the project's own packages (as configure._PROJECT): a frame in one of them is the project's code
_PROJECT = ("gr_functional", "backends", "npu_ops")
_PROJECT_ROOTS = tuple(str(Path(__file__).resolve().parent.parent / name) + os.sep for name in _PROJECT)

# the plugins imported in this process: resolved file -> entry, and package folder (ending in os.sep) -> entry
_FILES: dict[str, str] = {}
_FOLDERS: dict[str, str] = {}


def normalise(entry: str) -> str:
    """A ``.py`` file as its absolute path (a resume from another folder finds it); a module
    name unchanged."""
    if entry.endswith(".py"):
        return str(Path(entry).expanduser().resolve())
    return entry


def _module_name(path: Path) -> str:
    # one module per file, whatever the cwd: a second import of the same file is a no-op
    return f"grf_plugin_{path.stem}_{abs(hash(str(path))) % 10**8}"


def _is_module_name(entry: str) -> bool:
    return bool(entry) and all(part.isidentifier() for part in entry.split("."))


def _not_a_module(entry: str, where: str) -> ConfigError | None:
    """Why ``entry`` (not ending in ``.py``) names a folder or a file rather than a module, or None."""
    path = Path(entry).expanduser()
    if path.is_dir():
        package = " (a package: pass its module name, with the folder above it on PYTHONPATH)" if (
            path / "__init__.py").is_file() else ""
        return ConfigError(f"{where}: plugin {entry!r} is a folder{package}, not a plugin; {TAKES}")
    if path.exists():
        return ConfigError(f"{where}: plugin {entry!r} is not a .py file; {TAKES}")
    if not _is_module_name(entry):
        return ConfigError(f"{where}: plugin {entry!r} is neither an existing .py file nor a module name; {TAKES}")
    return None


def import_plugins(entries, where: str = "train.plugins") -> None:
    """Import each entry (a ``.py`` file or a module name) once; errors name the entry and the
    plugin's own failing line (a ``sys.exit`` at import is one: ConfigError, exit 2)."""
    for entry in entries:
        try:
            if entry.endswith(".py"):
                path = Path(entry).expanduser().resolve()
                if path.is_dir():
                    raise ConfigError(f"{where}: plugin {entry} is a folder, not a .py file; {TAKES}")
                if not path.is_file():
                    raise ConfigError(f"{where}: plugin file {entry} does not exist")
                name = _module_name(path)
                if name not in sys.modules:
                    spec = importlib.util.spec_from_file_location(name, path)
                    module = importlib.util.module_from_spec(spec)
                    sys.modules[name] = module
                    try:
                        spec.loader.exec_module(module)
                    except BaseException:
                        del sys.modules[name]
                        raise
                _FILES[str(path)] = entry
            else:
                if not _is_module_name(entry):
                    raise _not_a_module(entry, where)
                try:
                    module = importlib.import_module(entry)
                except ModuleNotFoundError as exc:
                    # the entry itself is no module (not a module the plugin imports): a file or folder?
                    if exc.name is None or not (entry == exc.name or entry.startswith(exc.name + ".")):
                        raise
                    raise (_not_a_module(entry, where) or ConfigError(
                        f"{where}: plugin {entry!r}: no module of that name can be imported (No module named "
                        f"{exc.name!r}), and it is not a file; {TAKES}")) from None
                if getattr(module, "__file__", None) is None and Path(entry).is_dir():
                    # a folder without __init__.py next to the cwd imports as an empty namespace package
                    raise _not_a_module(entry, where)
                _record_module(entry, module)
        except ConfigError:
            raise
        except SystemExit as exc:
            at = _where_in_plugin(exc, entry)
            at = f" ({at.removeprefix(' at ')})" if at else ""
            raise ConfigError(f"{where}: plugin {entry!r} called sys.exit({exc.code!r}) at import{at}; a plugin is "
                              f"imported, not run: it must only define and register things (put script code under "
                              f"`if __name__ == \"__main__\":`)") from None
        except Exception as exc:
            at = _where_in_plugin(exc, entry)
            raise ConfigError(f"{where}: importing plugin {entry!r} failed{at}: {type(exc).__name__}: {exc}") from exc


def _record_module(entry: str, module) -> None:
    file = getattr(module, "__file__", None)
    if not file:
        return
    path = Path(file).resolve()
    if getattr(module, "__path__", None) is not None:   # a package: every file under its folder
        _FOLDERS[str(path.parent) + os.sep] = entry
    else:
        _FILES[str(path)] = entry


def imported_files() -> dict[str, str]:
    """``{file: entry}`` of the plugins imported so far (a package plugin: its folder, ending in
    the path separator)."""
    return {**_FILES, **_FOLDERS}


def _where_in_plugin(exc: BaseException, entry: str) -> str:
    """`` at FILE:LINE`` of the plugin's own failing line (a SyntaxError's position, else the
    deepest frame inside the plugin file or module), or "" when none is the plugin's."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f" at {exc.filename}:{exc.lineno}"
    mine = (lambda f: Path(f).resolve() == Path(entry).expanduser().resolve()) if entry.endswith(".py") else (
        lambda f: entry.replace(".", "/") in f.replace("\\", "/"))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if mine(f.filename)]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


# ----------------------------------------------------------------------------- the user's code failed
_RESOLVED: dict[str, str] = {}


def _plugin_of(filename: str) -> str | None:
    """The plugin entry whose file (or package folder) holds ``filename``, or None."""
    if not (_FILES or _FOLDERS) or not filename or filename.startswith("<"):
        return None
    real = _RESOLVED.get(filename)
    if real is None:
        real = _RESOLVED[filename] = os.path.realpath(filename)
    if real in _FILES:
        return _FILES[real]
    return next((entry for folder, entry in _FOLDERS.items() if real.startswith(folder)), None)


def _in_project(filename: str) -> bool:
    real = _RESOLVED.get(filename) or os.path.realpath(filename)
    return real.startswith(_PROJECT_ROOTS)


def plugin_failure(exc: BaseException, resumes: bool = True) -> str | None:
    """The message for ``exc`` (an exception or ``SystemExit``) when it was raised inside a
    plugin's code, else None (the project's own error: it keeps its traceback).

    Decided by where it was raised: the innermost frame of its traceback that is either a
    plugin's (``imported_files``) or the project's (gr_functional, backends, npu_ops); frames of
    other libraries (torch, numpy, the standard library) are skipped, so a torch error raised by a
    plugin's own call is the plugin's, and a project function a plugin called that fails is the
    project's. The message names the registered entry the project called (optimizer, retrieval
    model and which of its functions, loss, dataset, ...), the plugin, its FILE:LINE, the
    exception, and (``resumes``: ``grf train``) that the same command resumes."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    at = None
    for code, line in reversed(frames):
        entry = _plugin_of(code.co_filename)
        if entry is not None:
            at = (code, line, entry)
            break
        if _in_project(code.co_filename):
            return None
    if at is None:
        return None
    code, line, entry = at
    # the registered function the project called: the outermost of the plugin's frames that is one
    names = (_registered(c) for c, _ in frames if _plugin_of(c.co_filename) is not None)
    called = next((name for name in names if name), None)
    plugin = entry if entry.endswith(".py") else f"{entry!r} ({code.co_filename})"
    text = str(exc) if not isinstance(exc, SystemExit) else ""
    what = (f"called sys.exit({exc.code!r})" if isinstance(exc, SystemExit)
            else f"raised {type(exc).__name__}{f': {text}' if text else ''}")
    who = called or f"its function {code.co_name}"
    then = ("Nothing was lost: the checkpoints already written are kept, and the same command, rerun once the "
            "plugin is fixed, resumes from the last of them" if resumes else
            "Nothing was written; fix the plugin and rerun the same command")
    return f"the plugin {plugin} failed: {who} {what} (at {code.co_filename}:{line}). {then}"


def _registries() -> list:
    """Every Registry of the project's loaded modules (module-level, or in a module-level dict,
    as backends.ops.OPS holds one per op)."""
    found: dict[int, Registry] = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in _PROJECT:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Registry):
                found[id(value)] = value
            elif isinstance(value, dict):
                for item in list(value.values()):
                    held = [item] if isinstance(item, Registry) else list(getattr(item, "__dict__", {}).values())
                    found.update((id(r), r) for r in held if isinstance(r, Registry))
    return list(found.values())


def _registered(code) -> str | None:
    """``"KIND 'NAME' (FUNCTION)"`` (with which of its functions, ``"retrieval model 'm'
    (init_params: my_init)"``) of the registered entry whose function or class method ``code``
    is, or None."""
    try:
        for registry in _registries():
            for name, entry in list(registry._entries.items()):
                source = registry._origins.get(name, (None,))[0]
                parts = []
                if dataclasses.is_dataclass(entry) and not isinstance(entry, type):   # which function of it
                    parts += [(f.name, getattr(entry, f.name, None)) for f in dataclasses.fields(entry)]
                parts += [("", source), ("", entry)]
                for field, obj in parts:
                    if obj is not None and _is_code_of(code, obj):
                        which = "" if field in ("", "fn") else f"{field}: "
                        return f"{registry.kind} {name!r} ({which}{code.co_qualname})"
    except Exception:  # noqa: BLE001 - naming the entry is a courtesy; the message stands without it
        return None
    return None


def _is_code_of(code, obj) -> bool:
    """Whether ``code`` is the code of function ``obj`` (unwrapped; a partial's function) or of a
    method of class ``obj``."""
    if isinstance(obj, type):
        try:
            file = inspect.getsourcefile(obj)
        except TypeError:
            return False
        return (code.co_qualname.startswith(obj.__qualname__ + ".") and file is not None
                and os.path.realpath(file) == os.path.realpath(code.co_filename))
    obj = getattr(obj, "func", obj)           # functools.partial
    try:
        obj = inspect.unwrap(obj)
    except ValueError:
        pass
    obj = getattr(obj, "__func__", obj)       # a bound method
    return getattr(obj, "__code__", None) is code
