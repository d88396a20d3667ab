"""The order in which the outer ranks exchange K/V: one order of rank pairs for all.

A rank's exchanges run one after another on its link, and an exchange between r and p
starts only when both are done with their earlier ones. Any single order of the pairs
that every rank follows is free of deadlock (the first pair still pending is the next
step of both its ranks), but the order decides how long links sit idle waiting for a
partner. Exchange rounds (r and p meet in round (r + p) mod R) are such an order that
knows nothing of the sizes: a long exchange in an early round holds up both partners'
next ones, and theirs the next, and so on.

`exchange_order` builds the order by simulating the links: the rank whose link is free
soonest takes, among the peers it still has to meet, the one whose link is free soonest
(ties: the longer exchange, so that the kernels have the most to work on early; then
the lower rank). It reads only the tokens the ranks send each other (an exchange takes
its larger direction over its link). Every rank computes the same order from the same
plan and cost model (integer ties, the same floating-point operations in the same order).
"""
from __future__ import annotations

import heapq

import numpy as np

from .cost_model import CostModel
from .program import exchange_round

MAX_ORDERED_PAIRS = 4096  # beyond, round order: the simulation's cost grows with pairs x peers


def exchange_order(traffic_tokens: np.ndarray, model: CostModel, inner_size: int) -> dict[tuple[int, int], int]:
    """The position of every exchanging pair of outer ranks `(a, b)`, a < b, in the order
    all ranks run their exchanges in (see the module docstring; round order beyond
    MAX_ORDERED_PAIRS pairs); `traffic_tokens[s, d]` is the forward K/V tokens outer rank
    s sends d."""
    R = len(traffic_tokens)
    pairs = [(int(a), int(b)) for a, b in zip(*np.nonzero(np.triu(traffic_tokens + traffic_tokens.T, 1)))]
    if len(pairs) > MAX_ORDERED_PAIRS:
        # Rounds, each a matching of the ranks (a document spread over every rank, the
        # usual way to get this many pairs, exchanges equal amounts in every round).
        pairs.sort(key=lambda pair: (exchange_round(*pair, R), pair))
        return {pair: i for i, pair in enumerate(pairs)}
    kv_bytes = model.inner_kv_bytes_per_token(inner_size)
    tokens = traffic_tokens.tolist()
    exchange_s: dict[tuple[int, int], float] = {}
    peers: list[list[int]] = [[] for _ in range(R)]
    for a, b in pairs:
        link = model.link_between(a * inner_size, b * inner_size)
        exchange_s[a, b] = model.transfer_seconds(max(tokens[a][b], tokens[b][a]) * kv_bytes, link)
        peers[a].append(b)
        peers[b].append(a)
    for r, ps in enumerate(peers):  # longest exchange first, then the lower rank
        ps.sort(key=lambda q, r=r: (-exchange_s[min(r, q), max(r, q)], q))
    free = [0.0] * R  # when each rank's link is done with its exchanges so far
    heap = [(0.0, r) for r in range(R) if peers[r]]
    order: dict[tuple[int, int], int] = {}
    while heap:
        at, r = heapq.heappop(heap)
        if at != free[r] or not peers[r]:
            continue  # a stale entry
        p, soonest = -1, float("inf")
        for q in peers[r]:  # the first peer already free starts now; else the one free soonest
            if free[q] < soonest:
                p, soonest = q, free[q]
                if soonest <= at:
                    break
        pair = (min(r, p), max(r, p))
        order[pair] = len(order)
        free[r] = free[p] = max(at, soonest) + exchange_s[pair]
        for a, b in ((r, p), (p, r)):
            peers[a].remove(b)
            if peers[a]:
                heapq.heappush(heap, (free[a], a))
    return order
