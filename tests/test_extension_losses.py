"""Extension point: a loss registered from outside the package (a plugin file, as a user writes
one) trained with `grf train`, recorded in config.toml and the checkpoint, refused on a resume
under another loss; legacy `[model] temperature` configs; the public `prepare` call."""
from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from gr_functional import losses
from gr_functional.checkpoint import read_checkpoint as load_checkpoint
from gr_functional.cli import main
from gr_functional.config import ConfigError, build_config
from gr_functional.configure import load_config

from .reliability.common import TINY, sets

PLUGIN = textwrap.dedent('''
    import gr_functional as grf

    @grf.losses.register("test_bpr", negatives="sampled")
    def test_bpr(B, user, items, batch, cfg):
        """BPR: -log sigmoid(pos - neg), averaged over the sampled negatives."""
        xp = B.xp
        pos = grf.losses.positive_logits(B, user, items, batch.targets, cfg.temperature)
        neg = B.sampled_logits(user, items, batch.negatives) / cfg.temperature
        margin = xp.reshape(pos, (-1, 1)) - neg
        nll = xp.mean(B.logsumexp(xp.stack([xp.zeros_like(margin), -margin]), axis=0), axis=1)
        total = xp.sum(batch.weights)
        return xp.sum(nll * batch.weights) / xp.maximum(total, xp.ones_like(total))
''')


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "my_losses.py"
    path.write_text(PLUGIN)
    return path


@pytest.fixture(scope="module")
def bpr_run(plugin, tmp_path_factory):
    out = tmp_path_factory.mktemp("bpr")
    code = main(["train", "--config", "quickstart", "--quiet", "--plugin", str(plugin), "--out", str(out),
                 *sets(TINY + ["loss.name=test_bpr", "train.epochs=1"])])
    assert code == 0
    return out


def test_a_plugin_loss_trains_and_is_recorded(bpr_run, plugin):
    text = (bpr_run / "config.toml").read_text()
    assert 'name = "test_bpr"' in text and str(plugin) in text
    ck = load_checkpoint(bpr_run / "checkpoints" / "last.safetensors")
    assert ck.config.loss.name == "test_bpr" and ck.config.train.plugins == (str(plugin),)
    lines = [json.loads(x) for x in (bpr_run / "metrics.jsonl").read_text().splitlines()]
    train = [x["loss"] for x in lines if x["kind"] == "train"]
    assert train and all(np.isfinite(train))


def test_resume_under_another_loss_is_refused(bpr_run, capsys):
    before = sorted(p.name for p in (bpr_run / "checkpoints").iterdir())
    code = main(["train", "--config", "quickstart", "--quiet", "--out", str(bpr_run),
                 *sets(TINY + ["loss.name=in_batch", "train.epochs=2"])])
    err = capsys.readouterr().err
    assert code == 2
    assert "loss.name: checkpoint 'test_bpr', now 'in_batch'" in err and "--fresh" in err
    assert sorted(p.name for p in (bpr_run / "checkpoints").iterdir()) == before


def test_resume_with_the_plugin_recorded_in_the_config_continues(bpr_run, plugin, capsys):
    # the config.toml of the run lists the plugin: resuming from it imports it again
    code = main(["train", "--config", str(bpr_run / "config.toml"), "--quiet", "--out", str(bpr_run),
                 "--set", "train.epochs=2"])
    assert code == 0, capsys.readouterr().err
    assert load_checkpoint(bpr_run / "checkpoints" / "last.safetensors").meta["epoch"] == 1


def test_eval_of_a_plugin_checkpoint_imports_the_plugin(bpr_run, capsys):
    out = bpr_run / "eval.json.test"
    assert main(["eval", "--checkpoint", str(bpr_run / "checkpoints" / "last.safetensors"),
                 "--out", str(out)]) == 0
    assert 0.0 <= json.loads(out.read_text())["hr@10"] <= 1.0


def test_an_unregistered_loss_names_the_registered_ones_and_the_fix(capsys):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["loss.name=sampled_sofmax"])
    message = str(err.value)
    assert "did you mean 'sampled_softmax'?" in message and "in_batch" in message and "--plugin" in message


def test_a_broken_plugin_names_its_own_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("x = 1\nraise RuntimeError('oops')\n")
    with pytest.raises(ConfigError) as err:
        load_config(None, plugins=[str(bad)])
    assert f"{bad}:2" in str(err.value) and "RuntimeError: oops" in str(err.value)


def test_register_refuses_a_taken_name_and_a_bad_negatives_kind():
    with pytest.raises(ValueError, match="already registered"):
        losses.register("sampled_softmax", lambda *a: None)
    with pytest.raises(ValueError, match="negatives='uniform' is not one of"):
        losses.register("x", lambda *a: None, negatives="uniform")


def test_legacy_model_temperature_is_migrated_in_stored_configs_and_refused_in_user_files(tmp_path):
    old = {"model": {"temperature": 0.1, "num_negatives": 32, "embed_dim": 16}}
    cfg = build_config(old, source="ck (embedded config)", stored=True)
    assert (cfg.loss.temperature, cfg.loss.num_negatives, cfg.loss.name) == (0.1, 32, "sampled_softmax")
    path = tmp_path / "old.toml"
    path.write_text("[model]\ntemperature = 0.1\n")
    with pytest.raises(ConfigError, match=r"model.temperature moved to loss.temperature"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"--set model.num_negatives=8: model.num_negatives moved to loss.num_negatives"):
        load_config(None, ["model.num_negatives=8"])


def test_prepare_yields_the_batches_grf_train_trains_on():
    import gr_functional as grf
    from gr_functional.data import batching, leave_one_out, load_dataset

    exp = grf.prepare("quickstart", TINY)
    first = next(exp.batches(epoch=1))
    data = load_dataset(exp.cfg.data)
    loader = batching.TrainLoader.from_config(leave_one_out(data).train, exp.cfg)
    again = loader.batch(1, 0)
    np.testing.assert_array_equal(first.targets, again.targets)
    np.testing.assert_array_equal(first.negatives, again.negatives)
    B = exp.backend()
    params = B.asarray_tree(exp.init_params())
    loss = grf.model.loss_fn(B, params, B.asarray_tree(first), exp.cfg.model, loss=exp.cfg.loss)
    assert np.isfinite(float(loss))
    assert set(exp.evaluate(B, params, "valid")) >= {"hr@10", "ndcg@10", "mrr"}
