"""gather_results: the spawned workers' results, failing fast when a worker dies or hangs."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from megatron_sap.spawned import gather_results


def _put(rank: int, results) -> None:
    results.put(rank)


def _fail(rank: int, results) -> None:
    if rank == 1:
        os._exit(3)  # dies without putting its result, as a rank that raised does
    results.put(rank)


def _hang(rank: int, results) -> None:
    time.sleep(600)


def _start(target, n: int):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, results)) for r in range(n)]
    for p in procs:
        p.start()
    return results, procs


def test_every_result_comes_back():
    results, procs = _start(_put, 3)
    assert sorted(gather_results(results, procs, 3, 60, "test run")) == [0, 1, 2]
    assert all(p.exitcode == 0 for p in procs)


def test_a_dead_worker_fails_the_run_at_once():
    results, procs = _start(_fail, 3)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"test run: a worker failed \(2/3 results, exit codes .*3"):
        gather_results(results, procs, 3, 600, "test run")
    assert time.monotonic() - start < 60
    assert not any(p.is_alive() for p in procs)


def test_a_hung_worker_fails_the_run_at_the_timeout_and_is_killed():
    results, procs = _start(_hang, 2)
    with pytest.raises(RuntimeError, match=r"test run: no results after 2 s \(0/2 results"):
        gather_results(results, procs, 2, 2, "test run")
    assert not any(p.is_alive() for p in procs)
