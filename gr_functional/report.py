"""Compare runs from their output files: what ``grf report`` prints.

A run directory (runner.train) holds config.toml, metrics.jsonl, timing.jsonl and, once finished,
eval.json. This module reads only those files, so it works on finished runs, on runs still
training (their best epoch so far) and on runs made by any backend or machine. It never imports
an array library.

- ``load_run(path) -> RunFolder``: one run's evaluations, config and timings.
- ``select_epoch(records, metric)``: the epoch rule of the runner (best validation HR@10, or click
  AUC for ranking runs; first on ties).
- ``summary_table(runs, metrics, group_seeds)``: one row per run, or per group of runs that differ
  only in ``train.seed`` (mean +- sample std), with the config keys that differ between rows.
- ``curve_table(runs, metric, split)``: the metric at every evaluated epoch, one column per run,
  to compare runs at equal training (e.g. bf16 against fp32 while the bf16 run is still going).
"""
from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path
from .config import Config, migrate
from .errors import ReportError  # noqa: F401 (re-exported)
from .log import warn
from .runlock import is_held
from .task import TASKS

DEFAULT_METRICS = ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200", "ndcg@200", "mrr")
SELECT_METRIC = "hr@10"
# model.task = "ranking" (gr_functional/ranking/task.py): its default columns and epoch rule
RANKING_METRICS = ("is_click/auc", "is_click/gauc", "is_click/ne", "long_view/auc", "long_view/gauc", "auc", "gauc")
RANKING_SELECT = "is_click/auc"
# keys that say how a run was watched, not what it trained: never a reason to tell runs apart
_BOOKKEEPING = ("train.eval_every", "train.log_every", "train.checkpoint_every", "train.keep_checkpoints",
                "train.max_bad_steps", "eval.batch_size", "eval.max_users", "data.path")
# keys that change how the same math is executed (rounding, speed), not the model: seeds of one
# config run with different ones still form one group
_EXECUTION = ("backend.deterministic", "ops.attention", "backend.device", "model.attention_tile")


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """One run directory, read.

    evals: ``[{"epoch": int, "valid": {metric: float}, "test": {metric: float}}]`` in epoch order
    (a split is absent when it was not evaluated). config: the flattened config.toml,
    ``{"section.key": value}``. finished: eval.json exists and metrics.jsonl holds every evaluation
    up to its last epoch, whole. epoch_seconds: wall seconds per epoch (timing.jsonl; the last
    record of an epoch that a resume ran twice). incomplete: why a run that wrote eval.json lacks
    records (metrics.jsonl cut mid-line or shortened), "" when it does not; such a run is not
    "done". warnings: one line per damaged file, naming it and the line (``find_runs`` prints them).
    """

    path: Path
    config: dict
    evals: list
    finished: bool
    epoch_seconds: dict
    aborted: bool = False   # metrics.jsonl ends in an abort record (grf train exited 3)
    live: bool = False      # a grf train holds the folder's lock now
    incomplete: str = ""
    warnings: tuple = ()
    selected_by: str = ""   # the metric eval.json says selected its epoch ("" before eval.json)
    commits: tuple = ()     # the code's commits that trained it (timing.jsonl start/resume), "+" = uncommitted changes

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def epochs_done(self) -> int:
        return 1 + max(self.epoch_seconds, default=-1)

    @property
    def wall_seconds(self) -> float:
        """Sum of epoch times: training and evaluation, over every process that ran the run."""
        return float(sum(self.epoch_seconds.values()))

    @property
    def ranking(self) -> bool:
        return self.config.get("model.task") == "ranking"

    @property
    def select_metric(self) -> str:
        """The validation metric that selects the epoch: the one eval.json names, else the task's
        (retrieval HR@10, ranking click AUC; a plugin task's: the first metric it evaluates)."""
        if self.selected_by:
            return self.selected_by
        if self.ranking:
            return RANKING_SELECT
        valid = [m for e in self.evals for m in e.get("valid", {})]
        return SELECT_METRIC if SELECT_METRIC in valid or not valid else valid[0]

    def selected(self) -> dict | None:
        """``{"epoch", "valid_" + select_metric: its value, metric: test value...}`` of the
        selected epoch, None before any evaluation."""
        record = select_epoch(self.evals, self.select_metric)
        if record is None or "test" not in record:
            return None
        return {"epoch": record["epoch"], f"valid_{self.select_metric}": record["valid"][self.select_metric],
                **record["test"]}


def select_epoch(records: list, metric: str = SELECT_METRIC) -> dict | None:
    """The record with the best validation ``metric`` (HR@10 for retrieval; the first of equals);
    None when none has one (a ranking metric is None where undefined).

    records: ``[{"epoch", "valid": {...}, "test": {...}}]``, the runner's per-epoch history.
    """
    best = None
    for record in records:
        value = record.get("valid", {}).get(metric)
        if value is not None and (best is None or value > best["valid"][metric]):
            best = record
    return best


def _read_jsonl(path: Path) -> tuple[list, int | None, int]:
    """``(records, cut, lines)``: the JSON objects of ``path`` (none when it is absent), the number
    of its last line when that line is cut mid-record (ignored) else None, and its line count. A
    bad line elsewhere is damage: ReportError."""
    if not path.exists():
        return [], None, 0
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot be read ({exc})") from None
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            # a run killed mid-write may leave a partial last line; anything else is damage
            if number == len(lines):
                return rows, number, len(lines)
            raise ReportError(f"{path}:{number}: not a JSON line") from None
        rows.append(row)
    return rows, None, len(lines)


def _flatten(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _stored_config(values: dict) -> dict:
    """The flattened config of a run folder's config.toml as the run computed with it: moved keys
    in their place and the keys added since at the value they meant then (``config.migrate``: the
    listed exceptions, else today's default, since a key is added with a default that keeps what
    runs did), so a key written only by newer runs still tells them apart from older ones."""
    flat = _flatten(migrate(values, stored=True))
    for key, value in _flatten(dataclasses.asdict(Config())).items():
        if key.split(".")[0] in values:                  # sections a run wrote; a plugin's stay as they are
            flat.setdefault(key, _plain(value))
    return flat


def _missing(path: Path) -> ReportError:
    return ReportError(f"{path}: does not exist (no such file or directory), so it is neither a run directory nor "
                       f"a folder of them; pass folders written by grf train --out, or a folder holding them")


def load_run(path: str | Path) -> RunFolder:
    """Read the run directory ``path``; ReportError when it does not exist or holds no metrics.jsonl.

    A finished run (eval.json written) whose metrics.jsonl was cut (last line cut mid-record, or
    records of its last evaluated epochs missing) is ``incomplete``, with a warning naming the file
    and line; a run that is not live and ends in a cut line gets the warning too.
    """
    path = Path(path)
    metrics_path = path / "metrics.jsonl"
    if not path.exists():
        raise _missing(path)
    if not metrics_path.exists():
        raise ReportError(f"{path}: not a run directory (no metrics.jsonl); pass folders written by grf train")
    config = {}
    if (path / "config.toml").exists():
        try:
            config = _stored_config(tomllib.loads((path / "config.toml").read_text()))
        except tomllib.TOMLDecodeError as exc:
            raise ReportError(f"{path / 'config.toml'}: not valid TOML: {exc}") from None
    live = is_held(path)
    by_epoch: dict[int, dict] = {}
    rows, cut, n_lines = _read_jsonl(metrics_path)
    aborted = bool(rows) and rows[-1].get("kind") == "abort"
    for row in rows:
        if row.get("kind") != "eval":
            continue
        if not all(k in row for k in ("epoch", "split")):
            raise ReportError(f"{metrics_path}: an eval record lacks its epoch or split: {json.dumps(row)[:120]}")
        values = {k: v for k, v in row.items() if k not in ("kind", "split", "epoch", "step")}
        by_epoch.setdefault(row["epoch"], {"epoch": row["epoch"]})[row["split"]] = values
    evals = [by_epoch[e] for e in sorted(by_epoch)]
    timing_path = path / "timing.jsonl"
    timing, timing_cut, _ = _read_jsonl(timing_path)
    epoch_seconds = {row["epoch"]: row["seconds"] for row in timing
                     if row.get("kind") == "epoch" and "epoch" in row and "seconds" in row}
    warnings = []
    if not live:  # a live run may be writing its last line right now
        for file, line in ((metrics_path, cut), (timing_path, timing_cut)):
            if line is not None:
                warnings.append(f"{file}:{line}: the last line is cut mid-record and was ignored (the run was killed "
                                f"while writing it, or the file was truncated)")
    finished, incomplete, selected_by = False, "", ""
    if (path / "eval.json").exists():
        try:
            result = json.loads((path / "eval.json").read_text())
        except json.JSONDecodeError:
            raise ReportError(f"{path / 'eval.json'}: not valid JSON") from None
        if not isinstance(result, dict):
            raise ReportError(f"{path / 'eval.json'}: not a JSON object")
        last = result.get("last_epoch", -1)
        if str(result.get("selected_by", "")).startswith("best valid "):
            selected_by = result["selected_by"][len("best valid "):]
        recorded = evals[-1]["epoch"] if evals else None
        finished = recorded is not None and last >= recorded
        if not live:
            if recorded is None or recorded < last:
                upto = "no evaluation" if recorded is None else f"evaluations up to epoch {recorded} only"
                lacking = f"{upto}, but eval.json reports epoch {last} evaluated"
            elif result.get("last_epoch_test") is not None and "test" not in evals[-1]:
                lacking = f"no test evaluation of epoch {last}, which eval.json reports"
            else:
                lacking = ""
            if lacking:
                warnings.append(f"{metrics_path}:{n_lines}: the file ends here with {lacking}: records are "
                                f"missing (the file was cut, or replaced by an older copy); the metrics shown are "
                                f"incomplete")
            if cut is not None:
                incomplete = f"metrics.jsonl cut at line {cut}"
            elif lacking:
                incomplete = f"metrics.jsonl lacks epoch {last}"
            finished = finished and not incomplete
    commits = tuple(dict.fromkeys(row["commit"][:10] + ("+" if row.get("dirty") else "") for row in timing
                                  if row.get("kind") in ("start", "resume") and row.get("commit")))
    return RunFolder(path, config, evals, finished, epoch_seconds, aborted, live, incomplete, tuple(warnings), selected_by,
                     commits)


def find_runs(paths: list) -> list:
    """Run directories named by ``paths``: each a run, or a folder whose subfolders are runs."""
    runs = []
    for p in map(Path, paths):
        if not p.exists():
            raise _missing(p)
        if (p / "metrics.jsonl").exists():
            runs.append(load_run(p))
        elif p.is_dir() and any((c / "metrics.jsonl").exists() for c in p.iterdir()):
            runs += [load_run(c) for c in sorted(p.iterdir()) if (c / "metrics.jsonl").exists()]
        else:
            raise ReportError(f"{p}: neither a run directory nor a folder of them (no metrics.jsonl)")
    for run in runs:  # damaged files: said once, on stderr, before the table
        for warning in run.warnings:
            warn(warning)
    return runs


def differing_keys(runs: list, ignore: tuple = ()) -> list:
    """Config keys with different values in different runs, bookkeeping keys left out. A key some
    configs lack (written before the key existed) counts only among the runs that have it."""
    keys = sorted(set().union(*(r.config for r in runs))) if runs else []
    skip = set(_BOOKKEEPING) | set(ignore)
    return [k for k in keys if k not in skip
            and len({repr(r.config[k]) for r in runs if k in r.config and _reads(r, k)}) > 1]


def _reads(run: RunFolder, key: str) -> bool:
    """Whether the run's task reads ``key`` (``Task.unused_keys``): a retrieval run's ranking.*
    defaults, changed by a later version, neither tell it apart nor split its seed group."""
    found = TASKS.find(run.config.get("model.task", "retrieval"))
    section, _, name = key.partition(".")
    if found is None or section not in found.unused_keys:
        return True
    unused = found.unused_keys[section]
    return unused is not None and name not in unused


def _status(run: RunFolder) -> str:
    planned = run.config.get("train.epochs")
    if run.incomplete and not run.live:
        return f"incomplete ({run.incomplete})"
    if run.finished and not run.live:
        return "done"
    # running: a grf train holds its lock; else it ended early (killed, or aborted: exit 3)
    what = "running" if run.live else "aborted" if run.aborted else "stopped"
    return f"{what}, {run.epochs_done}/{planned} epochs" if planned else f"{what}, {run.epochs_done} epochs"


def _mean_std(values: list) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def summary_rows(runs: list, metrics=DEFAULT_METRICS, group_seeds: bool = False) -> tuple[list, list]:
    """``(keys, rows)``: the differing config keys, and one dict per run or seed group.

    A row: ``{"run", "status", "epoch", key: value..., metric: value | (mean, std), "n", "wall_s",
    "trained_at"}`` (trained_at: the commits of the code that trained it, "" where not recorded)
    (wall_s per run). With ``group_seeds`` runs equal in every differing key but ``train.seed`` and
    the execution keys (determinism, attention kernel and tile, device) form one row whose metrics
    are ``(mean, sample std)`` of their selected epochs.
    """
    keys = differing_keys(runs, ignore=("train.seed", *_EXECUTION) if group_seeds else ())
    groups: dict = {}
    for run in runs:
        groups.setdefault(tuple(repr(run.config.get(k)) for k in keys) if group_seeds else run.path, []).append(run)
    rows = []
    for members in groups.values():
        chosen = [(r, r.selected()) for r in members]
        chosen = [(r, s) for r, s in chosen if s is not None]
        row = {"run": ", ".join(r.name for r in members), "n": len(chosen),
               "status": "; ".join(sorted({_status(r) for r in members})),
               **{k: members[0].config.get(k) for k in keys}}
        if chosen:
            valid = f"valid_{members[0].select_metric}"  # the selecting value: a grid is chosen on it
            if group_seeds and len(members) > 1:
                row["epoch"] = [s["epoch"] for _, s in chosen]
                row.update({m: _mean_std([s[m] for _, s in chosen]) for m in (valid, *metrics)})
            else:
                row["epoch"] = chosen[0][1]["epoch"]
                row.update({m: chosen[0][1].get(m) for m in (valid, *metrics)})
        row["wall_s"] = sum(r.wall_seconds for r in members) / len(members)  # per run
        row["trained_at"] = ", ".join(dict.fromkeys(c for r in members for c in r.commits))
        rows.append(row)
    return keys, rows


def _cell(value) -> str:
    if isinstance(value, tuple):
        mean, std = value
        return f"{mean:.4f}" if math.isnan(std) else f"{mean:.4f} ± {std:.4f}"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, list):
        return "/".join(map(str, value))
    return "" if value is None else str(value)


def evaluated_metrics(runs: list) -> set:
    """Every metric some run evaluated (runs with other ``eval.ks`` have other ones)."""
    return {m for r in runs for e in r.evals for split in ("valid", "test") for m in e.get(split, {})}


def default_metrics(runs: list) -> list:
    """``DEFAULT_METRICS`` that some run evaluated, then the other cut-offs they have (sorted)."""
    known = evaluated_metrics(runs)
    if runs and all(r.ranking for r in runs):  # every task's metrics would be too many columns
        return [m for m in RANKING_METRICS if m in known] or list(RANKING_METRICS)
    first = [m for m in DEFAULT_METRICS if m in known]
    return first + sorted(known - set(first)) if known else list(DEFAULT_METRICS)


def check_metrics(runs: list, metrics) -> None:
    """ReportError naming the metrics no run evaluated, and the ones it did."""
    known = evaluated_metrics(runs)
    unknown = [m for m in metrics if m not in known]
    if unknown and known:
        raise ReportError(f"unknown metric(s) {', '.join(unknown)}; the runs have {', '.join(sorted(known))}")


def summary_table(runs: list, metrics=DEFAULT_METRICS, group_seeds: bool = False) -> str:
    """Markdown: run, the differing config keys, status, selected epoch, test metrics, wall time."""
    check_metrics(runs, metrics)
    keys, rows = summary_rows(runs, metrics, group_seeds)
    head = ["run", *keys, "status", "epoch", *metrics, "wall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        wall = f"{row['wall_s'] / 60:.1f} min" if row["wall_s"] else ""
        cells = [row["run"], *("" if row[k] is None else str(row[k]) for k in keys), row["status"],
                 _cell(row.get("epoch")),
                 *(_cell(row.get(m)) for m in metrics), wall]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_table(runs: list, metric: str = "hr@10", split: str = "valid") -> str:
    """Markdown: ``metric`` on ``split`` at every epoch any run evaluated, one column per run."""
    check_metrics(runs, [metric])
    epochs = sorted({e["epoch"] for r in runs for e in r.evals})
    lines = ["| epoch | " + " | ".join(r.name for r in runs) + " |", "|" + "---|" * (len(runs) + 1)]
    for epoch in epochs:
        cells = []
        for run in runs:
            record = next((e for e in run.evals if e["epoch"] == epoch), None)
            value = None if record is None or split not in record else record[split].get(metric)
            cells.append("" if value is None else f"{value:.4f}")
        lines.append(f"| {epoch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
