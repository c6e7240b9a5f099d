"""A round's CPU, told apart by thread: the node's own work from its endpoint's, in a
process that runs many nodes (node/thread_cpu.py)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from meshfl.node.thread_cpu import cpu_spent, read_cpu, threads_cpu_seconds
from tests.protocol.endpoints import make_endpoint as make_endpoint  # the fixture

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread counters are Linux's"
)


def burn(seconds: float) -> None:
    """Spend about `seconds` of CPU on the calling thread."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Busy:
    """A thread that burns CPU when told to, and otherwise waits."""

    def __init__(self) -> None:
        self.go, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        while self.thread.native_id is None:
            time.sleep(0.001)

    def _run(self) -> None:
        self.go.wait()
        burn(0.3)
        self.done.set()
        time.sleep(5)  # alive while the test reads its counters

    def work(self) -> None:
        self.go.set()
        assert self.done.wait(10)


def test_a_thread_the_system_cannot_find_gives_no_figure():
    assert threads_cpu_seconds([2**31 - 7]) is None  # no thread of this process
    assert threads_cpu_seconds([]) == 0.0


@linux_only
def test_a_round_counts_the_nodes_own_work_apart_from_its_endpoints():
    endpoint = Busy()
    assert endpoint.thread.native_id is not None
    start = read_cpu([endpoint.thread.native_id])
    burn(0.1)  # the node's own work, on this thread
    endpoint.work()  # 0.3 s on the endpoint's
    spent = cpu_spent(start)
    assert 0.1 <= spent["node"] < 0.2, "this thread's own 0.1 s, not the endpoint's"
    assert spent["endpoint"] >= 0.2, "the endpoint thread's 0.3 s, to a clock tick"


def test_a_clock_the_system_does_not_give_is_left_out():
    spent = cpu_spent(read_cpu([2**31 - 7]))
    assert set(spent) == {"node"} and spent["node"] >= 0


def test_a_reading_from_another_thread_gives_no_figure():
    """A thread's CPU clock is its own: a round ended on another thread than the one
    it started on says nothing rather than another thread's time."""
    start = read_cpu([])
    spent: list[dict[str, float]] = []
    other = threading.Thread(target=lambda: spent.append(cpu_spent(start)))
    other.start()
    other.join()
    assert spent == [{}]


@linux_only
@pytest.mark.sockets
def test_an_endpoints_threads_are_its_own_live_threads(make_endpoint):
    endpoint = make_endpoint("node0")
    assert endpoint.thread_ids() == endpoint.transport.thread_ids(), "no worker before start"
    endpoint.start([])
    threads = endpoint.thread_ids()
    assert len(threads) == 2, "its worker's and its transport's"
    live = {thread.native_id for thread in threading.enumerate()}
    assert set(threads) <= live
    assert threads_cpu_seconds(threads) is not None
