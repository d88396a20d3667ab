"""Tally: a candidate's per-rank compute and transfer seconds, added one document at a time.

Candidates are built document by document (the heaviest first, in the greedy). The
tally keeps, per outer rank, the tile pairs it computes (and those whose keys it
holds), the seconds its KV sends and receives take (bytes over its links' bandwidth,
plus the latency of each message: one per pair of ranks that exchange anything) and
`floor_s`: the slowest rank's floor, forward and backward. A pass of a rank that
receives m messages takes (`evaluate` has the whole model; x = X/m, r = C_remote/m)

    forward  = max(x, C_local) + (m - 1) max(x, r) + r
             >= C_local + (m - 1)/m max(X, C_remote) + C_remote/m,  and >= max(X, C_remote) + min(X, C_remote)/m
    backward = b r + (m - 1) max(b r, x) + max(b C_local, x)
             >= b C_local + (m - 1)/m max(X, b C_remote) + b C_remote/m,  and >= max(X, b C_remote) + min(X, b C_remote)/m

and one that receives nothing its kernels, (1 + b) C. Adding documents lowers none of
C_local, C_remote, X and m; the first bounds grow with m, so with the messages a rank
receives so far they bound every placement that completes the candidate, and the
second ones do with R - 1 (the most messages a rank can receive) for m. So `floor_s`
bounds from below the modelled layer time of every such placement. A builder that knows
more of what is to come (the greedy: every rank's room must be filled, at a tile of pairs
per tile row at the least) adds it as `pending` pairs (`expect`), counted where they cost
least: remote in the first bounds (a pair adds 1/m there while the transfers dominate),
not at all in the second, in C for a rank that receives nothing; and once a rank takes no
more pieces (`close`: its room is full), its floor is its modelled time. A candidate whose
floor is already slower than the fastest one so far is given up there. Once every
document is in, the tally holds all that `evaluate` needs.
"""
from __future__ import annotations

import copy
from typing import Iterable, Sequence

import numpy as np

from .cost_model import LINK_INTER, LINK_INTRA, CostModel
from .cuts import Cut


class Tally:
    """Compute and transfers of the documents placed so far over `num_ranks` outer ranks
    of `inner_size` ranks each: per rank, `tiles` (tile pairs computed: the fewer of its
    calls' in the gathered and the pipelined schedule, `gathered` and `pipelined`, each
    summed over its slots (`Cut.pipelined_costs`), the pipelined ones weighed at the cost
    model's `pipelined_kernel_factor`; never decreasing), `local` (those whose keys it
    holds), `send_s` / `recv_s` (seconds of its forward sends and receives) and
    `messages` (how many ranks it receives from); `sends_to[r]` and
    `receives_from[r]` are bit masks of the ranks r sends to and receives from;
    `tokens` is the forward KV tokens moved in all."""

    def __init__(self, num_ranks: int, inner_size: int, model: CostModel) -> None:
        self.inner_size, self.model = inner_size, model
        self.node = [model.node_of(r * inner_size) for r in range(num_ranks)]
        self.num_nodes = self.node[-1] + 1 if num_ranks else 0  # node ids count up from 0
        nodes = len(set(self.node))
        self.one_node, self.node_per_rank = nodes == 1, nodes == num_ranks
        kv_bytes = model.inner_kv_bytes_per_token(inner_size)
        self.intra_s = kv_bytes / model.bandwidth(LINK_INTRA)  # seconds per KV token on each link class
        self.inter_s = kv_bytes / model.bandwidth(LINK_INTER)
        self.node_array = np.array(self.node)
        self.latency_s = model.message_latency_us * 1e-6
        self.pair_s = model.compute_seconds(1.0, head_fraction=1.0 / inner_size)
        # At least 1: the local pairs, counted one for one, stay within `tiles`, and its remote part never falls.
        self.pipelined_factor = max(1.0, model.pipelined_kernel_factor)
        self.backward_factor = model.backward_factor
        self.most_messages = max(num_ranks - 1, 1)  # a rank receives from every other at most
        self.bit = [1 << r for r in range(num_ranks)]
        self.tiles = [0] * num_ranks
        self.gathered = [0] * num_ranks  # tile pairs of each schedule's calls; `tiles` is the fewer
        self.pipelined = [0] * num_ranks
        self.local = [0] * num_ranks
        self.send_s = [0.0] * num_ranks
        self.recv_s = [0.0] * num_ranks
        self.messages = [0] * num_ranks
        self.sends_to = [0] * num_ranks
        self.receives_from = [0] * num_ranks
        self.tokens = 0
        self.pending = [0] * num_ranks  # tile pairs each rank will compute at least, beyond `tiles` (see `expect`)
        self.closed = [False] * num_ranks  # ranks that take no more pieces (see `close`)
        self.head_fraction = 1.0 / inner_size
        self.floor_s = 0.0

    def copy(self) -> Tally:
        """An independent tally of the same documents."""
        other = copy.copy(self)
        other.tiles, other.local, other.send_s, other.recv_s = self.tiles[:], self.local[:], self.send_s[:], self.recv_s[:]
        other.gathered, other.pipelined = self.gathered[:], self.pipelined[:]
        other.messages, other.sends_to, other.receives_from = self.messages[:], self.sends_to[:], self.receives_from[:]
        other.pending, other.closed = self.pending[:], self.closed[:]
        return other

    def matches(self, inner_size: int, model: CostModel) -> bool:
        return inner_size == self.inner_size and model == self.model

    def add(self, ranks: Sequence[int], cut: Cut) -> None:
        """Slot i of `cut` goes to rank `ranks[i]`."""
        tiles, gathered, pipelined, local, factor = self.tiles, self.gathered, self.pipelined, self.local, self.pipelined_factor
        occupied = cut.occupied
        slots = zip(ranks, cut.costs, cut.pipelined_costs, cut.local_costs)
        if occupied is not None:  # only the slots with tokens change anything (a short document over many ranks)
            costs, pipelined_costs, local_costs = cut.costs, cut.pipelined_costs, cut.local_costs
            slots = [(ranks[i], costs[i], pipelined_costs[i], local_costs[i]) for i in occupied]
        for r, g, p, lc in slots:
            g += gathered[r]
            p += pipelined[r]
            gathered[r], pipelined[r] = g, p
            if factor != 1.0:
                p *= factor
            tiles[r] = p if p < g else g
            local[r] += lc
        touched = ranks if occupied is None else [ranks[i] for i in occupied]
        if len(touched) > 1:
            self._add_transfers(ranks, cut)
        self._raise_floor(touched)

    def add_whole(self, ranks: Sequence[int], costs: Sequence[int]) -> None:
        """Documents kept whole, document i on rank `ranks[i]` with its whole tile pairs
        `costs[i]` (all its keys local, nothing moved): many `add`s of one-slot cuts in one."""
        tiles, gathered, pipelined, local, factor = self.tiles, self.gathered, self.pipelined, self.local, self.pipelined_factor
        for r, c in zip(ranks, costs):
            g, p = gathered[r] + c, pipelined[r] + c
            gathered[r], pipelined[r] = g, p
            if factor != 1.0:
                p *= factor
            tiles[r] = p if p < g else g
            local[r] += c
        self._raise_floor(set(ranks))

    def expect(self, ranks: Sequence[int], pairs: Sequence[int], raise_floor: bool = True) -> None:
        """Rank `ranks[i]` will compute at least `pairs[i]` tile pairs beyond its `tiles`
        once every document is in (what is left of its room, at the least a document can
        cost there): the floor counts them where they cost least (module docstring; with
        `raise_floor`, at once). The caller keeps `tiles + pending` of every rank from
        falling as documents arrive."""
        pending = self.pending
        for r, p in zip(ranks, pairs):
            pending[r] = p
        if raise_floor:
            self._raise_floor(ranks)

    def close(self, ranks: Iterable[int]) -> None:
        """These ranks take no more pieces (their room is full): nothing of theirs changes
        any more, so their floor is their modelled time (`rank_seconds`), raised when next
        `add` or `expect` touches them."""
        closed = self.closed
        for r in ranks:
            closed[r] = True

    def rank_seconds(self, r: int) -> float:
        """Rank r's forward + backward as `evaluate` models them, in its arithmetic."""
        model, b = self.model, self.backward_factor
        comp = model.compute_seconds(float(self.tiles[r]), head_fraction=self.head_fraction)
        m = self.messages[r]
        if not m:
            return comp + b * comp
        local = model.compute_seconds(float(self.local[r]), head_fraction=self.head_fraction)
        x = max(self.send_s[r], self.recv_s[r]) / m
        rs = (comp - local) / m
        forward = max(x, local) + (m - 1) * max(x, rs) + rs
        return forward + (b * rs + (m - 1) * max(b * rs, x) + max(b * local, x))

    def _raise_floor(self, ranks: Iterable[int]) -> None:
        """`floor_s` with these ranks' floors as they are now (a rank's floor only grows)."""
        # Each pass of a rank that receives: the bounds of the module docstring; of one that
        # receives nothing, its kernels; of a closed rank, its modelled time.
        tiles, local, pending, closed = self.tiles, self.local, self.pending, self.closed
        pair_s, backward, send_s, recv_s, messages = self.pair_s, self.backward_factor, self.send_s, self.recv_s, self.messages
        most = self.most_messages
        floor = self.floor_s
        for r in ranks:
            if closed[r]:
                rank_floor = self.rank_seconds(r)
                if rank_floor > floor:
                    floor = rank_floor
                continue
            m = messages[r]
            if m:
                x = send_s[r] if send_s[r] > recv_s[r] else recv_s[r]
                held = local[r] * pair_s
                remote = tiles[r] * pair_s - held
                # The bounds of the module docstring: (m - 1)/m max(X, C_remote) + C_remote/m
                # with the messages so far, the pending pairs remote (where they cost least),
                # and with the most messages.
                at_least = remote + pending[r] * pair_s
                larger = x if x > at_least else at_least
                forward = max(held + larger - (larger - at_least) / m, x + remote / most, remote + x / most)
                at_least *= backward
                larger = x if x > at_least else at_least
                rank_floor = forward + max(backward * held + larger - (larger - at_least) / m,
                                           x + backward * remote / most, backward * remote + x / most)
            else:
                rank_floor = (1.0 + backward) * ((tiles[r] + pending[r]) * pair_s)
            if rank_floor > floor:
                floor = rank_floor
        self.floor_s = floor

    def _add_transfers(self, ranks: Sequence[int], cut: Cut) -> None:
        """Bytes and messages of the document's KV exchange. A cut whose slots all hold
        a head and a tail (every slot sends every other) or all a head and no tail (each
        sends the later ones) is priced per slot from its totals, in O(k); any other
        pair by pair."""
        self.tokens += cut.tokens
        pattern = cut.pattern
        if pattern is None:
            self._add_pairs(ranks, cut)
            return
        send_s, recv_s, sent, received = self.send_s, self.recv_s, cut.send_tokens, cut.recv_tokens
        rate = self._link_rate(ranks)
        if rate is not None:
            for r, out, into in zip(ranks, sent, received):
                send_s[r] += out * rate
                recv_s[r] += into * rate
        else:
            intra, inter = self.intra_s, self.inter_s
            for r, out, into, out_intra, into_intra in zip(ranks, sent, received, *self._intra_tokens(ranks, cut, pattern)):
                send_s[r] += out_intra * intra + (out - out_intra) * inter
                recv_s[r] += into_intra * intra + (into - into_intra) * inter
        # Messages: between every two slots ("all"), or from each slot to every later one ("prefix").
        bit = self.bit
        if pattern == "all":
            group = 0
            for r in ranks:
                group |= bit[r]
            for r in ranks:
                self._link(r, group ^ bit[r], group ^ bit[r])
            return
        later, after = [0] * len(ranks), 0
        for j in range(len(ranks) - 1, -1, -1):
            later[j] = after
            after |= bit[ranks[j]]
        earlier = 0
        for r, dsts in zip(ranks, later):
            self._link(r, dsts, earlier)
            earlier |= bit[r]

    def _link(self, r: int, dsts: int, srcs: int) -> None:
        """Rank r sends to the ranks in bit mask `dsts` and receives from those in `srcs`:
        one message's latency for each pair new to the tally."""
        new = dsts & ~self.sends_to[r]
        if new:
            self.sends_to[r] |= new
            self.send_s[r] += new.bit_count() * self.latency_s
        new = srcs & ~self.receives_from[r]
        if new:
            self.receives_from[r] |= new
            count = new.bit_count()
            self.messages[r] += count
            self.recv_s[r] += count * self.latency_s

    def _intra_tokens(self, ranks: Sequence[int], cut: Cut, pattern: str) -> tuple[list[int], list[int]]:
        """Per slot, the KV tokens it sends to and receives from slots on its own node."""
        heads, tails = cut.heads, cut.tails
        nodes = [self.node[r] for r in ranks]
        k, per_node = len(ranks), [0] * self.num_nodes
        out_intra, into_intra = [0] * k, [0] * k
        if pattern == "all":
            # Slot j sends slot i its head, and its tail too when j > i: each slot sends
            # its head to the rest of its node, and its tail to the slots before it there.
            for g in nodes:
                per_node[g] += 1
            before = [0] * self.num_nodes
            for j, g in enumerate(nodes):
                out_intra[j] = heads[j] * (per_node[g] - 1) + tails[j] * before[g]
                before[g] += 1
            head_sum, tails_after = [0] * self.num_nodes, [0] * self.num_nodes
            for g, h in zip(nodes, heads):
                head_sum[g] += h
            for i in range(k - 1, -1, -1):
                g = nodes[i]
                into_intra[i] = head_sum[g] - heads[i] + tails_after[g]
                tails_after[g] += tails[i]
        else:
            # Slot j sends its head to every later slot.
            for i, g in enumerate(nodes):
                into_intra[i] = per_node[g]  # the heads before slot i on its node
                per_node[g] += heads[i]
            later = [0] * self.num_nodes
            for j in range(k - 1, -1, -1):
                g = nodes[j]
                out_intra[j] = heads[j] * later[g]
                later[g] += 1
        return out_intra, into_intra

    def _add_pairs(self, ranks: Sequence[int], cut: Cut) -> None:
        """Any cut: each pair of slots that exchanges anything, at its link's rate."""
        send_s, recv_s, latency = self.send_s, self.recv_s, self.latency_s
        bit, sends_to, receives_from, messages = self.bit, self.sends_to, self.receives_from, self.messages
        heads, tails, node, intra_s, inter_s = cut.heads, cut.tails, self.node, self.intra_s, self.inter_s
        for j, i in cut.send_pairs:
            src, dst = ranks[j], ranks[i]
            tokens = (heads[j] + (tails[j] if j > i else 0)) if tails[i] else heads[j]  # see Cut
            seconds = tokens * (intra_s if node[src] == node[dst] else inter_s)
            if not sends_to[src] & bit[dst]:
                sends_to[src] |= bit[dst]
                receives_from[dst] |= bit[src]
                messages[dst] += 1
                seconds += latency
            send_s[src] += seconds
            recv_s[dst] += seconds

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
