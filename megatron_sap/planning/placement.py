"""Placement: which document pieces each (outer) rank holds.

Every rank holds exactly `capacity` tokens. Candidate strategies:

- ``greedy``: documents in order of decreasing cost; a document stays whole on the
  least-loaded rank that has room when that keeps the rank within `(1 + slack)` of the
  ideal load, otherwise it is split over the fewest ranks `k` that do, as `2k` chunks
  paired head-to-tail (rank i holds chunks i and 2k-1-i) so causal work balances.
  What no longer fits whole is cut over the ranks with the most room. With `spread`, a
  document heavier than one rank's share of the work goes over as many ranks as it can.
- ``zigzag``: every document split over all ranks in 2R paired chunks (the ring layout
  without padding).
- ``contiguous``: the packed row cut into R equal contiguous slices (all-gather layout).

The planner evaluates every candidate with the cost model and keeps the fastest.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate, chain
from operator import add, attrgetter, itemgetter
from typing import Callable, Iterator, NamedTuple

from .cost_model import CostModel


class Piece(NamedTuple):
    """A contiguous token range [start, end) of document `doc`, in global packed positions.

    A named tuple rather than a dataclass: placements create thousands per batch.
    """

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Placement:
    """Pieces held by each rank (sorted by position), `capacity` tokens per rank;
    `tile_pairs`, when the strategy tracked them, each rank's tile-rounded pairs."""

    capacity: int
    ranks: tuple[tuple[Piece, ...], ...]
    strategy: str
    tile_pairs: tuple[int, ...] | None = None

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)


class Abandoned(NamedTuple):
    """A greedy pass given up once a rank's tile pairs passed the cap it was given:
    any placement it could finish has a rank at least that loaded."""

    strategy: str
    tile_pairs: int  # the busiest rank's tile pairs when the pass stopped


def piece_cost(model: CostModel, offset: int, length: int) -> int:
    """Tile-rounded pairs of a piece at `offset` in its document: its causal diagonal
    block plus one full block over every earlier key of the document."""
    return _tile_pairs(model.tile, offset, length)


def _tile_pairs(t: int, offset: int, length: int) -> int:
    """`piece_cost` for a tile of t tokens."""
    nq = -(-length // t)
    return t * t * (nq * (nq + 1) // 2 + nq * -(-offset // t))


def chunk_sizes(length: int, k: int) -> list[int]:
    """Sizes of 2k near-equal chunks whose head-to-tail pairs (i, 2k-1-i) differ by at most one token."""
    n = 2 * k
    sizes = [length // n] * n
    extra = length % n
    order = [i for i in range(k)] + [n - 1 - i for i in range(k)]
    for j in order[:extra]:
        sizes[j] += 1
    return sizes


def split_slots(length: int, k: int, split: str) -> list[list[tuple[int, int]]]:
    """How a document of `length` tokens is cut over k ranks: per rank, its (offset, size) pieces.

    ``zigzag``: 2k chunks paired head-to-tail, equal causal work per rank.
    ``contiguous``: k consecutive equal pieces. Later pieces carry more causal work but
    every rank needs only the keys before its piece, a third less traffic than zigzag;
    the greedy gives heavier pieces to lighter ranks and fills the rest with short
    documents.
    """
    if split == "zigzag":
        sizes = chunk_sizes(length, k)
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        return [[(offsets[i], sizes[i]), (offsets[2 * k - 1 - i], sizes[2 * k - 1 - i])] for i in range(k)]
    if split == "contiguous":
        bounds = [length * i // k for i in range(k + 1)]
        return [[(bounds[i], bounds[i + 1] - bounds[i])] for i in range(k)]
    raise ValueError(f"unknown split {split!r}; expected 'zigzag' or 'contiguous'")


class _Split(NamedTuple):
    """A document of one length cut over k ranks (`split_slots`), slots heaviest first
    (stable), with the costs the greedy weighs."""

    heavy_first: tuple[int, ...]  # slot indices of split_slots, heaviest first
    sizes: tuple[int, ...]  # their tokens
    costs: tuple[int, ...]  # their tile-rounded pairs (non-increasing)
    need: int  # tokens of the largest slot


@lru_cache(maxsize=4096)  # a 128K-token batch weighs about 500 splits (lengths recur across batches)
def _split(length: int, k: int, split: str, tile: int) -> _Split:
    """Sizes and tile-rounded costs of `split_slots(length, k, split)`, computed without
    building the slots; memoised, because the greedy weighs the same splits at every slack."""
    if split == "contiguous":
        bounds = [length * i // k for i in range(k + 1)]
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        costs = [_tile_pairs(tile, a, n) for a, n in zip(bounds, sizes)]
    elif split == "zigzag":
        chunks = chunk_sizes(length, k)
        offsets = list(accumulate(chunks, initial=0))
        pairs = list(zip(range(k), range(2 * k - 1, k - 1, -1)))  # slot i: chunks i and 2k-1-i
        sizes = [chunks[i] + chunks[j] for i, j in pairs]
        costs = [_tile_pairs(tile, offsets[i], chunks[i]) + _tile_pairs(tile, offsets[j], chunks[j]) for i, j in pairs]
    else:
        raise ValueError(f"unknown split {split!r}; expected 'zigzag' or 'contiguous'")
    heavy_first = sorted(range(k), key=costs.__getitem__, reverse=True)
    return _Split(
        tuple(heavy_first), tuple([sizes[i] for i in heavy_first]), tuple([costs[i] for i in heavy_first]), max(sizes)
    )


def _zigzag_pieces(doc: int, start: int, sizes: list[int]) -> list[list[Piece]]:
    """Cut a document into chunks of `sizes` and pair them head-to-tail: result[i] = pieces of pair i."""
    k = len(sizes) // 2
    bounds = [start]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    pairs: list[list[Piece]] = []
    for i in range(k):
        j = 2 * k - 1 - i
        pair = [Piece(doc, bounds[c], bounds[c + 1]) for c in (i, j) if sizes[c] > 0]
        pairs.append(pair)
    return pairs


_by_start = attrgetter("start")


def _finish(capacity: int, per_rank: list[list[Piece]], strategy: str) -> Placement:
    ranks = tuple(tuple(sorted(p, key=_by_start)) for p in per_rank)
    for r, pieces in enumerate(ranks):
        held = sum([end - start for _, start, end in pieces])
        if held != capacity:
            raise AssertionError(f"placement {strategy} gave rank {r} {held} tokens, expected {capacity}")
    return Placement(capacity, ranks, strategy)


def contiguous(doc_starts: list[int], lengths: list[int], num_ranks: int, capacity: int) -> Placement:
    """Rank r holds the packed positions [r*capacity, (r+1)*capacity)."""
    per_rank: list[list[Piece]] = [[] for _ in range(num_ranks)]
    for d, (s, n) in enumerate(zip(doc_starts, lengths)):
        pos, end = s, s + n
        while pos < end:
            r = pos // capacity
            cut = min(end, (r + 1) * capacity)
            per_rank[r].append(Piece(d, pos, cut))
            pos = cut
    return _finish(capacity, per_rank, "contiguous")


def zigzag(doc_starts: list[int], lengths: list[int], num_ranks: int, capacity: int) -> Placement | None:
    """Every document over all ranks in head-to-tail chunk pairs.

    The longest document absorbs the rounding so that every rank ends with exactly
    `capacity` tokens; None when that is impossible.
    """
    docs = [d for d, n in enumerate(lengths) if n > 0]
    if not docs:
        return None
    absorber = max(docs, key=lambda d: (lengths[d], -d))
    held = [0] * num_ranks
    per_rank: list[list[Piece]] = [[] for _ in range(num_ranks)]
    for d in docs:
        if d == absorber:
            continue
        sizes = chunk_sizes(lengths[d], num_ranks)
        # Pair i of chunk_sizes is the largest for small i: give it to the emptiest rank.
        ranks_by_room = sorted(range(num_ranks), key=held.__getitem__)  # stable: ties by rank
        for i, pair in enumerate(_zigzag_pieces(d, doc_starts[d], sizes)):
            r = ranks_by_room[i]
            per_rank[r].extend(pair)
            held[r] += sizes[i] + sizes[2 * num_ranks - 1 - i]
    need = [capacity - h for h in held]
    if min(need) < 0:
        return None
    sizes = []
    for r in range(num_ranks):
        sizes.append(need[r] // 2)
    sizes += [need[r] - need[r] // 2 for r in reversed(range(num_ranks))]
    for r, pair in enumerate(_zigzag_pieces(absorber, doc_starts[absorber], sizes)):
        per_rank[r].extend(pair)
    return _finish(capacity, per_rank, "zigzag")


def greedy(
    doc_starts: list[int],
    lengths: list[int],
    num_ranks: int,
    capacity: int,
    model: CostModel,
    slack: float,
    rank_node: list[int] | None = None,
    split: str = "zigzag",
    spread: bool = False,
) -> Placement:
    """Sequence-aware placement: keep documents whole, split the ones that would
    overload a rank over as few ranks as possible, preferring ranks of one node
    (see module docstring). `rank_node[r]` is the node of rank r; `split` is how a
    document is cut over k ranks (see `split_slots`); with `spread`, a document heavier
    than one rank's share of the work is split as wide as the ranks' room and chunks of
    at least one tile allow, instead of over the fewest ranks."""
    return _Greedy(doc_starts, lengths, num_ranks, capacity, model, rank_node).place(slack, split, spread)


_Held = tuple[int, tuple[Piece, ...]]  # a document's pieces on one rank, keyed by their first start


class _Greedy:
    """The greedy passes over one batch: costs, the document order and the pieces of
    every placed cut are computed once and shared by the passes at every slack."""

    def __init__(
        self,
        doc_starts: list[int],
        lengths: list[int],
        num_ranks: int,
        capacity: int,
        model: CostModel,
        rank_node: list[int] | None,
    ):
        self.starts, self.lengths, self.R, self.capacity, self.tile = doc_starts, lengths, num_ranks, capacity, model.tile
        self.rank_node = rank_node or [0] * num_ranks
        ranks_per_node = Counter(self.rank_node)
        # With one node, or one rank per node, the node-local choice is the least-loaded ranks.
        self.node_aware = 1 < len(ranks_per_node) < num_ranks
        self.cost = [_tile_pairs(self.tile, 0, n) for n in lengths]
        self.total = sum(self.cost)
        self.order = sorted((d for d in range(len(lengths)) if lengths[d] > 0), key=lambda d: (-self.cost[d], d))
        # Each document kept whole, as held by its rank.
        self.whole_entry = [(s, (Piece(d, s, s + n),)) for d, (s, n) in enumerate(zip(doc_starts, lengths))]
        self._entries: dict[tuple[int, int, str], tuple[_Held, ...]] = {}  # (doc, k, split) -> per slot

    def _put(self, d: int, split: str, option: tuple, load: list[int], room: list[int], held: list[list[_Held]]) -> None:
        """Place document d as `option` = (peak, k, ranks, cut): slot i of the cut (the whole
        document when k = 1) on the i-th rank. The pieces are built once per batch."""
        _, k, chosen, cut = option
        entries = (self.whole_entry[d],) if cut is None else self._entries.get((d, k, split))
        if entries is None:
            start, n = self.starts[d], self.lengths[d]
            slots = split_slots(n, k, split)
            slots = [[(o, size) for o, size in slots[i] if size] for i in cut.heavy_first]
            entries = tuple([(start + slot[0][0], tuple([Piece(d, start + o, start + o + size) for o, size in slot])) for slot in slots])
            self._entries[d, k, split] = entries
        sizes, costs = ((self.lengths[d],), (self.cost[d],)) if cut is None else (cut.sizes, cut.costs)
        for r, size, pairs, entry in zip(chosen, sizes, costs, entries):
            room[r] -= size
            load[r] += pairs
            held[r].append(entry)

    def place(self, slack: float, split: str, spread: bool = False, cap: float | None = None) -> Placement | Abandoned:
        """One greedy pass at `slack` (see `greedy`); given up as soon as a rank's tile
        pairs exceed `cap` (loads only grow during a pass)."""
        R, lengths, cost = self.R, self.lengths, self.cost
        share = self.total / R
        limit = (1.0 + slack) * share
        strategy = f"greedy(slack={slack:g}, {split}{', spread' if spread else ''})"
        load, room = [0] * R, [self.capacity] * R
        held: list[list[_Held]] = [[] for _ in range(R)]
        for d in self.order:
            if cap is not None and max(load) > cap:
                return Abandoned(strategy, max(load))
            n, c = lengths[d], cost[d]
            by_load = sorted(range(R), key=load.__getitem__)
            whole = next((r for r in by_load if room[r] >= n), None)
            options: list[tuple[int, int, list[int], _Split | None]] = []  # (peak, k, ranks, cut)
            if whole is not None:
                if load[whole] + c <= limit:
                    room[whole] -= n
                    load[whole] += c
                    held[whole].append(self.whole_entry[d])
                    continue
                options.append((load[whole] + c, 1, [whole], None))
            degrees = _split_degrees(c, [load[r] for r in by_load], limit, min(R, n))
            if spread and degrees and c > share:
                # A document heavier than a rank's share: as wide as chunks of at least a
                # tile and the ranks' room allow; the usual degrees as fallback.
                widest = min(n // (2 * self.tile), sum(1 for r in by_load if room[r] >= -(-n // R)))
                if widest > degrees[0]:
                    degrees = [widest] + degrees
            for k in degrees:
                cut = _split(n, k, split, self.tile)
                eligible = [r for r in by_load if room[r] >= cut.need]
                if len(eligible) < k:
                    continue
                first = eligible[:k]
                near = _node_local(eligible, k, self.rank_node, load) if self.node_aware else first
                best_here = None
                for chosen in (near, first) if near != first else (near,):
                    # The heaviest slot goes to the least-loaded chosen rank.
                    peak = max(map(add, map(load.__getitem__, chosen), cut.costs))
                    if best_here is None or (best_here[0] > limit and peak < best_here[0]):
                        best_here = (peak, k, chosen, cut)
                options.append(best_here)
                if best_here[0] <= limit:
                    break
            if options:
                # The loop stops at the first k within the limit; else take the lowest peak.
                best = options[-1] if options[-1][0] <= limit else min(options, key=lambda o: (o[0], o[1]))
                self._put(d, split, best, load, room, held)
            else:
                # Fragmented room: cut the document over the ranks with the most room.
                start = self.starts[d]
                pos, end = start, start + n
                for r in sorted(range(R), key=lambda r: (-room[r], load[r], r)):
                    if pos == end:
                        break
                    take = min(room[r], end - pos)
                    if take > 0:
                        held[r].append((pos, (Piece(d, pos, pos + take),)))
                        room[r] -= take
                        load[r] += _tile_pairs(self.tile, pos - start, take)
                        pos += take
        for r in range(R):
            if room[r]:
                raise AssertionError(f"placement {strategy} gave rank {r} {self.capacity - room[r]} tokens, expected {self.capacity}")
        if cap is not None and max(load) > cap:
            return Abandoned(strategy, max(load))
        ranks = tuple([tuple(chain.from_iterable(map(itemgetter(1), sorted(h)))) for h in held])
        return Placement(self.capacity, ranks, strategy, tuple(load))


def _node_local(eligible: list[int], k: int, rank_node: list[int], load: list[int]) -> list[int]:
    """k of the eligible ranks (given least-loaded first) spread over as few nodes as
    possible, least-loaded first."""
    by_node: dict[int, list[int]] = {}
    for r in eligible:
        ranks = by_node.setdefault(rank_node[r], [])
        ranks.append(r)
        if len(ranks) == k:
            # The first node to gather k eligible ranks: its k-th least-loaded one is the least loaded.
            return ranks
    chosen: list[int] = []
    for ranks in sorted(by_node.values(), key=len, reverse=True):
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
    for k in range(2, max_k + 1):
        if sorted_loads[k - 1] + doc_cost / k <= limit:
            return [k2 for k2 in (k, k + 1, k + 2) if k2 <= max_k] + ([max_k] if k + 2 < max_k else [])
    return [max_k] if max_k >= 2 else []


def candidates(
    doc_starts: list[int],
    lengths: list[int],
    num_ranks: int,
    capacity: int,
    model: CostModel,
    slacks: tuple[float, ...],
    rank_node: list[int] | None = None,
    cap: Callable[[], float | None] | None = None,
) -> Iterator[Placement | Abandoned]:
    """Every placement the planner weighs, built lazily in the order it weighs them:
    sequence-aware ones from the tightest slack (the most balanced) up, the split mode
    that moves fewer bytes first; then one that spreads each document heavier than a
    rank's share over as many ranks as it can (balance when one document dominates the
    work, worth its traffic where links are fast); then the zigzag and contiguous layouts.

    `cap()`, read before each greedy pass, is the most tile pairs a rank may reach
    before the pass is not worth finishing (None: no cap); a pass that passes it
    yields `Abandoned`."""
    passes = _Greedy(doc_starts, lengths, num_ranks, capacity, model, rank_node)
    cap = cap or (lambda: None)
    for s in slacks:
        for split in ("contiguous", "zigzag"):
            yield passes.place(s, split, cap=cap())
    if num_ranks > 1:
        yield passes.place(min(slacks, default=0.0), "zigzag", spread=True, cap=cap())
        z = zigzag(doc_starts, lengths, num_ranks, capacity)
        if z is not None:
            yield z
        yield contiguous(doc_starts, lengths, num_ranks, capacity)
