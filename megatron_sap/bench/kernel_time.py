"""Each method's attention work per rank, as kernel calls that one device can time.

Every method ends up computing, on each rank, causal attention for some query rows
over all earlier keys of their documents, for a fraction of the heads: SAP for its
outer group's pieces (Hq/U heads), the zigzag ring for its two chunks per document,
all-gather for its contiguous slice, Ulysses for every token (Hq/P heads), a2a+p2p for
its inner group's rows (Hq/U heads). `rank_work` lists that work, one varlen segment
per run of consecutive query positions (bottom-right aligned causal over the keys from
the document start); `time_work` runs it forward and backward on one device. The GPU
check script uses both to measure per-rank kernel time of every method on the same
batch, running each rank's calls in turn, and to calibrate the cost model.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..baselines import get as get_baseline
from ..kernels import varlen_backward, varlen_forward
from ..planning import CostModel, plan_sequences


@dataclass(frozen=True)
class RankWork:
    """Query runs (doc_start, start, end) a rank computes, over `head_fraction` of the heads."""

    runs: tuple[tuple[int, int, int], ...]
    head_fraction: float

    @property
    def pairs(self) -> int:
        """Causal (q, k) pairs, all heads counted as one."""
        return sum((e - s) * (s - d) + (e - s) * (e - s + 1) // 2 for d, s, e in self.runs)


def query_runs(positions: torch.Tensor, cu_seqlens: list[int]) -> tuple[tuple[int, int, int], ...]:
    """Maximal runs of consecutive real positions inside one document, with that document's start."""
    pos = sorted(int(p) for p in positions.tolist() if p >= 0)
    starts = torch.tensor(cu_seqlens[1:])
    runs: list[tuple[int, int, int]] = []
    for p in pos:
        doc = int(torch.searchsorted(starts, p, right=True))
        if runs and runs[-1][2] == p and runs[-1][0] == cu_seqlens[doc]:
            runs[-1] = (runs[-1][0], runs[-1][1], p + 1)
        else:
            runs.append((cu_seqlens[doc], p, p + 1))
    return tuple(runs)


def rank_work(method: str, cu_seqlens: list[int], world_size: int, inner_size: int = 1,
              cost_model: CostModel | None = None) -> list[RankWork]:
    """The attention work of every rank under `method` ("sap" or a baseline name)."""
    if method == "sap":
        plan = plan_sequences(cu_seqlens, outer_size=world_size // inner_size, inner_size=inner_size, cost_model=cost_model)
        return [
            RankWork(query_runs(plan.group_indices(r // inner_size), cu_seqlens), 1.0 / inner_size)
            for r in range(world_size)
        ]
    module = get_baseline(method)
    if method == "a2a+p2p":
        layout = module.layout(cu_seqlens, world_size, inner_size)
        groups = [torch.cat([layout.positions[o * inner_size + i] for i in range(inner_size)]) for o in range(world_size // inner_size)]
        return [RankWork(query_runs(groups[r // inner_size], cu_seqlens), 1.0 / inner_size) for r in range(world_size)]
    layout = module.layout(cu_seqlens, world_size)
    if method == "a2a":
        everything = query_runs(torch.arange(cu_seqlens[-1]), cu_seqlens)
        return [RankWork(everything, 1.0 / world_size)] * world_size
    return [RankWork(query_runs(layout.positions[r], cu_seqlens), 1.0) for r in range(world_size)]


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_work(work: RankWork, num_heads: int, num_kv_heads: int, head_dim: int, *, device: torch.device | str,
              dtype: torch.dtype, backend: str = "auto", repeats: int = 3) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one rank's work in one varlen call each (median of repeats)."""
    device = torch.device(device)
    heads = max(1, round(num_heads * work.head_fraction))
    kv_heads = max(1, round(num_kv_heads * work.head_fraction))
    if not work.runs:
        return 0.0, 0.0
    cu_q, cu_k = [0], [0]
    for d, s, e in work.runs:
        cu_q.append(cu_q[-1] + e - s)
        cu_k.append(cu_k[-1] + e - d)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(cu_q[-1], heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(cu_k[-1], kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(cu_k[-1], kv_heads, head_dim, generator=gen).to(device, dtype)
    args = (
        torch.tensor(cu_q, dtype=torch.int32, device=device),
        torch.tensor(cu_k, dtype=torch.int32, device=device),
        max(b - a for a, b in zip(cu_q, cu_q[1:])),
        max(b - a for a, b in zip(cu_k, cu_k[1:])),
    )
    out, lse = varlen_forward(q, k, v, *args, causal=True, backend=backend)
    dout = torch.randn_like(out)
    forward = _median_seconds(lambda: varlen_forward(q, k, v, *args, causal=True, backend=backend), device, repeats)
    backward = _median_seconds(
        lambda: varlen_backward(dout, q, k, v, out, lse, *args, causal=True, backend=backend), device, repeats
    )
    return forward, backward


def modelled_pairs(work: RankWork, model: CostModel) -> float:
    """The tile-rounded pairs the cost model charges for `work` (all heads counted as one,
    times its head fraction): per run, the full block over the earlier keys plus the
    causal diagonal, as the planner charges a piece."""
    pairs = sum(
        model.block_pairs(e - s, s - d, causal=False) + model.block_pairs(e - s, e - s, causal=True)
        for d, s, e in work.runs
    )
    return pairs * work.head_fraction


def fit_calibration(samples: list[tuple[RankWork, float, float]], model: CostModel) -> dict:
    """The cost model's compute rates fitted to measured kernel times.

    `samples` are (work, forward seconds, backward seconds) of ranks of any methods, timed
    at `model`'s shape. The forward rate is the modelled FLOPs over the measured seconds,
    summed over every rank (so each rank weighs by its time); the backward factor is the
    summed backward over forward time. Returns the rates, as `CostModel.from_calibration`
    reads them under "cost_model", and how far the fitted model's forward + backward time
    is from the measured one per rank (modelled / measured - 1)."""
    timed = [(w, f, b) for w, f, b in samples if f > 0 and b > 0]
    if not timed:
        raise ValueError("fit_calibration needs at least one rank with measured forward and backward time")
    flops = [modelled_pairs(w, model) * model.flops_per_pair for w, _, _ in timed]
    forward_s = sum(f for _, f, _ in timed)
    tflops = sum(flops) / forward_s / 1e12
    backward_factor = sum(b for _, _, b in timed) / forward_s
    errors = [x * (1 + backward_factor) / (tflops * 1e12) / (f + b) - 1 for x, (_, f, b) in zip(flops, timed)]
    return {
        "cost_model": {"name": model.name, "attention_tflops": tflops, "backward_factor": backward_factor},
        "ranks": len(timed),
        "relative_error": {"median": statistics.median(errors), "min": min(errors), "max": max(errors)},
    }
