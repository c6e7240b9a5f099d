"""Hosts forked from the launcher (launch/forked.py)."""

from __future__ import annotations

import gc

import pytest

from meshfl.launch.forked import can_fork, fork_call


@pytest.mark.skipif(not can_fork(), reason="launch forks only on Linux")
def test_a_forked_host_leaves_the_launchers_objects_out_of_its_collections(tmp_path):
    """Walked by the child's collector, the objects the launcher imported (torch's among
    them) would be copied page by page into every host; frozen before the fork, the
    collector never walks them."""

    def frozen_here() -> int:
        return 0 if gc.get_freeze_count() > 0 else 3

    child = fork_call(frozen_here, ["frozen_here"], tmp_path / "child.log", [])
    assert child.wait(timeout=60) == 0, (tmp_path / "child.log").read_text()
