"""Evaluate a placement under the cost model: per-rank work, traffic and modelled time.

The executor's program runs, on each outer rank, its local blocks first and then one
step per peer, the next step's transfer in flight while the current step computes.
Per rank and pass (forward, then backward at `backward_factor` times the compute):

    T = C                                   if the rank receives nothing
    T = max(C, C_local + X + C_remote / m)  otherwise

with C the kernel time of all its blocks, C_local that of blocks whose keys are local,
X the transfer time (max of its send and receive sides, each message paying the
latency), and m the number of messages it receives (the last step's compute cannot
overlap anything). The backward pass returns dK/dV over the same links with the same
bytes. With an inner (Ulysses) group of U ranks every outer quantity is split over U
head slices and the all-to-all of q, k, v, out (and their gradients) is added, not
overlapped. The layer time is the largest rank time (the makespan).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost_model import LINK_INTER, LINK_INTRA, CostModel
from .placement import Placement


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


def evaluate(placement: Placement, doc_starts: list[int], inner_size: int, model: CostModel) -> Evaluation:
    """Model one attention layer (forward + backward) for `placement`."""
    R, U, t = placement.num_ranks, inner_size, model.tile
    flat = [(p.doc, p.start, p.end, r) for r, pieces in enumerate(placement.ranks) for p in pieces]
    flat.sort(key=lambda x: (x[0], x[1]))
    if flat:
        doc, start, end, rank = (np.array(col, dtype=np.int64) for col in zip(*flat))
    else:
        doc = start = end = rank = np.zeros(0, dtype=np.int64)
    length = end - start
    offset = start - np.asarray(doc_starts, dtype=np.int64)[doc] if len(doc) else doc

    # Tokens each rank holds of the same document before each piece (exclusive prefix).
    onehot = np.zeros((len(doc), R), dtype=np.int64)
    onehot[np.arange(len(doc)), rank] = length
    exclusive = np.cumsum(onehot, axis=0) - onehot
    first_of_doc = np.ones(len(doc), dtype=bool)
    first_of_doc[1:] = doc[1:] != doc[:-1]
    doc_base = np.maximum.accumulate(np.where(first_of_doc, np.arange(len(doc)), 0)) if len(doc) else doc
    prefix = exclusive - exclusive[doc_base]
    own_before = prefix[np.arange(len(doc)), rank] if len(doc) else doc

    nq = _ceil_div(length, t)
    diag = t * t * nq * (nq + 1) // 2
    tile_all = diag + t * t * nq * _ceil_div(offset, t)
    tile_local = diag + t * t * nq * _ceil_div(own_before, t)
    exact = length * (length + 1) // 2 + length * offset

    # A rank needs every earlier piece of the document up to its last piece there.
    traffic = np.zeros((R, R), dtype=np.int64)
    if len(doc):
        # The last piece of each (document, rank): pieces of one rank in one document
        # need not be adjacent, so sort by key and keep the highest index.
        key = doc * R + rank
        order = np.lexsort((np.arange(len(key)), key))
        is_last = np.append(key[order][1:] != key[order][:-1], True)
        last = order[is_last]
        np.add.at(traffic.T, rank[last], prefix[last])
        np.fill_diagonal(traffic, 0)

    exact_pairs = np.bincount(rank, weights=exact, minlength=R) if len(doc) else np.zeros(R)
    tile_pairs = np.bincount(rank, weights=tile_all, minlength=R) if len(doc) else np.zeros(R)
    local_pairs = np.bincount(rank, weights=tile_local, minlength=R) if len(doc) else np.zeros(R)

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
    comp = np.array([model.compute_seconds(p, head_fraction=frac) for p in tile_pairs])
    local = np.array([model.compute_seconds(p, head_fraction=frac) for p in local_pairs])

    def pass_time(scale: float) -> np.ndarray:
        c, cl = comp * scale, local * scale
        overlapped = cl + xfer + (c - cl) / np.maximum(messages, 1)
        return np.where(messages > 0, np.maximum(c, overlapped), c)

    a2a_bytes = 0.0
    a2a_time = 0.0
    if U > 1:
        tokens = placement.capacity / U
        per_pass = (U - 1) / U * tokens * (2 * model.q_bytes_per_token + model.kv_bytes_per_token) / U
        a2a_bytes = 2 * per_pass
        a2a_time = 2 * (2 * (U - 1) * latency + per_pass / model.bandwidth(LINK_INTRA))
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
