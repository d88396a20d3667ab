"""The sequence-aware greedy placement.

Documents go in order of decreasing cost; a document stays whole on the least-loaded
rank that has room when that keeps the rank within `(1 + slack)` of the ideal load,
otherwise it is split over the fewest ranks `k` that do, as `2k` chunks paired
head-to-tail (rank i holds chunks i and 2k-1-i) so causal work balances, or as k
consecutive chunks (the ``contiguous`` split); chunks are whole kernel tiles where the
document has enough, token-level where the ranks' room is not whole tiles. What no
longer fits whole is cut over the ranks with the most room. With `spread`, a document
heavier than one rank's share of the work goes over as many ranks as it can (SPREAD_WIDE),
or, where the fewest ranks that balance it outnumber a node's, over as many ranks of one
node as it can (SPREAD_NODE: balance bought with fast links only); with
`fill`, a document that fits on one rank but finds no rank with room for it whole goes
through the rooms left in consecutive chunks, each fill starting where the last ended.
Ranks of one node are preferred for a split. With `projected`, "least loaded" reads the
ranks' projected loads: a rank's tile pairs plus its room at the work per token of the
documents still to place (`GreedyPasses.density`), so that a rank with much room left is not
taken for light while what must fill it is still to come.

The passes at every slack and split mode run as one build while they place documents
alike, and part where they choose differently (`GreedyBuild.step`).
"""
from __future__ import annotations

from bisect import bisect_left
from operator import add
from typing import NamedTuple, Sequence

import numpy as np

from .cost_model import CostModel
from .cuts import Cut, split_cut, split_need, token_split_cut, whole_pairs
from .placement import Build, Placement, Record, build_all
from .tally import Tally

SPREAD_WIDE = "wide"  # a document heavier than a rank's share: over as many ranks as have room
SPREAD_NODE = "node"  # ... over as many ranks of one node as have room


def heaviest_first(lengths: Sequence[int], costs: Sequence[int]) -> list[int]:
    """The non-empty documents by decreasing cost; among equal costs (documents within one
    tile row of each other cost the same) the longest first, so that the short ones fill
    the room left; then in packed order."""
    n, c = np.asarray(lengths, dtype=np.int64), np.asarray(costs, dtype=np.int64)
    docs = np.flatnonzero(n > 0)
    # lexsort: the last key is the primary one; it is stable, so equal keys stay in packed order.
    return docs[np.lexsort((-n[docs], -c[docs]))].tolist()


def greedy(
    doc_starts: list[int],
    lengths: list[int],
    num_ranks: int,
    capacity: int,
    model: CostModel,
    slack: float,
    inner_size: int = 1,
    split: str = "zigzag",
    spread: str | None = None,
    fill: bool = False,
    projected: bool = False,
) -> Placement:
    """Sequence-aware placement: keep documents whole, split the ones that would
    overload a rank over as few ranks as possible, preferring ranks of one node
    (see the module docstring). Outer rank r is on node `model.node_of(r * inner_size)`;
    `split` is how a document is cut over k ranks (see `split_cut`); with `spread`, a
    document heavier than one rank's share of the work is split as wide as the ranks'
    room and chunks of at least one tile allow (SPREAD_WIDE), or, where the fewest
    ranks that fit the limit outnumber a node's, as wide as that allows inside one node
    (SPREAD_NODE, `_DocChoices.node_wide`), instead of over the fewest ranks; with
    `fill`, a document that fits on one rank where none has room for it whole is cut
    through the rooms (`_DocChoices.fill`) instead of weighed by load; with `projected`, the
    ranks are weighed by their projected loads (`GreedyPasses.density`)."""
    passes = GreedyPasses(doc_starts, lengths, num_ranks, capacity, model, inner_size)
    name = greedy_name(slack, split, spread, fill, projected)
    (placement,) = build_all([passes.build([(name, 0, slack, split, spread, fill, projected)])]).values()
    return placement


def greedy_name(slack: float, split: str, spread: str | None = None, fill: bool = False, projected: bool = False) -> str:
    """The pass's candidate name; the slack short (``0.25``) where that reads back as the
    same number, else in full, so that passes at different slacks never share a name."""
    text = f"{slack:g}"
    if float(text) != slack:
        text = repr(float(slack))
    mode = {None: "", SPREAD_WIDE: ", spread", SPREAD_NODE: ", node spread"}[spread]
    return f"greedy(slack={text}, {split}{mode}{', fill' if fill else ''}{', projected' if projected else ''})"


class _Member(NamedTuple):
    """One greedy pass: its candidate name and index, its load slack, split, spread and fill
    mode, and whether it weighs the ranks by their projected loads."""

    name: str
    index: int
    slack: float
    split: str
    spread: str | None
    fill: bool
    projected: bool = False


class GreedyPasses:
    """The greedy passes over one batch: costs and the document order are computed once
    and shared by the passes at every slack."""

    def __init__(
        self,
        doc_starts: list[int],
        lengths: list[int],
        num_ranks: int,
        capacity: int,
        model: CostModel,
        inner_size: int = 1,
    ):
        self.starts, self.lengths, self.R, self.capacity = doc_starts, lengths, num_ranks, capacity
        self.model, self.inner_size, self.tile = model, inner_size, model.tile
        self.pairs_per_tile = model.tile * model.tile  # one tile of queries over one of keys
        by_node: dict[int, list[int]] = {}
        for r in range(num_ranks):
            by_node.setdefault(model.node_of(r * inner_size), []).append(r)
        self.node_ranks = list(by_node.values())  # each node's ranks, ascending
        self.node_index = [0] * num_ranks  # each rank's position in node_ranks
        for n, ranks in enumerate(self.node_ranks):
            for r in ranks:
                self.node_index[r] = n
        # With one node, or one rank per node, the node-local choice is the least-loaded ranks.
        self.node_aware = 1 < len(self.node_ranks) < num_ranks
        self.node_width = max(map(len, self.node_ranks))  # the most outer ranks on one node
        self.cost = whole_pairs(lengths, self.tile).tolist()
        self.total = sum(self.cost)
        self.share = self.total / num_ranks
        self.order = heaviest_first(lengths, self.cost)
        # From each position of the order on (0 past the end), the most tokens a piece of
        # the documents left holds per tile row: every rank must be filled exactly, and
        # each tile row of a piece costs at least a tile of pairs, so a rank's room costs
        # at least ceil(room / unit) tiles of pairs more (`Tally.expect`).
        in_order = np.asarray(lengths, dtype=np.int64)[self.order]
        self.units = np.minimum(np.maximum.accumulate(in_order[::-1])[::-1], self.tile).tolist() + [0]
        # At each position of the order, the tile pairs per token of the documents after it
        # (0 at the last). Every rank's room is filled from those, so a rank's projected
        # load is its tiles plus its room at that density: the projected loads sum to the
        # total work, and a rank with much room left is as loaded as what will fill it.
        # Weighing ranks by it keeps the heavy documents off ranks that must still take many
        # tokens (which the plain load, blind to the room, gives them while they are light).
        pairs_after = np.cumsum(np.asarray(self.cost, dtype=np.float64)[self.order][::-1])[::-1]
        tokens_after = np.cumsum(in_order[::-1])[::-1]
        self.density = [p / t for p, t in zip(pairs_after[1:].tolist(), tokens_after[1:].tolist())] + [0.0]

    def build(self, members: Sequence[tuple]) -> Build:
        """The passes (name, index, slack, split, spread, fill[, projected]), built together
        while they place documents alike."""
        build = GreedyBuild(self, tuple(_Member(*m) for m in members), Tally(self.R, self.inner_size, self.model),
                            [self.capacity] * self.R, [], 0, None)
        build._count_rooms(range(self.R), raise_floor=True)
        build.floor_s = build.tally.floor_s
        return build

    def choose(self, doc: _DocChoices, slack: float, split: str, spread: str | None, fill: bool) -> tuple[tuple[int, ...], Cut]:
        """Where a pass at `slack` puts the document: (rank of each slot, cut). What does
        not depend on the slack is worked out once per document in `doc`."""
        n, c, load = doc.n, doc.c, doc.load
        whole = doc.whole_rank
        if fill and whole is None and n <= self.capacity:
            return doc.fill()
        limit = (1.0 + slack) * self.share
        options: list[tuple[int, int, list[int], Cut | None]] = []  # (peak, k, ranks heaviest slot first, cut); k = 1: whole
        if whole is not None:
            if load[whole] + c <= limit:
                return (whole,), split_cut(n, 1, "contiguous", self.tile)
            options.append((load[whole] + c, 1, [whole], None))
        degrees = _split_degrees(c, doc.sorted_loads, limit, min(self.R, n))
        if spread == SPREAD_NODE and c > self.share and degrees and degrees[0] > self.node_width:
            # The fewest ranks that fit the limit would cross nodes: one node's, as many as can.
            inside = doc.node_wide(split)
            if inside is not None:
                return inside
        if spread == SPREAD_WIDE and degrees and c > self.share and doc.widest > degrees[0]:
            # A document heavier than a rank's share: as wide as chunks of at least a
            # tile and the ranks' room allow; the usual degrees as fallback.
            degrees = [doc.widest] + degrees
        for k in degrees:
            split_k = doc.split_over(k, split)
            if split_k is None:
                continue
            near, first, peak_near, peak_first, cut_k = split_k
            # The heaviest slot goes to the least-loaded chosen rank.
            best_here = (peak_near, k, near, cut_k)
            if near is not first and peak_near > limit and peak_first < peak_near:
                best_here = (peak_first, k, first, cut_k)
            options.append(best_here)
            if best_here[0] <= limit:
                break
        if not options:
            return doc.fragments()
        # The loop stops at the first k within the limit; else take the lowest peak.
        _, k, chosen, cut_k = options[-1] if options[-1][0] <= limit else min(options, key=lambda o: (o[0], o[1]))
        if k == 1:
            return (whole,), split_cut(n, 1, "contiguous", self.tile)
        return doc.slots(chosen, cut_k)


class _DocChoices:
    """What passes in one state weigh for document `d`: worked out when first asked,
    and kept for the other passes when `shared`. `spill` is the rank the state's last
    fill left part-filled (see `fill`)."""

    __slots__ = ("greedy", "d", "load", "room", "n", "c", "density", "by_load", "whole_rank", "shared", "spill",
                 "_sorted_loads", "_roomy", "_rooms", "_widest", "_splits", "_slots", "_fragments", "_node_wide",
                 "filled")

    def __init__(self, greedy: GreedyPasses, d: int, load: list[float], room: list[int], by_load: list[int],
                 whole_rank: int | None, shared: bool, spill: int | None, density: float = 0.0):
        self.greedy, self.d, self.load, self.room, self.shared, self.spill = greedy, d, load, room, shared, spill
        # With projected loads (`density` > 0) a piece adds its cost less what its tokens were
        # projected to cost, as placing it fills that much of its rank's room.
        self.n, self.density = greedy.lengths[d], density
        self.c = greedy.cost[d] - self.n * density
        self.by_load, self.whole_rank = by_load, whole_rank  # see `GreedyBuild.step`
        self._sorted_loads: list[float] | None = None
        self._roomy: list[int] | None = None  # the ranks with room, least loaded first
        self._rooms: list[int] | None = None  # their rooms, ascending
        self._widest: int | None = None
        self._splits: dict[tuple[int, str], tuple | None] = {}
        self._slots: dict[tuple[int, int], tuple[tuple[int, ...], Cut]] = {}
        self._fragments: tuple[tuple[int, ...], Cut] | None = None
        self._node_wide: dict[str, tuple[tuple[int, ...], Cut] | None] = {}
        self.filled: tuple[tuple[int, ...], Cut] | None = None

    @property
    def sorted_loads(self) -> list[float]:
        if self._sorted_loads is None:
            self._sorted_loads = list(map(self.load.__getitem__, self.by_load))
        return self._sorted_loads

    @property
    def roomy(self) -> list[int]:
        """The ranks with room left, least loaded first (late in a pass most ranks are full)."""
        if self._roomy is None:
            self._roomy = list(filter(self.room.__getitem__, self.by_load))
        return self._roomy

    @property
    def widest(self) -> int:
        """The most ranks with room for a 1/R share of the document, chunks of a tile at least."""
        if self._widest is None:
            need = -(-self.n // self.greedy.R)
            self._widest = min(self.n // (2 * self.greedy.tile), sum(1 for r in self.roomy if self.room[r] >= need))
        return self._widest

    def split_over(self, k: int, split: str) -> tuple | None:
        """(node-local ranks, least-loaded ranks, and the peak load of each) for the
        document over k ranks; None if fewer than k ranks have room. Node-local: the
        first node to have k of the least-loaded ranks with room, else as few nodes as
        possible (`_fewest_nodes`)."""
        key = (k, split)
        if key in self._splits:
            return self._splits[key]
        found = self._weigh_split(k, split)
        if self.shared:
            self._splits[key] = found
        return found

    def node_wide(self, split: str) -> tuple[tuple[int, ...], Cut] | None:
        """The document over as many ranks of one node as have room for it (chunks of a
        tile at least), those `split_over` picks node-locally (the least-loaded node that
        has them); None where no node has two. For a document heavier than a rank's share
        whose fewest balancing ranks would cross nodes: balanced as well as one node's
        fast links allow instead."""
        if split in self._node_wide:
            return self._node_wide[split]
        g, found = self.greedy, None
        for k in range(min(g.node_width, self.n // (2 * g.tile), len(self.roomy)), 1, -1):
            split_k = self.split_over(k, split)
            if split_k is not None and len({g.node_index[r] for r in split_k[0]}) == 1:
                found = self.slots(split_k[0], split_k[4])
                break
        if self.shared:
            self._node_wide[split] = found
        return found

    def _weigh_split(self, k: int, split: str) -> tuple | None:
        g, load, room = self.greedy, self.load, self.room
        roomy = self.roomy
        if self._rooms is None:
            self._rooms = sorted(map(room.__getitem__, roomy))
        if len(roomy) < k:
            return None
        # Whole-tile chunks first; where too few ranks have room for them (a document
        # that must fill ranks whose room is not whole tiles), token-level chunks.
        for tile, make_cut in ((g.tile, split_cut), (1, token_split_cut)):
            need = split_need(self.n, k, split, tile)
            if len(roomy) - bisect_left(self._rooms, need) >= k:
                break
        else:
            return None
        cut = make_cut(self.n, k, split, g.tile)
        heavy = cut.heavy
        # The ranks with room for the largest slot, least loaded first.
        eligible = roomy if need <= self._rooms[0] else [r for r in roomy if room[r] >= need]
        first = eligible[:k]
        near = first
        if g.node_aware:
            near = self._node_local(k, eligible)
            if near == first:
                near = first
        if self.density:
            heavy = [cost - cut.sizes[slot] * self.density for cost, slot in zip(heavy, cut.order)]
        peak_first = max(map(add, map(load.__getitem__, first), heavy))
        peak_near = peak_first if near is first else max(map(add, map(load.__getitem__, near), heavy))
        return near, first, peak_near, peak_first, cut

    def _node_local(self, k: int, eligible: list[int]) -> list[int]:
        """k of the `eligible` ranks (least loaded first): those of the first node to
        gather k of them going through the ranks by load (the node whose k-th
        least-loaded eligible rank is the least loaded), else over as few nodes as
        possible (`_fewest_nodes`)."""
        node = self.greedy.node_index
        per_node: dict[int, list[int]] = {}  # in the order of each node's least-loaded rank
        for r in eligible:
            ranks = per_node.get(node[r])
            if ranks is None:
                ranks = per_node[node[r]] = []
            ranks.append(r)
            if len(ranks) == k:
                return ranks
        return _fewest_nodes(list(per_node.values()), k, self.load)

    def slots(self, chosen: list[int], cut: Cut) -> tuple[tuple[int, ...], Cut]:
        """The rank of each slot of `cut` when its heaviest slots go to `chosen` in order."""
        key = (id(chosen), id(cut))
        if key in self._slots:
            return self._slots[key]
        ranks = [0] * len(chosen)
        for slot, r in zip(cut.order, chosen):
            ranks[slot] = r
        found = (tuple(ranks), cut)
        if self.shared:
            self._slots[key] = found
        return found

    def fill(self) -> tuple[tuple[int, ...], Cut]:
        """A document that fits on one rank, where no rank has room for it whole: in
        consecutive chunks through the ranks with room, starting where the last fill
        ended (`spill`), then its node's least-loaded ranks, then the others'. Each fill
        crosses only the rooms it fills up and leaves at most one rank part-filled, so a
        row's last documents fill the room left with few cuts, each between two ranks,
        instead of each cut over several ranks by load (many small messages)."""
        if self.filled is None:
            order, spill = self.roomy, self.spill
            if spill is not None and self.room[spill]:
                node = self.greedy.node_index
                home = node[spill]
                order = [spill] + [r for r in order if node[r] == home and r != spill] + [r for r in order if node[r] != home]
            self.filled = self._through(order)
        return self.filled

    def fragments(self) -> tuple[tuple[int, ...], Cut]:
        """Fragmented room: the document cut over the ranks with the most room."""
        if self._fragments is None:
            # The most room first; among equal rooms the least loaded (by_load's order, which
            # the stable sort keeps).
            self._fragments = self._through(sorted(self.roomy, key=self.room.__getitem__, reverse=True))
        return self._fragments

    def _through(self, order: list[int]) -> tuple[tuple[int, ...], Cut]:
        """The document in consecutive chunks through the rooms of the ranks in `order`
        (each with room), each chunk as much as its rank has room for."""
        room, n = self.room, self.n
        offset, ranks, chunks = 0, [], []
        for r in order:
            take = min(room[r], n - offset)
            ranks.append(r)
            chunks.append(take)
            offset += take
            if offset == n:
                break
        return tuple(ranks), Cut(chunks, False, self.greedy.tile)


class GreedyBuild(Build):
    """Greedy passes that have placed every document alike so far."""

    def __init__(self, greedy: GreedyPasses, members: tuple[_Member, ...], tally: Tally,
                 room: list[int], records: list[Record], position: int, spill: int | None):
        self.greedy, self.tally, self.room, self.records, self.position = greedy, tally, room, records, position
        self.spill = spill  # the rank the last fill left part-filled (`_DocChoices.fill`)
        self._join(members)

    def _join(self, members: tuple[_Member, ...]) -> None:
        self.members = members
        self.names = tuple(m.name for m in members)
        self.indices = tuple(m.index for m in members)
        self.index = members[0].index
        # The members by how they weigh the ranks (plain loads first, then projected), with
        # each group's tightest slack.
        self.views = tuple((projected, group, min(m.slack for m in group))
                           for projected in (False, True)
                           for group in [tuple(m for m in members if m.projected == projected)] if group)
        self.floor_s = self.tally.floor_s

    def step(self) -> list[Build]:
        g, tiles, room = self.greedy, self.tally.tiles, self.room
        d = g.order[self.position]
        n = g.lengths[d]
        whole_cut = None
        # Members that choose alike, by (ranks, cut, whether a fill chose it): a document on
        # one rank is the same placement whichever way it was chosen.
        groups: dict[tuple, tuple[tuple[tuple[int, ...], Cut], list[_Member]]] = {}
        for projected, members, tightest in self.views:
            density = g.density[self.position] if projected else 0.0
            load = [t + r * density for t, r in zip(tiles, room)] if projected else tiles
            # The least-loaded rank with room for the whole document (ties: the lowest rank),
            # most often simply the least-loaded rank.
            by_load, whole = None, None
            if n <= g.capacity:
                whole = load.index(min(load))
                if room[whole] < n:
                    by_load = sorted(range(g.R), key=load.__getitem__)
                    whole = next((r for r in by_load if room[r] >= n), None)
            if whole is not None and load[whole] + g.cost[d] - n * density <= (1.0 + tightest) * g.share:
                # Kept whole by the tightest pass, so by all: a larger slack only raises the
                # limit, and the split and spread modes change only how a document is split.
                if whole_cut is None:
                    whole_cut = split_cut(n, 1, "contiguous", g.tile)
                groups.setdefault(((whole,), None, False), (((whole,), whole_cut), []))[1].extend(members)
                continue
            if by_load is None:
                by_load = sorted(range(g.R), key=load.__getitem__)
            doc = _DocChoices(g, d, load, room, by_load, whole, len(members) > 1, self.spill, density)
            for m in members:
                choice = g.choose(doc, m.slack, m.split, m.spread, m.fill)
                filled = choice is doc.filled
                key = (choice[0], None if len(choice[0]) == 1 else id(choice[1]), filled)
                groups.setdefault(key, (choice, []))[1].append(m)
        if len(groups) == 1:
            ((_, _, filled), (choice, _)), = groups.items()
            self._place(d, choice, filled=filled)
            return [self]
        parted = [self] + [self._copy() for _ in range(len(groups) - 1)]
        for build, ((_, _, filled), (choice, members)) in zip(parted, groups.items()):
            build._join(tuple(members))  # before placing: a finished placement takes the first name
            build._place(d, choice, filled=filled)
        return parted

    def _count_rooms(self, ranks: Sequence[int], raise_floor: bool) -> None:
        """The tally's floor counts what the rooms of `ranks` cost at the least, filled with
        the documents left (`GreedyPasses.units`; nothing after the last document)."""
        unit, per_tile, room = self.greedy.units[self.position], self.greedy.pairs_per_tile, self.room
        self.tally.expect(ranks, [-(-room[r] // unit) * per_tile if unit else 0 for r in ranks], raise_floor)

    def _copy(self) -> GreedyBuild:
        return GreedyBuild(self.greedy, self.members, self.tally.copy(), self.room[:], self.records[:], self.position, self.spill)

    def _place(self, d: int, choice: tuple[tuple[int, ...], Cut], filled: bool = False) -> None:
        g, room = self.greedy, self.room
        ranks, cut = choice
        for r, size in zip(ranks, cut.sizes):
            room[r] -= size
        if filled:
            self.spill = ranks[-1] if room[ranks[-1]] else None
        self.position += 1
        self._count_rooms(ranks, raise_floor=False)  # before `add` raises their floors
        self.tally.close([r for r in ranks if not room[r]])
        self.tally.add(ranks, cut)
        if g.units[self.position] != g.units[self.position - 1]:  # shorter documents left: every room costs more
            self._count_rooms([r for r in range(g.R) if room[r]], raise_floor=True)
        self.floor_s = self.tally.floor_s
        self.records.append(Record(d, g.starts[d], ranks, cut))
        if self.position == len(g.order):
            for r, left in enumerate(room):
                if left:
                    raise AssertionError(f"placement {self.names[0]} gave rank {r} {g.capacity - left} tokens, expected {g.capacity}")
            self.placement = Placement(g.capacity, g.R, tuple(self.records), self.members[0].name, tuple(self.tally.tiles), self.tally)


def _fewest_nodes(per_node: list[list[int]], k: int, load: list[int]) -> list[int]:
    """k ranks spread over as few nodes as possible when no node has k: the nodes with
    the most of the eligible ranks `per_node` (each least loaded first; the nodes in
    the order of their least-loaded rank) first, ties in that order; the result least
    loaded first."""
    chosen: list[int] = []
    for ranks in sorted(per_node, key=len, reverse=True):
        chosen.extend(ranks[: k - len(chosen)])
        if len(chosen) == k:
            break
    return sorted(chosen, key=load.__getitem__)


def _split_degrees(doc_cost: int, sorted_loads: list[int], limit: float, max_k: int) -> list[int]:
    """Split degrees worth trying, smallest first.

    A split over k ranks lands about doc_cost / k on each of the k least-loaded ranks;
    the first k whose estimate fits the limit is tried with its neighbours (tile
    rounding makes the estimate slightly optimistic), then the largest degree as the
    fallback when nothing fits.
    """
    # No k under doc_cost / (limit - the lowest load) fits: start there.
    headroom = limit - sorted_loads[0]
    if headroom <= 0:
        return [max_k] if max_k >= 2 else []
    for k in range(max(2, int(doc_cost / headroom)), max_k + 1):
        if sorted_loads[k - 1] + doc_cost / k <= limit:
            return [k2 for k2 in (k, k + 1, k + 2) if k2 <= max_k] + ([max_k] if k + 2 < max_k else [])
    return [max_k] if max_k >= 2 else []
