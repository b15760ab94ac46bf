"""A config as a user wrote it, resolved and fully checked: the TOML file, ``--set`` overrides, the
plugins it names imported, the schema's checks (``config.build_config``), then each registry's
check of the section it owns. The schema (``config.py``) imports nothing of the project; this
module sits above the registries so that it can ask each of them.

    cfg = load_config("experiments/configs/quickstart.toml", ["loss.name=bpr"], plugins=["my_loss.py"])
"""
from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path
from typing import Any

from backends import BACKENDS, ops

from . import hooks, losses, model, optimizers, task
from .config import (EXTENSION_KEYS, PACKAGED_CONFIGS, Config, ConfigError, build_config, config_path,  # noqa: F401
                     is_run_record, problem_message, read_values)
from .data import registry as datasets
from .log import warn
from .plugins import import_plugins, normalise


def execution_problems(cfg: Config) -> list[tuple[str, str, str]]:
    """``(section, key, reason)``: the backend is not registered, or an ``[ops]`` choice cannot run
    with it (what ``grf eval --backend`` checks of a run's config)."""
    name = cfg.backend.name
    return [("backend", "name", BACKENDS.unknown_message(name))] if name not in BACKENDS else ops.config_problems(cfg)


def _optimizer_problems(cfg: Config) -> list[tuple[str, str, str]]:
    problem = optimizers.check_config(cfg)
    return [("optim", "name", problem)] if problem else []


# Each registry's check of its own section, in the order a user would fix them.
CHECKS = (execution_problems, task.check_config, model.check_config, losses.check_config,
          hooks.check_config, datasets.check_config, _optimizer_problems)


def check_registries(cfg: Config, source: str = "<config>", origins: dict | None = None) -> None:
    """ConfigError for the first registry name of ``cfg`` that is not registered or not usable."""
    for check in CHECKS:
        for section, key, message in check(cfg):
            raise ConfigError(problem_message(cfg, section, key, message, source, origins))


def check_used(values: dict, cfg: Config, source: str = "<config>", origins: dict | None = None) -> None:
    """ConfigError for a key the user wrote that ``model.task`` does not read (``Task.unused_keys``),
    naming the key, where it came from and the task."""
    runner = task.TASKS.find(cfg.model.task)
    for section, keys in (runner.unused_keys if runner is not None else {}).items():
        written = values.get(section)
        if not isinstance(written, dict):
            continue
        for key in written if keys is None else [k for k in written if k in keys]:
            where = (origins or {}).get((section, key), source)
            raise ConfigError(f"{where}: {section}.{key}: model.task={cfg.model.task!r} does not read "
                              f"{'[' + section + ']' if keys is None else section + '.' + key} (it would be "
                              f"ignored); remove it, or set model.task to the task it configures")


def check_optimizer_keys(values: dict, cfg: Config, source: str = "<config>", origins: dict | None = None) -> None:
    """ConfigError for an ``optim.*`` key the user wrote that ``optim.name`` does not read
    (``optimizers.registry.unread_keys``: ``optim.momentum`` under adamw), naming it and who reads it."""
    written = values.get("optim")
    if not isinstance(written, dict):
        return
    origins = origins or {}
    unread = optimizers.registry.unread_keys(cfg.optim.name)
    for key in written:
        if key not in unread:
            continue
        where = origins.get(("optim", key), source)
        readers = [n for n, keys in optimizers.registry.READS.items() if key in keys]
        if ("optim", key) not in origins and ("optim", "name") in origins:
            # the file's key was for the file's optimizer, which an override replaced: say so, go on
            warn(f"{where}: optim.{key} is not read by optim.name={cfg.optim.name!r} "
                 f"({origins[('optim', 'name')]}); it is ignored")
            continue
        raise ConfigError(f"{where}: optim.{key}: optim.name={cfg.optim.name!r} does not read it (it would be "
                          f"ignored); remove it, or choose an optimizer that reads it ({', '.join(readers)})")


def _declared_by(cls: type) -> str:
    """``FILE: Class`` of a plugin file's class (its module name is made up), else ``module.Class``."""
    module = sys.modules.get(cls.__module__)
    if cls.__module__.startswith("grf_plugin_") and getattr(module, "__file__", None):
        return f"{module.__file__}: {cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def check_extension_keys(values: dict, cfg: Config, source: str = "<config>", origins: dict | None = None) -> None:
    """ConfigError for a key an extension declared (``config.register_keys``) that the user wrote
    while the choice reading it is not selected (``loss.gamma`` of the focal loss under
    ``loss.name='bce'``), naming the key, where it came from and the choice that reads it."""
    for entry in EXTENSION_KEYS.values():
        reader = entry.reader
        written = values.get(entry.section)
        if reader is None or not isinstance(written, dict):
            continue
        section, key, wanted = reader
        chosen = getattr(getattr(cfg, section), key)
        if str(chosen) == wanted:
            continue
        for name in (k for k in written if k in entry.names):
            where = (origins or {}).get((entry.section, name), source)
            raise ConfigError(f"{where}: {entry.section}.{name} is read only when {entry.when} (declared by "
                              f"{_declared_by(entry.cls)}); {section}.{key}={chosen!r} does "
                              f"not read it (it would be ignored): remove it, or set {entry.when}")


def resolve(values: dict, source: str = "<config>", origins: dict | None = None, stored: bool = False) -> Config:
    """``build_config`` plus the registries' checks: a config a user wrote (``stored``: one a run
    wrote, which lists every key: the unused ones are not refused)."""
    cfg = build_config(values, source, origins, stored=stored, rules=task.task_rules(values))
    check_registries(cfg, source, origins)
    if not stored:
        check_used(values, cfg, source, origins)
        check_optimizer_keys(values, cfg, source, origins)
        check_extension_keys(values, cfg, source, origins)
    return cfg


def validate(cfg: Config, source: str = "<config>") -> None:
    """Check a Config made in code (``dataclasses.replace``, ``config.replace``) as one read from a
    file is: types, choices, ranges, cross-key rules, registry names."""
    resolve({section.name: {f.name: getattr(getattr(cfg, section.name), f.name)
                            for f in dataclasses.fields(getattr(cfg, section.name))}
             for section in dataclasses.fields(cfg)}, source, stored=True)


def load_config(path: str | Path | None = None, overrides: list = (), plugins: list = ()) -> Config:
    """Read a TOML config, apply overrides, import its plugins and check everything (``grf.load_config``).

    Args:
      path: a TOML file, or a packaged config's name (``"quickstart"``, ``"ml1m_hstu"``:
        ``config_path``); None: the defaults.
      overrides: ``"section.key=value"`` strings (TOML values, bare words allowed), or ``(label,
        "section.key=value")`` pairs, the label naming the flag in errors.
      plugins: files or modules appended to ``train.plugins`` (``grf train --plugin``); all of them
        are imported before the config is checked, so the names and keys they register are valid.
    Returns:
      the checked ``Config``.
    Raises:
      ConfigError: naming the file or override, the key and the fix (an unknown key suggests the
        nearest one).
    """
    path = config_path(path)
    values, source, origins = read_values(path, overrides)
    _import_plugins(values, source, origins, list(plugins))
    return resolve(values, source, origins, stored=is_run_record(path))


def _import_plugins(values: dict, source: str, origins: dict, extra: list) -> None:
    train = values.get("train")
    if extra:
        values["train"] = train = dict(train) if isinstance(train, dict) else {}
        listed = train.get("plugins", ())
        if not isinstance(listed, (list, tuple)):
            return  # malformed (a string?): build_config reports it, not a split into characters
        train["plugins"] = [*listed, *extra]
        origins.setdefault(("train", "plugins"), f"--plugin {' --plugin '.join(extra)}")
    entries = train.get("plugins") if isinstance(train, dict) else None
    if not isinstance(entries, (list, tuple)) or not all(isinstance(e, str) for e in entries):
        return  # absent, or malformed: build_config reports it
    train["plugins"] = [normalise(e) for e in entries]
    import_plugins(train["plugins"], where=origins.get(("train", "plugins"), f"{source}: train.plugins"))


# ----------------------------------------------------------------------------- what a run re-imports
_PROJECT = ("gr_functional", "backends", "npu_ops")


def used_names(cfg: Config) -> list[tuple[str, Any, str]]:
    """``(config key, registry, name)`` of every registry name ``cfg`` selects."""
    return [("model.task", task.TASKS, cfg.model.task), ("model.name", model.MODELS, cfg.model.name),
            ("loss.name", losses.LOSSES, cfg.loss.name), ("data.dataset", datasets.DATASETS, cfg.data.dataset),
            ("optim.name", optimizers.OPTIMIZERS, cfg.optim.name),
            *[("train.hooks", hooks.HOOKS, name) for name in cfg.train.hooks],
            *[(f"ops.{op}", ops.get_op(op).impls, name) for op, name in ops.choices(cfg).items()]]


def _has_main_guard(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
               and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
               for node in tree.body)


def plugins_in_use(cfg: Config) -> tuple[str, ...]:
    """The modules that registered the names ``cfg`` uses and that ``train.plugins`` does not list
    (a model, loss or optimizer registered in the script that calls ``grf.fit``, or in a module it
    imported): the entries to append to ``train.plugins``, so that a resume or ``grf eval`` imports
    them again. A script (``__main__``) is listed as its file, which must keep its training under
    ``if __name__ == "__main__":`` (importing it must not train again); a name registered where no
    file holds it (an interactive session) is a ConfigError saying how to fix it."""
    listed = set(cfg.train.plugins)
    found: list[str] = []
    # the classes declaring extension keys: their module must be imported again to read the keys
    declared = [(f"[{entry.section}] keys", entry.cls.__qualname__, entry.cls) for entry in EXTENSION_KEYS.values()]
    for key, name, source in [(key, name, registry.source(name) if name in registry else None)
                              for key, registry, name in used_names(cfg)] + declared:
        module = sys.modules.get(getattr(source, "__module__", None) or "")
        if module is None or module.__name__.split(".")[0] in _PROJECT:
            continue
        file = getattr(module, "__file__", None)
        path = str(Path(file).resolve()) if file else None
        if module.__name__ == "__main__":
            if path is None or not Path(path).is_file():
                raise ConfigError(f"{key}={name!r} is registered in an interactive session, which a resume or grf "
                                  f"eval cannot import again: define it in a .py file and pass it with grf train "
                                  f"--plugin FILE (or train.plugins)")
            if not _has_main_guard(Path(path)):
                raise ConfigError(f"{key}={name!r} is registered by the script {path}, which a resume or grf eval "
                                  f"imports again to find it: put the script's training under `if __name__ == "
                                  f"\"__main__\":` (importing it must not train), or move the registration to a module "
                                  f"listed in train.plugins")
            entry = path
        elif module.__name__.startswith("grf_plugin_") and path:
            entry = path  # a plugin file imported by path (plugins.import_plugins)
        else:
            entry = module.__name__
        if entry not in listed and entry not in found:
            found.append(entry)
    return tuple(found)


__all__ = ["CHECKS", "check_extension_keys", "check_registries", "execution_problems", "load_config", "plugins_in_use", "resolve", "used_names",
           "validate"]
