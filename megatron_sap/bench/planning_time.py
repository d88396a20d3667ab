"""Planning time: a fresh plan and a cache hit for real packed rows.

The planner runs once per micro-batch on every rank; its targets are a fresh plan of a
128K-token row at P = 64 in under 5 ms (median) and a cache hit in under 50 us.
Each layout plans rows it has not seen (its own packing seed), one after another as
training would: the plan cache is bypassed, while the cuts memoised from earlier rows
stay (document lengths recur). Times are wall-clock on this machine (CPU, one thread),
so they move with its load. Under Megatron-LM the data loader's workers make the plan and
rank 0's program and ship them pickled (`megatron_sap.megatron.loader`): what is left to
the training process is unpickling them, timed here too.
"""
from __future__ import annotations

import pickle
import platform
import statistics
import time
from pathlib import Path

import torch

import megatron_sap as sap
from megatron_sap.planning import PlanCache

from .data import CORPORA, lengths_of
from .packing import pack
from .scale import Target

TOKENS = 128 * 1024
LAYOUTS = ((1, 8), (8, 8), (1, 64))  # (inner U, outer R): one node, two-level P = 64, flat P = 64
FRESH_TARGET_S = 5e-3
HIT_TARGET_S = 50e-6


Row = tuple[str, int, int, float, float, float, float, float]


def measure(num_batches: int = 16, device: str = "cpu", sources: tuple[str, ...] = CORPORA) -> list[Row]:
    """(source, U, R, fresh median s, fresh min s, hit median s, program median s, unpickle
    median s) per source of document lengths (`lengths_of`: the real corpora by default)
    and layout; the program is outer rank 0's, compiled in the schedule
    it runs by default (which compiles and times both), with its index tensors on `device` (a
    GPU where the training runs: the copies there are part of the host's work); unpickling is
    of the plan with that program compiled on the CPU, as a data loader's worker ships it."""
    rows = []
    for source in sources:
        for layout, (inner, outer) in enumerate(LAYOUTS):
            batches = pack(lengths_of(source), TOKENS, num_batches, seed=5 + layout)
            fresh, programs, unpickled = [], [], []
            for cu in batches:
                start = time.perf_counter()
                plan = sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cache=None)
                fresh.append(time.perf_counter() - start)
                shipped = sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cache=None)
                shipped.program(0)
                shipped.group_indices(0)
                data = pickle.dumps(shipped, protocol=pickle.HIGHEST_PROTOCOL)
                start = time.perf_counter()
                pickle.loads(data)
                unpickled.append(time.perf_counter() - start)
                start = time.perf_counter()
                plan.program(0).to(device)  # with its index tensors, as the executor gets it
                if torch.device(device).type == "cuda":
                    torch.cuda.synchronize()
                programs.append(time.perf_counter() - start)
            cache = PlanCache()
            sap.plan_sequences(batches[0], outer_size=outer, inner_size=inner, cache=cache)
            hits = []
            for _ in range(200):
                start = time.perf_counter()
                sap.plan_sequences(batches[0], outer_size=outer, inner_size=inner, cache=cache)
                hits.append(time.perf_counter() - start)
            rows.append((source, inner, outer, statistics.median(fresh), min(fresh), statistics.median(hits),
                         statistics.median(programs), statistics.median(unpickled)))
    return rows


def cpu_name() -> str:
    """This machine's CPU model (Linux's /proc/cpuinfo), for the report beside the times."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def as_records(rows: list[Row]) -> list[dict]:
    """`measure`'s rows as JSON-able dicts (ms and us, rounded), for the GPU check's report."""
    return [
        {"corpus": corpus, "layout": f"{inner}x{outer}", "fresh_median_ms": round(median * 1e3, 2),
         "fresh_min_ms": round(best * 1e3, 2), "hit_median_us": round(hit * 1e6, 1),
         "program_median_ms": round(program * 1e3, 2), "unpickle_median_ms": round(unpickle * 1e3, 2)}
        for corpus, inner, outer, median, best, hit, program, unpickle in rows
    ]


def table(rows: list[Row]) -> str:
    lines = [
        "| lengths | U x R | fresh plan ms (median) | fresh plan ms (min) | cache hit us (median) | "
        "rank 0's program ms (median) | plan and program from a loader worker: unpickle ms (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for source, inner, outer, median, best, hit, program, unpickle in rows:
        lines.append(f"| {source} | {inner}x{outer} | {median * 1e3:.1f} | {best * 1e3:.1f} | {hit * 1e6:.0f} | "
                     f"{program * 1e3:.1f} | {unpickle * 1e3:.1f} |")
    return "\n".join(lines)


def targets(rows: list[Row]) -> list[Target]:
    """The targets, on the real corpora's rows (a synthetic mix's are reported beside them)."""
    rows = [r for r in rows if r[0] in CORPORA]
    at_64 = [r for r in rows if r[1] * r[2] == 64]
    worst_fresh = max(at_64, key=lambda r: r[3])
    worst_hit = max(rows, key=lambda r: r[5])
    return [
        Target(
            "planning a fresh 128K-token row at P=64 takes under 5 ms (median)",
            all(r[3] < FRESH_TARGET_S for r in at_64),
            "; ".join(f"{r[0]} {r[1]}x{r[2]}: {r[3] * 1e3:.1f} ms" for r in at_64)
            + f" (worst {worst_fresh[0]} {worst_fresh[1]}x{worst_fresh[2]})",
        ),
        Target(
            "a plan-cache hit takes under 50 us (median)",
            all(r[5] < HIT_TARGET_S for r in rows),
            f"worst {worst_hit[5] * 1e6:.0f} us ({worst_hit[0]} {worst_hit[1]}x{worst_hit[2]})",
        ),
    ]
