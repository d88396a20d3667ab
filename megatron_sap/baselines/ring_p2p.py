"""Zigzag ring attention over packed documents: the `p2p` context parallelism of
Megatron-Core / Transformer Engine for the THD format.

Layout: each document is padded to a multiple of 2P and cut into 2P equal chunks;
rank r holds chunks r and 2P-1-r of every document, stored per document as
[chunk r, chunk 2P-1-r]. Every rank therefore holds the same rows per document and
the same causal work, whatever the documents are.

Forward: one contiguous KV buffer travels P-1 steps around the ring. At step i rank
r holds the KV of rank s = r - i (mod P) and computes what causality allows:
  * i = 0: its own chunks, causal per document (the diagonal tile);
  * s < r: all local queries against the first-half KV chunk (chunk s);
  * s > r: the second-half query chunk against all KV.
Partial results merge by log-sum-exp. Backward runs the ring the other way, as
Transformer Engine does: each rank starts from the last KV it received forward (rank
r + 1's) and ends with its own block, and at every step sends the previous rank, as one
message, the KV it computed with and the dKV of the block before, its own share added to
the shares of the ranks it came through; the first message is KV only, the last dKV only,
which reaches its owner as that rank computes its own block. Each transfer is posted
before the step's kernels run, so it overlaps them.

Padding sits at the end of each document, so real queries never see a padding key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_sap.baselines.common import (
    BaselineLayout,
    as_cu_seqlens,
    causal_pairs,
    check_layout,
    check_world_size,
    cu_tensor,
    summarize,
    zero_padding_rows,
)
from megatron_sap.comm.groups import group_ranks
from megatron_sap.comm.p2p import post_exchange
from megatron_sap.kernels import (accumulation_dtype, first_order_only, merge_into, merge_partials, resolve_backend,
                                  resolve_softmax_scale, varlen_backward, varlen_forward)
from megatron_sap.planning.cost_model import CostModel

NAME = "p2p"


@dataclass(frozen=True, kw_only=True, eq=False)
class ZigzagLayout(BaselineLayout):
    """Zigzag layout; chunk_sizes[d]: rows of each of document d's 2P chunks."""

    chunk_sizes: tuple[int, ...]


def zigzag_layout(cu_seqlens: Tensor | Sequence[int], world_size: int, *, method: str = NAME,
                  inner_size: int = 1) -> ZigzagLayout:
    """Zigzag placement over `world_size` ranks: rank r holds chunks r and 2P-1-r of every document."""
    check_world_size(world_size)
    cu = as_cu_seqlens(cu_seqlens)
    lengths = torch.diff(cu)
    chunks = (lengths + 2 * world_size - 1) // (2 * world_size)
    doc = torch.repeat_interleave(torch.arange(chunks.numel()), 2 * chunks)
    offset_in_doc = torch.arange(doc.numel()) - (torch.cumsum(2 * chunks, 0) - 2 * chunks)[doc]
    second = offset_in_doc >= chunks[doc]
    offset_in_chunk = offset_in_doc - second * chunks[doc]
    positions = []
    for rank in range(world_size):
        chunk_index = torch.where(second, 2 * world_size - 1 - rank, rank)
        pos = cu[doc] + chunk_index * chunks[doc] + offset_in_chunk
        positions.append(torch.where(pos < cu[doc + 1], pos, -1))
    return ZigzagLayout(method=method, world_size=world_size, cu_seqlens=cu, positions=tuple(positions),
                        inner_size=inner_size, chunk_sizes=tuple(chunks.tolist()))


def layout(cu_seqlens: Tensor | Sequence[int], world_size: int) -> ZigzagLayout:
    """Token placement of the `p2p` method."""
    return zigzag_layout(cu_seqlens, world_size)


# ---- the ring ----------------------------------------------------------------------

@dataclass(frozen=True)
class RingShape:
    """Local segment structure of a zigzag shard with chunk sizes c_d.

    full: per document 2*c_d rows (both chunks); half: c_d rows (one chunk).
    first_rows / second_rows: local rows of the first / second chunk of every document.
    """

    cu_full: Tensor
    cu_half: Tensor
    max_full: int
    max_half: int
    first_rows: Tensor
    second_rows: Tensor

    @classmethod
    def from_chunks(cls, chunk_sizes: Sequence[int], device: torch.device) -> "RingShape":
        chunks = torch.as_tensor(chunk_sizes, dtype=torch.int64)
        rows = int(2 * chunks.sum())
        doc = torch.repeat_interleave(torch.arange(chunks.numel()), 2 * chunks)
        offset = torch.cumsum(2 * chunks, 0) - 2 * chunks
        first = torch.arange(rows) - offset[doc] < chunks[doc]
        max_half = int(chunks.max()) if chunks.numel() else 0
        return cls(
            cu_full=cu_tensor(2 * chunks, device),
            cu_half=cu_tensor(chunks, device),
            max_full=2 * max_half,
            max_half=max_half,
            first_rows=first.nonzero().flatten().to(device),
            second_rows=(~first).nonzero().flatten().to(device),
        )


@dataclass(frozen=True)
class Ring:
    """A process group seen as a ring: this rank's place and its neighbours' global ranks."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    next_peer: int
    prev_peer: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> "Ring":
        members = group_ranks(group)
        rank, size = dist.get_rank(group), len(members)
        return cls(group, rank, size, members[(rank + 1) % size], members[(rank - 1) % size])


class _Shift:
    """Send a buffer to the next rank while receiving one from the previous rank into
    `recv` (default: a new buffer like `send`); `backward`: to the previous rank, from the next."""

    def __init__(self, send: Tensor, ring: Ring, recv: Tensor | None = None, backward: bool = False) -> None:
        self.recv = torch.empty_like(send) if recv is None else recv
        to, source = (ring.prev_peer, ring.next_peer) if backward else (ring.next_peer, ring.prev_peer)
        self.pending = post_exchange(send, to, self.recv, source, ring.group, 0, "p2p baseline ring step")

    def wait(self) -> Tensor:
        self.pending.wait()
        return self.recv


@dataclass(frozen=True)
class _Block:
    """What this rank computes at one ring step: query rows x key rows (None: all rows)."""

    q_rows: Tensor | None
    kv_rows: Tensor | None
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    causal: bool


def _block(step: int, ring: Ring, shape: RingShape) -> _Block:
    """The causally allowed block when holding the KV of rank (ring.rank - step)."""
    if step == 0:
        return _Block(None, None, shape.cu_full, shape.cu_full, shape.max_full, shape.max_full, True)
    if step <= ring.rank:  # KV from an earlier rank: every local query sees its first chunk
        return _Block(None, shape.first_rows, shape.cu_full, shape.cu_half, shape.max_full, shape.max_half, False)
    # KV from a later rank: only the second query chunk sees it, all of it
    return _Block(shape.second_rows, None, shape.cu_half, shape.cu_full, shape.max_half, shape.max_full, False)


def _rows(x: Tensor, rows: Tensor | None, dim: int = 0) -> Tensor:
    """The selected rows of x (along dim), or x itself for all rows."""
    return x if rows is None else x.index_select(dim, rows)


class ZigzagRingAttention(torch.autograd.Function):
    """Ring attention over local zigzag shards q [n, Hq, D], k/v [n, Hkv, D]."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, shape: RingShape, ring: Ring,
                softmax_scale: float | None, backend: str) -> Tensor:
        # Resolved before the first message is posted: an error after it would leave that
        # message pending, for the group's next operation to wait on.
        kw: dict[str, Any] = {"softmax_scale": resolve_softmax_scale(q.shape[2], softmax_scale, q.dtype),
                              "backend": resolve_backend(backend, q.device, q.dtype, q.shape[2])}
        acc = accumulation_dtype(q)
        kv = torch.stack([k, v])  # the one contiguous buffer that travels
        out = lse = None
        for step in range(ring.size):
            shift = _Shift(kv, ring) if step + 1 < ring.size else None
            b = _block(step, ring, shape)
            o, l = varlen_forward(_rows(q, b.q_rows), _rows(kv[0], b.kv_rows), _rows(kv[1], b.kv_rows),
                                  b.cu_q, b.cu_k, b.max_q, b.max_k, causal=b.causal, **kw)
            if out is None:
                out, lse = o.to(acc), l.to(acc)
            elif b.q_rows is None:
                out, lse = merge_partials(out, lse, o, l)
            else:
                merge_into(out, lse, b.q_rows, o, l)
            if shift is not None:
                kv = shift.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, kv)  # kv: rank r + 1's (the last received), where backward starts
        ctx.shape, ctx.ring, ctx.kw = shape, ring, kw
        return out

    @staticmethod
    @first_order_only  # the exchanged gradients are not differentiable
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, last_kv = ctx.saved_tensors
        shape, ring, kw = ctx.shape, ctx.ring, ctx.kw
        dout = dout.contiguous()
        acc = accumulation_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        # Two message buffers [KV, dKV] in turn: this step's (its KV computed with, the dKV of
        # the previous block to send) and the one arriving (the next KV, this block's dKV so far).
        here, arriving = (torch.empty((2, *last_kv.shape), dtype=k.dtype, device=k.device) for _ in range(2))
        here[0].copy_(last_kv)
        size = ring.size
        for i in range(size):  # rank r + 1 + i's block, forward step size - 1 - i; the own block last
            shift = None
            if size > 1:
                part = slice(0, 1) if i == 0 else slice(1, 2) if i == size - 1 else slice(0, 2)
                shift = _Shift(here[part], ring, arriving[part], backward=True)
            b = _block(size - 1 - i, ring, shape)
            kv = here[0]
            dq_b, dk_b, dv_b = varlen_backward(
                _rows(dout, b.q_rows), _rows(q, b.q_rows), _rows(kv[0], b.kv_rows), _rows(kv[1], b.kv_rows),
                _rows(out, b.q_rows), _rows(lse, b.q_rows, dim=1),
                b.cu_q, b.cu_k, b.max_q, b.max_k, causal=b.causal, **kw)
            if b.q_rows is None:
                dq += dq_b
            else:
                dq.index_add_(0, b.q_rows, dq_b.to(acc))
            dkv = torch.stack([dk_b, dv_b]).to(acc)
            if b.kv_rows is not None:
                dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device).index_copy_(1, b.kv_rows, dkv)
            if shift is not None:
                shift.wait()
                if i > 0:  # the shares of the ranks this block came through
                    dkv += arriving[1]
            if i == size - 1:  # the own block: every share is in
                return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None
            arriving[1].copy_(dkv)  # sent with the next KV at the next step
            here, arriving = arriving, here


def attention(q: Tensor, k: Tensor, v: Tensor, layout: ZigzagLayout, group: dist.ProcessGroup | None, *,
              softmax_scale: float | None = None, backend: str = "auto") -> Tensor:
    """`p2p` attention of this rank's zigzag rows; padding rows come back zero."""
    ring = Ring.of(group)
    check_layout(layout, NAME, ring.size, q, k, v)
    shape = layout.on_device("ring shape", q.device, lambda d: RingShape.from_chunks(layout.chunk_sizes, d))
    out = ZigzagRingAttention.apply(q, k, v, shape, ring, softmax_scale, backend)
    return zero_padding_rows(out, layout, ring.rank)


# ---- analytic model ------------------------------------------------------------------

def ring_step_pairs(cost_model: CostModel, chunk_sizes: Sequence[int]) -> tuple[int, int]:
    """Tile-rounded pairs of the diagonal step and of every later step, per rank."""
    diagonal = sum(cost_model.block_pairs(2 * c, 2 * c, causal=True) for c in chunk_sizes)
    off_diagonal = sum(cost_model.block_pairs(2 * c, c, causal=False) for c in chunk_sizes)
    return diagonal, off_diagonal


def ring_seconds(cost_model: CostModel, size: int, diagonal_pairs: int, off_diagonal_pairs: int,
                 transfer_s: float, bundle_s: float, head_fraction: float = 1.0) -> float:
    """Forward plus backward of a zigzag ring of `size` ranks with overlapped transfers.

    transfer_s: the slowest link's time for one KV buffer; bundle_s: for one message of a
    KV and a dKV buffer (the ring moves at its slowest link's pace). Forward step i
    overlaps the KV transfer for step i+1. Backward runs the other way, the own block
    last: its first step overlaps a KV message, the middle ones a KV and dKV message, the
    last one the dKV coming home (see the module docstring).
    """
    total = 0.0
    for step in range(size):  # forward
        step_s = cost_model.compute_seconds(diagonal_pairs if step == 0 else off_diagonal_pairs,
                                            head_fraction=head_fraction)
        total += max(step_s, transfer_s if step + 1 < size else 0.0)
    for step in range(size):  # backward
        step_s = cost_model.compute_seconds(diagonal_pairs if step == size - 1 else off_diagonal_pairs,
                                            backward=True, head_fraction=head_fraction)
        message_s = 0.0 if size == 1 else transfer_s if step in (0, size - 1) else bundle_s
        total += max(step_s, message_s)
    return total


def ring_sent(rank: int, world_size: int, stride: int, buffer: float) -> dict[int, float]:
    """Bytes global `rank` sends per peer in a ring of the ranks `stride` apart (`world_size`
    in all; buffers of `buffer` bytes): P-1 KV buffers forward to the next rank, P-1 KV and
    P-1 dKV buffers backward to the previous one."""
    size = world_size // stride
    if size == 1:
        return {}
    sent = {(rank + stride) % world_size: (size - 1) * buffer}
    previous = (rank - stride) % world_size
    sent[previous] = sent.get(previous, 0) + 2 * (size - 1) * buffer
    return sent


def ring_message_seconds(cost_model: CostModel, world_size: int, stride: int, buffer: float) -> tuple[float, float]:
    """(one buffer's, one KV + dKV message's) seconds over the slowest link of the rings of
    ranks `stride` apart."""
    links = [cost_model.link_between(r, (r + stride) % world_size) for r in range(world_size)]
    return (max(cost_model.transfer_seconds(buffer, link) for link in links),
            max(cost_model.transfer_seconds(2 * buffer, link) for link in links))


def model_stats(cu_seqlens: Tensor | Sequence[int], world_size: int, cost_model: CostModel,
                inner_size: int = 1) -> dict[str, Any]:
    """Analytic cost of `p2p` (inner_size is unused: one signature for all baselines).

    Each rank sends its KV buffer to the next rank P-1 times in forward, and in
    backward P-1 times again plus P-1 dKV buffers of the same size to the previous one.
    """
    lay = layout(cu_seqlens, world_size)
    buffer = lay.local_tokens * cost_model.kv_bytes_per_token
    sent = [ring_sent(r, world_size, 1, buffer) for r in range(world_size)]
    transfer_s, bundle_s = ring_message_seconds(cost_model, world_size, 1, buffer)
    diagonal, off_diagonal = ring_step_pairs(cost_model, lay.chunk_sizes)
    pairs = [causal_pairs(p, lay.cu_seqlens) for p in lay.positions]
    time_s = ring_seconds(cost_model, world_size, diagonal, off_diagonal, transfer_s, bundle_s)
    stats = summarize(cost_model, lay.cu_seqlens, [lay.local_tokens] * world_size, pairs, sent, time_s)
    stats["peak_extra_bytes_per_rank"] = [float(peak_extra_bytes(lay.local_tokens, cost_model))] * world_size
    return stats


def peak_extra_bytes(rows: int, cost_model: CostModel) -> int:
    """Modelled extra memory of the op on one rank, beyond q, k, v and the output.

    Forward: the stacked K/V and the incoming K/V of the next step, fp32 output and lse
    accumulators. Backward: the K/V saved from the forward, the two [KV, dKV] message
    buffers (input dtype), the fp32 dq accumulator, this step's dK/dV (fp32) with the
    rows it is built from, and the saved fp32 lse.
    """
    a, b = 4, cost_model.bytes_per_element
    kv = rows * 2 * cost_model.num_kv_heads * cost_model.head_dim
    q = rows * cost_model.num_heads * cost_model.head_dim
    lse = rows * cost_model.num_heads
    forward = 2 * kv * b + (q + lse) * a
    backward = 5 * kv * b + q * a + 2 * kv * a + lse * a
    return max(forward, backward)
