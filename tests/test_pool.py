"""Tests of the distributed test harness (dist_pool.WorkerPool)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dist_pool import WorkerError, WorkerPool, WorkerTimeout, make_pool_fixture

pool4 = make_pool_fixture(4, timeout=30.0)


def rank_info(rank: int, world_size: int, token: str) -> tuple[int, int, str, float]:
    """This rank's view of the world plus the sum of all ranks over the default group."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, dist.get_world_size(), token, total.item()


def echo_args(rank: int, world_size: int, *args: object, **kwargs: object) -> tuple[int, tuple, dict]:
    return rank, args, kwargs


def raise_on(rank: int, world_size: int, bad_ranks: list[int]) -> int:
    if rank in bad_ranks:
        raise ValueError(f"boom on rank {rank}")
    return rank


def die_in_collective(rank: int, world_size: int, how: str) -> None:
    """Rank 1 dies while the other ranks wait for it in an all_reduce."""
    import torch
    import torch.distributed as dist

    if rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.all_reduce(torch.ones(1))


def sleep_on(rank: int, world_size: int, sleepy_rank: int, seconds: float) -> int:
    if rank == sleepy_rank:
        time.sleep(seconds)
    return rank


def worker_pid(rank: int, world_size: int) -> int:
    return os.getpid()


def assert_healthy(pool: WorkerPool, token: str) -> None:
    """The pool answers a fresh job with that job's own results, collectives included."""
    n = pool.world_size
    assert pool.run(rank_info, token) == [(r, n, token, float(n * (n - 1) // 2)) for r in range(n)]


def test_results_in_rank_order(pool4: WorkerPool) -> None:
    assert_healthy(pool4, "first")
    assert_healthy(pool4, "second")


def test_args_and_kwargs(pool4: WorkerPool) -> None:
    results = pool4.run(echo_args, 1, "two", scale=3, name=None)
    assert results == [(r, (1, "two"), {"scale": 3, "name": None}) for r in range(4)]


def test_unpicklable_function_is_refused_in_the_parent(pool4: WorkerPool) -> None:
    with pytest.raises(TypeError, match="module-level function"):
        pool4.run(lambda rank, world_size: rank)
    assert_healthy(pool4, "after refusal")


def test_exception_carries_rank_and_traceback(pool4: WorkerPool) -> None:
    with pytest.raises(WorkerError) as info:
        pool4.run(raise_on, [2])
    message = str(info.value)
    assert "failed on ranks [2]" in message
    assert "\n  rank 2: ValueError: boom on rank 2\n" in message
    assert "--- rank 2 traceback:\nTraceback (most recent call last):" in message
    assert 'in raise_on\n    raise ValueError(f"boom on rank {rank}")' in message
    assert "ValueError: boom on rank 2" in message
    assert info.value.failures == {2: "ValueError: boom on rank 2"}
    assert_healthy(pool4, "after exception")


def test_every_failing_rank_is_reported(pool4: WorkerPool) -> None:
    with pytest.raises(WorkerError) as info:
        pool4.run(raise_on, [0, 1, 2, 3])
    assert sorted(info.value.failures) == [0, 1, 2, 3]
    assert info.value.failures == {rank: f"ValueError: boom on rank {rank}" for rank in range(4)}
    assert_healthy(pool4, "after four exceptions")


@pytest.mark.parametrize(("how", "fate"), [("exit", "exited with code 3"), ("segfault", "died from signal SIGSEGV")])
def test_dead_rank_fails_fast_and_pool_recovers(pool4: WorkerPool, how: str, fate: str) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool4.run(die_in_collective, how)
    assert time.monotonic() - start < 10.0
    assert not isinstance(info.value, WorkerTimeout)
    assert f"\n  rank 1: {fate}" in str(info.value)
    assert info.value.failures[1] == fate
    assert_healthy(pool4, f"after {how}")


def test_stuck_rank_times_out_and_pool_recovers(pool4: WorkerPool) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"timed out after 1.5 s on ranks \[3\]"):
        pool4.run(sleep_on, 3, 60.0, timeout=1.5)
    assert time.monotonic() - start < 10.0
    assert_healthy(pool4, "after timeout")


def test_two_pools_at_once() -> None:
    """Two live pools, driven from two threads at once, never see each other's ranks."""
    with WorkerPool(2) as small, WorkerPool(3) as large:
        outcomes: dict[int, list] = {}

        def drive(pool: WorkerPool) -> None:
            outcomes[pool.world_size] = [pool.run(rank_info, f"job{i}") for i in range(3)]

        threads = [threading.Thread(target=drive, args=(pool,)) for pool in (small, large)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for n in (2, 3):
        assert outcomes[n] == [[(r, n, f"job{i}", float(n * (n - 1) // 2)) for r in range(n)] for i in range(3)]


_ORPHAN_SCRIPT = """
import sys, time
sys.path.insert(0, {tests_dir!r})
from dist_pool import WorkerPool
from test_pool import worker_pid
pool = WorkerPool(2)
print(*pool.run(worker_pid), flush=True)
time.sleep(120)
"""


def _is_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (orphans may be reaped late in containers)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone; reading as it exits raises ESRCH
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_workers_die_with_their_parent(tmp_path: Path) -> None:
    script = _ORPHAN_SCRIPT.format(tests_dir=str(Path(__file__).resolve().parent))
    # The killed owner cannot remove its rendezvous directory: make it under tmp_path.
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        pids = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(_is_running(pid) for pid in pids)
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 10.0
    while any(_is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_is_running(pid) for pid in pids)
