"""Dataset "synthetic": the generator of ``gr_functional/data/synthetic.py`` (no file needed)."""
from __future__ import annotations

from pathlib import Path

from ..registry import DatasetSpec, register_dataset
from ..sequences import SequenceData
from ..synthetic import make_synthetic


def load_synthetic(cfg, path: Path | None) -> SequenceData:
    """``make_synthetic`` with the ``data.synthetic_*`` / ``zipf_a`` / ``seed`` keys (item ids
    1..synthetic_items; ``data.remap_items`` is applied by ``load_dataset``)."""
    return make_synthetic(cfg.synthetic_users, cfg.synthetic_items, cfg.synthetic_max_events, cfg.zipf_a, cfg.seed)


register_dataset(DatasetSpec("synthetic", "synthetic", load_synthetic, needs_file=False))
