"""Evaluate a placement under the cost model: per-rank work, traffic and modelled time.

The executor's program runs, on each outer rank, its local blocks first and then one
step per peer, the next step's transfer in flight while the current step computes.
Per rank and pass (forward, then backward at `backward_factor` times the compute):

    T = C                                                if the rank receives nothing
    T = max(C_local, x) + (m - 1) * max(r, x) + r        otherwise, x = X / m, r = C_remote / m

a pipeline of m steps: the first transfer overlaps the local blocks, each later one the
previous step's compute, and the last step's compute overlaps nothing. C is the kernel
time of all the rank's blocks, C_local that of blocks whose keys are local, C_remote =
C - C_local, X the transfer time (max of its send and receive sides, each message
paying the latency) and m the number of messages it receives. The backward pass returns dK/dV over the same links with the same
bytes. With an inner (Ulysses) group of U ranks every outer quantity is split over U
head slices and the all-to-all of q, k, v, out (and their gradients) is added, not
overlapped. The layer time is the largest rank time (the makespan).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost_model import LINK_INTER, LINK_INTRA, CostModel
from .placement import Placement, piece_cost


@dataclass(frozen=True)
class Evaluation:
    """Modelled quantities per outer rank (arrays of length R) and the makespan."""

    exact_pairs: np.ndarray  # causal (q, k) pairs computed, all heads
    tile_pairs: np.ndarray  # tile-rounded pairs
    traffic_tokens: np.ndarray  # [R, R]: KV tokens sent from row rank to column rank (forward)
    intra: np.ndarray  # [R, R] bool: the pair of ranks shares a node
    a2a_bytes: float  # per inner rank, forward + backward, intra-node
    rank_time_s: np.ndarray
    makespan_s: float
    ideal_s: float


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


def _piece_arrays(placement: Placement, doc_starts: np.ndarray) -> tuple[np.ndarray, ...]:
    """start, length, doc and rank of every piece, in packed-position order.

    Pieces are non-empty and disjoint, so position order is (document, start) order; a
    piece's document is the last one starting at or before it (earlier documents that
    start at the same position are empty).
    """
    ranks = placement.ranks
    start = np.array([p.start for pieces in ranks for p in pieces], dtype=np.int64)
    end = np.array([p.end for pieces in ranks for p in pieces], dtype=np.int64)
    rank = np.repeat(np.arange(len(ranks)), [len(pieces) for pieces in ranks])
    order = np.argsort(start, kind="stable")
    start, end, rank = start[order], end[order], rank[order]
    doc = np.searchsorted(doc_starts, start, side="right") - 1
    return start, end - start, doc, rank


def _tokens_before(placement: Placement, doc_starts: list[int]) -> tuple[np.ndarray, ...]:
    """Per piece (position order): length, offset in its document, rank, the tokens its rank
    holds of the document before it; and the [R, R] forward KV traffic in tokens.

    `held[r, i]`: tokens of rank r in pieces 0..i; a rank needs every earlier piece of the
    document up to its last piece there (pieces of one rank in one document need not be
    adjacent).
    """
    R = placement.num_ranks
    starts = np.asarray(doc_starts, dtype=np.int64)
    start, length, doc, rank = _piece_arrays(placement, starts)
    n = len(start)
    traffic = np.zeros((R, R), dtype=np.int64)
    if n == 0:
        return length, start, rank, start, traffic
    index = np.arange(n)
    offset = start - starts[doc]
    first_of_doc = np.ones(n, dtype=bool)
    first_of_doc[1:] = doc[1:] != doc[:-1]
    doc_first = np.maximum.accumulate(np.where(first_of_doc, index, 0))

    held = np.zeros((R, n), dtype=np.int64)
    held[rank, index] = length
    np.cumsum(held, axis=1, out=held)

    def before(r: np.ndarray, i: np.ndarray) -> np.ndarray:
        """Tokens of rank r[j] in pieces 0..i[j]-1."""
        return held[r, i] - np.where(rank[i] == r, length[i], 0)

    own_before = before(rank, index) - before(rank, doc_first)

    key = doc * R + rank
    _, last_reversed = np.unique(key[::-1], return_index=True)
    last = n - 1 - last_reversed  # the last piece of each (document, rank)
    first = doc_first[last]
    need = held[:, last] - held[:, first]  # [R, M]: tokens of each rank between first and last
    need[rank[last], np.arange(len(last))] -= length[last]
    need[rank[first], np.arange(len(last))] += length[first]
    by_dst = np.argsort(rank[last], kind="stable")
    dst = rank[last][by_dst]
    bounds = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
    traffic[:, dst[bounds]] = np.add.reduceat(need[:, by_dst], bounds, axis=1)
    np.fill_diagonal(traffic, 0)
    return length, offset, rank, own_before, traffic


def whole_documents_s(lengths: list[int], world_size: int, model: CostModel) -> float:
    """Forward + backward of every document computed whole, spread evenly over
    `world_size` ranks, with no communication: no placement is modelled faster
    (splitting a document only adds tile rounding)."""
    work = sum(piece_cost(model, 0, n) for n in lengths)
    return (1.0 + model.backward_factor) * model.compute_seconds(float(work)) / world_size


def ulysses_cost(model: CostModel, group_tokens: float, inner_size: int) -> tuple[float, float]:
    """Bytes each inner rank sends in the Ulysses all-to-alls of one layer (forward +
    backward) and their time, for an inner group holding `group_tokens` tokens.

    An inner rank sends (U-1)/U of its tokens' q, k, v (KV heads replicated when fewer
    than U) and of its head slice of the group's outputs; backward mirrors it. Two
    all-to-alls per pass, each of U-1 messages; not overlapped with compute.
    """
    U = inner_size
    if U <= 1:
        return 0.0, 0.0
    tokens = group_tokens / U
    replicated_kv = model.kv_bytes_per_token * max(model.num_kv_heads, U) / model.num_kv_heads
    per_pass = (U - 1) / U * tokens * (2 * model.q_bytes_per_token + replicated_kv)
    latency = model.message_latency_us * 1e-6
    return 2 * per_pass, 2 * (2 * (U - 1) * latency + per_pass / model.bandwidth(LINK_INTRA))


def evaluate(placement: Placement, doc_starts: list[int], inner_size: int, model: CostModel) -> Evaluation:
    """Model one attention layer (forward + backward) for `placement`."""
    R, U, t = placement.num_ranks, inner_size, model.tile
    length, offset, rank, own_before, traffic = _tokens_before(placement, doc_starts)

    nq = _ceil_div(length, t)
    diag = t * t * nq * (nq + 1) // 2
    tile_all = diag + t * t * nq * _ceil_div(offset, t)
    tile_local = diag + t * t * nq * _ceil_div(own_before, t)
    exact = length * (length + 1) // 2 + length * offset

    exact_pairs = np.bincount(rank, weights=exact, minlength=R)
    tile_pairs = np.bincount(rank, weights=tile_all, minlength=R)
    local_pairs = np.bincount(rank, weights=tile_local, minlength=R)

    outer_nodes = np.array([model.node_of(r * U) for r in range(R)])
    intra = outer_nodes[:, None] == outer_nodes[None, :]
    kv_bytes = traffic * (model.kv_bytes_per_token / U)
    latency = model.message_latency_us * 1e-6
    bw = np.where(intra, model.bandwidth(LINK_INTRA), model.bandwidth(LINK_INTER))
    msg_time = np.where(traffic > 0, latency + kv_bytes / bw, 0.0)
    send_time, recv_time = msg_time.sum(axis=1), msg_time.sum(axis=0)
    xfer = np.maximum(send_time, recv_time)
    messages = (traffic > 0).sum(axis=0)

    frac = 1.0 / U
    comp = model.compute_seconds(tile_pairs, head_fraction=frac)
    local = model.compute_seconds(local_pairs, head_fraction=frac)

    def pass_time(scale: float) -> np.ndarray:
        c, cl = comp * scale, local * scale
        m = np.maximum(messages, 1)
        x, r = xfer / m, (c - cl) / m
        pipelined = np.maximum(cl, x) + (m - 1) * np.maximum(r, x) + r
        return np.where(messages > 0, pipelined, c)

    a2a_bytes, a2a_time = ulysses_cost(model, placement.capacity, U)
    rank_time = pass_time(1.0) + pass_time(model.backward_factor) + a2a_time
    ideal = (1.0 + model.backward_factor) * model.compute_seconds(float(tile_pairs.sum())) / (R * U)
    return Evaluation(
        exact_pairs=exact_pairs,
        tile_pairs=tile_pairs,
        traffic_tokens=traffic,
        intra=intra,
        a2a_bytes=a2a_bytes,
        rank_time_s=rank_time,
        makespan_s=float(rank_time.max()) if R else 0.0,
        ideal_s=ideal,
    )
