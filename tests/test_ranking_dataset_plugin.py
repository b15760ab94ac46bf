"""A ranking dataset of one's own is one plugin file: ``register_dataset(DatasetSpec(..., task="ranking"))``
whose loader returns ranking sequences; ``grf train --plugin FILE --set data.dataset=NAME`` trains the
ranking model on it (no edit of the package), and the run records the plugin."""
from __future__ import annotations

from .reliability.common import metrics
from .test_ranking_train import _run
import pytest

PLUGIN = '''
from gr_functional.data.registry import DatasetSpec, register_dataset
from gr_functional.data.sources.kuairand_ranking_synthetic import synthetic_ranking


def load_small_stream(cfg, path):
    """A ranking stream of my own: the synthetic generator with a steeper popularity curve."""
    d = cfg.data
    return synthetic_ranking(d.synthetic_users, d.synthetic_items, d.synthetic_max_events, 1.6, seed=7,
                             min_events=3 * cfg.ranking.num_candidates + 1)


register_dataset(DatasetSpec("my-ranking-stream", "My ranking stream", load_small_stream, needs_file=False,
                             task="ranking"))
'''


@pytest.mark.slow
@pytest.mark.data("kuairand-user-features", "kuairand-video-features")   # the ranking model's feature tables
def test_a_ranking_dataset_registered_by_a_plugin_trains(tmp_path):
    plugin = tmp_path / "my_ranking_stream.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "run"
    proc = _run(out, "data.dataset=my-ranking-stream", "train.epochs=1", f"train.plugins=[\"{plugin}\"]")
    assert proc.returncode == 0, proc.stderr
    text = (out / "config.toml").read_text()
    assert 'dataset = "my-ranking-stream"' in text and str(plugin) in text
    assert [r for r in metrics(out) if r["kind"] == "train"]
