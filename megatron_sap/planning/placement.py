"""Placement: which document pieces each (outer) rank holds.

Every rank holds exactly `capacity` tokens. Candidate strategies:

- ``greedy``: documents in order of decreasing cost; a document stays whole on the
  least-loaded rank that has room when that keeps the rank within `(1 + slack)` of the
  ideal load, otherwise it is split over the fewest ranks `k` that do, as `2k` chunks
  paired head-to-tail (rank i holds chunks i and 2k-1-i) so causal work balances, or
  as k consecutive chunks (the ``contiguous`` split); chunks are whole kernel tiles
  where the document has enough, token-level where the ranks' room is not whole tiles.
  What no longer fits whole is cut over the ranks with the most room. With `spread`, a
  document heavier than one rank's share of the work goes over as many ranks as it can.
- ``zigzag``: every document split over all ranks in 2R paired chunks (the ring layout
  without padding).
- ``contiguous``: the packed row cut into R equal contiguous slices (all-gather layout).
- ``whole``: every document whole, every rank exactly full (a bounded search for such
  a packing, where the greedy's choices leave rooms no remaining document fits).

A placement is stored as one `Record` per document: the document's `Cut` (its slots,
each the pieces one rank holds) and the rank of each slot. The evaluation works on the
cuts' chunk sizes in a few array operations, and the pieces per rank are built only
when asked for (the chosen candidate). Candidates are built as `Build`s, a document at
a time with a `Tally` of their compute and transfers, so that the planner can give up
one as soon as it can no longer be the fastest; greedy passes that place documents
alike are one build until they part.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from itertools import accumulate, chain
from operator import add, itemgetter
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from .cost_model import CostModel
from .tally import Tally


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


def piece_cost(model: CostModel, offset: int, length: int) -> int:
    """Tile-rounded pairs of a piece at `offset` in its document: its causal diagonal
    block plus one full block over every earlier key of the document."""
    return _tile_pairs(model.tile, offset, length)


def _tile_pairs(t: int, offset: int, length: int) -> int:
    """`piece_cost` for a tile of t tokens."""
    nq = -(-length // t)
    return t * t * (nq * (nq + 1) // 2 + nq * -(-offset // t))


def whole_pairs(lengths: Sequence[int], tile: int) -> np.ndarray:
    """Each document's tile-rounded pairs computed whole (`piece_cost` at offset 0), int64:
    one array operation for rows of thousands of documents."""
    tiles = -(-np.asarray(lengths, dtype=np.int64) // tile)
    return tile * tile * (tiles * (tiles + 1) // 2)


class _memo:
    """A cut's attribute computed on first use and then stored on the instance (as
    functools.cached_property, without the lock it takes on Python < 3.12: a fresh batch
    makes hundreds of cuts). None depends on the size of the document's last chunk, so
    a `Cut.shortened` copy takes it from the cut it was made from, computed once there."""

    def __init__(self, compute: Callable):
        self.compute, self.name, self.__doc__ = compute, compute.__name__, compute.__doc__

    def __get__(self, obj: object, owner: type | None = None):
        if obj is None:
            return self
        source = obj.__dict__.get("unshortened")
        value = obj.__dict__[self.name] = self.compute(obj) if source is None else getattr(source, self.name)
        return value


@lru_cache(maxsize=256)  # bounded: a matrix over 128 ranks is 128 KiB, and cuts stay memoised much longer
def _sends(heads: tuple[int, ...], tails: tuple[int, ...]) -> np.ndarray:
    """`Cut.sends` of the slots with these head and tail chunks."""
    k = len(heads)
    h, tl = np.array(heads, dtype=np.int64), np.array(tails, dtype=np.int64)
    j, i = np.arange(k)[:, None], np.arange(k)[None, :]
    sends = np.where(tl[None, :] > 0, h[:, None] + np.where(j > i, tl[:, None], 0), np.where(j < i, h[:, None], 0))
    sends[:, h + tl == 0] = 0
    np.fill_diagonal(sends, 0)
    sends.flags.writeable = False
    return sends


_ARRAY_CHUNKS = 64  # from this many chunks, slot costs in array operations (their call overhead pays from there)


def _array_slot_costs(chunks: Sequence[int], k: int, paired: bool, tile: int) -> tuple[int, ...]:
    """`Cut.costs` of many chunks: each chunk's tile pairs (see `_tile_pairs`), plus its
    partner's in a paired cut."""
    sizes = np.array(chunks, dtype=np.int64)
    tiles = -(-sizes // tile)
    pairs = tiles * (tiles + 1) // 2 + tiles * -(-(np.cumsum(sizes) - sizes) // tile)
    if paired:
        pairs = pairs[:k] + pairs[: k - 1 : -1]
    return tuple((pairs * (tile * tile)).tolist())


class Cut:
    """A document cut into consecutive chunks of the given sizes and dealt to slots, one
    slot per rank: `paired`, 2k chunks with slot i holding chunks i and 2k-1-i
    (head-to-tail, so causal work balances); otherwise slot i holds chunk i. Every slot
    is a head chunk and a tail chunk later in the document, either possibly empty (an
    unpaired cut has empty tails).

    The greedy gives the heaviest slots (`order`, by tile-rounded `costs`, stable) to the
    least-loaded ranks. Slot j sends slot i the forward KV tokens i needs
    before its own last piece: with a tail (after every head, and after the tails of
    later slots), every other head and the tails of later slots; without, the heads of
    earlier slots. The tally adds up the per-slot totals and the pairs that exchange
    anything (closed forms); `sends` is the [k, k] matrix.
    """

    def __init__(self, chunks: Sequence[int], paired: bool, tile: int) -> None:
        offsets = list(accumulate(chunks, initial=0))
        n = len(chunks)
        k = n // 2 if paired else n
        self.heads, self.head_at = tuple(chunks[:k]), tuple(offsets[:k])
        if paired:
            self.tails, self.tail_at = tuple(chunks[: k - 1 : -1]), tuple(offsets[n - 1 : k - 1 : -1])
        else:
            self.tails, self.tail_at = (0,) * k, self.head_at
        if n >= _ARRAY_CHUNKS:
            self.costs = _array_slot_costs(chunks, k, paired, tile)
        elif paired:
            self.costs = tuple([
                _tile_pairs(tile, ho, h) + _tile_pairs(tile, to, tl)
                for h, ho, tl, to in zip(self.heads, self.head_at, self.tails, self.tail_at)
            ])
        else:
            self.costs = tuple([_tile_pairs(tile, ho, h) for h, ho in zip(self.heads, self.head_at)])
        self.sizes = tuple(map(add, self.heads, self.tails))
        self.need = max(self.sizes, default=0)
        self.tile = tile

    @_memo
    def order(self) -> tuple[int, ...]:
        """Slots, heaviest first (stable)."""
        return tuple(sorted(range(len(self.costs)), key=self.costs.__getitem__, reverse=True))

    @_memo
    def heavy(self) -> tuple[int, ...]:
        """The slots' costs, heaviest first."""
        return tuple(sorted(self.costs, reverse=True))

    @_memo
    def pattern(self) -> str | None:
        """Who sends whom: "all" when every slot holds a head and a tail (each sends
        every other), "prefix" when every slot holds a head and none a tail (each sends
        every later one), else None."""
        if all(self.heads):
            if all(self.tails):
                return "all"
            if not any(self.tails):
                return "prefix"
        return None

    @_memo
    def local_costs(self) -> tuple[int, ...]:
        """Per slot, the tile pairs whose keys it holds: each chunk's diagonal, and the
        tail's block over the head (its only earlier local key)."""
        t = self.tile
        return tuple(
            t * t * (nh * (nh + 1) // 2 + nt * (nt + 1) // 2 + nt * nh)
            for nh, nt in ((-(-h // t), -(-tl // t)) for h, tl in zip(self.heads, self.tails))
        )

    @_memo
    def recv_tokens(self) -> tuple[int, ...]:
        """Per slot, the KV tokens it receives from the other slots."""
        h, t = self.heads, self.tails
        k, total = len(h), sum(h)
        received = [0] * k
        later_tails = 0
        for i in range(k - 1, -1, -1):
            if t[i]:
                received[i] = total - h[i] + later_tails
            later_tails += t[i]
        earlier_heads = 0
        for i in range(k):
            if not t[i] and h[i]:
                received[i] = earlier_heads
            earlier_heads += h[i]
        return tuple(received) if k > 1 else (0,) * k

    @_memo
    def send_tokens(self) -> tuple[int, ...]:
        """Per slot, the KV tokens it sends the other slots."""
        h, t = self.heads, self.tails
        k = len(h)
        with_tail = sum(1 for x in t if x)
        sent = [0] * k
        later_without_tail = 0  # slots after j with a head and no tail: they need j's head
        for j in range(k - 1, -1, -1):
            sent[j] = h[j] * (with_tail - (1 if t[j] else 0) + later_without_tail)
            if not t[j] and h[j]:
                later_without_tail += 1
        earlier_with_tail = 0  # slots before j with a tail: they need j's tail too
        for j in range(k):
            sent[j] += t[j] * earlier_with_tail
            if t[j]:
                earlier_with_tail += 1
        return tuple(sent) if k > 1 else (0,) * k

    @_memo
    def tokens(self) -> int:
        """The forward KV tokens the slots send each other in all."""
        return sum(self.send_tokens)

    @_memo
    def send_pairs(self) -> tuple[tuple[int, int], ...]:
        """(j, i) for every slot j that sends slot i something (the tally needs them only
        for cuts without a `pattern`)."""
        h, t = self.heads, self.tails
        k = len(h)
        pairs = []
        for i in range(k):
            if t[i]:
                pairs += [(j, i) for j in range(k) if j != i and (h[j] or (j > i and t[j]))]
            elif h[i]:
                pairs += [(j, i) for j in range(i) if h[j]]
        return tuple(pairs)

    def shortened(self, short: int) -> Cut:
        """This cut with its last chunk (the document's end) `short` tokens shorter, for
        `short` under a tile: the same tile-rounded costs, and the same transfers (no
        slot needs the keys at a document's end but the one holding them), so only that
        slot's size changes."""
        if not short:
            return self
        other = object.__new__(Cut)
        other.__dict__.update(self.__dict__)
        other.unshortened = self  # the memoised attributes' source (see `_memo`)
        if self.tails[0]:  # paired: the last chunk is slot 0's tail
            other.tails = (self.tails[0] - short,) + self.tails[1:]
            other.sizes = (self.sizes[0] - short,) + self.sizes[1:]
        else:  # consecutive: the last chunk is the last slot's head
            other.heads = self.heads[:-1] + (self.heads[-1] - short,)
            other.sizes = self.sizes[:-1] + (self.sizes[-1] - short,)
        other.need = max(other.sizes)
        return other

    @property
    def sends(self) -> np.ndarray | None:
        """[k, k]: the forward KV tokens slot j sends slot i (read-only); None for a
        single slot."""
        return _sends(self.heads, self.tails) if len(self.heads) > 1 else None

    def slots(self) -> list[list[tuple[int, int]]]:
        """Per slot, its non-empty pieces as (offset in the document, size), in order."""
        return [
            [(o, n) for o, n in ((ho, h), (to, tl)) if n]
            for h, ho, tl, to in zip(self.heads, self.head_at, self.tails, self.tail_at)
        ]


def chunk_sizes(length: int, k: int) -> list[int]:
    """Sizes of 2k near-equal chunks whose head-to-tail pairs (i, 2k-1-i) differ by at most one token."""
    n = 2 * k
    sizes = [length // n] * n
    extra = length % n
    order = [i for i in range(k)] + [n - 1 - i for i in range(k)]
    for j in order[:extra]:
        sizes[j] += 1
    return sizes


def tile_chunk_sizes(length: int, k: int, tile: int) -> list[int]:
    """`chunk_sizes` in whole tiles: the document's ceil(length / tile) tiles dealt like
    tokens there, the last chunk short by the partial tile. Every chunk but the last is
    a whole number of tiles, so a kernel segment of several chunks (the keys one rank
    sends another) rounds up nothing the document as a whole would not. Token-level
    `chunk_sizes` where the document has fewer than 2k tiles."""
    tiles = -(-length // tile)
    if tiles < 2 * k:
        return chunk_sizes(length, k)
    sizes = [c * tile for c in chunk_sizes(tiles, k)]
    sizes[-1] -= tiles * tile - length
    return sizes


def contiguous_chunk_sizes(length: int, k: int, tile: int) -> list[int]:
    """k consecutive near-equal chunks, in whole tiles but the last (short by the partial
    tile), the extra tiles on the first (lighter) chunks; token-level where the
    document has fewer than 2k tiles (so that the last chunk keeps more than a tile)."""
    tiles = -(-length // tile)
    if tiles < 2 * k:
        return [length * (i + 1) // k - length * i // k for i in range(k)]
    base, extra = divmod(tiles, k)
    sizes = [(base + (i < extra)) * tile for i in range(k)]
    sizes[-1] -= tiles * tile - length
    return sizes


@lru_cache(maxsize=8192)  # weighed for every degree the greedy tries, at every step
def split_need(length: int, k: int, split: str, tile: int) -> int:
    """The largest slot of `split_cut(length, k, split, tile)`, without making the cut."""
    tiles = -(-length // tile)
    short = tiles * tile - length  # the last chunk's partial tile
    if split == "zigzag":
        # Slot i holds head i and tail 2k-1-i; the extra units go to heads 0..k-1, then
        # tails 2k-1 down to k, so slot 0 has the most units, slot 1 the next most.
        if tiles < 2 * k:
            unit, units, short = 1, length, 0
        else:
            unit, units = tile, tiles
        base, extra = divmod(units, 2 * k)
        slot0 = unit * (2 * base + (extra >= 1) + (extra >= k + 1)) - short
        slot1 = unit * (2 * base + (extra >= 2) + (extra >= k + 2)) if k > 1 else 0
        return max(slot0, slot1)
    if k == 1:
        return length
    if tiles < 2 * k:
        return -(-length // k)
    return (tiles // k + (tiles % k > 0)) * tile


@lru_cache(maxsize=4096)
def token_split_cut(length: int, k: int, split: str, tile: int) -> Cut:
    """`split_cut` in token-level chunks, costed at `tile`: for a document that must fill
    ranks whose room is not a whole number of tiles (its largest slot is
    `split_need(length, k, split, 1)`)."""
    return Cut(*_chunks(length, k, split, 1), tile)


@lru_cache(maxsize=4096)  # a 128K-token batch weighs about 500 cuts (lengths recur across batches)
def split_cut(length: int, k: int, split: str, tile: int) -> Cut:
    """How a document of `length` tokens is cut over k ranks; memoised, because the
    greedy weighs the same cuts at every slack and for every degree it tries (and
    lengths recur across batches). Chunks are whole tiles where the document has enough
    of them (`tile_chunk_sizes`, `contiguous_chunk_sizes`).

    ``zigzag``: 2k chunks paired head-to-tail, equal causal work per rank.
    ``contiguous``: k consecutive equal pieces. Later pieces carry more causal work but
    every rank needs only the keys before its piece, a third less traffic than zigzag;
    the greedy gives heavier pieces to lighter ranks and fills the rest with short
    documents.
    """
    tiles = -(-length // tile)
    if tiles < 2 * k:
        return Cut(*_chunks(length, k, split, tile), tile)
    return _whole_tile_cut(tiles, k, split, tile).shortened(tiles * tile - length)


@lru_cache(maxsize=4096)
def _whole_tile_cut(tiles: int, k: int, split: str, tile: int) -> Cut:
    """`split_cut` of a document of `tiles` whole tiles: every document with as many
    tiles is this cut `shortened` by its partial tile, so cuts recur by tile count."""
    return Cut(*_chunks(tiles * tile, k, split, tile), tile)


def _chunks(length: int, k: int, split: str, tile: int) -> tuple[list[int], bool]:
    """The chunk sizes of a split in whole tiles of `tile` tokens, and whether they are paired."""
    if split == "zigzag":
        return tile_chunk_sizes(length, k, tile), True
    if split == "contiguous":
        return contiguous_chunk_sizes(length, k, tile), False
    raise ValueError(f"unknown split {split!r}; expected 'zigzag' or 'contiguous'")


@lru_cache(maxsize=1024)
def ring_cut(length: int, num_ranks: int, tile: int) -> Cut:
    """The zigzag layout's cut of a document: `chunk_sizes` over every rank, token-level
    like the ring's (memoised: lengths recur across batches)."""
    return Cut(chunk_sizes(length, num_ranks), True, tile)


class Record(NamedTuple):
    """Where one document lives: slot i of `cut` on rank `ranks[i]`; `start` is the
    document's first packed position."""

    doc: int
    start: int
    ranks: tuple[int, ...]
    cut: Cut


@dataclass(frozen=True, eq=False)
class Placement:
    """`capacity` tokens on each of `num_ranks` ranks, one record per non-empty
    document, and each rank's tile-rounded pairs. Equal placements hold equal pieces."""

    capacity: int
    num_ranks: int
    records: tuple[Record, ...]
    strategy: str
    tile_pairs: tuple[int, ...]
    tally: Tally | None = field(default=None, repr=False)  # of the records, when built with one

    @cached_property
    def ranks(self) -> tuple[tuple[Piece, ...], ...]:
        """The pieces each rank holds, sorted by position."""
        held: list[list[tuple[int, tuple[Piece, ...]]]] = [[] for _ in range(self.num_ranks)]
        for doc, start, ranks, cut in self.records:
            if len(ranks) == 1 and not cut.tails[0]:  # a document kept whole, in one piece (most are)
                held[ranks[0]].append((start, (Piece(doc, start, start + cut.sizes[0]),)))
                continue
            for r, slot in zip(ranks, cut.slots()):
                if slot:
                    held[r].append((start + slot[0][0], tuple([Piece(doc, start + o, start + o + n) for o, n in slot])))
        return tuple([tuple(chain.from_iterable(map(itemgetter(1), sorted(h)))) for h in held])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (self.capacity, self.strategy, self.ranks) == (other.capacity, other.strategy, other.ranks)

    __hash__ = None  # type: ignore[assignment]


def _finish(capacity: int, num_ranks: int, records: list[Record], strategy: str, tally: Tally | None = None) -> Placement:
    """The placement of these records (tallied in `tally`), checked to give every rank
    `capacity` tokens."""
    ranks = list(chain.from_iterable(rec.ranks for rec in records))
    sizes = list(chain.from_iterable(rec.cut.sizes for rec in records))
    costs = list(chain.from_iterable(rec.cut.costs for rec in records))
    held = np.bincount(ranks, weights=sizes, minlength=num_ranks)
    wrong = np.flatnonzero(held != capacity)
    if len(wrong):
        r = int(wrong[0])
        raise AssertionError(f"placement {strategy} gave rank {r} {int(held[r])} tokens, expected {capacity}")
    pairs = np.bincount(ranks, weights=costs, minlength=num_ranks)
    return Placement(capacity, num_ranks, tuple(records), strategy, tuple([int(x) for x in pairs]), tally)


def _contiguous_chunks(doc_starts: list[int], lengths: list[int], capacity: int,
                       order: Sequence[int] | None = None) -> Iterator[tuple[int, int, int, list[int]]]:
    """(document, start, first rank, chunks) of each non-empty document when the documents,
    in `order` (default: the packed row's), are laid end to end and rank r holds positions
    [r*capacity, (r+1)*capacity) of that row: chunk i on rank first + i."""
    position = 0
    for d in range(len(lengths)) if order is None else order:
        n = lengths[d]
        if n:
            yield d, doc_starts[d], *_slice_chunks(position, n, capacity)
            position += n


def _slice_chunks(start: int, length: int, capacity: int) -> tuple[int, list[int]]:
    """The first rank of a non-empty document under the contiguous layout (see
    `_contiguous_chunks`), and its chunks."""
    first, last = start // capacity, (start + length - 1) // capacity
    if first == last:
        return first, [length]
    bounds = [start, *range((first + 1) * capacity, last * capacity + 1, capacity), start + length]
    return first, [b - a for a, b in zip(bounds, bounds[1:])]


def contiguous(doc_starts: list[int], lengths: list[int], num_ranks: int, capacity: int, tile: int,
               order: Sequence[int] | None = None, name: str = "contiguous") -> Placement:
    """Rank r holds the packed positions [r*capacity, (r+1)*capacity), of the documents laid
    end to end in `order` (default: as packed; see `balanced_order`)."""
    records = [
        Record(d, s, (first,), split_cut(chunks[0], 1, "contiguous", tile)) if len(chunks) == 1
        else Record(d, s, tuple(range(first, first + len(chunks))), Cut(chunks, False, tile))
        for d, s, first, chunks in _contiguous_chunks(doc_starts, lengths, capacity, order)
    ]
    return _finish(capacity, num_ranks, records, name)


def heaviest_first(lengths: Sequence[int], costs: Sequence[int]) -> list[int]:
    """The non-empty documents by decreasing cost; among equal costs (documents within one
    tile row of each other cost the same) the longest first, so that the short ones fill
    the room left; then in packed order."""
    return sorted((d for d in range(len(lengths)) if lengths[d] > 0), key=lambda d: (-costs[d], -lengths[d], d))


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


def greedy(
    doc_starts: list[int],
    lengths: list[int],
    num_ranks: int,
    capacity: int,
    model: CostModel,
    slack: float,
    inner_size: int = 1,
    split: str = "zigzag",
    spread: bool = False,
) -> Placement:
    """Sequence-aware placement: keep documents whole, split the ones that would
    overload a rank over as few ranks as possible, preferring ranks of one node
    (see module docstring). Outer rank r is on node `model.node_of(r * inner_size)`;
    `split` is how a document is cut over k ranks (see `split_cut`); with `spread`, a
    document heavier than one rank's share of the work is split as wide as the ranks'
    room and chunks of at least one tile allow, instead of over the fewest ranks."""
    passes = _Greedy(doc_starts, lengths, num_ranks, capacity, model, inner_size)
    (placement,) = build_all([passes.build([(greedy_name(slack, split, spread), 0, slack, split, spread)])]).values()
    return placement


def greedy_name(slack: float, split: str, spread: bool = False) -> str:
    return f"greedy(slack={slack:g}, {split}{', spread' if spread else ''})"


class Build:
    """A candidate under construction, for the planner to run as far as it is worth.

    `step()` places more of the batch and returns the builds that carry on from there
    (itself, or several where greedy passes that agreed so far now part, or none where
    the layout is impossible); `floor_s` is the floor of its tally (seconds, see
    `Tally`, never decreasing); `placement` is set once it is complete. A build stands
    for the candidates `names` (in order); `index` is the first one's position among
    all candidates.
    """

    names: tuple[str, ...]
    indices: tuple[int, ...]  # of each name among all candidates
    index: int
    floor_s: float = 0.0
    placement: Placement | None = None
    eager: bool = False  # cheap to finish: finished first where its starting floor is at the bound

    def step(self) -> list[Build]:
        raise NotImplementedError


def build_all(builds: list[Build]) -> dict[str, Placement]:
    """Run builds to the end: every possible candidate's placement, by name, in the
    candidates' order."""
    done: dict[int, Placement] = {}
    builds = list(builds)
    while builds:
        build = builds.pop()
        if build.placement is None:
            builds.extend(build.step())
            continue
        for name, index in zip(build.names, build.indices):
            done[index] = build.placement if name == build.placement.strategy else replace(build.placement, strategy=name)
    return {done[i].strategy: done[i] for i in sorted(done)}


class _Member(NamedTuple):
    """One greedy pass: its candidate name and index, its load slack, split and spread mode."""

    name: str
    index: int
    slack: float
    split: str
    spread: bool


class _Greedy:
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
        self.cost = whole_pairs(lengths, self.tile).tolist()
        self.total = sum(self.cost)
        self.share = self.total / num_ranks
        self.order = heaviest_first(lengths, self.cost)

    def build(self, members: Sequence[tuple[str, int, float, str, bool]]) -> Build:
        """The passes (name, index, slack, split, spread), built together while they
        place documents alike."""
        tally = Tally(self.R, self.inner_size, self.model)
        return _GreedyBuild(self, tuple(_Member(*m) for m in members), tally, [self.capacity] * self.R, [], 0)

    def choose(self, doc: _DocChoices, slack: float, split: str, spread: bool) -> tuple[tuple[int, ...], Cut]:
        """Where a pass at `slack` puts the document: (rank of each slot, cut). What does
        not depend on the slack is worked out once per document in `doc`."""
        n, c, load = doc.n, doc.c, doc.load
        limit = (1.0 + slack) * self.share
        options: list[tuple[int, int, list[int], Cut | None]] = []  # (peak, k, ranks heaviest slot first, cut); k = 1: whole
        whole = doc.whole_rank
        if whole is not None:
            if load[whole] + c <= limit:
                return (whole,), split_cut(n, 1, "contiguous", self.tile)
            options.append((load[whole] + c, 1, [whole], None))
        degrees = _split_degrees(c, doc.sorted_loads, limit, min(self.R, n))
        if spread and degrees and c > self.share and doc.widest > degrees[0]:
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
    and kept for the other passes when `shared`."""

    __slots__ = ("greedy", "d", "load", "room", "n", "c", "by_load", "whole_rank", "shared",
                 "_sorted_loads", "_roomy", "_rooms", "_widest", "_splits", "_slots", "_fragments")

    def __init__(self, greedy: _Greedy, d: int, load: list[int], room: list[int], by_load: list[int],
                 whole_rank: int | None, shared: bool):
        self.greedy, self.d, self.load, self.room, self.shared = greedy, d, load, room, shared
        self.n, self.c = greedy.lengths[d], greedy.cost[d]
        self.by_load, self.whole_rank = by_load, whole_rank  # see `_GreedyBuild.step`
        self._sorted_loads: list[int] | None = None
        self._roomy: list[int] | None = None  # the ranks with room, least loaded first
        self._rooms: list[int] | None = None  # their rooms, ascending
        self._widest: int | None = None
        self._splits: dict[tuple[int, str], tuple | None] = {}
        self._slots: dict[tuple[int, int], tuple[tuple[int, ...], Cut]] = {}
        self._fragments: tuple[tuple[int, ...], Cut] | None = None

    @property
    def sorted_loads(self) -> list[int]:
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

    def fragments(self) -> tuple[tuple[int, ...], Cut]:
        """Fragmented room: the document cut over the ranks with the most room."""
        if self._fragments is None:
            offset, ranks, chunks = 0, [], []
            room = self.room
            # The most room first; among equal rooms the least loaded (by_load's order, which
            # the stable sort keeps).
            for r in sorted(self.roomy, key=room.__getitem__, reverse=True):
                if offset == self.n:
                    break
                take = min(room[r], self.n - offset)
                if take > 0:
                    ranks.append(r)
                    chunks.append(take)
                    offset += take
            self._fragments = (tuple(ranks), Cut(chunks, False, self.greedy.tile))
        return self._fragments


class _GreedyBuild(Build):
    """Greedy passes that have placed every document alike so far."""

    def __init__(self, greedy: _Greedy, members: tuple[_Member, ...], tally: Tally,
                 room: list[int], records: list[Record], position: int):
        self.greedy, self.tally, self.room, self.records, self.position = greedy, tally, room, records, position
        self._join(members)

    def _join(self, members: tuple[_Member, ...]) -> None:
        self.members = members
        self.names = tuple(m.name for m in members)
        self.indices = tuple(m.index for m in members)
        self.index = members[0].index
        self.tightest = min(m.slack for m in members)
        self.floor_s = self.tally.floor_s

    def step(self) -> list[Build]:
        g, load, room = self.greedy, self.tally.tiles, self.room
        d = g.order[self.position]
        n = g.lengths[d]
        by_load = sorted(range(g.R), key=load.__getitem__)
        # The least-loaded rank with room for the whole document.
        whole = next((r for r in by_load if room[r] >= n), None) if n <= g.capacity else None
        if whole is not None and load[whole] + g.cost[d] <= (1.0 + self.tightest) * g.share:
            # Kept whole by the tightest pass, so by all: a larger slack only raises the
            # limit, and the split and spread modes change only how a document is split.
            self._place(d, ((whole,), split_cut(n, 1, "contiguous", g.tile)))
            return [self]
        doc = _DocChoices(g, d, load, room, by_load, whole, shared=len(self.members) > 1)
        if len(self.members) == 1:
            m = self.members[0]
            self._place(d, g.choose(doc, m.slack, m.split, m.spread))
            return [self]
        groups: dict[tuple, tuple[tuple[tuple[int, ...], Cut], list[_Member]]] = {}
        for m in self.members:
            choice = g.choose(doc, m.slack, m.split, m.spread)
            groups.setdefault((choice[0], id(choice[1])), (choice, []))[1].append(m)
        parted = [self] + [self._copy() for _ in range(len(groups) - 1)]
        for build, (choice, members) in zip(parted, groups.values()):
            if len(groups) > 1:
                build._join(tuple(members))  # before placing: a finished placement takes the first name
            build._place(d, choice)
        return parted

    def _copy(self) -> _GreedyBuild:
        return _GreedyBuild(self.greedy, self.members, self.tally.copy(), self.room[:], self.records[:], self.position)

    def _place(self, d: int, choice: tuple[tuple[int, ...], Cut]) -> None:
        g, room = self.greedy, self.room
        ranks, cut = choice
        for r, size in zip(ranks, cut.sizes):
            room[r] -= size
        self.tally.add(ranks, cut)
        self.floor_s = self.tally.floor_s
        self.records.append(Record(d, g.starts[d], ranks, cut))
        self.position += 1
        if self.position == len(g.order):
            for r, left in enumerate(room):
                if left:
                    raise AssertionError(f"placement {self.names[0]} gave rank {r} {g.capacity - left} tokens, expected {g.capacity}")
            self.placement = Placement(g.capacity, g.R, tuple(self.records), self.members[0].name, tuple(self.tally.tiles), self.tally)


class _ZigzagBuild(Build):
    """Every document over all ranks in head-to-tail chunk pairs (the ring layout
    without padding), each pair of chunks to the ranks holding the fewest tokens, in
    document order. The longest document comes last and absorbs the rounding so that
    every rank ends with exactly `capacity` tokens; the layout is impossible when the
    others leave a rank over capacity. The first step lays out the slot sizes; each
    step then cuts and tallies one document, the longest first. Its floor before the
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
        even, extra_held = 0, [0] * R
        fewest_first = tuple(range(R))
        self.ranks = {}
        for d in docs:
            if d == self.absorber:
                continue
            # Pair i, the largest for small i, goes to the i-th emptiest rank (stable: ties by rank).
            self.ranks[d] = fewest_first
            base, extra = divmod(lengths[d], 2 * R)
            even += 2 * base
            if extra:
                for r in fewest_first[: min(extra, R)]:
                    extra_held[r] += 1
                for r in fewest_first[: max(extra - R, 0)]:
                    extra_held[r] += 1
                fewest_first = tuple(sorted(range(R), key=extra_held.__getitem__))
        need = [self.capacity - even - e for e in extra_held]
        if min(need) < 0:
            return False
        self.absorber_chunks = [need[r] // 2 for r in range(R)] + [need[r] - need[r] // 2 for r in reversed(range(R))]
        self.ranks[self.absorber] = tuple(range(R))
        self.pending = sorted(self.ranks, key=lambda d: (lengths[d], -d))  # popped longest first
        return True

    def step(self) -> list[Build]:
        if self.ranks is None and not self._lay_out():
            return []
        d = self.pending.pop()
        tile, R = self.tally.model.tile, len(self.tally.tiles)
        cut = Cut(self.absorber_chunks, True, tile) if d == self.absorber else ring_cut(self.lengths[d], R, tile)
        record = self.records[d] = Record(d, self.starts[d], self.ranks[d], cut)
        self.tally.add(record.ranks, record.cut)
        self.floor_s = max(self._layout_floor, self.tally.floor_s)
        if not self.pending:
            records = [self.records[d] for d in sorted(self.records) if d != self.absorber] + [self.records[self.absorber]]
            self.placement = _finish(self.capacity, R, records, "zigzag", self.tally)
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


class _ContiguousBuild(Build):
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
        # slice boundary chunk by chunk; `starts`: where each lies in the row laid out.
        sizes = np.asarray(lengths, dtype=np.int64)
        if order is None:
            starts = np.asarray(doc_starts, dtype=np.int64)
        else:
            starts, laid = np.zeros(len(sizes), dtype=np.int64), np.asarray(order, dtype=np.int64)
            starts[laid] = np.cumsum(sizes[laid]) - sizes[laid]
        first, last = starts // capacity, (starts + sizes - 1) // capacity
        inside = (sizes > 0) & (first == last)
        tiles = np.zeros(R, dtype=np.int64)
        np.add.at(tiles, first[inside], np.asarray(costs, dtype=np.int64)[inside])  # whole documents
        for d in np.flatnonzero((sizes > 0) & ~inside).tolist():
            rank, chunks = _slice_chunks(int(starts[d]), lengths[d], capacity)
            for r, offset, size in zip(range(rank, rank + len(chunks)), accumulate(chunks, initial=0), chunks):
                tiles[r] += _tile_pairs(tile, offset, size)
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
WHOLE_SEARCH_VISITS = 4096  # ranks looked at by the search for a whole-document packing, at most


def whole_packing(lengths: Sequence[int], costs: Sequence[int], num_ranks: int, capacity: int,
                  visits: int = WHOLE_SEARCH_VISITS) -> list[int] | None:
    """A rank for every non-empty document such that every rank holds exactly `capacity`
    tokens and no document is split, or None if the search finds none.

    Documents go longest first (ties: heavier first); each to a rank with room for it:
    one it fills exactly if there is one, else the least loaded (by tile-rounded cost),
    so the packing is as balanced as the first fit allows. When a rank is left with less
    room than the shortest document, the search backs up and tries the next rank (ranks
    in the same state are one choice). It gives up after looking at `visits` ranks:
    packing into exact capacities is NP-hard, and this is a candidate, not a guarantee.
    """
    docs = sorted((d for d, n in enumerate(lengths) if n > 0), key=lambda d: (-lengths[d], -costs[d], d))
    if not docs or lengths[docs[0]] > capacity:
        return None
    if len(docs) > 1 and len(docs) * num_ranks >= visits:
        return None  # one pass down the documents alone looks at more ranks than that
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


class _WholeBuild(Build):
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
        self.floor_s = self.tally.floor_s
        self.placement = _finish(self.capacity, R, records, "whole", self.tally)
        return [self]


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


def candidates(
    doc_starts: list[int],
    lengths: list[int],
    num_ranks: int,
    capacity: int,
    model: CostModel,
    slacks: tuple[float, ...],
    inner_size: int = 1,
) -> list[Build]:
    """Every placement the planner weighs, as builds (see `Build`), in this order:
    sequence-aware ones from the tightest slack (the most balanced) up, the split mode
    that moves fewer bytes first; then one that spreads each document heavier than a
    rank's share over as many ranks as it can (balance when one document dominates the
    work, worth its traffic where links are fast); then the zigzag, contiguous and
    whole layouts, and the contiguous layouts of the documents in `balanced_order` and
    in `dealt_order` (where every document fits on one rank). The greedy passes start as
    one build."""
    passes = _Greedy(doc_starts, lengths, num_ranks, capacity, model, inner_size)
    members = [
        (greedy_name(s, split), 2 * i + j, s, split, False)
        for i, s in enumerate(slacks)
        for j, split in enumerate(("contiguous", "zigzag"))
    ]
    builds: list[Build] = []
    if num_ranks > 1:
        spread_slack = min(slacks, default=0.0)
        members.append((greedy_name(spread_slack, "zigzag", spread=True), 2 * len(slacks), spread_slack, "zigzag", True))
        builds.append(_ZigzagBuild(2 * len(slacks) + 1, doc_starts, lengths, passes.cost, capacity,
                                   Tally(num_ranks, inner_size, model)))
        builds.append(_ContiguousBuild(2 * len(slacks) + 2, doc_starts, lengths, passes.cost, capacity,
                                       Tally(num_ranks, inner_size, model)))
        if max(lengths, default=0) <= capacity:  # else no packing keeps every document whole
            builds.append(_WholeBuild(2 * len(slacks) + 3, doc_starts, lengths, passes.cost, capacity,
                                      Tally(num_ranks, inner_size, model)))
            builds.append(_ContiguousBuild(2 * len(slacks) + 4, doc_starts, lengths, passes.cost, capacity,
                                           Tally(num_ranks, inner_size, model),
                                           balanced_order(passes.order, lengths, passes.cost, num_ranks, capacity),
                                           BALANCED))
            builds.append(_ContiguousBuild(2 * len(slacks) + 5, doc_starts, lengths, passes.cost, capacity,
                                           Tally(num_ranks, inner_size, model), dealt_order(passes.order, num_ranks),
                                           DEALT))
    return [passes.build(members)] + builds if members else builds
