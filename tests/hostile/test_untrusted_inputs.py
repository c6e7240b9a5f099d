"""Data and settings a node is handed are untrusted too: each mistake is one clear line."""

from __future__ import annotations

import numpy as np
import pytest

from meshfl.node import config as cfgmod
from meshfl.node.datasets import DataError
from meshfl.node.splits import load_node_data
from tests.launch.test_cli_errors import assert_one_line_error, run_meshfl
from tests.nodes import write_config


def npz(path, x):
    np.savez(path, x=x, y=np.arange(len(x)) % 3)
    return f"npz:{path}"


def test_an_npz_whose_x_holds_nan_or_inf_is_refused_with_the_file_and_the_count(tmp_path):
    x = np.ones((30, 4), dtype=np.float32)
    x[0, 0], x[5, 1], x[7, 2] = np.nan, np.inf, -np.inf
    dataset = npz(tmp_path / "dirty.npz", x)
    with pytest.raises(DataError, match=r"dirty\.npz holds 3 NaN or infinite value\(s\) of 120"):
        load_node_data(dataset, None, "iid", 1, 0, seed=0)


def test_an_npz_whose_x_holds_strings_is_one_clear_error(tmp_path):
    dataset = npz(tmp_path / "words.npz", np.array([["a", "b"]] * 30))
    with pytest.raises(DataError, match=r"x in .*words\.npz must hold numbers.*<U1"):
        load_node_data(dataset, None, "iid", 1, 0, seed=0)


def test_a_node_handed_such_a_file_exits_with_one_line(tmp_path):
    x = np.ones((30, 4), dtype=np.float32)
    x[3, 3] = np.nan
    config = tmp_path / "peers.yaml"
    write_config(config, 1, data={"dataset": npz(tmp_path / "dirty.npz", x)})
    result = run_meshfl(
        "node", "--config", str(config), "--name", "node0", "--out", str(tmp_path / "out")
    )
    assert_one_line_error(result, "dirty.npz", "1 NaN or infinite")


def test_fedc2i_with_a_head_of_several_layers_is_a_config_error_at_start(tmp_path):
    result = run_meshfl(
        "launch", "--out", str(tmp_path / "run"), "--algorithm", "fedc2i", "--set", "model.head=fc"
    )
    assert_one_line_error(result, "'model.head'", "fc", "last with algorithm fedc2i")


@pytest.mark.parametrize("other", ["tcp://localhost:7801", "tcp://LOCALHOST:7801"])
def test_localhost_and_the_loopback_address_are_one_socket(other):
    peers = [cfgmod.PeerConfig("a", "tcp://127.0.0.1:7801"), cfgmod.PeerConfig("b", other)]
    with pytest.raises(cfgmod.ConfigError, match="'peers.1.listen'.*peers.0 has it"):
        cfgmod.validate(cfgmod.MeshConfig(peers=peers))
