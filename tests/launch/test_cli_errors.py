"""Every class of user mistake ends in one clear line on stderr and exit code 2."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshfl.launch.errors import UserError
from meshfl.launch.mesh import check_resumable
from meshfl.node.config import MeshConfig, apply_overrides, with_explicit_params
from tests.nodes import write_config
from tests.spawn import run_to_end


def run_meshfl(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return run_to_end(list(args), timeout=120, cwd=cwd)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("meshfl: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--algorithm", "fedmagic"], ["algorithm", "fedmagic", "fedavg"]),
        (["--partition", "dirichlet:x"], ["data.partition", "dirichlet:x"]),
        (
            ["--dataset", "mnist", "--data-root", "/nonexistent/meshfl-data"],
            ["mnist", "--data-root"],
        ),
        (["--set", "lr=-1"], ["lr", "-1"]),
        (["--set", "algorithm.gamma=2"], ["algorithm.gamma"]),
        (
            ["--algorithm", "pfedlia", "--rounds", "5", "--set", "algorithm.warmup=20"],
            ["'algorithm.warmup'", "rounds 5", "algorithm.warmup_only=true"],
        ),
    ],
)
def test_launch_mistakes(tmp_path, flags, fragments):
    result = run_meshfl("launch", "--out", str(tmp_path / "run"), *flags)
    assert_one_line_error(result, *fragments)


def test_a_run_folders_checkpoints_take_its_own_config_with_defaults_left_out():
    """What a resumed run may not change is judged with the rule's parameters written
    out, as the runner saves them: a peers.yaml that leaves a default out asks for the
    run's own settings, and only a real change is refused."""
    plain = apply_overrides(MeshConfig(), ["algorithm=pfedlia", "rounds=4"])
    saved = with_explicit_params(plain)  # the run folder's config.yaml
    check_resumable(saved, plain, Path("run"))
    check_resumable(saved, apply_overrides(plain, ["data.root=/elsewhere", "lr=0.5"]), None)
    changes = [("algorithm.warmup=1", "algorithm.warmup"), ("algorithm=fedc2i", "algorithm.name")]
    for change, field in [*changes, ("seed=3", "seed")]:
        with pytest.raises(UserError, match=f"^{field}: got .*; the run in run has"):
            check_resumable(saved, apply_overrides(plain, [change]), Path("run"))


def test_a_run_folder_that_cannot_be_made(tmp_path):
    a_file = tmp_path / "afile"
    a_file.touch()
    assert_one_line_error(run_meshfl("launch", "--out", str(a_file)), "--out", "is a file")
    beneath = a_file / "run"  # a folder cannot be made inside a file
    assert_one_line_error(run_meshfl("launch", "--out", str(beneath)), "--out", str(beneath))


def test_port_in_use(tmp_path):
    config = tmp_path / "peers.yaml"
    cfg = write_config(config, 2)
    host, port = cfg["peers"][0]["listen"].removeprefix("tcp://").split(":")
    with socket.socket() as squatter:
        squatter.bind((host, int(port)))
        squatter.listen()
        result = run_meshfl(
            "node", "--config", str(config), "--name", "node0", "--out", str(tmp_path)
        )
    assert_one_line_error(result, "port in use", port)


def test_unreadable_key(tmp_path):
    config = tmp_path / "peers.yaml"
    write_config(config, 2)
    key = tmp_path / "broken.pem"
    key.write_text("not a key\n")
    result = run_meshfl(
        "node",
        "--config",
        str(config),
        "--name",
        "node0",
        "--out",
        str(tmp_path),
        "--key",
        str(key),
    )
    assert_one_line_error(result, str(key), "PEM")


def test_unknown_node_name(tmp_path):
    config = tmp_path / "peers.yaml"
    write_config(config, 2)
    result = run_meshfl("node", "--config", str(config), "--name", "nobody")
    assert_one_line_error(result, "nobody", "node0")


def test_keygen_refuses_to_overwrite(tmp_path):
    key = tmp_path / "node.pem"
    first = run_meshfl("keygen", str(key))
    assert first.returncode == 0 and "public key:" in first.stdout
    assert key.stat().st_mode & 0o777 == 0o600
    assert_one_line_error(run_meshfl("keygen", str(key)), "refusing to overwrite")


# Runs a command as `meshfl` does and prints, last on stdout, whether it loaded torch.
TORCH_PROBE = (
    "import sys\n"
    "from meshfl.launch.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print('torch loaded' if 'torch' in sys.modules else 'no torch')\n"
    "sys.exit(code)\n"
)


@pytest.mark.parametrize(
    "command, fragments",
    [
        (["launch", "--config", "/nonexistent/peers.yaml"], ["/nonexistent/peers.yaml"]),
        (["launch", "--set", "rounds=-1"], ["rounds", "-1", ">= 1"]),
        (["launch", "--nodes", "0"], ["--nodes", "0"]),
        (["launch", "--partition", "dirichlet:x"], ["data.partition", "dirichlet:x"]),
        (["node", "--name", "node0", "--config", "/nonexistent/peers.yaml"], ["/nonexistent"]),
        (["node", "--name", "node0", "--set", "rounds=-1"], ["rounds", "-1"]),
        (["host", "--names", "node0,node1", "--set", "rounds=-1"], ["rounds", "-1"]),
        (["coordinator", "--set", "rounds=-1"], ["rounds", "-1"]),
        (["join", "tcp://127.0.0.1:9", "--set", "rounds=-1"], ["rounds", "-1"]),
        (["join", "tcp://127.0.0.1:9", "--config", "/nonexistent/peers.yaml"], ["/nonexistent"]),
    ],
)
def test_a_config_mistake_answers_before_torch_loads(tmp_path, command, fragments):
    result = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, *command, "--out", str(tmp_path / "run")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(result, *fragments)
    assert result.stdout.splitlines()[-1] == "no torch"
    assert not (tmp_path / "run").exists()
