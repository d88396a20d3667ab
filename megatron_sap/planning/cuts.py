"""Cuts: how one document is cut into chunks and dealt to slots, one slot per rank.

A `Cut` holds a document's chunk sizes and, in closed forms, what the planner weighs
about them: each slot's tile-rounded pairs, the keys it receives from and sends to the
other slots, and who sends whom. Cuts depend only on (length, k, split, tile), so they
are memoised: the greedy weighs the same cuts at every slack, and lengths recur across
batches.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import accumulate
from operator import add
from typing import Callable, Sequence

import numpy as np


def tile_pairs(t: int, offset: int, length: int) -> int:
    """Tile-rounded pairs (tile of t tokens) of a piece of `length` tokens at `offset` in its
    document: its causal diagonal block plus one full block over every earlier key of the
    document (docs/planner.md, "piece_cost")."""
    nq = -(-length // t)
    return t * t * (nq * (nq + 1) // 2 + nq * -(-offset // t))


def pipelined_pairs(heads: Sequence[int], tails: Sequence[int], t: int) -> list[int]:
    """Per slot of a cut, the tile pairs of the pipelined schedule's calls: head and tail
    side by side in one causal segment (`program._document_runs`; s tiles), the two
    against each earlier slot's head and the tail against each later slot's head and tail,
    one block per peer (docs/planner.md, "piece_cost"). Equal to `tile_pairs` of head and
    tail where the chunks are whole tiles."""
    if 2 * len(heads) >= _ARRAY_CHUNKS:  # a paired cut's chunks (an unpaired one's empty tails count too)
        h, tl = np.array(heads, dtype=np.int64), np.array(tails, dtype=np.int64)
        head_tiles, tail_tiles, s = -(-h // t), -(-tl // t), -(-(h + tl) // t)
        pairs = s * (s + 1) // 2 + s * (np.cumsum(head_tiles) - head_tiles) + tail_tiles * (s.sum() - np.cumsum(s))
        return (pairs * (t * t)).tolist()
    costs = []
    earlier = 0  # the tiles of the heads before the slot
    later = sum(-(-(h + tl) // t) for h, tl in zip(heads, tails))  # of the slots from it on
    for h, tl in zip(heads, tails):
        s = -(-(h + tl) // t)
        later -= s
        costs.append(t * t * (s * (s + 1) // 2 + s * earlier + -(-tl // t) * later))
        earlier += -(-h // t)
    return costs


def whole_pairs(lengths: Sequence[int], tile: int) -> np.ndarray:
    """Each document's tile-rounded pairs computed whole (`tile_pairs` at offset 0), int64:
    one array operation for rows of thousands of documents."""
    tiles = -(-np.asarray(lengths, dtype=np.int64) // tile)
    return tile * tile * (tiles * (tiles + 1) // 2)


class _memo:
    """A cut's attribute computed on first use and then stored on the instance (as
    functools.cached_property, without the lock it takes on Python < 3.12: a fresh batch
    makes hundreds of cuts). A `Cut.shortened` copy takes it from the cut it was made
    from, computed once there: only whole-tile cuts are shortened (`split_cut`), by less
    than a tile, and none of these depends on the last chunk's size there."""

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
    """`Cut.costs` of many chunks: each chunk's tile pairs (see `tile_pairs`), plus its
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
                tile_pairs(tile, ho, h) + tile_pairs(tile, to, tl)
                for h, ho, tl, to in zip(self.heads, self.head_at, self.tails, self.tail_at)
            ])
        else:
            self.costs = tuple([tile_pairs(tile, ho, h) for h, ho in zip(self.heads, self.head_at)])
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
    def occupied(self) -> tuple[int, ...] | None:
        """The slots that hold tokens, where some do not (a document of fewer tokens than
        chunks), else None. An empty slot computes, sends and receives nothing."""
        if all(self.sizes):
            return None
        return tuple([i for i, size in enumerate(self.sizes) if size])

    @_memo
    def local_costs(self) -> tuple[int, ...]:
        """Per slot, the tile pairs whose keys it holds: each chunk's diagonal, and the
        tail's block over the head (its only earlier local key). Together they are one
        causal segment of the head and tail rows side by side, as the pipelined schedule's
        local call runs them (`program._document_runs`): with s tiles, s (s + 1) / 2 tile
        pairs. The gathered schedule's calls take no fewer (the tally counts these local
        pairs whichever sum it counts a rank by)."""
        t = self.tile
        return tuple([t * t * (s * (s + 1) // 2) for s in (-(-size // t) for size in self.sizes)])

    @_memo
    def pipelined_costs(self) -> tuple[int, ...]:
        """Per slot, the tile pairs of the pipelined schedule's calls (`pipelined_pairs`;
        `costs` are the gathered schedule's). A rank is costed the fewer of its slots' sums
        in either (`Tally`): it runs one schedule. The two are equal where every chunk
        but the document's last is whole tiles (`split_cut` of a document of at least 2k
        tiles); token-level cuts differ."""
        t = self.tile
        if all(h % t == 0 for h in self.heads) and all(tl % t == 0 for tl in self.tails[1:]):
            return self.costs
        return tuple(pipelined_pairs(self.heads, self.tails, t))

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
    """Sizes of 2k near-equal chunks whose head-to-tail pairs (i, 2k-1-i) differ by at most
    one token: the extra tokens go to heads 0, 1, ..., then tails 2k-1, 2k-2, ..."""
    base, extra = divmod(length, 2 * k)
    heads = min(extra, k)
    return [base + 1] * heads + [base] * (2 * k - extra) + [base + 1] * (extra - heads)


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
