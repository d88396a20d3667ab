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


class PendingAllToAll:
    """One posted all-to-all of several parts, each [U, n, h_i, D] (part[j] goes to group
    rank j); `wait()` returns them as received (part[j] from group rank j)."""

    def __init__(self, parts: Sequence[torch.Tensor], group: dist.ProcessGroup | None, step: str):
        ranks = group_ranks(group)
        me = dist.get_rank(group)
        self.heads = [p.shape[2] for p in parts]
        send = parts[0].contiguous() if len(parts) == 1 else torch.cat(list(parts), dim=2)
        for j, peer in enumerate(ranks):
            if j != me:
                record_send(send[j], peer, "a2a")
        self.description = f"{step} over group ranks {ranks}, from group rank {me},"
        self.recv = torch.empty_like(send)
        self.send = send  # alive until the all-to-all is done
        with failure_named(self.description):  # a dead peer can fail the post already
            self.work = dist.all_to_all_single(self.recv, send, group=group, async_op=True)

    def wait(self) -> list[torch.Tensor]:
        """The received parts, once the all-to-all is done (a failure, a dead or stuck peer,
        raised naming the step, the group and this rank)."""
        with failure_named(self.description):
            self.work.wait()
        self.send = None
        return list(self.recv.split(self.heads, dim=2))


def scatter_part(t: torch.Tensor, size: int) -> torch.Tensor:
    """A sequence-sharded [n, H, D] tensor as an all-to-all part [U, n, H/U, D]: group rank
    j's is heads [j*H/U, (j+1)*H/U)."""
    return t.reshape(t.shape[0], size, t.shape[1] // size, *t.shape[2:]).transpose(0, 1)


def from_scatter_part(part: torch.Tensor) -> torch.Tensor:
    """A received `scatter_part` as head-sharded [U*n, h, D]: the group's token shards in rank order."""
    return part.flatten(0, 1)


def gather_part(t: torch.Tensor, size: int) -> torch.Tensor:
    """A head-sharded [U*n, h, D] tensor as an all-to-all part [U, n, h, D]: group rank j's
    is the rows of its tokens."""
    return t.reshape(size, t.shape[0] // size, *t.shape[1:])


def from_gather_part(part: torch.Tensor) -> torch.Tensor:
    """A received `gather_part` as sequence-sharded [n, U*h, D] (group rank j's heads j-th)."""
    return part.transpose(0, 1).flatten(1, 2)


def scatter_heads(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, step: str) -> list[torch.Tensor]:
    """Sequence-sharded [n, H_i, D] tensors to head-sharded [U*n, H_i/U, D], all in one
    all-to-all: group rank j gets heads [j*H_i/U, (j+1)*H_i/U) of every tensor, and the
    rows of the result are the group's token shards in rank order."""
    size = dist.get_world_size(group)
    received = PendingAllToAll([scatter_part(t, size) for t in tensors], group, step).wait()
    return [from_scatter_part(part) for part in received]


def gather_heads(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, step: str) -> list[torch.Tensor]:
    """Inverse of `scatter_heads`: head-sharded [U*n, h_i, D] to sequence-sharded [n, U*h_i, D]."""
    size = dist.get_world_size(group)
    received = PendingAllToAll([gather_part(t, size) for t in tensors], group, step).wait()
    return [from_gather_part(part) for part in received]


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
