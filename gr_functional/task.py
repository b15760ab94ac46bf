"""Tasks: what a training run trains, as a value the one run loop (runner.py) calls.

A task supplies the data and its split, the training loader, the parameters (fresh or from a
checkpoint), the step runner (its objective inside), the evaluation hook and the metric that
selects the epoch. The loop around it (locking the folder, resuming, checkpoints, hooks, the
output files, one process or many) is the same for every task. ``model.task`` names one; the
shipped ones are ``retrieval`` (gr_functional/retrieval: GR's research HSTU, leave-one-out
HR/NDCG) and ``ranking`` (gr_functional/ranking: dlrm_v3's HSTU ranking model, per-task AUC).

A task of one's own is one module with a ``Task`` subclass and one ``register_task`` call (a
``--plugin`` file), and ``--set model.task=NAME`` trains it with ``grf train``; ``grf eval`` and
``grf report`` read its run folders as any other (tests/test_task_plugin.py registers one).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .config import Config
from .errors import ConfigError
from .registry import Registry
from .contracts import Backend, Comm


@dataclasses.dataclass
class Prepared:
    """What a task's data gives the run loop.

      cfg          the config completed from the data (e.g. ``model.num_items``); recorded in OUT
      loader       the training loader: ``position`` (epoch, batch), ``steps_per_epoch``,
                   ``state_dict()`` / ``load_state_dict(d)`` (``DataError`` when the data changed)
      fingerprint  sha256 of the data (a resume on other data is refused)
      meta         the data's record in every checkpoint: ``{"sha256", "users", "events"}``
      describe     the "data ..." line the run prints
      label        eval.json's ``"dataset"``
      payload      the task's own (sequences, splits, ...), for its other methods
    """

    cfg: Config
    loader: Any
    fingerprint: str
    meta: dict
    describe: str
    label: str
    payload: Any = None


@dataclasses.dataclass
class ModelState:
    """A run's parameters on the backend, and its sparse tables: ``host`` (a hash table's id map,
    ``embedding.lookup.EmbeddingHost``, or None) and ``shard`` (a row-sharded table, or None)."""

    params: Any
    host: Any = None
    shard: Any = None


class Task:
    """The interface the run loop calls (every method gets the resolved ``cfg``).

    ``select_metric``: the validation metric whose best epoch eval.json reports (``curve_label``
    names it on curves.png); ``unused_keys``: the config it does not read; ``rng_generator``: how the task's randomness is drawn, recorded in each
    checkpoint's meta; ``result_fields``: constant fields eval.json adds (e.g. ``{"task": ...}``)."""

    name: str = ""
    # config keys this task does not read, refused when a user sets them (a silently ignored key
    # is a result that does not mean what its config says): {section: None (all of it) | keys}
    unused_keys: dict = {}
    select_metric: str = "hr@10"
    curve_label: str = "HR@10"
    rng_generator: str = "numpy default_rng((train.seed, epoch, batch))"
    result_fields: dict = {}

    def config_rules(self, cfg: Config, fail) -> None:
        """The task's rules joining config keys, run when a config is read (``config.validate``):
        call ``fail(section, key, message)`` for the first broken one; it raises the ConfigError that
        names the key, where its value came from and, if an override broke the rule, that override."""

    @property
    def unread_sections(self) -> tuple[str, ...]:
        """Config sections this task never reads (``unused_keys`` with None): a change there (a moved
        default) changes nothing it computes, so resuming and the refactor fingerprints ignore them."""
        return tuple(section for section, keys in self.unused_keys.items() if keys is None)

    def table_dim(self, cfg: Config) -> int:
        """The width of the task's sparse embedding table (what a row kernel's limits are checked
        against): the retrieval HSTU's ``model.embed_dim`` by default."""
        return cfg.model.embed_dim

    def check(self, cfg: Config, world_size: int) -> None:
        """Refuse what the task cannot do, before any data is read (ConfigError naming the key)."""

    def prepare(self, cfg: Config, world_size: int) -> Prepared:
        """Load and check the data, complete ``cfg`` from it, build the training loader."""
        raise NotImplementedError

    def fresh(self, B: Backend, prepared: Prepared, comm: Comm) -> ModelState:
        """The parameters of a fresh run (initialised in numpy from ``train.seed``) on ``B``."""
        raise NotImplementedError

    def restore(self, B: Backend, prepared: Prepared, comm: Comm, checkpoint) -> ModelState:
        """The parameters and tables of ``checkpoint`` (``checkpoint.Checkpoint``) on ``B``."""
        raise NotImplementedError

    def host_state(self, state: ModelState, comm: Comm) -> dict | None:
        """What a checkpoint keeps of the sparse tables (called on every rank: a row-sharded table
        gathers its shards); None when there is nothing."""
        return None

    def steps(self, B: Backend, prepared: Prepared, comm: Comm, state: ModelState):
        """The step runner: ``batches(epoch, start, limit)`` and ``run(params, opt_state, micro,
        step, epoch) -> (params, opt_state, hooks.StepResult)``."""
        raise NotImplementedError

    def evaluation(self, B: Backend, prepared: Prepared, comm: Comm, state: ModelState, ckdir):
        """The evaluation hook (``hooks.Evaluation``) of the run."""
        raise NotImplementedError

    def run_files(self, prepared: Prepared) -> dict[str, str]:
        """``{path under OUT: text}`` the run writes when it starts, beside config.toml (the
        retrieval task: ``checkpoints/item_ids.tsv``, a CSV's string item ids). Default: none."""
        return {}

    def param_shapes(self, cfg: Config, host_state: dict | None) -> dict:
        """``{path: shape}`` of the params a checkpoint of this config holds (its file is checked
        against them); ``host_state``: the checkpoint's host tables."""
        raise NotImplementedError

    def evaluate_checkpoint(self, B: Backend, cfg: Config, checkpoint, split: str) -> dict:
        """``grf eval``: the metrics of ``checkpoint``'s params (and host tables) on ``split``
        ("valid" | "test"), with ``cfg`` (its config, maybe on another backend)."""
        raise NotImplementedError


def _load_shipped() -> None:
    import importlib

    for module in ("gr_functional.retrieval.task", "gr_functional.ranking.task"):
        importlib.import_module(module)


TASKS: Registry[Task] = Registry(
    "task", config_key="model.task", load=_load_shipped,
    how="A task of your own is a gr_functional.task.Task subclass registered with "
        "gr_functional.task.register_task(NAME, task) in a module passed to grf train --plugin")


def register_task(name: str, task: Task, *, replace: bool = False) -> Task:
    """Make ``model.task = name`` train ``task``.

    Args:
      name: the ``model.task`` value.
      task: a ``Task`` instance (its methods are what the run loop calls).
      replace: replace a task already registered under ``name``.
    Returns:
      ``task``. Raises ValueError for a taken name (unless the same class is registered again).
    """
    task.name = name
    TASKS.add(name, task, origin_of=type(task), replace=replace)
    return task


def unread_sections(name: str) -> tuple[str, ...]:
    """``Task.unread_sections`` of task ``name`` (none for a task not registered here)."""
    found = TASKS.find(name)
    return found.unread_sections if found is not None else ()


def table_dim(cfg: Config) -> int:
    """``Task.table_dim`` of ``cfg``'s task (``model.embed_dim`` for a task not registered here)."""
    found = TASKS.find(cfg.model.task)
    return found.table_dim(cfg) if found is not None else cfg.model.embed_dim


def task_rules(values: dict) -> tuple:
    """The ``config_rules`` of the task a config's raw values name (``model.task``; "retrieval" when
    unset), as ``config.build_config(rules=...)`` takes them; () for a name not registered (the
    registry check names it next)."""
    model = values.get("model")
    name = model.get("task", "retrieval") if isinstance(model, dict) else "retrieval"
    found = TASKS.find(name) if isinstance(name, str) else None
    return (found.config_rules,) if found is not None else ()


def get_task(name: str) -> Task:
    return TASKS.get_or(name, lambda message: ConfigError(f"model.task={name!r}: {message}"))


def check_config(cfg: Config) -> list[tuple[str, str, str]]:
    """``model.task`` must name a registered task."""
    if cfg.model.task not in TASKS:
        return [("model", "task", TASKS.unknown_message(cfg.model.task))]
    return []
