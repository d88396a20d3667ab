"""Evaluate a placement under the cost model: per-rank work, traffic and modelled time.

The executor's program runs, on each outer rank, one step per peer, on a GPU with one
hardware queue (`timeline`: a transfer leaves the queue once the kernels queued before it
are done, and no kernel queued after it starts before it has left). Forward, the first
transfer is posted and the local blocks run under it; each later transfer is posted one
step ahead, so it waits for the kernels queued before it, and a step's blocks run once
its transfer is in and the next one has left. Backward, each step's blocks run and their
dK/dV go back, one transfer after another, each waiting for its step; the local blocks
run after the last return has left. With the m steps taken as equal (x = X / m,
r = C_remote / m), per rank:

    forward  = C                                                  if the rank receives nothing
             = max(x, C_local) + (m - 1) max(x, r) + r            otherwise
    backward = b C                                                if the rank receives nothing
             = b r + (m - 1) max(b r, x) + max(b C_local, x)      otherwise

C is the kernel time of all the rank's blocks, C_local that of blocks whose keys are
local, C_remote = C - C_local, b = `backward_factor`, X the transfer time (max of its
send and receive sides, each message paying the latency) and m the number of messages it
receives. A rank that waits for partners busy with other exchanges is not modelled here:
`timeline.joint_schedule` times that on the compiled programs. (Before 2026-12-05 the
forward was max(C, x + C_remote, X + r) and the backward max(b C, b r + X, b C_remote +
x), as if transfers overlapped the local blocks whatever the order they were queued in:
never more, and on rows of many small exchanges much less, than the timeline.) The
backward pass returns dK/dV over the same links with the same bytes. With an inner
(Ulysses) group of U ranks every outer quantity is split over U head slices and the
all-to-all of q, k, v, out (and their gradients) is added, not overlapped. The layer time
is the largest rank time (the makespan).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np

from .cost_model import LINK_INTER, LINK_INTRA, CostModel
from .cuts import whole_pairs
from .placement import Placement
from .tally import Tally


@dataclass(frozen=True)
class Evaluation:
    """Modelled quantities per outer rank (arrays of length R) and the makespan."""

    placement: Placement = field(repr=False)
    tile_pairs: np.ndarray  # tile-rounded pairs
    pipelined_pairs: np.ndarray  # tile-rounded pairs of the pipelined schedule's calls (`Tally.pipelined`)
    local_pairs: np.ndarray  # tile-rounded pairs whose keys the rank holds
    traffic_total: int  # forward KV tokens moved between outer ranks in all
    intra: np.ndarray  # [R, R] bool: the pair of ranks shares a node
    a2a_bytes: float  # per inner rank, forward + backward (split by link: `inner_peer_links`)
    rank_time_s: np.ndarray
    makespan_s: float
    ideal_s: float  # every document computed whole, spread evenly, no communication (`whole_documents_s`)

    @property
    def exact_pairs(self) -> np.ndarray:
        """Causal (q, k) pairs each rank computes, all heads."""
        exact = self.__dict__.get("_exact")  # an unpickled evaluation's (`__getstate__`)
        return self._work[0] if exact is None else exact

    @property
    def traffic_tokens(self) -> np.ndarray:
        """[R, R]: forward KV tokens the row rank sends the column rank."""
        return self._work[1]

    @cached_property
    def _work(self) -> tuple[np.ndarray, np.ndarray]:
        return rank_work(self.placement)

    def __getstate__(self) -> dict:
        """Pickled without the [R, R] traffic, worked out again where read (`Plan.stats`,
        `Plan.memory_bytes`, a program still to compile): a plan made in a loader's worker
        goes to the training process every micro-batch, and from 64 outer ranks on the
        traffic is a third to a half of its bytes. The pairs per rank stay (the Megatron
        summary reads them every micro-batch)."""
        state = dict(self.__dict__)
        work = state.pop("_work", None)
        if work is not None:
            state["_exact"] = work[0]
        return state


def rank_work(placement: Placement) -> tuple[np.ndarray, np.ndarray]:
    """Per outer rank, exact causal pairs (float64, length R), and the [R, R] forward
    KV traffic in tokens (row sends to column), from the head and tail chunk of every
    slot and the `sends` of every cut."""
    R = placement.num_ranks
    exact = [0] * R
    index, tokens = [], []
    for record in placement.records:
        cut = record.cut
        if len(record.ranks) == 1 and not cut.tails[0]:  # a document kept whole, in one piece (most are)
            n = cut.heads[0]
            exact[record.ranks[0]] += n * (n + 1) // 2
            continue
        for r, h, ho, tl, to in zip(record.ranks, cut.heads, cut.head_at, cut.tails, cut.tail_at):
            exact[r] += h * (h + 1) // 2 + h * ho + tl * (tl + 1) // 2 + tl * to
        if cut.sends is not None:
            # A rank holds one slot of a document: no two entries land on the same pair.
            ranks = np.array(record.ranks)
            index.append((ranks[:, None] * R + ranks).ravel())
            tokens.append(cut.sends.ravel())
    traffic = np.zeros(R * R, dtype=np.int64)
    if tokens:
        traffic = np.bincount(np.concatenate(index), weights=np.concatenate(tokens), minlength=R * R).astype(np.int64)
    return np.array(exact, dtype=np.float64), traffic.reshape(R, R)


def step_pairs(placement: Placement, tile: int = 1) -> np.ndarray:
    """[R, R] float64: the (q, k) pairs the row rank computes on keys the column rank
    holds (what its exchange step with that rank computes in the pipelined schedule), in
    `tile`-rounded blocks as its calls run them (1: the exact causal pairs). Slot i of a
    split document runs its head and tail as one query segment of s_i tiles against each
    earlier slot's head (h_j tiles), and its tail (t_i tiles) against each later slot's
    head and tail as one key segment (s_j tiles), as `cuts.pipelined_pairs` counts them."""
    R = placement.num_ranks
    index, pairs = [], []
    for record in placement.records:
        if len(record.ranks) == 1:
            continue
        cut = record.cut
        owner = np.array(record.ranks)
        heads, tails = np.array(cut.heads, dtype=np.int64), np.array(cut.tails, dtype=np.int64)
        head_tiles, tail_tiles, both = -(-heads // tile), -(-tails // tile), -(-(heads + tails) // tile)
        slot = np.arange(len(owner))
        blocks = np.where(slot[None, :] < slot[:, None], both[:, None] * head_tiles[None, :],  # [query slot, key slot]
                          np.where(slot[None, :] > slot[:, None], tail_tiles[:, None] * both[None, :], 0))
        blocks = np.where(owner[None, :] != owner[:, None], blocks, 0)
        index.append((owner[:, None] * R + owner[None, :]).ravel())
        pairs.append(blocks.ravel().astype(np.float64) * (tile * tile))
    if not pairs:
        return np.zeros((R, R))
    return np.bincount(np.concatenate(index), weights=np.concatenate(pairs), minlength=R * R).reshape(R, R)


def whole_documents_s(lengths: list[int], world_size: int, model: CostModel) -> float:
    """Forward + backward of every document computed whole, spread evenly over
    `world_size` ranks, with no communication: no placement is modelled faster
    (splitting a document only adds tile rounding)."""
    work = int(whole_pairs(lengths, model.tile).sum())
    return (1.0 + model.backward_factor) * model.compute_seconds(float(work)) / world_size


def ulysses_cost(model: CostModel, group_tokens: float, inner_size: int, outer_size: int) -> tuple[float, float]:
    """Bytes each inner rank sends in the Ulysses all-to-alls of one layer (forward +
    backward) and their time, for inner groups of `group_tokens` tokens each, the
    `outer_size` groups of `inner_size` consecutive CP ranks.

    An inner rank sends (U-1)/U of its tokens' q, k, v (KV heads replicated when fewer
    than U) and of its head slice of the group's outputs, an equal share to each peer;
    backward mirrors it. Two all-to-alls per pass, each of U-1 messages; not overlapped
    with compute (`ulysses_seconds` times the head-chunked ones that are).
    """
    U = inner_size
    if U <= 1:
        return 0.0, 0.0
    per_token = 2 * model.q_bytes_per_token + U * model.inner_kv_bytes_per_token(U)
    return 2 * ((U - 1) / U * (group_tokens / U) * per_token), 2 * ulysses_seconds(model, group_tokens, U, outer_size,
                                                                                per_token, 2)


def ulysses_exposed_seconds(model: CostModel, group_tokens: float, inner_size: int, outer_size: int,
                            chunks: int) -> float:
    """The least time of a layer's Ulysses all-to-alls in `chunks` head chunks that no
    kernel can hide (`RankProgram.chunked`): per pass the first (one chunk's inputs, forward
    with the K/V) and the last (one chunk's outputs, backward with dK/dV). One chunk: all of
    them (`ulysses_cost`)."""
    if chunks == 1 or inner_size <= 1:
        return ulysses_cost(model, group_tokens, inner_size, outer_size)[1]
    sizes = (model, group_tokens, inner_size, outer_size, chunks)
    return 2 * (chunk_all_to_all_seconds(*sizes, 1, True) + chunk_all_to_all_seconds(*sizes, 1, False))


def chunk_all_to_all_seconds(model: CostModel, group_tokens: float, inner_size: int, outer_size: int, chunks: int,
                             query_chunks: int, with_kv: bool) -> float:
    """One all-to-all of a pass in `chunks` head chunks: `query_chunks` chunks of queries
    (outputs, their gradients) a token, with the K/V (or dK/dV) or not (`ulysses_seconds`)."""
    U = inner_size
    per_token = query_chunks * model.q_bytes_per_token / chunks + with_kv * U * model.inner_kv_bytes_per_token(U)
    return ulysses_seconds(model, group_tokens, U, outer_size, per_token)


def ulysses_seconds(model: CostModel, group_tokens: float, inner_size: int, outer_size: int,
                    bytes_per_token: float, all_to_alls: int = 1) -> float:
    """Seconds of `all_to_alls` Ulysses all-to-alls that together move `bytes_per_token`
    of each of an inner rank's group_tokens / U tokens ((U-1)/U of them leave it, an equal
    share to each peer). Messages to peers on the rank's node and to those on other nodes
    go over their own links at once (`inner_peer_links`), a latency per message; the
    slowest rank sets the time."""
    U = inner_size
    if U <= 1:
        return 0.0
    sent = (U - 1) / U * (group_tokens / U) * bytes_per_token
    latency = model.message_latency_us * 1e-6
    seconds = 0.0
    for counts in set(inner_peer_links(model.gpus_per_node, U, outer_size)):
        for link, peers in zip((LINK_INTRA, LINK_INTER), counts):
            if peers:
                seconds = max(seconds, all_to_alls * peers * latency + sent * (peers / (U - 1)) / model.bandwidth(link))
    return seconds


@lru_cache(maxsize=64)
def inner_peer_links(gpus_per_node: int, inner_size: int, outer_size: int) -> tuple[tuple[int, int], ...]:
    """Per CP rank (inner groups of `inner_size` consecutive ranks, nodes of
    `gpus_per_node`), how many of its inner group's other ranks are on its node and how
    many on other nodes: (U - 1, 0) for every rank where each group fits in a node."""
    U, G = inner_size, gpus_per_node
    links = []
    for rank in range(U * outer_size):
        start, node_start = rank - rank % U, rank - rank % G
        same_node = min(start + U, node_start + G) - max(start, node_start) - 1
        links.append((same_node, U - 1 - same_node))
    return tuple(links)


def evaluate(placement: Placement, inner_size: int, model: CostModel) -> Evaluation:
    """Model one attention layer (forward + backward) for `placement`, from the tally it
    was built with (or a new one for another inner size or model)."""
    R, U = placement.num_ranks, inner_size
    tally = placement.tally
    if tally is None or not tally.matches(U, model):
        tally = Tally(R, U, model)
        for record in placement.records:
            tally.add(record.ranks, record.cut)
    tile_pairs = np.array(tally.tiles, dtype=np.float64)
    local_pairs = np.array(tally.local, dtype=np.float64)
    # Transfer time: each message's latency plus its bytes over its link, the larger of
    # the send and the receive side; m is the number of messages received.
    xfer = np.maximum(np.array(tally.send_s), np.array(tally.recv_s))
    messages = np.array(tally.messages)

    frac = 1.0 / U
    comp = model.compute_seconds(tile_pairs, head_fraction=frac)
    local = model.compute_seconds(local_pairs, head_fraction=frac)

    # The pipelines of the module docstring, over m equal steps.
    m = np.maximum(messages, 1)
    x, r = xfer / m, (comp - local) / m
    b = model.backward_factor
    forward = np.maximum(x, local) + (m - 1) * np.maximum(x, r) + r
    backward = b * r + (m - 1) * np.maximum(b * r, x) + np.maximum(b * local, x)
    receives = messages > 0
    a2a_bytes, a2a_time = ulysses_cost(model, placement.capacity, U, R)
    rank_time = np.where(receives, forward, comp) + np.where(receives, backward, b * comp) + a2a_time
    ideal = whole_documents_s([sum(record.cut.sizes) for record in placement.records], R * U, model)
    return Evaluation(
        placement=placement,
        tile_pairs=tile_pairs,
        pipelined_pairs=np.array(tally.pipelined, dtype=np.float64),
        local_pairs=local_pairs,
        traffic_total=tally.tokens,
        intra=tally.node_array[:, None] == tally.node_array[None, :],
        a2a_bytes=a2a_bytes,
        rank_time_s=rank_time,
        makespan_s=float(rank_time.max()) if R else 0.0,
        ideal_s=ideal,
    )
