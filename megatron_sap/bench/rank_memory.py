"""Peak memory and compute time of one rank's attention op, measured alone in this process.

Inside `local_exchanges()` the op's point-to-point steps send nothing and receive
zeros, so one rank of a P-rank SAP plan (or of the zigzag KV ring) runs with exactly
the buffers it allocates in a real job: a single GPU measures every rank's peak with
`torch.cuda.max_memory_allocated` (CPU: tracked storages), and times each rank's
executor without its communication (`rank_seconds`). Values are zeros where
data would have arrived, so only sizes and time are meaningful, not outputs. Flat
layouts only (the inner all-to-all is a collective).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

import megatron_sap as sap
from megatron_sap.baselines import ring_p2p
from megatron_sap.comm.p2p import local_exchanges
from megatron_sap.memory import track_peak_memory
from megatron_sap.simulate import _timer
from megatron_sap.planning import CostModel


@dataclass(frozen=True)
class RankMemory:
    """Peak bytes allocated by one rank's forward + backward (its output and input gradients
    included, the inputs not), and the formula's extra buffers (output and gradients not included)."""

    rank: int
    measured: int
    formula: float
    output_and_grads: int


def _inputs(rows: int, heads: int, kv_heads: int, dim: int, device, dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    shapes = ((rows, heads, dim), (rows, kv_heads, dim), (rows, kv_heads, dim), (rows, heads, dim))
    return [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]


def _peak(step, local: list[torch.Tensor], device) -> tuple[int, int]:
    """(peak of forward + backward, bytes of the output and the input gradients)."""
    q, k, v = (t.clone().requires_grad_() for t in local[:3])
    with local_exchanges():
        step(q, k, v).backward(local[3])  # warm-up: programs, kernel plans and probes cached
        q.grad = k.grad = v.grad = None
        with track_peak_memory(device) as peak:
            out = step(q, k, v)
            out.backward(local[3])
            del out
    q_bytes, k_bytes, v_bytes = (t.numel() * t.element_size() for t in local[:3])
    return peak.peak_bytes, 2 * q_bytes + k_bytes + v_bytes


def _sap_op(cu_seqlens: list[int], world_size: int, rank: int, heads: int, kv_heads: int, dim: int,
            device: torch.device, dtype: torch.dtype, cost_model: CostModel | None, schedule: str = "auto",
            recompute_kv: bool = False) -> tuple[Callable, list[torch.Tensor], float]:
    """(step, this rank's inputs, formula bytes) of one rank of a flat SAP plan."""
    plan = sap.plan_sequences(cu_seqlens, outer_size=world_size, cost_model=cost_model)
    groups = SimpleNamespace(world_size=world_size, inner_size=1, outer_rank=rank, cp_rank=rank,
                             outer_group=None, outer_peer=lambda r: r)

    def step(q, k, v):
        return sap.sap_attention(q, k, v, plan, groups, check_agreement=False, schedule=schedule,
                                 recompute_kv=recompute_kv)

    shape = plan.cost_model.with_shape(heads, kv_heads, dim, torch.empty((), dtype=dtype).element_size())
    formula = plan.memory_bytes(rank, shape, schedule, recompute_kv)
    return step, _inputs(plan.local_tokens, heads, kv_heads, dim, device, dtype), max(formula["forward"], formula["backward"])


def _ring_op(cu_seqlens: list[int], world_size: int, rank: int, heads: int, kv_heads: int, dim: int,
             device: torch.device, dtype: torch.dtype) -> tuple[Callable, list[torch.Tensor], float]:
    """(step, this rank's inputs, formula bytes) of one rank of the zigzag KV ring."""
    layout = ring_p2p.layout(cu_seqlens, world_size)
    ring = ring_p2p.Ring(None, rank, world_size, (rank + 1) % world_size, (rank - 1) % world_size)
    shape = ring_p2p.RingShape.from_chunks(layout.chunk_sizes, device)

    def step(q, k, v):  # ring_p2p.attention, with the ring given instead of read from a process group
        out = ring_p2p.ZigzagRingAttention.apply(q, k, v, shape, ring, None, "auto")
        return ring_p2p.zero_padding_rows(out, layout, rank)

    model = CostModel.preset("h100").with_shape(heads, kv_heads, dim, torch.empty((), dtype=dtype).element_size())
    local = _inputs(layout.local_tokens, heads, kv_heads, dim, device, dtype)
    return step, local, float(ring_p2p.peak_extra_bytes(layout.local_tokens, model))


def sap_rank_memory(cu_seqlens: list[int], world_size: int, rank: int, heads: int, kv_heads: int, dim: int, *,
                    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    cost_model: CostModel | None = None, schedule: str = "auto", recompute_kv: bool = False) -> RankMemory:
    """One rank of a flat SAP plan over `world_size` ranks, run in `schedule` with `recompute_kv`."""
    device = torch.device(device)
    step, local, formula = _sap_op(cu_seqlens, world_size, rank, heads, kv_heads, dim, device, dtype, cost_model,
                                   schedule, recompute_kv)
    return RankMemory(rank, *_peak_and_formula(step, local, device, formula))


def ring_rank_memory(cu_seqlens: list[int], world_size: int, rank: int, heads: int, kv_heads: int, dim: int, *,
                     device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> RankMemory:
    """One rank of the zigzag KV ring (Megatron/TE `p2p`) over `world_size` ranks."""
    device = torch.device(device)
    step, local, formula = _ring_op(cu_seqlens, world_size, rank, heads, kv_heads, dim, device, dtype)
    return RankMemory(rank, *_peak_and_formula(step, local, device, formula))


def rank_seconds(method: str, cu_seqlens: list[int], world_size: int, rank: int, heads: int, kv_heads: int, dim: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 cost_model: CostModel | None = None, schedule: str = "auto", repeats: int = 3) -> tuple[float, float]:
    """(forward, backward) seconds of one rank's whole op, `method` "sap" (in `schedule`) or
    "p2p", with its exchanges local: the executor's compute (kernel calls, gathers, merges,
    buffers) without the communication. Medians of `repeats` runs after a warm-up; CUDA
    events on a GPU."""
    device = torch.device(device)
    if method == "sap":
        step, local, _ = _sap_op(cu_seqlens, world_size, rank, heads, kv_heads, dim, device, dtype, cost_model,
                                 schedule)
    elif method == "p2p":
        step, local, _ = _ring_op(cu_seqlens, world_size, rank, heads, kv_heads, dim, device, dtype)
    else:
        raise ValueError(f"rank_seconds times 'sap' or 'p2p', got {method!r}")
    q, k, v = (t.clone().requires_grad_() for t in local[:3])
    start, stop = _timer(device)
    forward, backward = [], []
    with local_exchanges():
        step(q, k, v).backward(local[3])  # warm-up
        for _ in range(repeats):
            mark = start()
            out = step(q, k, v)
            forward.append(stop(mark))
            mark = start()
            out.backward(local[3])
            backward.append(stop(mark))
    return statistics.median(f() for f in forward), statistics.median(b() for b in backward)


def _peak_and_formula(step, local: list[torch.Tensor], device, formula: float) -> tuple[int, float, int]:
    measured, output_and_grads = _peak(step, local, device)
    return measured, formula, output_and_grads
