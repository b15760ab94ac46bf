"""A CSV's string item ids: saved beside the run's checkpoints (checkpoints/item_ids.tsv) and checked
by grf eval, which refuses the checkpoint when the file's ids changed since training (round 4: the
mapping was not saved, and eval silently read the rows as other items)."""
import json

from gr_functional.cli import main


def _csv(path, extra_item: str = "") -> None:
    rows = ["user_id,item_id,timestamp"]
    for u in range(40):
        for k in range(12):
            rows.append(f"{u},SKU{(u * 7 + k * 3) % 50:03d},{1000 + 10 * k}")
    if extra_item:
        rows.append(f"0,{extra_item},5")
    path.write_text("\n".join(rows) + "\n")


def test_string_item_ids_are_saved_and_checked_by_eval(tmp_path, capsys):
    data, out = tmp_path / "events.csv", tmp_path / "run"
    _csv(data)
    sets = ["data.dataset=csv", f"data.path={data}", "model.max_len=16", "model.embed_dim=16", "model.dqk=8",
            "model.dv=8", "loss.num_negatives=8", "train.epochs=1", "train.batch_size=16", "eval.batch_size=64"]
    args = ["train", "--quiet", "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 0
    table = (out / "checkpoints" / "item_ids.tsv").read_text().splitlines()
    assert table[0] == "id\traw_id" and table[1] == "1\tSKU000" and len(table) == 51
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["hr@10"] >= 0
    _csv(data, extra_item="SKU000A")  # one new string id: every later id shifts by one
    assert main(["eval", "--checkpoint", str(out)]) == 2
    err = capsys.readouterr().err
    assert "item_ids.tsv: the run's item ids do not match" in err and "'2\\tSKU001'" in err
