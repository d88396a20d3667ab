"""Tally: a candidate's per-rank compute and transfer seconds, added one document at a time.

Candidates are built document by document (the heaviest first, in the greedy). The
tally keeps, per outer rank, the tile pairs it computes (and those whose keys it
holds), the seconds its KV sends and receives take (bytes over its links' bandwidth,
plus the latency of each message: one per pair of ranks that exchange anything), and
`floor_s`: the slowest rank's compute or transfers, forward and backward. Every pass of a
rank's pipeline (see `evaluate`) takes at least its compute and, if the rank receives
anything, at least its transfer time, and adding documents shrinks neither, so
`floor_s` bounds from below the modelled layer time of every placement that completes
the candidate. A candidate whose floor is already slower than the fastest one so far is
given up there. Once every document is in, the tally holds all that `evaluate` needs.
"""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from .cost_model import LINK_INTER, LINK_INTRA, CostModel

# Documents over at most this many ranks add their messages pair by pair; wider ones
# as one array update (over ranks of several nodes, that pays from fewer ranks on).
_PAIRWISE_UP_TO = 8
_MIXED_PAIRWISE_UP_TO = 4


class Tally:
    """Compute and transfers of the documents placed so far over `num_ranks` outer ranks
    of `inner_size` ranks each: per rank, `tiles` (tile pairs computed), `local` (those
    whose keys it holds) and `send_s` / `recv_s` (seconds of its forward sends and
    receives); `linked[src * R + dst]` is 1 once src sends dst anything; `tokens` is
    the forward KV tokens moved in all."""

    def __init__(self, num_ranks: int, inner_size: int, model: CostModel):
        self.inner_size, self.model = inner_size, model
        self.node = [model.node_of(r * inner_size) for r in range(num_ranks)]
        nodes = len(set(self.node))
        self.one_node, self.node_per_rank = nodes == 1, nodes == num_ranks
        kv_bytes = model.kv_bytes_per_token / inner_size
        self.intra_s = kv_bytes / model.bandwidth(LINK_INTRA)  # seconds per KV token on each link class
        self.inter_s = kv_bytes / model.bandwidth(LINK_INTER)
        self.node_array = np.array(self.node)
        self.latency_s = model.message_latency_us * 1e-6
        self.pair_s = model.compute_seconds(1.0, head_fraction=1.0 / inner_size)
        self.backward_factor = model.backward_factor
        self.tiles = [0] * num_ranks
        self.local = [0] * num_ranks
        self.send_s = [0.0] * num_ranks
        self.recv_s = [0.0] * num_ranks
        self.tokens = 0
        self.floor_s = 0.0
        self.linked = bytearray(num_ranks * num_ranks)
        self._linked = np.frombuffer(self.linked, dtype=np.uint8)  # the same bytes, for array updates

    def copy(self) -> Tally:
        """An independent tally of the same documents."""
        other = copy.copy(self)
        other.tiles, other.local, other.send_s, other.recv_s = self.tiles[:], self.local[:], self.send_s[:], self.recv_s[:]
        other.linked = bytearray(self.linked)
        other._linked = np.frombuffer(other.linked, dtype=np.uint8)
        return other

    def matches(self, inner_size: int, model: CostModel) -> bool:
        return inner_size == self.inner_size and model == self.model

    def add(self, ranks: Sequence[int], cut) -> None:
        """Slot i of `cut` (a `placement.Cut`) goes to rank `ranks[i]`."""
        tiles, local = self.tiles, self.local
        for r, c, lc in zip(ranks, cut.costs, cut.local_costs):
            tiles[r] += c
            local[r] += lc
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
        send_s, recv_s, latency = self.send_s, self.recv_s, self.latency_s
        self.tokens += cut.tokens
        rate = self._link_rate(ranks)
        if len(ranks) <= (_PAIRWISE_UP_TO if rate is not None else _MIXED_PAIRWISE_UP_TO):
            linked, R = self.linked, len(send_s)
            if rate is not None:
                # Every pair of these ranks on one link class: slot totals price the bytes.
                for r, sent, received in zip(ranks, cut.send_tokens, cut.recv_tokens):
                    send_s[r] += sent * rate
                    recv_s[r] += received * rate
                for j, i in cut.send_pairs:
                    src, dst = ranks[j], ranks[i]
                    if not linked[src * R + dst]:
                        linked[src * R + dst] = 1
                        send_s[src] += latency
                        recv_s[dst] += latency
                return
            heads, tails, node, intra_s, inter_s = cut.heads, cut.tails, self.node, self.intra_s, self.inter_s
            for j, i in cut.send_pairs:
                src, dst = ranks[j], ranks[i]
                tokens = (heads[j] + (tails[j] if j > i else 0)) if tails[i] else heads[j]  # see Cut
                seconds = tokens * (intra_s if node[src] == node[dst] else inter_s)
                if not linked[src * R + dst]:
                    linked[src * R + dst] = 1
                    seconds += latency
                send_s[src] += seconds
                recv_s[dst] += seconds
            return
        # Many ranks: each pair's tokens at its link's rate, in one array pass.
        R = len(send_s)
        rk = np.array(ranks)
        pairs = (rk[:, None] * R + rk).ravel()
        sends = cut.sends
        new = (sends > 0) & (self._linked[pairs].reshape(sends.shape) == 0)
        self._linked[pairs] |= new.ravel()
        if rate is None:
            node = self.node_array[rk]
            rate = np.where(node[:, None] == node[None, :], self.intra_s, self.inter_s)
        seconds = sends * rate + new * latency
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
