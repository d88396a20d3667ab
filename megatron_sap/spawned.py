"""Results from spawned worker processes, without waiting on workers that died.

The demo and the benchmark's measured part run their ranks as spawned gloo processes that
put results on a queue. A rank that raises (bad input, a peer that died) never puts its
share, so waiting on the queue alone would sit out the whole timeout: the exit codes are
checked between short waits instead.
"""
from __future__ import annotations

import queue
import time
from typing import Any, Sequence


def gather_results(results: Any, procs: Sequence[Any], expected: int, timeout_s: float, what: str) -> list:
    """`expected` items from the `results` queue of the processes `procs`; RuntimeError as soon
    as one of them exits non-zero, or when `timeout_s` passes. The processes are joined (and
    killed when still alive) before returning or raising."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < expected:
            try:
                got.append(results.get(timeout=1.0))
            except queue.Empty:
                failed = any(p.exitcode not in (None, 0) for p in procs)
                if failed or time.monotonic() > deadline:
                    codes = [p.exitcode for p in procs]
                    why = "a worker failed" if failed else f"no results after {timeout_s:.0f} s"
                    raise RuntimeError(f"{what}: {why} ({len(got)}/{expected} results, exit codes {codes})") from None
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return got
