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


def rank_work(placement: Placement, tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per outer rank: exact causal pairs and tile-rounded pairs whose keys it holds
    (float64 arrays of length R), and the [R, R] forward KV traffic in tokens (row
    sends to column), from the head and tail chunk of every slot of every document.

    A slot's tail comes after its head, so the head is the tail's only local earlier
    key; what slots send each other is the cut's `sends`.
    """
    R = placement.num_ranks
    rank: list[int] = []
    head: list[int] = []
    head_at: list[int] = []
    tail: list[int] = []
    tail_at: list[int] = []
    for record in placement.records:
        cut = record.cut
        rank.extend(record.ranks)
        head.extend(cut.heads)
        head_at.extend(cut.head_at)
        tail.extend(cut.tails)
        tail_at.extend(cut.tail_at)
    rank_a, h, ho, tl, to = (np.array(x, dtype=np.int64) for x in (rank, head, head_at, tail, tail_at))
    nh, nt = -(-h // tile), -(-tl // tile)
    exact = h * (h + 1) // 2 + h * ho + tl * (tl + 1) // 2 + tl * to
    local = tile * tile * (nh * (nh + 1) // 2 + nt * (nt + 1) // 2 + nt * -(-h // tile))
    exact_pairs = np.bincount(rank_a, weights=exact, minlength=R)
    local_pairs = np.bincount(rank_a, weights=local, minlength=R)
    # Scatter every document's slot-to-slot sends to its ranks (a rank holds one slot
    # of a document, so no two entries of one document land on the same pair).
    index, tokens = [], []
    for record in placement.records:
        sends = record.cut.sends
        if sends is not None:
            ranks = np.array(record.ranks)
            index.append((ranks[:, None] * R + ranks).ravel())
            tokens.append(sends.ravel())
    if not tokens:
        return exact_pairs, local_pairs, np.zeros((R, R), dtype=np.int64)
    traffic = np.bincount(np.concatenate(index), weights=np.concatenate(tokens), minlength=R * R)
    return exact_pairs, local_pairs, traffic.astype(np.int64).reshape(R, R)


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


def evaluate(placement: Placement, inner_size: int, model: CostModel) -> Evaluation:
    """Model one attention layer (forward + backward) for `placement`."""
    R, U = placement.num_ranks, inner_size
    exact_pairs, local_pairs, traffic = rank_work(placement, model.tile)
    tile_pairs = np.array(placement.tile_pairs, dtype=np.float64)

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
