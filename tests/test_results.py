"""Results as data (gr_functional/results.py): ``--record`` writes what a command printed under a stamp
(command, date, commit, machine), and the documentation's results page is generated from such files
(tools/gen_docs.py), never typed."""
from __future__ import annotations

import importlib.util

from gr_functional import results
from gr_functional.cli import main

from .reliability.common import ROOT, TINY, sets


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_record_writes_stamped_rows_and_the_results_page_shows_them(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", "quickstart", "--quiet", "--out", str(run), *sets(TINY + ["train.epochs=1"])]) == 0
    record = tmp_path / "results" / "quality" / "tiny.jsonl"
    assert main(["report", str(run), "--record", str(record)]) == 0
    stamp, rows = results.read(record)
    assert stamp["command"].startswith("grf report") and stamp["date"] and stamp["machine"]["cpus"] >= 1
    assert len(stamp["commit"]) in (0, 40) and len(rows) == 1 and "hr@10" in str(rows[0])
    # the commit the run was trained at (timing.jsonl), beside the one the report ran at
    assert rows[0]["trained_at"].rstrip("+") == stamp["commit"][:10]
    gen = _gen_docs()
    monkeypatch.setattr(gen, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    page = gen.results_page()
    assert "## results/quality/tiny.jsonl" in page and stamp["date"] in page and "grf report" in page


def test_a_plot_is_stale_once_its_data_changes(tmp_path, monkeypatch):
    """Plots are SVGs drawn from a results file, their title the data's sha256 (SVG bytes vary with
    the matplotlib version; the data does not): the check fails once the data moves on."""
    import shutil

    gen = _gen_docs()
    rel = "bench/attention.jsonl"
    (tmp_path / "results" / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "results" / rel, tmp_path / "results" / rel)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(gen, "PLOTS_DIR", tmp_path / "plots")
    assert gen.stale_plots()  # not drawn yet
    gen.draw_plots()
    assert gen.stale_plots() == []
    with open(tmp_path / "results" / rel, "a") as f:
        f.write('{"backend": "torch", "variant": "new", "truncation": 256, "seconds": 1.0}\n')
    assert gen.stale_plots()


def test_a_table_in_a_written_page_is_generated_from_its_results_file(tmp_path, monkeypatch):
    """A ``grf:table`` block: the prose around it is written, its rows come from the results file
    (filtered, formatted, under the command and commit that measured them), and a page whose block
    no longer matches its data is named by the check."""
    gen = _gen_docs()
    (tmp_path / "results").mkdir()
    results.write(tmp_path / "results" / "b.jsonl", "grf bench b --record",
                  [{"backend": "torch", "mfu": 0.337, "bytes": 3 * 2**20, "hr": [0.3, 0.001]},
                   {"backend": "jax", "mfu": 0.2, "bytes": 2**20, "hr": [0.31, 0.002]}])
    page = tmp_path / "docs" / "speed.md"
    page.parent.mkdir()
    page.write_text('Prose.\n<!-- grf:table results/b.jsonl columns="backend, mfu:MFU:.1%, bytes:MiB:MiB, hr:HR@10:±" '
                    'where="backend:torch" -->\nold\n<!-- grf:end -->\nMore prose.\n'
                    '```markdown\n<!-- grf:table results/NAME.jsonl columns="x" -->\n<!-- grf:end -->\n```\n')
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    text = gen.fill_tables(page.read_text(), page)
    assert text.startswith("Prose.\n<!-- grf:table") and "<!-- grf:end -->\nMore prose.\n" in text
    assert text.endswith('```markdown\n<!-- grf:table results/NAME.jsonl columns="x" -->\n<!-- grf:end -->\n```\n')
    # (an example block in fenced code, as docs/extending/benchmark.md shows one, is left as written)
    assert "| torch | 33.7% | 3 | 0.3000 ± 0.0010 |" in text and "| jax |" not in text
    assert "`grf bench b --record`" in text and "old" not in text
    assert gen.fill_tables(text, page) == text  # generated once, stable
    page.write_text(text.replace("33.7%", "40.0%"))
    assert gen.written_pages() == [page]
    assert gen.fill_tables(page.read_text(), page) != page.read_text()  # what --check compares: a typed figure shows
