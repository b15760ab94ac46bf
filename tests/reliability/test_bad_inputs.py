"""The bad-input corpus: every entry gets a clear error (``grf`` exits 2 with a message naming the
file/key and the fix, never a traceback from inside numpy/torch/JAX) or a documented, tested
handling. Each failing command runs against the output folder of a finished run, and that folder
must come out byte-identical: a rejected run loses no checkpoint.

Documented handlings (README "Reliability"):
  out-of-order timestamps   each user's events are stably sorted by time: same run as sorted input
  length-1 histories        such users are dropped from training and test (need >= 2 events),
                            length-2 ones from validation (needs >= 3)
  long sequences            truncated to the most recent model.max_len events
  user ids beyond int32     fine: user ids are int64 keys, never model inputs
"""
from __future__ import annotations

import numpy as np
import pytest

from gr_functional.cli import main
from gr_functional.jagged import Jagged, JaggedError

from .common import TINY, file_digests, metrics, sets

BASE_TIME = 978_300_000


def ratings(users=30, seed=0, long_user=0):
    """ML-1M style ``UserID::MovieID::Rating::Timestamp`` rows, sorted by user then time."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(1, users + 1):
        n = long_user if (long_user and u == 1) else int(rng.integers(3, 9))
        items = rng.choice(np.arange(1, 51), size=n, replace=n > 50)
        times = BASE_TIME + np.cumsum(rng.integers(1, 10_000, n))
        rows += [[u, int(i), int(rng.integers(1, 6)), int(t)] for i, t in zip(items, times)]
    return rows


def write(path, rows):
    path.write_text("".join("::".join(str(x) for x in r) + "\n" for r in rows))
    return path


def train_args(out, data_path, *extra):
    return (["train", "--config", "quickstart", "--quiet", "--out", str(out)]
            + sets(TINY + ["train.epochs=1", "data.dataset=ml-1m", f"data.path={data_path}", *extra]))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A completed ML-1M-format run whose folder every failing command below targets."""
    root = tmp_path_factory.mktemp("bad_inputs")
    good = write(root / "ratings.dat", ratings())
    out = root / "run"
    assert main(train_args(out, good, "train.checkpoint_every=2")) == 0
    return root, out, good


def _mutate(rows, kind):
    rows = [list(r) for r in rows]
    if kind == "item_zero":
        rows[3][1] = 0
    elif kind == "item_beyond_int32":
        rows[3][1] = 2**31
    elif kind == "milliseconds":
        rows[3][3] = rows[3][3] * 1000
    elif kind == "milliseconds_all":  # every timestamp: the span fits int32 seconds, the values do not
        for r in rows:
            r[3] = r[3] * 1000
    elif kind == "all_length_1":
        first = {}
        for r in rows:
            first.setdefault(r[0], r)
        rows = list(first.values())
    return rows


# name -> (file text or row mutation, extra --set values, expected message fragments)
CORPUS = {
    "malformed_line": ("1::2::5\n", [], ["ratings.dat:5", "expected 4 fields"]),
    "non_integer_field": ("1::abc::5::978300760\n", [], ["ratings.dat:5", "(MovieID) is not an integer"]),
    "empty_file": ("", [], ["no data rows"]),
    "blank_line_inside": ("\n", [], ["ratings.dat:5", "empty line"]),
    "item_zero": ("item_zero", [], ["item id 0", "padding id"]),
    "item_beyond_int32": ("item_beyond_int32", [], ["2147483648", "does not fit int32"]),
    "milliseconds": ("milliseconds", [], ["look like milliseconds", "Convert them to seconds"]),
    "milliseconds_all": ("milliseconds_all", [], ["look like milliseconds", "Convert them to seconds"]),
    "all_length_1": ("all_length_1", [], ["split is empty", ">= "]),
    "num_items_too_small": (None, ["model.num_items=20"], ["model.num_items=20", "item ids up to"]),
    "max_tokens_below_max_len": (None, ["train.max_tokens=4"], ["max_tokens=4", "model.max_len"]),
    "wrong_type_int": (None, ["train.batch_size=abc"], ["train.batch_size", "expected an integer"]),
    "wrong_type_float": (None, ["optim.lr=fast"], ["optim.lr", "expected a number"]),
    "wrong_type_bool": (None, ["model.pos_bias=maybe"], ["model.pos_bias", "true/false"]),
    "bad_deterministic": (None, ["backend.deterministic=maybe"], ["--set backend.deterministic=maybe: 'maybe' is "
                                                                 "not one of 'auto', 'on', 'off'"]),
    "bad_precision": (None, ["backend.precision=fp8"], ["--set backend.precision=fp8", "'fp32', 'bf16', 'fp16'"]),
    "bad_accumulate": (None, ["train.accumulate=0"], ["--set train.accumulate=0: must be >= 1"]),
    "bad_max_bad_steps": (None, ["train.max_bad_steps=-1"], ["--set train.max_bad_steps=-1: must be >= 0"]),
    # [hardening]: every value range-checked at parse time, errors name the --set, not the file
    "lr_nan": (None, ["optim.lr=nan"], ["--set optim.lr=nan: must be a finite number >= 0"]),
    "temperature_zero": (None, ["loss.temperature=0"], ["--set loss.temperature=0: must be > 0"]),
    "kernel_flash": (None, ["ops.attention=flash"], ["--set ops.attention=flash", "'jagged'"]),
    "dtype_int8": (None, ["backend.dtype=int8"], ["--set backend.dtype=int8", "'float32', 'float64'"]),
    "max_len_zero": (None, ["model.max_len=0"], ["--set model.max_len=0: must be >= 1"]),
    "eval_batch_zero": (None, ["eval.batch_size=0"], ["--set eval.batch_size=0: must be >= 1"]),
    "underscore_digits": ("1::1_2::5::978300760\n", [], ["ratings.dat:5", "(MovieID) is not an integer: '1_2'"]),
    "fullwidth_digits": ("1::\uff11\uff12::5::978300760\n", [], ["ratings.dat:5", "(MovieID) is not an integer"]),
    "key_typo": (None, ["model.num_block=4"], ["--set model.num_block=4: unknown key model.num_block; did you mean "
                                               "model.num_blocks?"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CORPUS))
def test_bad_input_is_a_clear_error_and_loses_nothing(case, finished_run, capsys):
    root, out, good = finished_run
    content, extra, expected = CORPUS[case]
    data = good
    if content is not None:
        data = root / case / "ratings.dat"
        data.parent.mkdir(exist_ok=True)
        if content in ("item_zero", "item_beyond_int32", "milliseconds", "milliseconds_all", "all_length_1"):
            write(data, _mutate(ratings(), content))
        else:
            lines = good.read_text().splitlines(keepends=True)
            data.write_text("".join(lines[:4]) + content + ("".join(lines[4:]) if content else "")
                            if case != "empty_file" else "")
    before = file_digests(out)
    capsys.readouterr()
    assert main(train_args(out, data, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("grf: error: ") and "Traceback" not in err
    for fragment in expected:
        assert fragment in err, (fragment, err)
    assert file_digests(out) == before


def test_config_file_with_a_wrong_type(finished_run, tmp_path, capsys):
    _, out, _ = finished_run
    bad = tmp_path / "bad.toml"
    bad.write_text('[train]\nepochs = "ten"\n')
    before = file_digests(out)
    assert main(["train", "--config", str(bad), "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: train.epochs: expected an integer, got 'ten'" in err
    assert file_digests(out) == before


def test_changed_data_is_not_resumed(finished_run, capsys):
    """Same path and config, different content: the checkpoint's data fingerprint refuses it."""
    root, out, good = finished_run
    changed = root / "changed" / "ratings.dat"
    changed.parent.mkdir(exist_ok=True)
    write(changed, ratings(seed=1))
    before = file_digests(out)
    saved = good.read_bytes()
    try:
        good.write_bytes(changed.read_bytes())
        assert main(train_args(out, good, "train.epochs=2")) == 2
    finally:
        good.write_bytes(saved)
    assert "the training data changed" in capsys.readouterr().err
    assert file_digests(out) == before


def test_eval_of_a_damaged_checkpoint(finished_run, tmp_path, capsys):
    _, out, _ = finished_run
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes((out / "checkpoints" / "last.safetensors").read_bytes()[:-100])
    assert main(["eval", "--checkpoint", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "Traceback" not in err
    assert main(["eval", "--checkpoint", str(tmp_path / "missing.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------------- documented handling
def test_out_of_order_timestamps_are_sorted(tmp_path):
    """Shuffled lines give the same run as time-sorted ones (stable per-user sort by time)."""
    rows = ratings()
    sorted_path = write(tmp_path / "sorted.dat", rows)
    shuffled = [rows[i] for i in np.random.default_rng(3).permutation(len(rows))]
    shuffled_path = write(tmp_path / "shuffled.dat", shuffled)
    assert main(train_args(tmp_path / "a", sorted_path)) == 0
    assert main(train_args(tmp_path / "b", shuffled_path)) == 0
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (tmp_path / "b" / "metrics.jsonl").read_bytes()


def test_short_histories_long_sequences_and_huge_user_ids(tmp_path):
    """Length-1 and length-2 users train (dropped where they cannot serve), a 3000-event user is
    truncated to max_len, and a user id beyond int32 is just a key."""
    from gr_functional.data.loaders import load_movielens_1m
    from gr_functional.data.sequences import from_interactions
    from gr_functional.data.split import leave_one_out

    rows = ratings(long_user=3000)
    rows += [[31, 7, 4, BASE_TIME + 5]]                                    # 1 event
    rows += [[32, 8, 4, BASE_TIME + 5], [32, 9, 4, BASE_TIME + 6]]        # 2 events
    rows += [[5_000_000_000, 10, 3, BASE_TIME + t] for t in (1, 2, 3)]    # user id beyond int32
    path = write(tmp_path / "ratings.dat", rows)
    split = leave_one_out(from_interactions(load_movielens_1m(path), remap_items=False))
    users_train = set(split.train.user_ids.tolist())
    assert 31 not in users_train and 32 not in users_train and 5_000_000_000 in users_train
    assert 32 in set(split.test.history.user_ids.tolist()) and 32 not in set(split.valid.history.user_ids.tolist())
    assert main(train_args(tmp_path / "run", path)) == 0
    assert all(np.isfinite(m["loss"]) for m in metrics(tmp_path / "run") if m["kind"] == "train")


def test_sequence_longer_than_max_len_is_a_clear_jagged_error():
    with pytest.raises(JaggedError, match="length 17 > max_len=16; truncate it"):
        Jagged.from_sequences([np.arange(1, 18)], max_len=16)


def test_a_utf8_byte_order_mark_is_read(finished_run, tmp_path):
    _, _, good = finished_run
    data = tmp_path / "ratings.dat"
    data.write_bytes(b"\xef\xbb\xbf" + good.read_bytes())
    assert main(train_args(tmp_path / "out", data, "train.max_steps=1")) == 0
