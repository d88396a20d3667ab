"""Hierarchical `a2a+p2p` context parallelism over packed documents.

P = U x R ranks: inner groups of U consecutive ranks run Ulysses (head all-to-all),
the R inner groups form a zigzag ring (`p2p`) across each other. CP rank r = g*U + u
(outer rank g, inner rank u) holds the same rows as under `p2p` with P ranks: chunks
r and 2P-1-r of every document. After the inner all-to-all an inner group's rows,
put in order, are exactly chunks g and 2R-1-g of an R-way zigzag split with chunks
U times larger, so the ring of `p2p` runs on them unchanged, for Hq/U heads.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_sap.baselines.common import (
    causal_pairs,
    check_layout,
    check_world_size,
    collective_seconds,
    summarize,
    zero_padding_rows,
)
from megatron_sap.baselines.ring_p2p import (
    Ring,
    RingShape,
    ZigzagLayout,
    ZigzagRingAttention,
    ring_message_seconds,
    ring_seconds,
    ring_sent,
    ring_step_pairs,
    zigzag_layout,
)
from megatron_sap.baselines.ulysses import exchange_bytes, kv_heads_per_rank, replicate_kv_heads
from megatron_sap.comm.groups import group_ranks
from megatron_sap.comm.ulysses import GatherHeads, ScatterHeads
from megatron_sap.planning.cost_model import CostModel
from megatron_sap.validation import positive_int

NAME = "a2a+p2p"
STEP = "a2a+p2p inner all-to-all"  # names the collective when a peer fails


def layout(cu_seqlens: Tensor | Sequence[int], world_size: int, inner_size: int = 1) -> ZigzagLayout:
    """Token placement of `a2a+p2p`: the `p2p` zigzag over all P ranks."""
    check_world_size(world_size)
    inner_size = positive_int(inner_size, "inner_size")
    if world_size % inner_size:
        raise ValueError(f"inner_size ({inner_size}) must divide world_size ({world_size})")
    return zigzag_layout(cu_seqlens, world_size, method=NAME, inner_size=inner_size)


def outer_order(chunk_sizes: Sequence[int], inner_size: int, device: torch.device) -> Tensor:
    """Rows of the inner all-to-all output, taken in the outer ring's zigzag order.

    The output stacks the U inner ranks' rows; inner rank u holds, per document,
    [chunk gU+u, chunk 2P-1-gU-u]. The outer order is, per document, the first
    chunks for u = 0..U-1 and then the second chunks for u = U-1..0.
    """
    chunks = torch.as_tensor(chunk_sizes, dtype=torch.int64)
    rows = int(2 * chunks.sum())
    outer = inner_size * chunks  # outer chunk size per document
    doc = torch.repeat_interleave(torch.arange(chunks.numel()), 2 * outer)
    offset = torch.arange(doc.numel()) - (torch.cumsum(2 * outer, 0) - 2 * outer)[doc]
    c = chunks[doc]
    second = offset >= outer[doc]
    within = offset - second * outer[doc]
    inner_rank = torch.where(second, inner_size - 1 - within // c, within // c)
    source = inner_rank * rows + (torch.cumsum(2 * chunks, 0) - 2 * chunks)[doc] + second * c + within % c
    return source.to(device)


def attention(q: Tensor, k: Tensor, v: Tensor, layout: ZigzagLayout,
              group: tuple[dist.ProcessGroup, dist.ProcessGroup | None], *,
              softmax_scale: float | None = None, backend: str = "auto") -> Tensor:
    """`a2a+p2p` attention of this rank's zigzag rows; group is (inner, outer).

    inner: the U consecutive CP ranks of this rank's Ulysses group; outer: the R ranks
    with the same inner rank, one per inner group, or None where R = 1 (as
    `SAPGroups.outer_group` is). Padding rows come back zero.
    """
    if not isinstance(group, (tuple, list)) or len(group) != 2:
        raise ValueError(f"a2a+p2p takes its groups as the pair (inner, outer), got {group!r}")
    inner, outer = group
    if inner is None:
        raise ValueError("a2a+p2p needs its inner group (got None); with one inner rank it is the p2p ring: "
                         "use megatron_sap.baselines.ring_p2p")
    size = dist.get_world_size(inner)
    # One outer rank: a ring of this rank alone, which moves nothing.
    outer_ranks = group_ranks(outer) if outer is not None else [dist.get_rank()]
    check_layout(layout, NAME, size * len(outer_ranks), q, k, v)
    if size != layout.inner_size:
        raise ValueError(f"inner group has {size} ranks but the layout was made for {layout.inner_size}")
    inner_ranks = group_ranks(inner)
    spacing = {b - a for a, b in zip(outer_ranks, outer_ranks[1:])}
    if inner_ranks != list(range(inner_ranks[0], inner_ranks[0] + size)) or spacing - {size}:
        raise ValueError(f"group must be (inner, outer): inner {size} consecutive ranks, outer the ranks {size} apart; "
                         f"got inner {inner_ranks} and outer {outer_ranks}")
    k, v = replicate_kv_heads(k, v, q.shape[1], size)
    q_h, k_h, v_h = ScatterHeads.apply(inner, STEP, q, k, v)
    order = layout.on_device("outer order", q.device, lambda d: outer_order(layout.chunk_sizes, size, d))
    unorder = layout.on_device("outer order inverse", q.device, lambda d: torch.argsort(order))
    shape = layout.on_device("ring shape", q.device,
                             lambda d: RingShape.from_chunks([size * c for c in layout.chunk_sizes], d))
    ring = Ring.of(outer) if outer is not None else Ring(None, 0, 1, dist.get_rank(), dist.get_rank())
    out_z = ZigzagRingAttention.apply(q_h[order], k_h[order], v_h[order], shape, ring, softmax_scale, backend)
    (out,) = GatherHeads.apply(inner, STEP, out_z[unorder])
    return zero_padding_rows(out, layout, ring.rank * size + dist.get_rank(inner))


# ---- analytic model ------------------------------------------------------------------

def model_stats(cu_seqlens: Tensor | Sequence[int], world_size: int, cost_model: CostModel,
                inner_size: int = 1) -> dict[str, Any]:
    """Analytic cost of `a2a+p2p` with inner groups of `inner_size` consecutive ranks.

    Per rank: the eight Ulysses all-to-alls within the inner group (`ulysses.exchange_bytes`), and the `p2p` ring
    traffic (3(R-1) buffers of U*n rows for the rank's KV heads) to the next and previous outer
    ranks (`ring_sent`).
    """
    lay = layout(cu_seqlens, world_size, inner_size)
    u_size, r_size = inner_size, world_size // inner_size
    kv_heads = kv_heads_per_rank(cost_model.num_heads, cost_model.num_kv_heads, u_size)
    phases = exchange_bytes(cost_model, lay.local_tokens, u_size)
    buffer = u_size * lay.local_tokens * 2 * kv_heads * cost_model.head_dim * cost_model.bytes_per_element

    groups = [list(range(g * u_size, (g + 1) * u_size)) for g in range(r_size)]
    sent = []
    for members in groups:
        for rank in members:
            by_peer = {p: sum(phases) for p in members if p != rank}
            for peer, nbytes in ring_sent(rank, world_size, u_size, buffer).items():
                by_peer[peer] = by_peer.get(peer, 0) + nbytes
            sent.append(by_peer)
    transfer_s, bundle_s = ring_message_seconds(cost_model, world_size, u_size, buffer)
    diagonal, off_diagonal = ring_step_pairs(cost_model, [u_size * c for c in lay.chunk_sizes])
    time_s = (sum(max(collective_seconds(cost_model, members, b) for members in groups) for b in phases)
              + ring_seconds(cost_model, r_size, diagonal, off_diagonal, transfer_s, bundle_s,
                             head_fraction=1.0 / u_size))
    group_pairs = [causal_pairs(torch.cat([lay.positions[r] for r in members]), lay.cu_seqlens) / u_size
                   for members in groups]
    pairs = [group_pairs[r // u_size] for r in range(world_size)]
    return summarize(cost_model, lay.cu_seqlens, [lay.local_tokens] * world_size, pairs, sent, time_s)
