"""Ulysses (`a2a`) context parallelism over packed documents.

Layout: the packed row, padded at its end to a multiple of P, split contiguously.
All-to-alls turn the sequence sharding into head sharding (every rank receives
all tokens for Hq/P query heads and their KV heads), plain varlen attention over the
documents runs locally, and an all-to-all brings the output back. Backward
mirrors it: all-to-all of dout, local backward, all-to-all of dq, dk and dv. This
executor fuses q, k and v (and dq, dk, dv) into one all-to-all; the analytic model
prices Transformer Engine's one per tensor (`exchange_bytes`).

KV heads: with Hkv a multiple of P each rank gets Hkv/P of them; with Hkv < P and
P a multiple of Hkv each KV head is replicated to the P/Hkv ranks whose query heads
read it, and autograd sums the replicas' gradients. Other shapes raise ValueError.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_sap.baselines.common import (
    BaselineLayout,
    check_layout,
    contiguous_layout,
    collective_seconds,
    padded_segments,
    summarize,
    total_causal_pairs,
    zero_padding_rows,
)
from megatron_sap.comm import ulysses
from megatron_sap.comm.ulysses import GatherHeads, ScatterHeads
from megatron_sap.kernels import first_order_only, varlen_backward, varlen_forward
from megatron_sap.planning.cost_model import CostModel

NAME = "a2a"
STEP = "a2a all-to-all"  # names the collective when a peer fails


def layout(cu_seqlens: Tensor | Sequence[int], world_size: int) -> BaselineLayout:
    """Token placement of the `a2a` method: contiguous slices of the padded row."""
    return contiguous_layout(cu_seqlens, world_size, NAME)


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, size: int) -> int:
    """KV heads each rank receives when `size` ranks split the heads (replicated when fewer
    than the ranks, `comm.ulysses.check_heads`); ValueError if they cannot."""
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    ulysses.check_heads(num_heads, num_kv_heads, size)
    return max(num_kv_heads // size, 1)


def replicate_kv_heads(k: Tensor, v: Tensor, num_heads: int, size: int) -> tuple[Tensor, Tensor]:
    """K and V with the head order the head all-to-all expects (`comm.ulysses.replicate_kv_heads`),
    after checking that the heads split over `size` ranks."""
    kv_heads_per_rank(num_heads, k.shape[1], size)
    return ulysses.replicate_kv_heads(k, v, size)


class VarlenAttention(torch.autograd.Function):
    """Causal varlen attention of head-sharded tokens on one rank."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int,
                softmax_scale: float | None, backend: str) -> Tensor:
        out, lse = varlen_forward(q, k, v, cu, cu, max_len, max_len, causal=True,
                                  softmax_scale=softmax_scale, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.max_len, ctx.softmax_scale, ctx.backend = max_len, softmax_scale, backend
        return out

    @staticmethod
    @first_order_only  # the kernels' backward is not differentiable itself
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = varlen_backward(dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len,
                                     causal=True, softmax_scale=ctx.softmax_scale, backend=ctx.backend)
        return dq, dk, dv, None, None, None, None


def attention(q: Tensor, k: Tensor, v: Tensor, layout: BaselineLayout, group: dist.ProcessGroup | None, *,
              softmax_scale: float | None = None, backend: str = "auto") -> Tensor:
    """`a2a` attention of this rank's contiguous rows; padding rows come back zero."""
    size = dist.get_world_size(group)
    check_layout(layout, NAME, size, q, k, v)
    k, v = replicate_kv_heads(k, v, q.shape[1], size)
    q_h, k_h, v_h = ScatterHeads.apply(group, STEP, q, k, v)
    segments = padded_segments(layout)
    cu = layout.on_device("segments", q.device, lambda d: segments.to(device=d, dtype=torch.int32))
    out_h = VarlenAttention.apply(q_h, k_h, v_h, cu, int(torch.diff(segments).max()), softmax_scale, backend)
    (out,) = GatherHeads.apply(group, STEP, out_h)
    return zero_padding_rows(out, layout, dist.get_rank(group))


# ---- analytic model ------------------------------------------------------------------

def exchange_bytes(cost_model: CostModel, tokens: int, size: int) -> list[int]:
    """Bytes a rank sends each peer in each all-to-all of one layer, one per tensor as
    Transformer Engine runs them (its `flash_attn_a2a_communicate` issues an
    all-to-all per tensor of the list it gets): q, k, v and out forward, dout, dq, dk
    and dv backward. Eight collectives, each paying its messages' latency.

    tokens: rows the rank holds before the exchange; size: ranks splitting the heads.
    """
    per_head = tokens * cost_model.head_dim * cost_model.bytes_per_element
    q = per_head * (cost_model.num_heads // size)
    kv = per_head * kv_heads_per_rank(cost_model.num_heads, cost_model.num_kv_heads, size)
    return [q, kv, kv, q, q, q, kv, kv]


def model_stats(cu_seqlens: Tensor | Sequence[int], world_size: int, cost_model: CostModel,
                inner_size: int = 1) -> dict[str, Any]:
    """Analytic cost of `a2a` (inner_size is unused: one signature for all baselines).

    Every rank computes the whole row's causal attention for 1/P of the heads; the
    eight all-to-alls (`exchange_bytes`) are not overlapped with compute.
    """
    lay = layout(cu_seqlens, world_size)
    phases = exchange_bytes(cost_model, lay.local_tokens, world_size)
    ranks = list(range(world_size))
    sent = [{p: sum(phases) for p in ranks if p != r} for r in ranks]
    tile_pairs = sum(cost_model.block_pairs(n, n, causal=True) for n in torch.diff(padded_segments(lay)).tolist())
    fraction = 1.0 / world_size
    time_s = (sum(collective_seconds(cost_model, ranks, b) for b in phases)
              + cost_model.compute_seconds(tile_pairs, head_fraction=fraction)
              + cost_model.compute_seconds(tile_pairs, backward=True, head_fraction=fraction))
    pairs = [total_causal_pairs(lay.cu_seqlens) * fraction] * world_size
    return summarize(cost_model, lay.cu_seqlens, [lay.local_tokens] * world_size, pairs, sent, time_s)
