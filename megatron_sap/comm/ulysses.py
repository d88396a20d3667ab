"""Ulysses all-to-all: sequence sharding <-> head sharding.

Inside a group of U ranks, rank u holds n consecutive tokens with all heads.
`ScatterHeads` gives every rank all U*n tokens for H/U heads (rank j's tokens at rows
[j*n, (j+1)*n)) of several tensors in one all-to-all; `GatherHeads` is its inverse.
Each is an autograd function whose backward is the other one, so one layer costs two
all-to-alls forward (q, k, v; the output) and two backward. SAP's inner level and the
`a2a` and `a2a+p2p` baselines share them.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .groups import group_ranks
from .p2p import failure_named
from .traffic import record_send


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup | None, step: str) -> torch.Tensor:
    """send[j] goes to group rank j; the result's [j] came from group rank j. A failure
    (a dead or stuck peer) is raised naming `step`, the group and this rank."""
    send = send.contiguous()
    ranks = group_ranks(group)
    me = dist.get_rank(group)
    for j, peer in enumerate(ranks):
        if j != me:
            record_send(send[j], peer, "a2a")
    recv = torch.empty_like(send)
    with failure_named(f"{step} over group ranks {ranks}, from group rank {me},"):
        dist.all_to_all_single(recv, send, group=group)
    return recv


def scatter_heads(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, step: str) -> list[torch.Tensor]:
    """Sequence-sharded [n, H_i, D] tensors to head-sharded [U*n, H_i/U, D], all in one
    all-to-all: group rank j gets heads [j*H_i/U, (j+1)*H_i/U) of every tensor, and the
    rows of the result are the group's token shards in rank order."""
    size, rows = dist.get_world_size(group), tensors[0].shape[0]
    heads = [t.shape[1] // size for t in tensors]
    send = torch.cat([t.reshape(rows, size, h, *t.shape[2:]) for t, h in zip(tensors, heads)], dim=2)
    recv = _all_to_all(send.transpose(0, 1), group, step)
    return list(recv.flatten(0, 1).split(heads, dim=1))


def gather_heads(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, step: str) -> list[torch.Tensor]:
    """Inverse of `scatter_heads`: head-sharded [U*n, h_i, D] to sequence-sharded [n, U*h_i, D]."""
    heads = [t.shape[1] for t in tensors]
    send = torch.cat(list(tensors), dim=1)
    send = send.reshape(dist.get_world_size(group), -1, *send.shape[1:])
    recv = _all_to_all(send, group, step).transpose(0, 1)
    return [x.flatten(1, 2) for x in recv.split(heads, dim=2)]


class ScatterHeads(torch.autograd.Function):
    """`scatter_heads`, whose backward is `gather_heads` of the gradients (one
    all-to-all each way): `ScatterHeads.apply(group, step, *tensors)`."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup | None, step: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.step = group, step
        return tuple(scatter_heads(tensors, group, step))

    @staticmethod
    @torch.autograd.function.once_differentiable  # an all-to-all of gradients is not differentiable here
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, *gather_heads(grads, ctx.group, f"{ctx.step} (backward)"))


class GatherHeads(torch.autograd.Function):
    """`gather_heads`, whose backward is `scatter_heads` of the gradients:
    `GatherHeads.apply(group, step, *tensors)`."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup | None, step: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.step = group, step
        return tuple(gather_heads(tensors, group, step))

    @staticmethod
    @torch.autograd.function.once_differentiable  # an all-to-all of gradients is not differentiable here
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, *scatter_heads(grads, ctx.group, f"{ctx.step} (backward)"))


def check_heads(num_heads: int, num_kv_heads: int, inner_size: int) -> None:
    """Check that the heads split over an inner group of `inner_size` ranks.

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
        return
    if inner_size % num_kv_heads:
        raise ValueError(
            f"key/value heads ({num_kv_heads}) fewer than the inner size ({inner_size}) must divide it "
            f"so they can be replicated"
        )


def replicate_kv_heads(k: torch.Tensor, v: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V with the head order `ScatterHeads` over `size` ranks expects (the heads
    checked by `check_heads`): unchanged when the KV heads split evenly; with fewer KV
    heads than ranks, head j of the result is the KV head rank j's query heads read
    (index_select, so the replicas' gradients sum in backward)."""
    num_kv_heads = k.shape[1]
    if num_kv_heads % size == 0:
        return k, v
    index = torch.arange(size, device=k.device) * num_kv_heads // size  # made on the device: no copy, no sync
    return k.index_select(1, index), v.index_select(1, index)
