"""From a config to real batches in one call: the public entry point of an experiment script.

    import gr_functional as grf

    exp = grf.prepare("ml1m_hstu", ["train.batch_size=32"])   # data read, split, checked
    B = exp.backend()                                          # the backend of cfg.backend
    params = B.asarray_tree(exp.init_params())
    for batch in exp.batches(epoch=0):                         # HSTUBatch (numpy) of real users
        loss = grf.model.loss_fn(B, params, B.asarray_tree(batch), exp.cfg.model, loss=exp.cfg.loss)
    exp.evaluate(B, params, split="valid")                     # {"hr@10": ..., "ndcg@10": ..., ...}

The batches are exactly the ones ``grf train`` trains on with the same config (same users, order,
negatives of ``loss.name`` and dropout masks); ``grf.fit(exp.cfg, out)`` runs the whole loop.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

# Nothing in the package imports this module (grf.prepare loads it on first use), so it imports what
# it calls at module level: no circle to keep apart.
from . import model
from .batch import HSTUBatch
from .config import Config, ConfigError, replace
from .configure import load_config, validate
from .contracts import Backend
from .embedding.lookup import make_host, table_params
from .optim import resolve_schedule
from .plugins import import_plugins, normalise
from .retrieval.task import RetrievalTask, evaluate
from .runtime import make_backend
from .task import get_task


@dataclasses.dataclass
class Experiment:
    """A config resolved against its data (``model.num_items`` and a run-long ``optim.decay_steps``
    filled in), the data, its leave-one-out split and the training loader
    (``data.batching.TrainLoader``)."""

    cfg: Config
    data: object     # data.SequenceData
    splits: object   # data.Split: train / valid / test
    loader: object   # data.batching.TrainLoader over splits.train

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[HSTUBatch]:
        """The training batches of ``epoch`` from batch ``start`` on (numpy; ``B.asarray_tree``
        moves one to a backend). Random access, does not move the loader's position."""
        for step in range(start, self.loader.steps_in_epoch(epoch)):
            yield self.loader.batch(epoch, step)

    def backend(self, name: str | None = None, device: str | None = None):
        """The backend ``cfg.backend`` names (kernel, dtype, determinism applied), or backend
        ``name`` with the same dtype and precision and its default kernels."""

        cfg = self.cfg
        if name is not None and name != cfg.backend.name:
            cfg = replace(cfg, backend={"name": name, "device": ""}, ops={f.name: "default" for f in dataclasses.fields(cfg.ops)})
        return make_backend(cfg, device)

    def init_params(self, seed: int | None = None) -> dict:
        """Fresh parameters (numpy), as ``grf train`` initialises them (``train.seed`` by default);
        with ``embedding.kind = "hash"`` the item table has ``embedding.capacity + 1`` zero rows."""

        dense = model.model_of(self.cfg.model).init_params(self.cfg.model,
                                                           seed=self.cfg.train.seed if seed is None else seed)
        return table_params(dense, make_host(self.cfg, dense["item_emb"]))

    def embedding_host(self):
        """A fresh ``embedding.lookup.EmbeddingHost``: with a row-sparse embedding optimizer,
        ``host.prepare([batch], step)`` maps a step's ids to table rows (in step order) and
        returns the batches ``step.make_train_step`` takes."""

        return make_host(self.cfg)

    def evaluate(self, B: Backend, params, split: str = "valid", host=None) -> dict:
        """HR@K / NDCG@K / MRR (``eval.ks``) of ``params`` on the ``valid`` or ``test`` split,
        full-catalogue ranking as ``grf train`` evaluates (``host``: a hash table's)."""

        if self.cfg.embedding.kind == "hash" and host is None:
            raise ValueError("evaluate: a hash table's rows are not indexed by id; pass host= (the "
                             "EmbeddingHost that mapped the training ids, exp.embedding_host())")
        return evaluate(B, params, self.cfg, getattr(self.splits, split), self.data.candidates, host=host)


def prepare(config: Config | str | Path | None = None, overrides: list = (), plugins: list = ()) -> Experiment:
    """The data, split and training loader of a retrieval config, as ``grf train`` builds them (``grf.prepare``).

    Args:
      config: a ``Config``, or a TOML path / packaged config name (``"quickstart"``, ``"ml1m_hstu"``);
        None: the defaults.
      overrides: ``--set``-style ``"section.key=value"`` strings (not with a ``Config``: change one
        with ``gr_functional.config.replace``).
      plugins: files or modules to import first (``grf train --plugin``).
    Returns:
      an ``Experiment``: ``cfg`` (completed from the data), ``data``, ``splits``, ``loader``;
      ``batches(epoch)``, ``init_params()``, ``backend(name)``, ``evaluate(B, params, split)``.
    Raises:
      ConfigError / DataError: with the messages ``grf train`` prints.
    """

    if isinstance(config, Config):
        if overrides:
            raise TypeError("prepare(Config, overrides): change a Config with gr_functional.config.replace(cfg, "
                            "model={...}); overrides apply to a config file or name")
        entries = tuple(normalise(e) for e in (*config.train.plugins, *plugins))
        import_plugins(entries)
        cfg = replace(config, train={"plugins": tuple(dict.fromkeys(entries))})  # recorded: grf.fit(exp.cfg) keeps them
        validate(cfg)
    else:
        cfg = load_config(config, list(overrides), plugins=list(plugins))
    task = get_task(cfg.model.task)
    if not isinstance(task, RetrievalTask):
        raise ConfigError(f"model.task={cfg.model.task!r}: grf.prepare gives a retrieval Experiment (sequences, "
                          f"leave-one-out splits, its loader); train this task with grf.fit / grf train")
    prepared = task.prepare(cfg, world_size=1)  # what grf train does: the same data, checks and loader
    data, splits = prepared.payload
    return Experiment(resolve_schedule(prepared.cfg, prepared.loader.steps_per_epoch), data, splits, prepared.loader)
