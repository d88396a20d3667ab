"""KV all-gather context parallelism over packed documents, contiguous shards (no load balancing).

Layout: the packed row, padded at its end to a multiple of P, split contiguously
(rank r holds rows [r*n, (r+1)*n)). Every rank all-gathers K and V, then runs its
queries against the keys of their documents with the document boundaries as varlen
segments: the query part of a document is the tail of its key part, so the
bottom-right causal mask is exact. Backward gathers K and V again (as Transformer
Engine does, instead of keeping P times the KV alive) and reduce-scatters dK, dV to
their owners. Neither collective overlaps compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_sap.baselines.common import (
    BaselineLayout,
    all_gather_single,
    causal_pairs,
    check_layout,
    collective_seconds,
    contiguous_layout,
    cu_tensor,
    padded_segments,
    reduce_scatter_single,
    summarize,
    zero_padding_rows,
)
from megatron_sap.comm.groups import group_ranks
from megatron_sap.comm.p2p import failure_named
from megatron_sap.comm.traffic import record_send
from megatron_sap.kernels import first_order_only, varlen_backward, varlen_forward
from megatron_sap.planning.cost_model import CostModel

NAME = "all_gather"


def layout(cu_seqlens: Tensor | Sequence[int], world_size: int) -> BaselineLayout:
    """Token placement of the `all_gather` method: contiguous slices of the padded row."""
    return contiguous_layout(cu_seqlens, world_size, NAME)


@dataclass(frozen=True)
class Segments:
    """One rank's query rows against the gathered keys, document by document.

    Keys [key_start, key_end) of the gathered row; q_lengths[d] / k_lengths[d]:
    rows of the d-th document piece the rank's queries touch.
    """

    key_start: int
    key_end: int
    q_lengths: list[int]
    k_lengths: list[int]

    @classmethod
    def of(cls, layout: BaselineLayout, rank: int) -> "Segments":
        bounds = padded_segments(layout)
        first, last = rank * layout.local_tokens, (rank + 1) * layout.local_tokens
        starts, ends = bounds[:-1], bounds[1:]
        hit = (ends > first) & (starts < last) & (ends > starts)
        starts, ends = starts[hit], ends[hit].clamp(max=last)
        return cls(
            key_start=int(starts[0]),
            key_end=last,
            q_lengths=(ends - starts.clamp(min=first)).tolist(),
            k_lengths=(ends - starts).tolist(),
        )


def _gather_kv(k: Tensor, v: Tensor, group: dist.ProcessGroup | None, ranks: list[int]) -> Tensor:
    """All ranks' K and V as one [P*n, 2, Hkv, D] tensor in row order."""
    local = torch.stack([k, v], dim=1)
    me = dist.get_rank(group)
    for j, peer in enumerate(ranks):
        if j != me:
            record_send(local, peer, "allgather")
    gathered = local.new_empty((len(ranks) * local.shape[0], *local.shape[1:]))
    with failure_named(f"all_gather baseline K/V all-gather over ranks {ranks}"):
        all_gather_single(gathered, local, group=group)
    return gathered


class AllGatherAttention(torch.autograd.Function):
    """Local queries against all-gathered keys; dK, dV reduce-scattered back."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, segments: Segments, cu: tuple[Tensor, Tensor],
                group: dist.ProcessGroup | None, softmax_scale: float | None, backend: str) -> Tensor:
        ranks = group_ranks(group)
        kv = _gather_kv(k, v, group, ranks)[segments.key_start:segments.key_end]
        args = (*cu, max(segments.q_lengths), max(segments.k_lengths))
        kw: dict[str, Any] = {"causal": True, "softmax_scale": softmax_scale, "backend": backend}
        out, lse = varlen_forward(q, kv[:, 0].contiguous(), kv[:, 1].contiguous(), *args, **kw)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.segments, ctx.group, ctx.ranks, ctx.args, ctx.kw = segments, group, ranks, args, kw
        return out

    @staticmethod
    @first_order_only  # the exchanged gradients are not differentiable
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        seg, group, ranks = ctx.segments, ctx.group, ctx.ranks
        kv = _gather_kv(k, v, group, ranks)
        keys = kv[seg.key_start:seg.key_end]
        dq, dk, dv = varlen_backward(dout.contiguous(), q, keys[:, 0].contiguous(), keys[:, 1].contiguous(),
                                     out, lse, *ctx.args, **ctx.kw)
        dkv_all = torch.zeros_like(kv)
        dkv_all[seg.key_start:seg.key_end] = torch.stack([dk, dv], dim=1)
        rows, me = k.shape[0], dist.get_rank(group)
        for j, peer in enumerate(ranks):
            if j != me:
                record_send(dkv_all[j * rows:(j + 1) * rows], peer, "reduce_scatter")
        dkv = dkv_all.new_empty((rows, *dkv_all.shape[1:]))
        with failure_named(f"all_gather baseline dK/dV reduce-scatter (backward) over ranks {ranks}"):
            reduce_scatter_single(dkv, dkv_all, group=group)
        return dq, dkv[:, 0], dkv[:, 1], None, None, None, None, None


def attention(q: Tensor, k: Tensor, v: Tensor, layout: BaselineLayout, group: dist.ProcessGroup | None, *,
              softmax_scale: float | None = None, backend: str = "auto") -> Tensor:
    """`all_gather` attention of this rank's contiguous rows; padding rows come back zero."""
    rank = dist.get_rank(group)
    check_layout(layout, NAME, dist.get_world_size(group), q, k, v)
    segments = Segments.of(layout, rank)
    cu = layout.on_device(f"segments {rank}", q.device,
                          lambda d: (cu_tensor(segments.q_lengths, d), cu_tensor(segments.k_lengths, d)))
    out = AllGatherAttention.apply(q, k, v, segments, cu, group, softmax_scale, backend)
    return zero_padding_rows(out, layout, rank)


# ---- analytic model ------------------------------------------------------------------

def model_stats(cu_seqlens: Tensor | Sequence[int], world_size: int, cost_model: CostModel,
                inner_size: int = 1) -> dict[str, Any]:
    """Analytic cost of `all_gather` (inner_size is unused: one signature for all baselines).

    Each rank sends its KV to every peer twice (forward and backward gathers) and one
    dKV slice to every peer (reduce-scatter); collectives do not overlap compute.
    """
    lay = layout(cu_seqlens, world_size)
    piece = lay.local_tokens * cost_model.kv_bytes_per_token
    ranks = list(range(world_size))
    sent = [{p: 3 * piece for p in ranks if p != r} for r in ranks]
    tile_pairs = []
    for r in ranks:
        seg = Segments.of(lay, r)
        tile_pairs.append(sum(
            cost_model.block_pairs(q, k - q, causal=False) + cost_model.block_pairs(q, q, causal=True)
            for q, k in zip(seg.q_lengths, seg.k_lengths)
        ))
    collective_s = collective_seconds(cost_model, ranks, piece)
    time_s = (3 * collective_s + cost_model.compute_seconds(max(tile_pairs))
              + cost_model.compute_seconds(max(tile_pairs), backward=True))
    pairs = [causal_pairs(p, lay.cu_seqlens) for p in lay.positions]
    return summarize(cost_model, lay.cu_seqlens, [lay.local_tokens] * world_size, pairs, sent, time_s)
