"""The fixed layouts the planner weighs beside the greedy: zigzag, contiguous and whole.

- ``zigzag``: every document split over all ranks in 2R paired chunks (the ring layout
  without padding).
- ``contiguous``: the packed row cut into R equal contiguous slices (the all-gather
  layout), also of the documents reordered (`balanced_order`, `dealt_order`, and the
  balanced order with a few swaps, `refined_order`) so that the slices balance the work.
- ``whole``: every document whole, every rank exactly full (a bounded search for such
  a packing, where the greedy's choices leave rooms no remaining document fits).
"""
from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import Counter
from dataclasses import replace
from itertools import accumulate
from typing import Sequence

import numpy as np

from .cuts import Cut, ring_cut, split_cut, tile_pairs
from .placement import Build, Placement, Record, finish_placement
from .tally import Tally

# `refined_order`: at most this many swaps, on rows of at most this many documents (a step
# weighs every document of the heaviest slice against every other, each swap over the whole
# row: about 1 ms at 30 documents, 7-16 ms at 64).
REFINE_SWAPS = 8
REFINE_MAX_DOCS = 40


def _laid_out(lengths: Sequence[int], capacity: int,
              order: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The row of the non-empty documents laid end to end in `order` (default: as packed),
    cut into slices of `capacity`: the documents in that order, where each starts in the
    row, and the first and last slice it touches (int64 arrays)."""
    sizes = np.asarray(lengths, dtype=np.int64)
    laid = np.arange(len(sizes)) if order is None else np.asarray(order, dtype=np.int64)
    laid = laid[sizes[laid] > 0]
    ends = np.cumsum(sizes[laid])
    positions = ends - sizes[laid]
    return laid, positions, positions // capacity, (ends - 1) // capacity


def _slice_chunks(start: int, length: int, capacity: int) -> tuple[int, list[int]]:
    """The first rank of a non-empty document that starts at `start` of a row cut into
    slices of `capacity` (the contiguous layout), and its chunks, one per slice it crosses."""
    first, last = start // capacity, (start + length - 1) // capacity
    if first == last:
        return first, [length]
    bounds = [start, *range((first + 1) * capacity, last * capacity + 1, capacity), start + length]
    return first, [b - a for a, b in zip(bounds, bounds[1:])]


def contiguous(doc_starts: list[int], lengths: list[int], num_ranks: int, capacity: int, tile: int,
               order: Sequence[int] | None = None, name: str = "contiguous") -> Placement:
    """Rank r holds the positions [r*capacity, (r+1)*capacity) of the row of the documents
    laid end to end in `order` (default: as packed; see `balanced_order`)."""
    records = []
    for d, position, first, last in zip(*(a.tolist() for a in _laid_out(lengths, capacity, order))):
        if first == last:  # inside one rank's slice (most documents)
            records.append(Record(d, doc_starts[d], (first,), split_cut(lengths[d], 1, "contiguous", tile)))
        else:
            chunks = _slice_chunks(position, lengths[d], capacity)[1]
            records.append(Record(d, doc_starts[d], tuple(range(first, last + 1)), Cut(chunks, False, tile)))
    return finish_placement(capacity, num_ranks, records, name)


def dealt_order(docs: Sequence[int], num_ranks: int) -> list[int]:
    """`docs` (`heaviest_first`) in an order whose contiguous layout spreads work and tokens
    alike: dealt to `num_ranks` bins back and forth (0 .. R-1, then R-1 .. 0, ...); the
    bins, in rank order, give the order. Where documents are many and alike (short ones
    all cost a tile of pairs), every bin gets as many of each size, which
    `balanced_order`'s room-bound choices do not."""
    turn, seat = np.divmod(np.arange(len(docs)), num_ranks)
    bins = np.where(turn % 2 == 0, seat, num_ranks - 1 - seat)
    return np.asarray(docs, dtype=np.int64)[np.argsort(bins, kind="stable")].tolist()


def balanced_order(docs: Sequence[int], lengths: Sequence[int], costs: Sequence[int], num_ranks: int,
                   capacity: int) -> list[int]:
    """`docs` (`heaviest_first`) in an order whose contiguous layout balances the work.

    In turn, each document goes to the least-loaded of `num_ranks` bins of `capacity`
    tokens that has room for it whole, else to the emptiest bin; the bins, in rank order,
    give the order. Cut into equal slices, that row splits only the documents on a slice
    boundary, each over consecutive ranks (at most R - 1 of them), and each rank holds
    about its bin: a row of short documents gets close to an even packing without the
    greedy's cuts over fragmented room.
    """
    tokens, load, bins = [0] * num_ranks, [0] * num_ranks, [[] for _ in range(num_ranks)]
    smallest = [0] * len(docs)  # the shortest document from each position on
    shortest = capacity + 1
    for i in range(len(docs) - 1, -1, -1):
        shortest = smallest[i] = min(shortest, lengths[docs[i]])
    # (load, rank) of the bins that may take another document; an entry whose load is no
    # longer the bin's is stale (a bin's load only grows) and dropped when met.
    open_bins = [(0, r) for r in range(num_ranks)]
    for i, d in enumerate(docs):
        n, passed, chosen = lengths[d], [], None
        while open_bins:
            entry = heapq.heappop(open_bins)
            r = entry[1]
            if entry[0] != load[r]:
                continue
            if tokens[r] + n <= capacity:
                chosen = r
                break
            if capacity - tokens[r] >= smallest[i]:  # a later, shorter document may fit
                passed.append(entry)
        for entry in passed:
            heapq.heappush(open_bins, entry)
        if chosen is None:
            chosen = min(range(num_ranks), key=lambda r: (tokens[r], load[r], r))
        bins[chosen].append(d)
        tokens[chosen] += n
        load[chosen] += costs[d]
        if tokens[chosen] < capacity:
            heapq.heappush(open_bins, (load[chosen], chosen))
    return [d for bin_ in bins for d in bin_]


def refined_order(order: Sequence[int], lengths: Sequence[int], num_ranks: int, capacity: int, tile: int,
                  swaps: int = REFINE_SWAPS) -> list[int] | None:
    """`order` (of documents no longer than a slice, such as `balanced_order`'s) with up to
    `swaps` pairs of documents swapped to even out its contiguous layout's slices; None
    where no swap does. A bin of `balanced_order` seldom holds exactly a slice's tokens,
    so the slices cut from its row are less even than its bins. Each step takes, of every
    swap of a document on the heaviest slice with one of another length, the one that
    leaves the slices' tile pairs lowest (the heaviest slice, then the sum of squares), as
    long as that beats the order before it; every such swap is weighed on the whole row
    re-sliced, all of a step's in one array operation."""
    laid = np.asarray([d for d in order if lengths[d] > 0], dtype=np.int64)
    sizes = np.asarray(lengths, dtype=np.int64)[laid]
    tiles = _slice_tiles(sizes[None], num_ranks, capacity, tile)[0]
    best, swapped_any = (tiles.max(), np.square(tiles).sum()), False
    for _ in range(swaps):
        ends = np.cumsum(sizes)
        starts = ends - sizes
        heavy = tiles.argmax()
        on_heavy = np.flatnonzero((starts // capacity <= heavy) & ((ends - 1) // capacity >= heavy))
        first, second = np.repeat(on_heavy, len(sizes)), np.tile(np.arange(len(sizes)), len(on_heavy))
        differ = sizes[first] != sizes[second]
        first, second = first[differ], second[differ]
        if not len(first):
            break
        tried = np.repeat(sizes[None], len(first), axis=0)
        rows = np.arange(len(first))
        tried[rows, first], tried[rows, second] = sizes[second], sizes[first]
        slices = _slice_tiles(tried, num_ranks, capacity, tile)
        heaviest, squares = slices.max(axis=1), np.square(slices).sum(axis=1)
        k = np.lexsort((squares, heaviest))[0]
        if (heaviest[k], squares[k]) >= best:
            break
        best, tiles, swapped_any = (heaviest[k], squares[k]), slices[k], True
        pair = [first[k], second[k]]
        laid[pair], sizes[pair] = laid[pair[::-1]], sizes[pair[::-1]]
    if not swapped_any:
        return None
    return laid.tolist() + [d for d in order if lengths[d] == 0]


def _slice_tiles(sizes: np.ndarray, num_ranks: int, capacity: int, tile: int) -> np.ndarray:
    """Tile pairs of every slice of `capacity` tokens of rows of documents (each no longer
    than a slice) laid end to end: [rows, documents] sizes to [rows, num_ranks] pairs
    (float64; exact below 2^53 pairs). A document crossing a boundary is its head in the
    slice it starts in and the rest, at that offset, in the next."""
    rows = sizes.shape[0]
    ends = np.cumsum(sizes, axis=1)
    starts = ends - sizes
    head = np.minimum(sizes, capacity - starts % capacity)
    slot = (np.arange(rows) * num_ranks)[:, None] + starts // capacity
    size = rows * num_ranks + 1  # the slot after a row's last slice only ever gets empty tails
    pairs = np.bincount(slot.ravel(), tile_pairs(tile, 0, head).ravel(), size)
    pairs += np.bincount((slot + 1).ravel(), tile_pairs(tile, head, sizes - head).ravel(), size)
    return pairs[:-1].reshape(rows, num_ranks)


class ZigzagBuild(Build):
    """Every document over all ranks in head-to-tail chunk pairs (the ring layout
    without padding), each pair of chunks to the ranks holding the fewest tokens, in
    document order. The longest document comes last and absorbs the rounding so that
    every rank ends with exactly `capacity` tokens; the layout is impossible when the
    others leave a rank over capacity. The first step lays out the slot sizes; each
    step then cuts and tallies one document, the longest first (a document of n <= R
    tokens over its n occupied slots only), and one last step all the one-token
    documents left. Its floor before the
    first step is the larger of its transfers' (`_transfer_floor_s`) and its chunks'
    compute (`_chunk_floor_s`, from the documents' whole `costs`); then the larger of
    that and its tally's."""

    def __init__(self, index: int, doc_starts: list[int], lengths: list[int], costs: list[int], capacity: int,
                 tally: Tally):
        self.names, self.indices, self.index = ("zigzag",), (index,), index
        self.starts, self.lengths, self.capacity, self.tally = doc_starts, lengths, capacity, tally
        self.ranks: dict[int, tuple[int, ...]] | None = None  # per document, the rank of each slot
        self.records: dict[int, Record] = {}
        self.floor_s = self._layout_floor = max(_transfer_floor_s(lengths, tally), _chunk_floor_s(lengths, costs, tally))

    def _lay_out(self) -> bool:
        """Each document's ranks, and the rounding the longest one absorbs; False if impossible.

        Chunk pair i of `chunk_sizes(n, R)` holds 2 * (n // 2R) tokens plus one for
        i < n % 2R and one more for i < n % 2R - R: every rank gains the same even part,
        so the ranks holding the fewest tokens are those with the fewest extra ones."""
        R, lengths = len(self.tally.tiles), self.lengths
        docs = [d for d, n in enumerate(lengths) if n > 0]
        if not docs:
            return False
        self.absorber = max(docs, key=lambda d: (lengths[d], -d))
        # Pair i, the largest for small i, goes to the i-th emptiest rank (ties by rank): a
        # document's extra tokens go one per rank in turn from the emptiest, so the
        # emptiest ranks are always those from where the last one stopped, round the ranks.
        even, dealt, turns = 0, 0, {}
        self.ranks = {}
        for d in docs:
            if d == self.absorber:
                continue
            start = dealt % R
            fewest_first = turns.get(start)
            if fewest_first is None:
                fewest_first = turns[start] = tuple(range(start, R)) + tuple(range(start))
            self.ranks[d] = fewest_first
            base, extra = divmod(lengths[d], 2 * R)
            even += 2 * base
            dealt += extra
        level, over = divmod(dealt, R)
        need = [self.capacity - even - level - (r < over) for r in range(R)]
        if min(need) < 0:
            return False
        self.absorber_chunks = [need[r] // 2 for r in range(R)] + [need[r] - need[r] // 2 for r in reversed(range(R))]
        self.ranks[self.absorber] = tuple(range(R))
        self.pending = sorted(self.ranks, key=lambda d: (lengths[d], -d))  # popped longest first
        return True

    def step(self) -> list[Build]:
        if self.ranks is None and not self._lay_out():
            return []
        tile, R = self.tally.model.tile, len(self.tally.tiles)
        d = self.pending[-1]
        n = self.lengths[d]
        if n == 1 and d != self.absorber:
            # The rest are one-token documents, each whole on the first rank of its turn,
            # nothing moved: tallied in one step (a row can hold hundreds of thousands).
            cut = split_cut(1, 1, "contiguous", tile)
            ranks = [self.ranks[d][0] for d in self.pending]
            for d, r in zip(self.pending, ranks):
                self.records[d] = Record(d, self.starts[d], (r,), cut)
            self.tally.add_whole(ranks, [cut.costs[0]] * len(ranks))
            self.pending = []
        else:
            self.pending.pop()
            if d == self.absorber:
                cut, ranks = Cut(self.absorber_chunks, True, tile), self.ranks[d]
            elif n <= R:  # a token in each of the first n slots' head chunks: those slots only
                cut, ranks = split_cut(n, n, "contiguous", tile), self.ranks[d][:n]
            else:
                cut, ranks = ring_cut(n, R, tile), self.ranks[d]
            self.records[d] = Record(d, self.starts[d], ranks, cut)
            self.tally.add(ranks, cut)
        self.floor_s = max(self._layout_floor, self.tally.floor_s)
        if not self.pending:
            records = [self.records[d] for d in sorted(self.records) if d != self.absorber] + [self.records[self.absorber]]
            self.placement = finish_placement(self.capacity, R, records, "zigzag", self.tally)
        return [self]


def _transfer_floor_s(lengths: list[int], tally: Tally) -> float:
    """A floor on the zigzag layout's passes from its transfers, before it is laid out.

    Every document but the longest (which absorbs the rounding) is cut into 2R chunks of
    at least n // 2R tokens, one pair per rank, and every rank receives at least the
    head chunk of every other: that many tokens over each pair's link, and a message
    from each of the other R - 1 ranks once one document has 2R tokens. The busiest
    rank receives at least the mean, and each pass waits for what it receives."""
    R = len(tally.tiles)
    positive = [n for n in lengths if n > 0]
    if R < 2 or len(positive) < 2:
        return 0.0
    others = sorted(positive)[:-1]
    head_tokens = sum(n // (2 * R) for n in others)  # per ordered pair of ranks, at least
    if not head_tokens:
        return 0.0
    node_size = Counter(tally.node)
    pair_seconds = sum((node_size[g] - 1) * tally.intra_s + (R - node_size[g]) * tally.inter_s for g in tally.node)
    return 2 * (head_tokens * pair_seconds / R + (R - 1) * tally.latency_s)


def _chunk_floor_s(lengths: list[int], costs: list[int], tally: Tally) -> float:
    """A floor on the zigzag layout's compute, before it is laid out.

    Every document but the longest is cut into 2R chunks, min(n, 2R) of them non-empty, and
    a non-empty chunk costs at least its diagonal tile; cut or not, a document costs at
    least its whole tile-rounded pairs. The busiest rank computes at least the mean, both
    passes. (Rows of many short documents: each token its own chunk on its own rank.)
    `costs`: each document's whole tile-rounded pairs."""
    R, t = len(tally.tiles), tally.model.tile
    sizes = np.asarray(lengths, dtype=np.int64)  # empty documents add nothing
    if not len(sizes):
        return 0.0
    whole = np.asarray(costs, dtype=np.int64)
    chunks = np.maximum(np.minimum(sizes, 2 * R) * (t * t), whole)
    longest = int(sizes.argmax())  # it absorbs the rounding: its whole cost
    pairs = int(chunks.sum()) - int(chunks[longest]) + int(whole[longest])
    return pairs / R * tally.pair_s * (1.0 + tally.backward_factor)


class ContiguousBuild(Build):
    """The contiguous layout (see `contiguous`) of the documents in `order` (default: as
    packed): its compute floor first, from the chunk sizes alone; built whole at its
    first step, then tallied a document at a time, the widest first, and the documents
    that stay on one rank (no transfers, their compute already in the floor) in one last
    step."""

    def __init__(self, index: int, doc_starts: list[int], lengths: list[int], costs: list[int], capacity: int,
                 tally: Tally, order: list[int] | None = None, name: str = "contiguous"):
        self.names, self.indices, self.index, self.tally = (name,), (index,), index, tally
        self.eager = order is not None  # the orders that balance the slices (the packed one is weighed in turn)
        self.starts, self.lengths, self.capacity, self.order = doc_starts, lengths, capacity, order
        tile, R = tally.model.tile, len(tally.tiles)
        # Documents inside one rank's slice in one array operation, the few that cross a
        # slice boundary chunk by chunk.
        laid, positions, first, last = _laid_out(lengths, capacity, order)
        inside = first == last
        tiles = np.zeros(R, dtype=np.int64)
        np.add.at(tiles, first[inside], np.asarray(costs, dtype=np.int64)[laid[inside]])  # whole documents
        for d, position in zip(laid[~inside].tolist(), positions[~inside].tolist()):
            rank, chunks = _slice_chunks(position, lengths[d], capacity)
            for r, offset, size in zip(range(rank, rank + len(chunks)), accumulate(chunks, initial=0), chunks):
                tiles[r] += tile_pairs(tile, offset, size)
        self._compute_s = int(tiles.max(initial=0)) * tally.pair_s * (1.0 + tally.backward_factor)
        self.floor_s = self._compute_s
        self._built: Placement | None = None

    def step(self) -> list[Build]:
        if self._built is None:
            self._built = contiguous(self.starts, self.lengths, len(self.tally.tiles), self.capacity, self.tally.model.tile,
                                     self.order, self.names[0])
            records = self._built.records
            self._local = [rec for rec in records if len(rec.ranks) == 1]
            self._pending = sorted((rec for rec in records if len(rec.ranks) > 1), key=lambda rec: rec.cut.need * len(rec.ranks))
        if self._pending:
            record = self._pending.pop()
            self.tally.add(record.ranks, record.cut)
        else:
            self.tally.add_whole([rec.ranks[0] for rec in self._local], [rec.cut.costs[0] for rec in self._local])
            self._local = None
        self.floor_s = max(self._compute_s, self.tally.floor_s)
        if self._local is None:
            self.placement = replace(self._built, tally=self.tally)
        return [self]


BALANCED = "contiguous(balanced)"  # the contiguous layout of the documents in `balanced_order`
DEALT = "contiguous(dealt)"  # the contiguous layout of the documents in `dealt_order`
REFINED = "contiguous(refined)"  # the contiguous layout of the documents in `refined_order`
WHOLE_SEARCH_VISITS = 4096  # ranks looked at by the search for a whole-document packing, at most


def whole_packing(lengths: Sequence[int], costs: Sequence[int], num_ranks: int, capacity: int,
                  visits: int = WHOLE_SEARCH_VISITS) -> list[int] | None:
    """A rank for every non-empty document such that every rank holds exactly `capacity`
    tokens and no document is split, or None if none is found.

    Documents go longest first (ties: heavier first); each to a rank with room for it:
    one it fills exactly if there is one, else the least loaded (by tile-rounded cost),
    so the packing is as balanced as the first fit allows. When a rank is left with less
    room than the shortest document, the search backs up and tries the next rank (ranks
    in the same state are one choice). It gives up after looking at `visits` ranks:
    packing into exact capacities is NP-hard, and this is a candidate, not a guarantee.
    Where it gives up (or would look at more ranks than that in one pass down the
    documents: many documents over many ranks), the best fit (`best_fit_packing`) is
    the packing, if it finds one.
    """
    docs = sorted((d for d, n in enumerate(lengths) if n > 0), key=lambda d: (-lengths[d], -costs[d], d))
    if not docs or lengths[docs[0]] > capacity:
        return None
    if len(docs) > 1 and len(docs) * num_ranks >= visits:
        return best_fit_packing(lengths, docs, num_ranks, capacity)
    return _balanced_packing(lengths, costs, docs, num_ranks, capacity, visits) or best_fit_packing(
        lengths, docs, num_ranks, capacity)


def best_fit_packing(lengths: Sequence[int], docs: Sequence[int], num_ranks: int, capacity: int) -> list[int] | None:
    """A rank for every document in `docs` (non-empty, longest first) such that every rank
    holds exactly `capacity` tokens, in one pass: each document to the rank with the least
    room that holds it and is left with none, or with at least the shortest document's
    room (ties: the lower rank); None where no rank is left so. It fills ranks one after
    another instead of balancing them, and finds an exact packing where the balanced
    search runs out of visits (99.85% of 2,000 random packable rows of 8-64 ranks)."""
    shortest = lengths[docs[-1]]
    rooms = [(capacity, r) for r in range(num_ranks)]  # (room, rank) of the ranks with room, ascending
    where = [0] * len(lengths)
    for d in docs:
        n = lengths[d]
        i = bisect_left(rooms, (n, -1))
        while i < len(rooms) and 0 < rooms[i][0] - n < shortest:
            i += 1
        if i == len(rooms):
            return None
        room, r = rooms.pop(i)
        where[d] = r
        if room > n:
            insort(rooms, (room - n, r))
    return where


def _balanced_packing(lengths: Sequence[int], costs: Sequence[int], docs: list[int], num_ranks: int, capacity: int,
                      visits: int) -> list[int] | None:
    """`whole_packing`'s search (see there) of the documents `docs`, longest first."""
    shortest = lengths[docs[-1]]
    room, load = [capacity] * num_ranks, [0] * num_ranks
    where = [0] * len(lengths)
    budget = visits

    def options(n: int) -> list[int]:
        nonlocal budget
        budget -= num_ranks
        fits, seen = [], set()
        for r in range(num_ranks):
            left = room[r] - n
            if left < 0 or (0 < left < shortest) or (room[r], load[r]) in seen:
                continue
            seen.add((room[r], load[r]))
            fits.append(r)
        fits.sort(key=lambda r: (room[r] != n, load[r], r))
        return fits

    stack = [options(lengths[docs[0]])]
    while stack:
        i = len(stack) - 1
        d = docs[i]
        if i and budget <= 0:
            return None
        if not stack[-1]:  # no rank left for document i: undo document i - 1
            stack.pop()
            if stack:
                prev = docs[len(stack) - 1]
                room[where[prev]] += lengths[prev]
                load[where[prev]] -= costs[prev]
            continue
        r = stack[-1].pop(0)
        where[d] = r
        room[r] -= lengths[d]
        load[r] += costs[d]
        if i + 1 == len(docs):
            return where
        stack.append(options(lengths[docs[i + 1]]))
    return None


class WholeBuild(Build):
    """Every document whole on one rank (`whole_packing`): no communication, as balanced
    as the packing found. Absent where a document is longer than a rank holds or no
    packing is found. Its floor before the search is the mean compute, which no
    placement beats; the search and the tally are its one step."""

    def __init__(self, index: int, doc_starts: list[int], lengths: list[int], costs: list[int], capacity: int,
                 tally: Tally):
        self.names, self.indices, self.index, self.tally = ("whole",), (index,), index, tally
        self.starts, self.lengths, self.costs, self.capacity = doc_starts, lengths, costs, capacity
        self.floor_s = sum(costs) / len(tally.tiles) * tally.pair_s * (1.0 + tally.backward_factor)

    def step(self) -> list[Build]:
        R, tile = len(self.tally.tiles), self.tally.model.tile
        where = whole_packing(self.lengths, self.costs, R, self.capacity)
        if where is None:
            return []
        records = [Record(d, self.starts[d], (where[d],), split_cut(n, 1, "contiguous", tile))
                   for d, n in enumerate(self.lengths) if n > 0]
        self.tally.add_whole([rec.ranks[0] for rec in records], [rec.cut.costs[0] for rec in records])
        self.floor_s = max(self.floor_s, self.tally.floor_s)  # the mean, rounded otherwise, may be the larger by an ulp
        self.placement = finish_placement(self.capacity, R, records, "whole", self.tally)
        return [self]
