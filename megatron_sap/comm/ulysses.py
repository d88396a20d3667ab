"""Inner-level all-to-all (Ulysses): sequence sharding <-> head sharding.

Inside an inner group of U ranks, rank u holds n consecutive tokens of the group's
order with all heads. `seq_to_head` gives every rank all U*n tokens for H/U heads
(rank j's tokens at rows [j*n, (j+1)*n)); `head_to_seq` is its inverse. Both are
autograd functions whose backward is the other one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .traffic import record_send


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all_single over the first dimension of a [U, ...] tensor."""
    x = x.contiguous()
    out = torch.empty_like(x)
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    chunk = x[0]
    for j, peer in enumerate(ranks):
        if j != me:
            record_send(chunk, peer, "a2a")
    try:
        dist.all_to_all_single(out, x, group=group)
    except Exception as exc:  # a dead or stuck peer: the backend's own error type varies (gloo, NCCL)
        raise RuntimeError(
            f"SAP inner all-to-all over inner group ranks {ranks}, from inner rank {me}, failed: {exc}"
        ) from exc
    return out


def _seq_to_head(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    n, h, d = x.shape
    parts = x.view(n, size, h // size, d).transpose(0, 1)  # [U, n, H/U, D]
    return _all_to_all(parts, group).reshape(size * n, h // size, d)


def _head_to_seq(y: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    m, h, d = y.shape
    n = m // size
    got = _all_to_all(y.view(size, n, h, d), group)  # [U, n, H/U, D] from each rank's heads
    return got.transpose(0, 1).reshape(n, size * h, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _seq_to_head(x, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _head_to_seq(grad, ctx.group, ctx.size), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _head_to_seq(y, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_head(grad, ctx.group, ctx.size), None, None


def check_heads(num_heads: int, num_kv_heads: int, inner_size: int) -> int:
    """KV-head replication factor for an inner group of `inner_size` ranks.

    Query heads must divide by U. KV heads split evenly when U divides them; when
    there are fewer KV heads than U, each is replicated U / Hkv times (U must be a
    multiple of Hkv) so that every rank gets the one its query heads read.
    """
    if num_heads % inner_size:
        raise ValueError(f"query heads ({num_heads}) must be divisible by the inner (Ulysses) size ({inner_size})")
    if num_kv_heads >= inner_size:
        if num_kv_heads % inner_size:
            raise ValueError(
                f"key/value heads ({num_kv_heads}) must be divisible by the inner size ({inner_size}), "
                f"or be fewer than it and divide it"
            )
        return 1
    if inner_size % num_kv_heads:
        raise ValueError(
            f"key/value heads ({num_kv_heads}) fewer than the inner size ({inner_size}) must divide it "
            f"so they can be replicated"
        )
    return inner_size // num_kv_heads


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup, size: int, replicate: int = 1) -> torch.Tensor:
    """Scatter heads, gather the inner group's tokens; heads are first repeated `replicate` times."""
    if replicate > 1:
        x = x.repeat_interleave(replicate, dim=1)  # gradients of the copies sum back through autograd
    return _SeqToHead.apply(x, group, size)


def head_to_seq(y: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Scatter tokens back to their owners, gather all heads."""
    return _HeadToSeq.apply(y, group, size)
