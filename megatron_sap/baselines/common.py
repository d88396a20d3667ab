"""Pieces every baseline shares: the token layout, sharding, and cost-model bookkeeping.

A baseline places the tokens of one packed row on the ranks of a context-parallel
group; `BaselineLayout.positions[r]` lists, for every row rank r holds, the global
position of its token (-1 for a padding row). The benchmark feeds each method's
`attention` with `shard(x, layout, r)` and reads results back with `unshard`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_sap.planning.cost_model import LINK_INTER, LINK_INTRA, CostModel
from megatron_sap.validation import check_qkv, cu_seqlens_to_list, is_positive_int

# Recent torch renames the fused collectives (deprecating the old names); older releases lack the new ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, kw_only=True, eq=False)
class BaselineLayout:
    """Where the tokens of one packed row live under a baseline method.

    cu_seqlens: the row's document boundaries (int64, CPU). positions[r]: global
    position of every row rank r holds, -1 for padding rows. Every rank holds the
    same number of rows, so collectives and ring buffers have one shape. A layout equals
    only itself (`eq=False`): its tensor fields have no single truth value to compare by.
    """

    method: str
    world_size: int
    cu_seqlens: Tensor
    positions: tuple[Tensor, ...]
    inner_size: int = 1
    _made: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def on_device(self, name: str, device: torch.device | str, make: Callable[[torch.device], Any]) -> Any:
        """`make(device)`, made on the first call for this name and device and then kept with the
        layout: the index tensors and kernel boundaries a method copies to the GPU (each copy
        from host memory waits for the GPU to finish its queued work) are made once per batch
        layout, not on every call, as SAP's program is."""
        device = torch.device(device)
        key = (name, device)
        if key not in self._made:
            self._made[key] = make(device)
        return self._made[key]

    @property
    def total_tokens(self) -> int:
        """Real tokens in the packed row."""
        return int(self.cu_seqlens[-1])

    @property
    def local_tokens(self) -> int:
        """Rows per rank, padding included."""
        return self.positions[0].numel()

    @property
    def padding_tokens(self) -> int:
        """Padding rows over all ranks."""
        return self.world_size * self.local_tokens - self.total_tokens


def as_cu_seqlens(cu_seqlens: Tensor | Sequence[int]) -> Tensor:
    """Validated int64 CPU copy of document boundaries (`cu_seqlens_to_list`'s checks, as
    SAP's planner makes them)."""
    values = cu_seqlens_to_list(cu_seqlens)
    if values[-1] == 0:
        raise ValueError("cu_seqlens describes an empty batch (0 tokens)")
    return torch.tensor(values, dtype=torch.int64)


def check_layout(layout: BaselineLayout, method: str, world_size: int, q: Tensor, k: Tensor, v: Tensor) -> None:
    """What a method's `attention` is given, checked before anything is exchanged: q, k, v
    of one dtype, device and head_dim, whole groups of query heads per key/value head
    (`check_qkv`), a layout made by that method for `world_size` ranks (the group's), and
    this rank's rows of it (`shard`) in each of q, k and v. Anything else would run and
    give a wrong answer, or fail in a kernel after a first message was sent (which the
    group's next operation would then wait for)."""
    check_qkv(q, k, v)
    if layout.method != method:
        raise ValueError(f"{method} attention got a layout made for {layout.method!r}: use {method}'s own layout()")
    if layout.world_size != world_size:
        raise ValueError(f"the layout was made for {layout.world_size} ranks, but the group has {world_size}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != layout.local_tokens:
            raise ValueError(f"{name} holds {t.shape[0]} rows, but the layout gives each rank {layout.local_tokens} "
                             "(pass shard(x, layout, rank))")


def check_world_size(world_size: int) -> None:
    """Reject a world size a layout cannot be built for (an int: the callers use it as given)."""
    if not is_positive_int(world_size):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")


def contiguous_layout(cu_seqlens: Tensor | Sequence[int], world_size: int, method: str) -> BaselineLayout:
    """The row padded at its end to a multiple of P, rank r holding the r-th contiguous slice."""
    check_world_size(world_size)
    cu = as_cu_seqlens(cu_seqlens)
    total = int(cu[-1])
    per_rank = -(-total // world_size)
    positions = []
    for rank in range(world_size):
        pos = torch.arange(rank * per_rank, (rank + 1) * per_rank)
        positions.append(torch.where(pos < total, pos, -1))
    return BaselineLayout(method=method, world_size=world_size, cu_seqlens=cu, positions=tuple(positions))


def padded_segments(layout: BaselineLayout) -> Tensor:
    """Segment boundaries of the whole padded row: the documents, then the padding as one segment."""
    padded = layout.world_size * layout.local_tokens
    if padded == layout.total_tokens:
        return layout.cu_seqlens
    return torch.cat([layout.cu_seqlens, torch.tensor([padded])])


def shard(x: Tensor, layout: BaselineLayout, rank: int) -> Tensor:
    """Rows of a [T, ...] tensor that `rank` holds, in layout order, padding rows zero."""
    pos = layout.positions[rank].to(x.device)
    real = pos >= 0
    out = x.new_zeros((pos.numel(), *x.shape[1:]))
    out[real] = x[pos[real]]
    return out


def unshard(parts: Sequence[Tensor], layout: BaselineLayout) -> Tensor:
    """Inverse of `shard`: the [T, ...] tensor assembled from every rank's rows."""
    first = parts[0]
    out = first.new_zeros((layout.total_tokens, *first.shape[1:]))
    for pos, part in zip(layout.positions, parts):
        pos = pos.to(part.device)
        real = pos >= 0
        out[pos[real]] = part[real]
    return out


def zero_padding_rows(out: Tensor, layout: BaselineLayout, rank: int) -> Tensor:
    """Zero the output of `rank`'s padding rows; differentiable, so their gradient is dropped too.

    Padding rows compute garbage (they attend whatever shares their kernel segment);
    masking here keeps them from sending gradient into real keys in backward, as long as
    their q, k, v are finite (`shard` fills them with zeros): a NaN or Inf there makes
    the kernel's backward NaN for their whole segment, the real keys' dK/dV included
    (`p2p`, `a2a+p2p`; a zero gradient times NaN is still NaN).
    """
    real = layout.on_device(f"real rows {rank}", out.device, lambda d: (layout.positions[rank] >= 0).to(d))
    return torch.where(real[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def cu_tensor(lengths: Sequence[int] | Tensor, device: torch.device) -> Tensor:
    """int32 cumulative boundaries of segment lengths, as the varlen kernels take them."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu.to(device=device, dtype=torch.int32)


# ---- cost-model bookkeeping -------------------------------------------------------

def causal_pairs(positions: Tensor, cu_seqlens: Tensor) -> int:
    """Real causal (q, k) pairs of the queries at `positions` (-1 entries ignored)."""
    pos = positions[positions >= 0]
    doc = torch.searchsorted(cu_seqlens, pos, right=True) - 1
    return int((pos - cu_seqlens[doc] + 1).sum())


def total_causal_pairs(cu_seqlens: Tensor) -> int:
    """Real causal pairs of the whole packed row."""
    lengths = torch.diff(cu_seqlens)
    return int((lengths * (lengths + 1) // 2).sum())


def exchange_seconds(cost_model: CostModel, rank: int, bytes_to_peer: dict[int, int]) -> float:
    """Time for `rank` to send one message to each listed peer at once.

    Intra- and inter-node links work in parallel; each message pays the latency.
    """
    seconds = 0.0
    for link in (LINK_INTRA, LINK_INTER):
        peers = [p for p in bytes_to_peer if cost_model.link_between(rank, p) == link]
        if peers:
            nbytes = sum(bytes_to_peer[p] for p in peers)
            seconds = max(seconds, cost_model.transfer_seconds(nbytes, link, messages=len(peers)))
    return seconds


def collective_seconds(cost_model: CostModel, members: Sequence[int], bytes_per_peer: int) -> float:
    """Time of a collective in which each member sends `bytes_per_peer` to every other member."""
    return max(exchange_seconds(cost_model, r, {p: bytes_per_peer for p in members if p != r}) for r in members)


def summarize(
    cost_model: CostModel,
    cu_seqlens: Tensor,
    tokens_per_rank: list[int],
    pairs_per_rank: list[float],
    sent: list[dict[int, int]],
    modelled_time_s: float,
) -> dict[str, Any]:
    """The `model_stats` dictionary every baseline returns.

    sent[r][peer]: bytes rank r sends to peer over forward and backward.
    ideal_time_s: forward plus backward of the real causal pairs spread evenly, with
    no padding, tile rounding or communication: the bound no method beats.
    """
    world_size = len(tokens_per_rank)
    recv = [0] * world_size
    intra = [0] * world_size
    inter = [0] * world_size
    for rank, by_peer in enumerate(sent):
        for peer, nbytes in by_peer.items():
            recv[peer] += nbytes
            if cost_model.link_between(rank, peer) == LINK_INTRA:
                intra[rank] += nbytes
            else:
                inter[rank] += nbytes
    mean_pairs = sum(pairs_per_rank) / world_size
    share = total_causal_pairs(cu_seqlens) / world_size
    return {
        "tokens_per_rank": list(tokens_per_rank),
        "padding_tokens": sum(tokens_per_rank) - int(cu_seqlens[-1]),
        "pairs_per_rank": list(pairs_per_rank),
        "imbalance": max(pairs_per_rank) / mean_pairs if mean_pairs > 0 else 1.0,
        "sent_bytes_per_rank": [sum(by_peer.values()) for by_peer in sent],
        "recv_bytes_per_rank": recv,
        "sent_bytes_intra_per_rank": intra,
        "sent_bytes_inter_per_rank": inter,
        "modelled_time_s": modelled_time_s,
        "ideal_time_s": cost_model.compute_seconds(share) + cost_model.compute_seconds(share, backward=True),
    }
