"""Tally: a candidate's per-rank compute and transfer seconds, added one document at a time.

Candidates are built document by document (the heaviest first, in the greedy). The
tally keeps, per outer rank, the tile pairs it computes and the seconds its KV sends and
receives take on their links (bytes over bandwidth; the latency of a message only where
a document spans ranks of several nodes), and
`floor_s`: the slowest rank's compute or transfers, forward and backward. Every pass of a
rank's pipeline (see `evaluate`) takes at least its compute and, if the rank receives
anything, at least its transfer time, and adding documents shrinks neither, so `floor_s` bounds from below the modelled
layer time of every placement that completes the candidate. A candidate whose floor is
already slower than the fastest one so far is given up there.
"""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from .cost_model import LINK_INTER, LINK_INTRA, CostModel


class Tally:
    """Compute and transfers of the documents placed so far over `num_ranks` outer ranks
    of `inner_size` ranks each; `tiles[r]` is the tile pairs rank r computes."""

    def __init__(self, num_ranks: int, inner_size: int, model: CostModel):
        self.node = [model.node_of(r * inner_size) for r in range(num_ranks)]
        nodes = len(set(self.node))
        self.one_node, self.node_per_rank = nodes == 1, nodes == num_ranks
        kv_bytes = model.kv_bytes_per_token / inner_size
        self.intra_s = kv_bytes / model.bandwidth(LINK_INTRA)  # seconds per KV token on each link class
        self.inter_s = kv_bytes / model.bandwidth(LINK_INTER)
        self.node_array = np.array(self.node)
        self.pair_s = model.compute_seconds(1.0, head_fraction=1.0 / inner_size)
        self.backward_factor = model.backward_factor
        self.tiles = [0] * num_ranks
        self.send_s = [0.0] * num_ranks
        self.recv_s = [0.0] * num_ranks
        self.floor_s = 0.0
        self.latency_s = model.message_latency_us * 1e-6
        self.linked = np.zeros(num_ranks * num_ranks, dtype=bool)  # [src * R + dst]: latency counted

    def copy(self) -> "Tally":
        """An independent tally of the same documents."""
        other = copy.copy(self)
        other.tiles, other.send_s, other.recv_s = self.tiles[:], self.send_s[:], self.recv_s[:]
        other.linked = self.linked.copy()
        return other

    def add(self, ranks: Sequence[int], cut) -> None:
        """Slot i of `cut` (a `placement.Cut`) goes to rank `ranks[i]`."""
        tiles = self.tiles
        for r, c in zip(ranks, cut.costs):
            tiles[r] += c
        if len(ranks) > 1:
            self._add_transfers(ranks, cut)
        # No pass is faster than its compute, nor, on a rank that receives (the model
        # overlaps a rank's sends only with its own receive steps), than its transfers.
        pair_s, backward, send_s, recv_s = self.pair_s, self.backward_factor, self.send_s, self.recv_s
        floor = self.floor_s
        for r in ranks:
            c, x = tiles[r] * pair_s, (send_s[r] if send_s[r] > recv_s[r] else recv_s[r]) if recv_s[r] else 0.0
            rank_floor = (c if c > x else x) + (backward * c if backward * c > x else x)
            if rank_floor > floor:
                floor = rank_floor
        self.floor_s = floor

    def _add_transfers(self, ranks: Sequence[int], cut) -> None:
        send_s, recv_s = self.send_s, self.recv_s
        rate = self._link_rate(ranks)
        if rate is not None:  # every pair of the cut's ranks on one link class: slot totals suffice
            for r, sent, received in zip(ranks, cut.send_tokens, cut.recv_tokens):
                send_s[r] += sent * rate
                recv_s[r] += received * rate
            return
        # Mixed (many ranks over several nodes): each pair's tokens at its link's rate,
        # and each message new to the tally pays its latency (only here: where many
        # ranks exchange, latencies add up).
        R = len(send_s)
        rk = np.array(ranks)
        node = self.node_array[rk]
        pairs = (rk[:, None] * R + rk).ravel()
        new = cut.links & ~self.linked[pairs].reshape(cut.links.shape)
        self.linked[pairs] |= new.ravel()
        rate = np.where(node[:, None] == node[None, :], self.intra_s, self.inter_s)
        seconds = cut.sends * rate + new * self.latency_s
        for r, sent, received in zip(ranks, seconds.sum(1).tolist(), seconds.sum(0).tolist()):
            send_s[r] += sent
            recv_s[r] += received

    def _link_rate(self, ranks: Sequence[int]) -> float | None:
        """Seconds per token when all of these ranks share a node or none do, else None."""
        if self.one_node:
            return self.intra_s
        if self.node_per_rank:
            return self.inter_s
        nodes = [self.node[r] for r in ranks]
        if nodes.count(nodes[0]) == len(nodes):
            return self.intra_s
        if len(set(nodes)) == len(nodes):
            return self.inter_s
        return None
