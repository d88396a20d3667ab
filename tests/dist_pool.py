"""A pool of gloo-connected worker processes for distributed tests on CPU.

Starting a process that imports torch costs seconds, so a test module starts one pool and sends
it every distributed job: `pool.run(fn, *args)` calls `fn(rank, world_size, *args)` on every rank
with the default gloo group initialised and returns the results in rank order.

Workers come from a forkserver that has imported torch once for the whole pytest session (not
from `fork`, which is unsafe once the test process holds threads, and not from plain `spawn`,
which re-imports torch in each worker), so even restarts are cheap. Ranks meet through a
FileStore in a private temporary directory, so concurrent pools never race for a port.

A job that raises, kills a rank or outlives its timeout raises WorkerError (WorkerTimeout for the
timeout) naming each failed rank with its traceback or exit status; the pool then kills all its
workers and starts fresh ones, so the next test gets a clean world. A pool is not thread-safe.
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import pytest

# Imported once by the forkserver, inherited by every worker it forks.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "pytest"]
# After the first rank fails, how long the others get to report before they are killed: ranks
# blocked in a collective with the failed rank would otherwise wait for the gloo timeout.
FAILURE_GRACE_S = 1.0
# Job id of the start-up handshake; real jobs count from 1.
_START_JOB_ID = 0
_PARENT_GONE_EXIT_CODE = 70


class WorkerError(RuntimeError):
    """A job failed: `failures` maps each failed rank to one line (its exception or its fate).

    The message adds the remote tracebacks.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class WorkerTimeout(WorkerError):
    """A job (or the pool's start) did not finish within its timeout."""


@dataclass(frozen=True)
class _Failure:
    summary: str  # "ValueError: boom", "exited with code 1", ...
    traceback: str = ""


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection  # jobs go down, replies come up
    lifeline: Connection  # never written; the worker exits when it closes (the parent died)


class WorkerPool:
    """`world_size` worker processes joined in one gloo process group, serving jobs.

    `timeout` (seconds) is both the default job timeout and the gloo timeout of the workers'
    default group; `start_timeout` bounds how long starting the workers may take. With
    `destroy_job_groups`, the process groups a job makes are destroyed once every rank has
    finished it: for jobs that set up their groups afresh each time (Megatron's
    `initialize_model_parallel`), not for modules that keep groups from one job to the next.
    """

    def __init__(self, world_size: int, timeout: float = 60.0, start_timeout: float = 120.0,
                 destroy_job_groups: bool = False) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.destroy_job_groups = destroy_job_groups
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
        self._tmpdir = tempfile.mkdtemp(prefix="dist_pool_")
        self._generation = 0
        self._job_ids = itertools.count(_START_JOB_ID + 1)
        self._workers: list[_Worker] = []
        self._ready = False
        self._closed = False
        self._start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call `fn(rank, world_size, *args, **kwargs)` on every rank; return the results by rank.

        `fn` must be a module-level function of an importable module (a test module or a helper
        next to it); arguments and results travel pickled. Raises WorkerError if any rank raises
        or dies, WorkerTimeout if the job takes longer than `timeout` (default: the pool's).
        """
        if self._closed:
            raise RuntimeError("the pool is closed")
        try:
            job = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"cannot send {fn!r} and its arguments to the workers ({exc}); "
                "fn must be a module-level function and the arguments picklable"
            ) from exc
        self._wait_ready()
        job_id = next(self._job_ids)
        message = pickle.dumps((job_id, job))
        for worker in self._workers:
            try:
                worker.conn.send_bytes(message)
            except OSError:
                pass  # a dead worker is reported by _gather
        limit = self.timeout if timeout is None else timeout
        results, failures, unfinished = self._gather(job_id, time.monotonic() + limit)
        if failures or unfinished:
            self._restart()
            raise _job_error(f"job {job_id} ({fn.__module__}.{fn.__qualname__})", failures, unfinished, limit)
        return results

    def close(self) -> None:
        """Kill the workers and remove the rendezvous directory; workers hold nothing to save."""
        if self._closed:
            return
        self._closed = True
        self._stop()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> None:
        """Start a fresh set of workers; they join a new FileStore and report when ready."""
        self._generation += 1
        store_path = os.path.join(self._tmpdir, f"store{self._generation}")
        for rank in range(self.world_size):
            conn, child_conn = self._ctx.Pipe()
            lifeline_r, lifeline_w = self._ctx.Pipe(duplex=False)
            process = self._ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, store_path, self.timeout, self.destroy_job_groups, child_conn, lifeline_r),
                name=f"dist_pool-rank{rank}",
                daemon=True,
            )
            process.start()
            child_conn.close()
            lifeline_r.close()
            self._workers.append(_Worker(process, conn, lifeline_w))
        self._ready = False

    def _wait_ready(self) -> None:
        """Wait until every worker has initialised its process group (once per start)."""
        if self._ready:
            return
        _, failures, unfinished = self._gather(_START_JOB_ID, time.monotonic() + self.start_timeout)
        if failures or unfinished:
            self._restart()
            raise _job_error(
                f"starting the pool (world_size={self.world_size})", failures, unfinished, self.start_timeout
            )
        self._ready = True

    def _gather(self, job_id: int, deadline: float) -> tuple[list[Any], dict[int, _Failure], list[int]]:
        """Collect every rank's reply to `job_id`: (results, failures by rank, unfinished ranks).

        Returns at the deadline, or FAILURE_GRACE_S after the first failure if that is sooner.
        """
        results: list[Any] = [None] * self.world_size
        failures: dict[int, _Failure] = {}
        pending = set(range(self.world_size))
        give_up = deadline
        while pending and (remaining := give_up - time.monotonic()) > 0:
            owner: dict[Any, int] = {}
            for rank in pending:
                owner[self._workers[rank].conn] = rank
                owner[self._workers[rank].process.sentinel] = rank
            for ready in wait(list(owner), remaining):
                rank = owner[ready]
                if rank not in pending:
                    continue  # its connection and its sentinel both fired
                reply = self._read_reply(rank, job_id)
                if reply is None:
                    continue
                pending.discard(rank)
                if isinstance(reply, _Failure):
                    failures[rank] = reply
                    give_up = min(give_up, time.monotonic() + FAILURE_GRACE_S)
                else:
                    results[rank] = reply[0]
        return results, failures, sorted(pending)

    def _read_reply(self, rank: int, job_id: int) -> tuple[Any] | _Failure | None:
        """(result,) or what went wrong, for a rank whose pipe or sentinel fired.

        None for a reply to another job: replies carry their job id so that a late answer can
        never be taken for the current job's.
        """
        worker = self._workers[rank]
        try:
            if worker.conn.poll():  # a reply sent just before exiting still counts
                reply_id, ok, data = pickle.loads(worker.conn.recv_bytes())
                if reply_id != job_id:
                    return None
                return (pickle.loads(data),) if ok else _Failure(*data)
        except (EOFError, OSError):
            pass
        worker.process.join(timeout=5.0)
        return _Failure(_describe_exit(worker.process.exitcode))

    def _restart(self) -> None:
        """Kill every worker and start a fresh set (they initialise in the background)."""
        self._stop()
        self._start()

    def _stop(self) -> None:
        """Kill all workers (all at once, so none outlives a peer long enough to log its loss)."""
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
        for worker in self._workers:
            worker.process.join()
            worker.process.close()
            worker.conn.close()
            worker.lifeline.close()
        self._workers = []
        store_path = os.path.join(self._tmpdir, f"store{self._generation}")
        if os.path.exists(store_path):
            os.remove(store_path)


def make_pool_fixture(world_size: int, timeout: float = 60.0, destroy_job_groups: bool = False) -> Any:
    """A module-scoped pytest fixture yielding a WorkerPool; assign it to a module-level name.

    Example: `pool4 = make_pool_fixture(4)`, then tests take a `pool4` argument.
    """

    @pytest.fixture(scope="module")
    def pool() -> Iterator[WorkerPool]:
        with WorkerPool(world_size, timeout=timeout, destroy_job_groups=destroy_job_groups) as started:
            yield started

    return pool


def _job_error(what: str, failures: dict[int, _Failure], unfinished: list[int], limit: float) -> WorkerError:
    """The exception for a failed job: one line per rank, then the remote tracebacks."""
    if not failures:
        return WorkerTimeout(
            f"{what} timed out after {limit:g} s on ranks {unfinished}; the pool was restarted",
            {rank: "timed out" for rank in unfinished},
        )
    lines = [f"{what} failed on ranks {sorted(failures)}; the pool was restarted"]
    lines += [f"  rank {rank}: {failures[rank].summary}" for rank in sorted(failures)]
    killed = f"killed, still running {FAILURE_GRACE_S:g} s after the first failure"
    lines += [f"  rank {rank}: {killed}" for rank in unfinished]
    for rank in sorted(failures):
        if failures[rank].traceback:
            lines += [f"--- rank {rank} traceback:", failures[rank].traceback.rstrip()]
    return WorkerError("\n".join(lines), {rank: failure.summary for rank, failure in failures.items()})


def _describe_exit(exitcode: int | None) -> str:
    """Human-readable fate of a worker process that stopped answering."""
    if exitcode is None:
        return "closed its connection without exiting"
    if exitcode < 0:
        return f"died from signal {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _exit_with_parent(lifeline: Connection) -> None:
    """Block until the parent's end of the lifeline closes (it exited or was killed), then exit."""
    try:
        lifeline.recv_bytes()
    except EOFError:
        pass
    os._exit(_PARENT_GONE_EXIT_CODE)


def _worker_main(
    rank: int, world_size: int, store_path: str, timeout_s: float, destroy_job_groups: bool, conn: Connection,
    lifeline: Connection,
) -> None:
    """Join the gloo group, report readiness, then run jobs until the parent kills us or dies."""
    os.environ["OMP_NUM_THREADS"] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True).start()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store_path, world_size),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except BaseException as exc:
        conn.send_bytes(pickle.dumps((_START_JOB_ID, False, _failure_report(exc))))
        return
    conn.send_bytes(pickle.dumps((_START_JOB_ID, True, pickle.dumps(None))))
    while True:  # until the parent kills us (or dies: EOF)
        try:
            job_id, job = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        groups_before = _process_groups() if destroy_job_groups else None
        try:
            fn, args, kwargs = pickle.loads(job)
            reply = (job_id, True, pickle.dumps(fn(rank, world_size, *args, **kwargs)))
            if groups_before is not None:
                _destroy_groups_made_since(groups_before)
        except BaseException as exc:  # pytest.fail and sys.exit raise BaseExceptions; report them too
            reply = (job_id, False, _failure_report(exc))
        conn.send_bytes(pickle.dumps(reply))


def _process_groups() -> set:
    """The process groups torch holds now (it keeps every group until it is destroyed)."""
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map)


def _destroy_groups_made_since(before: set) -> None:
    """Destroy the groups a job made (Megatron's `destroy_model_parallel` only forgets its own),
    once every rank is done with them: torch keeps every group, each gloo one with about three
    threads, until it is destroyed; a module of Megatron jobs would gather thousands and crawl."""
    import torch.distributed as dist

    made = [group for group in _process_groups() - before if group is not dist.group.WORLD]
    if made:
        dist.barrier()
        for group in made:
            dist.destroy_process_group(group)


def _failure_report(exc: BaseException) -> tuple[str, str]:
    """(one-line summary, formatted traceback) of an exception, as plain picklable strings."""
    lines = str(exc).splitlines()
    summary = f"{type(exc).__qualname__}: {lines[0]}" if lines else type(exc).__qualname__
    return summary, "".join(traceback.format_exception(exc))
