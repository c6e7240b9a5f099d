"""`meshfl report RUN_DIR`: figures and a short markdown summary of a finished run.

Reads what the nodes wrote (<node>/metrics.jsonl, <node>/info.json, the coordinator's
metrics and config.yaml) and draws:

* accuracy.png: every node's test accuracy per round, and their mean;
* matrix-<measure>.png: who learns from whom, one heatmap per measure the algorithm
  records (aggregation weights, FedC²I influence vectors, pFedSV Shapley values,
  pFedLIA lazy scores and groups, FedReMa relevant sets). Rows are learners, columns
  the peers they learn from; nodes are ordered and labelled by their true cluster,
  group or domain where the partition has one;
* report.md: the run's settings, a per-node table and what each figure shows.

matplotlib is an optional extra (`pip install meshfl[report]`), imported only here.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshfl.node import config as cfgmod
from meshfl.node.metrics import RoundRecord

from . import run_folder
from .errors import UserError
from .measures import measures_of, node_decisions
from .run_folder import RunRecords, natural_order

MAX_ANNOTATED = 12  # cells carry their value as text up to this many nodes

Rows = dict[str, dict[str, float]]  # learner -> peer -> value


# --------------------------------------------------------------------------- reading a run


def read_run(folder: Path) -> RunRecords:
    """The run to report on: every node that finished a round, with what it recorded."""
    if not folder.is_dir():
        raise UserError(f"RUN_DIR: {folder} is not a folder")
    run = run_folder.read_run(folder)
    recorded = {name: rounds for name, rounds in run.history.items() if rounds}
    if not recorded:
        raise UserError(
            f"RUN_DIR: no <node>/metrics.jsonl with a finished round under {folder}; "
            "give the --out folder of `meshfl launch` or `meshfl node`"
        )
    return dataclasses.replace(run, history=recorded)


# --------------------------------------------------------------------------- measures


@dataclass(frozen=True)
class MatrixMeasure:
    """One who-learns-from-whom quantity: per round, a row of values for each learner."""

    key: str
    title: str  # what the matrix is
    cell: str  # what one cell means, for the colour bar
    rows: Callable[[RunRecords], dict[int, Rows]]  # round -> learner -> peer -> value
    signed: bool = False  # values of both signs: a diverging colour scale around 0
    absent_is_zero: bool = True  # a peer missing from a row: 0 (not used) or not measured
    averaged: bool = True  # also show the mean over rounds (not for running totals)


def node_rows(extract: Callable[[RoundRecord], Any]) -> Callable[[RunRecords], dict[int, Rows]]:
    """Rows from each node's own metrics: `extract(record)` is that node's row or None."""

    def rows(run: RunRecords) -> dict[int, Rows]:
        by_round: dict[int, Rows] = {}
        for name, records in run.history.items():
            for record in records:
                row = extract(record)
                if row:
                    by_round.setdefault(record.round, {})[name] = _as_row(row)
        return by_round

    return rows


def _as_row(row: dict[str, Any] | list[str]) -> dict[str, float]:
    """A mapping of peer values, or a list of chosen peers (each counted as 1)."""
    if isinstance(row, list):
        return {peer: 1.0 for peer in row}
    return {peer: float(value) for peer, value in row.items()}


def diagnostic(key: str) -> Callable[[RoundRecord], Any]:
    return lambda record: (record.diagnostics or {}).get(key)


def relevant_set_rows(run: RunRecords) -> dict[int, Rows]:
    """FedReMa's relevant sets, chosen by the coordinator in its CCP rounds."""
    return {
        record.round: {client: _as_row(members) for client, members in sets.items()}
        for record in run.coordinator
        if (sets := (record.diagnostics or {}).get("relevant_sets"))
    }


WEIGHTS = MatrixMeasure(
    "weights",
    "Aggregation weights",
    "weight of the column's model in the row's new model",
    node_rows(lambda record: record.weights),
)
IN_SET = "1: the column is in the row's {0}, 0: it is not"
# Which of them a rule's run shows: its `matrices` in launch/measures.py.
MATRIX_MEASURES = {
    "weights": WEIGHTS,
    "influence_vector": MatrixMeasure(
        "influence_vector",
        "FedC²I client-level influence λ",
        "influence λ of the column's model on the row",
        node_rows(diagnostic("influence_vector")),
    ),
    "shapley": MatrixMeasure(
        "shapley",
        "pFedSV Shapley values",
        "Shapley value of the column for the row (> 0: it adds to the row's val accuracy)",
        node_rows(diagnostic("shapley")),
        signed=True,
        absent_is_zero=False,
    ),
    "lazy_scores": MatrixMeasure(
        "lazy_scores",
        "pFedLIA lazy-influence scores",
        "the column's lazy-influence score, summed over rounds (> 0: it helps the row)",
        node_rows(diagnostic("lazy_scores")),
        signed=True,
        absent_is_zero=False,
        averaged=False,
    ),
    "group": MatrixMeasure(
        "group",
        "pFedLIA groups found",
        IN_SET.format("group"),
        node_rows(diagnostic("group")),
        averaged=False,
    ),
    "neighbours": MatrixMeasure(
        "neighbours",
        "Neighbours (a bounded mesh's active views)",
        IN_SET.format("neighbours when its round began") + " (mean: the share of rounds it is)",
        node_rows(lambda record: record.neighbours),
    ),
    "relevant_sets": MatrixMeasure(
        "relevant_sets",
        "FedReMa relevant sets",
        IN_SET.format("relevant set") + " (mean: the share of rounds it is in it)",
        relevant_set_rows,
    ),
}


def matrix_measures_for(run: RunRecords) -> list[tuple[MatrixMeasure, dict[int, Rows]]]:
    """The rule's matrix measures that the run recorded, with their rows; any found where
    no config names the rule (`meshfl node` writes none)."""
    keys = measures_of(run.algorithm).matrices if run.config else list(MATRIX_MEASURES)
    if "neighbours" not in keys:
        keys = [*keys, "neighbours"]  # any rule's, where the mesh was bounded
    found = []
    for key in keys:
        measure = MATRIX_MEASURES[key]
        rows = measure.rows(run)
        if rows:
            found.append((measure, rows))
    return found


# --------------------------------------------------------------------------- matrices


@dataclass
class Matrix:
    names: list[str]  # row and column order
    values: list[list[float]]  # nan: not measured
    caption: str  # which rounds


def node_order(run: RunRecords, extra: list[str]) -> list[str]:
    """Every node (with any named only in rows), grouped by its true cluster if known."""
    names = list(dict.fromkeys([*run.history, *sorted(extra, key=natural_order)]))

    def cluster_first(name: str) -> tuple[str, list[Any]]:
        truth = run.truth(name)
        return (str(truth[1]) if truth else "", natural_order(name))

    return sorted(names, key=cluster_first)


def final_matrix(run: RunRecords, measure: MatrixMeasure, by_round: dict[int, Rows]) -> Matrix:
    """Each learner's row of the last round it recorded one."""
    last: dict[str, tuple[int, dict[str, float]]] = {}
    for round_no in sorted(by_round):
        for learner, row in by_round[round_no].items():
            last[learner] = (round_no, row)
    names = node_order(run, _everyone(by_round))
    rounds = {round_no for round_no, _ in last.values()}
    caption = f"last round ({rounds.pop()})" if len(rounds) == 1 else "each node's last round"
    rows = {learner: row for learner, (_, row) in last.items()}
    return Matrix(names, _grid(names, rows, measure), caption)


def mean_matrix(run: RunRecords, measure: MatrixMeasure, by_round: dict[int, Rows]) -> Matrix:
    """Each cell's mean over the rounds in which its learner recorded a row."""
    names = node_order(run, _everyone(by_round))
    grids = [_grid(names, rows, measure) for rows in by_round.values()]
    values = [
        [_nanmean([grid[i][j] for grid in grids]) for j in range(len(names))]
        for i in range(len(names))
    ]
    first, last = min(by_round), max(by_round)
    caption = f"mean over rounds {first}-{last}" if first != last else f"round {first}"
    return Matrix(names, values, caption)


def _everyone(by_round: dict[int, Rows]) -> list[str]:
    return list(
        {
            name
            for rows in by_round.values()
            for learner, row in rows.items()
            for name in (learner, *row)
        }
    )


def _grid(names: list[str], rows: Rows, measure: MatrixMeasure) -> list[list[float]]:
    absent = 0.0 if measure.absent_is_zero else math.nan
    return [
        [rows[learner].get(peer, absent) if learner in rows else math.nan for peer in names]
        for learner in names
    ]


def _nanmean(values: list[float]) -> float:
    present = [value for value in values if not math.isnan(value)]
    return statistics.fmean(present) if present else math.nan


# --------------------------------------------------------------------------- drawing


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UserError(
            "meshfl report draws with matplotlib, which is not installed: "
            "pip install 'meshfl[report]'"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib.figure import Figure

    return Figure


def node_label(run: RunRecords, name: str) -> str:
    truth = run.truth(name)
    return f"{name} ({truth[0]} {truth[1]})" if truth else name


def draw_accuracy(run: RunRecords, path: Path) -> None:
    figure = _matplotlib()(figsize=(8, 4.8), layout="constrained")
    axes = figure.subplots()
    curves = {
        name: [(record.round, _test_acc(record)) for record in _evaluated(records)]
        for name, records in run.history.items()
    }
    for name, points in curves.items():
        axes.plot(
            *zip(*points, strict=True),
            marker="o",
            markersize=3,
            linewidth=1,
            alpha=0.8,
            label=node_label(run, name),
        )
    mean = _mean_curve(curves)
    axes.plot(
        *zip(*mean, strict=True),
        color="black",
        linewidth=2.5,
        linestyle="--",
        label="mean over nodes",
    )
    axes.set(
        title=f"Test accuracy per round: {_headline(run)}",
        xlabel="round",
        ylabel="test accuracy (each node's own test split)",
        ylim=(0, 1.02),
    )
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.grid(alpha=0.3)
    columns = 1 if len(curves) <= 12 else 2
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", ncol=columns)
    figure.savefig(path, dpi=120)


def _evaluated(records: list[RoundRecord]) -> list[RoundRecord]:
    """The records of the rounds the node was tested in."""
    return [record for record in records if record.test_acc is not None]


def _test_acc(record: RoundRecord) -> float:
    """The test accuracy of a record that `_evaluated` kept."""
    assert record.test_acc is not None, "an evaluated round"
    return record.test_acc


def _mean_curve(curves: dict[str, list[tuple[int, float]]]) -> list[tuple[int, float]]:
    by_round: dict[int, list[float]] = {}
    for points in curves.values():
        for round_no, accuracy in points:
            by_round.setdefault(round_no, []).append(accuracy)
    return [(round_no, statistics.fmean(values)) for round_no, values in sorted(by_round.items())]


def draw_matrix(
    run: RunRecords, measure: MatrixMeasure, by_round: dict[int, Rows], path: Path
) -> None:
    matrices = [final_matrix(run, measure, by_round)]
    if measure.averaged and len(by_round) > 1:
        matrices.append(mean_matrix(run, measure, by_round))
    size = len(matrices[0].names)
    side = max(4.0, 0.45 * size + 2.5)
    figure = _matplotlib()(figsize=(side * len(matrices) + 1.2, side), layout="constrained")
    panels = figure.subplots(1, len(matrices), squeeze=False)[0]
    scale = _colour_scale(measure, matrices)
    for axes, matrix in zip(panels, matrices, strict=True):
        image = _heatmap(axes, run, matrix, scale)
    figure.colorbar(image, ax=list(panels), shrink=0.8, label=textwrap.fill(measure.cell, 40))
    figure.suptitle(f"Who learns from whom: {measure.title}\n{_headline(run)}")
    figure.savefig(path, dpi=120)


def _colour_scale(measure: MatrixMeasure, matrices: list[Matrix]) -> dict[str, Any]:
    values = [v for matrix in matrices for row in matrix.values for v in row if not math.isnan(v)]
    if measure.signed:
        bound = max((abs(v) for v in values), default=1.0) or 1.0
        return {"cmap": "RdBu", "vmin": -bound, "vmax": bound}  # red hurts, blue helps
    return {"cmap": "viridis", "vmin": 0.0, "vmax": max(values, default=1.0) or 1.0}


def _heatmap(axes: Any, run: RunRecords, matrix: Matrix, scale: dict[str, Any]) -> Any:
    import numpy as np

    values = np.ma.masked_invalid(np.array(matrix.values, dtype=float))
    image = axes.imshow(values, **scale)
    axes.set_facecolor("0.85")  # masked cells: not measured
    labels = [node_label(run, name) for name in matrix.names]
    ticks = range(len(labels))
    axes.set_xticks(ticks, labels, rotation=60, ha="right", fontsize="small")
    axes.set_yticks(ticks, labels, fontsize="small")
    unmeasured = any(math.isnan(value) for row in matrix.values for value in row)
    title = matrix.caption + ("\n(grey: not measured)" if unmeasured else "")
    axes.set(xlabel="peer learned from (column)", ylabel="learner (row)", title=title)
    if len(labels) <= MAX_ANNOTATED:
        _annotate(axes, matrix, image)
    _cluster_lines(axes, run, matrix.names)
    return image


def _annotate(axes: Any, matrix: Matrix, image: Any) -> None:
    for i, row in enumerate(matrix.values):
        for j, value in enumerate(row):
            if math.isnan(value):
                continue
            red, green, blue, _ = image.cmap(image.norm(value))
            dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
            axes.text(
                j,
                i,
                _cell_text(value),
                ha="center",
                va="center",
                fontsize="x-small",
                color="white" if dark else "black",
            )


def _cell_text(value: float) -> str:
    """Two decimals, but a plain 0 or 1 where a cell is a yes or no."""
    return str(int(value)) if value in (0.0, 1.0) else f"{value:.2f}"


def _cluster_lines(axes: Any, run: RunRecords, names: list[str]) -> None:
    """Lines between nodes of different true clusters, so blocks stand out."""
    truths = [run.truth(name) for name in names]
    for index in range(1, len(names)):
        if truths[index] and truths[index] != truths[index - 1]:
            axes.axhline(index - 0.5, color="white", linewidth=2)
            axes.axvline(index - 0.5, color="white", linewidth=2)


def _headline(run: RunRecords) -> str:
    nodes = cfgmod.counted(len(run.history), "node")
    if not run.config:  # `meshfl node` writes no config.yaml
        return f"{nodes} (no config.yaml in the run folder)"
    data = run.config.get("data") or {}
    dataset, partition = data.get("dataset", "?"), data.get("partition", "?")
    task = run.config.get("task")
    learns = f"task {task}" if task else f"{dataset} ({partition})"
    return f"{run.algorithm} on {learns}, {nodes}"


# --------------------------------------------------------------------------- the summary


def summary_markdown(run: RunRecords, figures: list[tuple[str, str]]) -> str:
    decisions = node_decisions(run.algorithm, run.history, run.coordinator)
    lines = [
        f"# Run report: {run.folder.name if run.folder else '(in memory)'}",
        "",
        _headline(run)
        + (
            f", {cfgmod.counted(run.config['rounds'], 'round')}, seed {run.config.get('seed')}"
            if "rounds" in run.config
            else ""
        )
        + ".",
        "",
        "| node | rounds | first test acc | final test acc | best | val acc | n_train |"
        + (" decision |" if decisions else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if decisions else ""),
    ]
    finals: list[float] = []
    for name, records in run.history.items():
        scored = _evaluated(records)
        if not scored:
            continue
        first, last = scored[0], scored[-1]
        best = max(_test_acc(record) for record in scored)
        finals.append(_test_acc(last))
        val_acc = math.nan if last.val_acc is None else last.val_acc
        lines.append(
            f"| {node_label(run, name)} | {first.round}-{last.round} | "
            f"{first.test_acc:.3f} | {last.test_acc:.3f} | {best:.3f} | "
            f"{val_acc:.3f} | {'?' if last.n_train is None else last.n_train} |"
            + (f" {decisions.get(name, '-')} |" if decisions else "")
        )
    if finals:
        lines += [
            "",
            f"Final test accuracy: mean {statistics.fmean(finals):.3f}, "
            f"std {statistics.pstdev(finals):.3f}, min {min(finals):.3f}.",
        ]
    lines += ["", "## Figures", ""]
    lines += [f"- [{file}]({file}): {caption}" for file, caption in figures]
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Draw every figure of the run and write report.md; return the files written."""
    run = read_run(run_dir)
    _matplotlib()  # fail before writing anything
    out = out or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    figures = [("accuracy.png", "test accuracy per round, each node and the mean")]
    draw_accuracy(run, out / "accuracy.png")
    for measure, by_round in matrix_measures_for(run):
        file = f"matrix-{measure.key}.png"
        draw_matrix(run, measure, by_round, out / file)
        figures.append(
            (
                file,
                f"{measure.title}; row: learner, column: the peer it learns "
                f"from; cell: {measure.cell}",
            )
        )
    (out / "report.md").write_text(summary_markdown(run, figures))
    return [out / file for file, _ in figures] + [out / "report.md"]


def run_report(run_dir: str, out: str | None) -> int:
    written = write_report(Path(run_dir), Path(out) if out else None)
    for path in written:
        print(path)
    return 0
