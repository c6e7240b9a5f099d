"""`meshfl report`: figures and summary of a real finished run, and the matrices behind
the who-learns-from-whom heatmaps."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from meshfl.launch import report
from meshfl.launch.cli import main
from tests.spawn import run_to_end

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real run: three digits nodes, FedAvg, two rounds."""
    out = tmp_path_factory.mktemp("run")
    done = run_to_end(
        [
            *("launch", "--nodes", "3", "--rounds", "2", "--samples-per-node", "150"),
            *("--set", "local_epochs=1", "--quiet", "--out", str(out)),
        ],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return out


def test_report_on_a_finished_run_writes_readable_pngs_and_a_summary(
    finished_run, tmp_path, capsys
):
    image = pytest.importorskip("matplotlib.image")
    assert main(["report", str(finished_run), "--out", str(tmp_path)]) == 0
    written = {Path(line).name for line in capsys.readouterr().out.split()}
    assert written == {"accuracy.png", "matrix-weights.png", "report.md"}
    for name in ("accuracy.png", "matrix-weights.png"):
        path = tmp_path / name
        assert path.read_bytes()[:8] == PNG_MAGIC, name
        height, width, _ = image.imread(path).shape
        assert width > 400 and height > 300, (name, width, height)
    summary = (tmp_path / "report.md").read_text()
    finals = json.loads((finished_run / "summary.json").read_text())["nodes"]
    for node in finals:
        assert f"| {node['name']} | 1-2 |" in summary
        assert f"{node['test_acc']:.3f}" in summary
    assert "(matrix-weights.png)" in summary


def test_report_writes_into_the_run_folder_by_default(finished_run, capsys):
    pytest.importorskip("matplotlib")
    assert main(["report", str(finished_run)]) == 0
    assert (finished_run / "report" / "accuracy.png").read_bytes()[:8] == PNG_MAGIC


def test_without_matplotlib_report_names_the_extra_in_one_line(finished_run, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert main(["report", str(finished_run)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "pip install 'meshfl[report]'" in error


def test_a_folder_without_metrics_is_a_one_line_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "metrics.jsonl" in error


def write_node(run: Path, name: str, records: list[dict], cluster: int | None = None) -> None:
    folder = run / name
    folder.mkdir(parents=True)
    folder.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = {} if cluster is None else {"true_cluster": cluster}
    folder.joinpath("info.json").write_text(json.dumps({"name": name, "data": data}))


def test_shapley_matrix_orders_by_cluster_and_leaves_unmeasured_cells_blank(tmp_path):
    (tmp_path / "config.yaml").write_text("algorithm: {name: pfedsv}\nrounds: 2\n")
    write_node(
        tmp_path,
        "node0",
        [
            {"round": 1, "test_acc": 0.5, "diagnostics": {"shapley": {"node0": 0.4, "node2": 0.2}}},
            {"round": 2, "test_acc": 0.6, "diagnostics": {"shapley": {"node0": 0.6}}},
        ],
        cluster=1,
    )
    write_node(
        tmp_path,
        "node1",
        [
            {
                "round": 2,
                "test_acc": 0.7,
                "diagnostics": {"shapley": {"node1": 0.3, "node0": -0.1}},
            },
        ],
        cluster=0,
    )
    write_node(tmp_path, "node2", [{"round": 1, "test_acc": 0.4}], cluster=1)
    run = report.read_run(tmp_path)
    ((measure, by_round),) = [
        found for found in report.matrix_measures_for(run) if found[0].key == "shapley"
    ]

    final = report.final_matrix(run, measure, by_round)
    assert final.names == ["node1", "node0", "node2"], "cluster 0 first, then cluster 1"
    assert final.caption == "last round (2)"
    assert final.values[0][:2] == [0.3, -0.1]
    assert final.values[1][1] == 0.6 and math.isnan(final.values[1][2]), "node2 not measured"
    assert all(math.isnan(value) for value in final.values[2]), "node2 measured nothing"

    mean = report.mean_matrix(run, measure, by_round)
    assert mean.values[1][1] == pytest.approx(0.5) and mean.values[1][2] == 0.2


def test_relevant_sets_come_from_the_coordinator_and_count_as_shares(tmp_path):
    (tmp_path / "config.yaml").write_text("algorithm: {name: fedrema}\n")
    for name in ("a", "b"):
        write_node(tmp_path, name, [{"round": 1, "test_acc": 0.5, "weights": {name: 1.0}}])
    coordinator = [
        {"round": 1, "diagnostics": {"relevant_sets": {"a": ["a", "b"], "b": ["b"]}}},
        {"round": 2, "diagnostics": {"relevant_sets": {"a": ["a"], "b": ["b"]}}},
        {"round": 3, "diagnostics": {"ccp": False}},
    ]
    write_node(tmp_path, "coordinator", coordinator)
    run = report.read_run(tmp_path)
    assert list(run.history) == ["a", "b"], "the coordinator is no learner"
    found = {measure.key: rows for measure, rows in report.matrix_measures_for(run)}
    assert list(found) == ["relevant_sets", "weights"]
    relevant_sets = report.MATRIX_MEASURES["relevant_sets"]
    mean = report.mean_matrix(run, relevant_sets, found["relevant_sets"])
    assert mean.values == [[1.0, 0.5], [0.0, 1.0]]
    assert mean.caption == "mean over rounds 1-2"


def test_the_summary_table_says_what_the_rule_decided_for_each_node(tmp_path):
    (tmp_path / "config.yaml").write_text("algorithm: {name: pfedlia}\nrounds: 2\n")
    write_node(
        tmp_path,
        "node0",
        [
            {"round": 1, "test_acc": 0.5, "diagnostics": {"phase": "warmup"}},
            {
                "round": 2,
                "test_acc": 0.6,
                "diagnostics": {"phase": "clustered", "group": ["node0", "node1"]},
            },
        ],
    )
    write_node(
        tmp_path, "node1", [{"round": 1, "test_acc": 0.4, "diagnostics": {"phase": "warmup"}}]
    )
    table = report.summary_markdown(report.read_run(tmp_path), []).splitlines()
    assert table[4].endswith("| n_train | decision |")
    assert table[6].startswith("| node0 | 1-2 |") and table[6].endswith("| group node0,node1 |")
    assert table[7].endswith("| warm-up only, no group |")


@pytest.mark.parametrize(
    "config, headline",
    [
        ("data: {dataset: mnist, partition: 'dirichlet:0.5'}\n", "fedavg on mnist (dirichlet:0.5)"),
        ("task: my_task.py\n", "fedavg on task my_task.py, 1 node"),  # its data are its own
    ],
)
def test_the_summary_names_what_the_run_learned(tmp_path, config, headline):
    (tmp_path / "config.yaml").write_text("algorithm: {name: fedavg}\nrounds: 1\n" + config)
    write_node(tmp_path, "node0", [{"round": 1, "test_acc": 0.5}])
    assert headline in report.summary_markdown(report.read_run(tmp_path), [])
