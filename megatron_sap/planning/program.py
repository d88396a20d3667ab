"""Compile a placement into the per-rank program the executor runs.

A rank's program is data, not code: index tensors and `cu_seqlens` prepared once per
batch signature, so the hot loop makes no host-device sync and no Python loop over
documents. Structure, for outer rank r:

- `local_calls`: kernel calls whose keys are local (every piece's causal diagonal,
  consecutive pieces of one document in one segment, then full blocks against the rank's
  own earlier pieces of the same document in other segments);
- `transfers`: one step per peer that r exchanges anything with. Outer ranks r and p
  meet in round s = (r + p) mod R (a matching of the ranks: p's partner in round s is
  r; the round tags the step's messages) and exchange in one batched P2P call: r sends
  p the rows of its pieces that p needs and receives the rows of p's that it needs;
  then it runs `calls` on the received rows. Every pair of ranks meets once, so a
  rank's sends to and receives from one peer travel together, in both directions of
  the link at once: its exchanges take the sum over peers of the larger side, where
  pairing a send to r+d with a receive from r-d (a ring schedule) took the sum over
  steps, up to twice as long where traffic is one-sided per peer. The steps follow one
  order of the rank pairs that every rank runs (`Plan.exchange_order`: `order.exchange_order`,
  `order.paced_exchange_order` or `order.matching_order`), which keeps ranks from waiting
  long for each other;
  any such order is free of deadlock. Where R is odd the ranks have no perfect matching:
  pairwise exchanges need R rounds, one rank idle in each. There a plan may run ring
  shifts instead (`ring_exchanges`, `Plan.ring_exchanges`): in step d (1 to R - 1) rank r
  sends r + d what it needs and receives from r - d (mod R), one message out and one in,
  so R - 1 steps carry every pair's traffic, each direction in a step of its own. All
  ranks take the steps in shift order, which is free of deadlock too.

The backward pass runs the same steps with the roles reversed: the gradients of the
received rows go back to their owner, which adds them at `send_rows`. It takes them in
its own order of the rank pairs (each step's `backward_level`: the forward's order or its
reverse, `Plan.backward_exchange_order`), one that every rank follows too. A pass runs as a
list of events (`RankProgram.forward_events`, `backward_events`) that the executor
follows, the timeline times and `Plan.memory_bytes` counts; with `recompute_kv` the
backward's refetches and returns are ordered by each exchange's backward level
(`exchange_levels` of the backward's order), which keeps them in one order all ranks share.

That is the ``pipelined`` schedule: each step's calls run on the rows it received while
the next exchange is in flight, and every call's partial (out, lse) is merged into fp32
accumulators. The ``gathered`` schedule moves the same rows in the same steps into one
source buffer (the local rows, then every step's received rows in step order) and runs
each query piece once, against all keys of its document up to its end in one
bottom-right causal segment, as soon as those keys are there: the local calls take the
pieces whose earlier keys are all local, the calls of step i those whose last keys
arrive in step i. Each query row gets its whole result from one call, so nothing is
merged, and a document's keys from several peers are one kernel segment, not one per
peer; a piece waits for its last keys. Backward, its calls run first and the gradients
of the received rows then go back, in step order, under the local calls.

Within one call every query row and every key row appears at most once, so a call's
outputs merge into their rows by gather and write-back (in place, through a view, where
the rows are one run of consecutive rows, as are most received rows and many query
pieces), and gradients accumulate without atomics (the merges
are bitwise deterministic on every device; for the kernels' own backward see
docs/architecture.md).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate
from typing import Mapping, Sequence

import numpy as np
import torch

from .cuts import tile_pairs
from .placement import Piece, Placement


CPU = torch.device("cpu")

# Which rows of a tensor a call or step reads or writes (`kernels.take_rows` and its
# siblings apply it): None for all rows in order, a slice where they are one run of
# consecutive rows (a view: no gather, no scatter), else an int64 index tensor.
Rows = torch.Tensor | slice | None


@dataclass(frozen=True, eq=False)
class KernelCall:
    """One varlen kernel call: segment i pairs query rows i with key rows i.

    The rows are kept as ranges; their `Rows` and `cu_seqlens` are made on
    `device` when first used (`RankProgram.to` makes them all at once): the cost model
    times a program from `seqlens` alone, and a rank compiles both schedules to time
    them but runs one.
    """

    q_ranges: tuple[range, ...] | None  # local rows used as queries, in segment order (None: all, in order)
    k_ranges: tuple[range, ...] | None  # rows of the key/value source (None: all, in order)
    causal: bool
    seqlens: tuple[tuple[int, int], ...]  # (query, key) rows of each segment
    device: torch.device = CPU

    @cached_property
    def q_rows(self) -> Rows:
        return None if self.q_ranges is None else _rows(self.q_ranges, self.device)

    @cached_property
    def k_rows(self) -> Rows:
        return None if self.k_ranges is None else _rows(self.k_ranges, self.device)

    @cached_property
    def cu_seqlens_q(self) -> torch.Tensor:  # int32
        return _offsets([q for q, _ in self.seqlens], self.device)

    @cached_property
    def cu_seqlens_k(self) -> torch.Tensor:  # int32
        return _offsets([k for _, k in self.seqlens], self.device)

    @cached_property
    def max_seqlen_q(self) -> int:
        return max(q for q, _ in self.seqlens)

    @cached_property
    def max_seqlen_k(self) -> int:
        return max(k for _, k in self.seqlens)


@dataclass(frozen=True, eq=False)
class Transfer:
    """One batched P2P step: send the rows `send_ranges` (`send_rows`, as `Rows` on
    `device`, made when first used or by `RankProgram.to`) to `send_peer`, receive
    `recv_tokens` rows from `recv_peer` (outer ranks; None when that side is empty), then
    run `calls`."""

    # exchange round s: the peer is (s - rank) mod R on both sides; ring shifts: the shift d,
    # sending to rank + d and receiving from rank - d (mod R). The messages' tag.
    round: int
    level: int  # the pair's level in the exchange order, the same on both sides (`exchange_levels`)
    backward_level: int  # its level in the order the backward runs the exchanges (`Plan.backward_exchange_order`)
    send_peer: int | None
    send_ranges: tuple[range, ...] | None
    recv_peer: int | None
    recv_tokens: int
    calls: tuple[KernelCall, ...]
    device: torch.device = CPU

    @property
    def send_tokens(self) -> int:
        return sum(map(len, self.send_ranges)) if self.send_ranges else 0

    @cached_property
    def send_rows(self) -> Rows:
        return None if self.send_ranges is None else _rows(self.send_ranges, self.device)


SCHEDULES = ("pipelined", "gathered")

# What a rank does in one pass, in the order of `RankProgram.forward_events` and
# `backward_events`: the executor runs these, the timeline times them and
# `Plan.memory_bytes` counts the buffers they hold.
FETCH = "fetch"  # post step i's K/V exchange (forward, or fetching the K/V again in backward)
LOCAL = "local"  # run the local calls
COMPUTE = "compute"  # wait for step i's K/V where fetched, run its calls
RETURN = "return"  # post the gradients of step i's received rows back to their owner
COLLECT = "collect"  # wait for the gradients of the rows step i sent, add them to dK/dV

# The pipelined forward posts each step's K/V exchange this many steps ahead of the step
# whose calls run (the first before the local calls). One is what a GPU with a single
# hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron-LM requires with TP or CP
# before Blackwell) overlaps: an exchange waits for the one before it on the group's NCCL
# stream, and every kernel queued after it waits until it starts, so with every exchange
# posted first the kernels would wait until all but the last were done. The price: an
# exchange waits for the kernels queued before it, on both its ranks (the timeline models
# both; docs/architecture.md).
FETCH_AHEAD = 1

# With recompute_kv, the backward posts K/V refetches this far ahead of the step whose rows the
# kernels work on, and waits for returned gradients this far behind, instead of all at
# once: a rank holds the rows of a few steps, each at most one peer's T/R rows,
# however long the documents (`Plan.memory_bytes`). In backward "ahead" counts exchange
# levels (`exchange_levels`), which every rank shares: NCCL runs a group's batched calls in
# the order each rank posts them, and refetches and returns interleaved by each rank's own
# step count can wait on each other in a cycle (tests/test_reliability.py runs gloo's
# batches in that order; tests/test_program.py checks every rank's order on many plans).
RECOMPUTE_KV_AHEAD = 2

Event = tuple[str, int]  # (what, step index; -1 for LOCAL)

# With the Ulysses all-to-alls in head chunks (`RankProgram.chunked`), a pass's events as
# (what, step index, head chunk): the first and the last kernel events that have calls run
# chunk by chunk, the others as one unit for every chunk (ALL_HEADS); between chunks of
# those the executor posts an inner all-to-all, POST (POST, chunk whose inputs it brings
# or NO_CHUNK, chunk whose outputs it takes or NO_CHUNK).
POST = "post"
ALL_HEADS = NO_CHUNK = -1
Unit = tuple[str, int, int]


def head_chunks(num_heads: int, num_kv_heads: int, inner_size: int, chunks: int) -> tuple[tuple[slice, slice], ...] | None:
    """An inner rank's head slice (num_heads / U query heads, max(num_kv_heads, U) / U KV
    heads, replicated where fewer than U) in `chunks` equal chunks of query heads, each with
    the slice of KV heads those read (query head i reads KV head i // (query heads per KV
    head)); None where they do not split so (the query heads do not divide over the U inner
    ranks or into the chunks, or a chunk would read part of a KV head's group and part of
    another's)."""
    heads, kv_heads = num_heads // inner_size, max(num_kv_heads, inner_size) // inner_size
    if chunks < 1 or num_heads % inner_size or heads % chunks:
        return None
    per_chunk, group = heads // chunks, heads // kv_heads
    if per_chunk % group and group % per_chunk:
        return None
    return tuple((slice(c * per_chunk, (c + 1) * per_chunk),
                  slice(c * per_chunk // group, ((c + 1) * per_chunk - 1) // group + 1)) for c in range(chunks))


@dataclass(frozen=True)
class RankProgram:
    """Everything one outer rank executes for one attention layer, in one of `SCHEDULES`
    (see the module docstring). Pipelined, a step's calls index the rows it received;
    gathered, the source buffer: the local rows, then every step's received rows in step
    order."""

    rank: int
    num_tokens: int
    local_calls: tuple[KernelCall, ...]
    transfers: tuple[Transfer, ...]
    schedule: str = "pipelined"

    def to(self, device: torch.device | str) -> "RankProgram":
        """This program on `device`, its index tensors made now, not in the hot loop: all
        rows in one int64 buffer and all `cu_seqlens` in one int32 buffer, each copied to
        the device at once (two copies, not one per tensor), every tensor a view of them."""
        device = torch.device(device)
        rows, offsets = _Staged(np.int64), _Staged(np.int32, align=4)  # cu_seqlens views start 16-byte aligned
        views: list[tuple[dict, str, _Staged, int]] = []  # (attributes of a call or step, name, buffer, array)

        def staged(item, runs: dict[str, slice], **tensors: tuple[_Staged, int]):
            moved = replace(item, device=device)
            moved.__dict__.update(runs)  # where the cached properties keep what they make
            for name, (buffer, array) in tensors.items():
                views.append((moved.__dict__, name, buffer, array))
            return moved

        def stage_rows(name: str, ranges: tuple[range, ...] | None, runs: dict, tensors: dict) -> None:
            """`Rows` `name` of these ranges: a slice now, or an index tensor to stage."""
            run = None if ranges is None else _one_run(ranges)
            if run is not None:
                runs[name] = run
            elif ranges is not None:
                tensors[name] = (rows, rows.add_ranges(ranges))

        def call_on(call: KernelCall) -> KernelCall:
            runs, tensors = {}, {"cu_seqlens_q": (offsets, offsets.add_offsets([q for q, _ in call.seqlens])),
                                 "cu_seqlens_k": (offsets, offsets.add_offsets([k for _, k in call.seqlens]))}
            stage_rows("q_rows", call.q_ranges, runs, tensors)
            stage_rows("k_rows", call.k_ranges, runs, tensors)
            return staged(call, runs, **tensors)

        local_calls = tuple(map(call_on, self.local_calls))
        transfers = []
        for step in self.transfers:
            runs, tensors = {}, {}
            stage_rows("send_rows", step.send_ranges, runs, tensors)
            transfers.append(staged(replace(step, calls=tuple(map(call_on, step.calls))), runs, **tensors))
        made = {buffer: buffer.to(device) for buffer in (rows, offsets)}
        for attributes, name, buffer, array in views:
            attributes[name] = made[buffer][array]  # where the cached property keeps what it makes
        return replace(self, local_calls=local_calls, transfers=tuple(transfers))

    def forward_events(self) -> tuple[Event, ...]:
        """The forward pass in order. Pipelined: the first exchange posted, the local calls,
        then for each step i the exchange of step i + FETCH_AHEAD posted and step i's calls
        once its K/V are in. Gathered: every exchange posted, the local calls, then each
        step's calls (most steps have none: a piece waits for its last keys), so that no
        exchange waits for a kernel and the ranks' kernels do not wait for each other's
        (with one hardware queue the local calls start once all but the last exchange are
        done). `recompute_kv` changes only what is kept. Every rank posts its exchanges in
        its step order, the one order of rank pairs."""
        n = len(self.transfers)
        ahead = n if self.schedule == "gathered" else FETCH_AHEAD
        events = [(FETCH, i) for i in range(min(ahead, n))] + [(LOCAL, -1)]
        for i in range(n):
            if i + ahead < n:
                events.append((FETCH, i + ahead))
            events.append((COMPUTE, i))
        return tuple(events)

    def backward_events(self, recompute_kv: bool = False) -> tuple[Event, ...]:
        """The backward pass in order, its steps by `backward_level` (the backward's own
        order of rank pairs, which every rank follows). Keeping the K/V: each step's calls
        and its gradients posted back, the local calls under the last return, then every
        return waited for; gathered, every step's calls first (a piece's keys may come from
        several steps), then the first return, the local calls under it, the other returns,
        every return waited for (with one hardware queue the local calls queued after the
        last return would wait for all but that one to be done, see FETCH_AHEAD). With `recompute_kv` (pipelined programs only: a gathered forward's
        backward runs the pipelined program) every event is keyed by its step's level, which
        both ranks of an exchange share: the refetch at level - RECOMPUTE_KV_AHEAD, the calls
        and the return at the level, the wait for the return at level + RECOMPUTE_KV_AHEAD;
        the local calls follow the first refetches (with one hardware queue they start once all
        but the last of those are done). A rank has one step per level at most
        (a peer, or with ring shifts one to send to and one to receive from), so it holds the K/V of at most RECOMPUTE_KV_AHEAD + 1 steps and as many steps'
        returning gradients, and every rank posts its exchanges in one global order."""
        steps = sorted(range(len(self.transfers)), key=lambda i: self.transfers[i].backward_level)
        collects = [(COLLECT, i) for i in steps]
        if not recompute_kv and self.schedule == "gathered":
            returns = [(RETURN, i) for i in steps]
            return tuple([(COMPUTE, i) for i in steps] + returns[:1] + [(LOCAL, -1)] + returns[1:] + collects)
        if not recompute_kv:
            return tuple([event for i in steps for event in ((COMPUTE, i), (RETURN, i))] + [(LOCAL, -1)] + collects)
        if self.schedule != "pipelined":
            raise ValueError("with recompute_kv the backward runs the pipelined program (Plan.backward_program)")
        ahead = RECOMPUTE_KV_AHEAD
        keyed = []
        for i in steps:
            level = self.transfers[i].backward_level
            keyed += [(level - ahead, 0, FETCH, i), (level, 1, COMPUTE, i), (level, 2, RETURN, i),
                      (level + ahead, 3, COLLECT, i)]
        events = [(kind, i) for _, _, kind, i in sorted(keyed)]
        first_calls = next((e for e, (kind, _) in enumerate(events) if kind == COMPUTE), len(events))
        events.insert(first_calls, (LOCAL, -1))
        return tuple(events)

    def chunked(self, events: Sequence[Event], chunks: int) -> tuple[Unit, ...]:
        """`events` (`forward_events`, or `backward_events` keeping the K/V) with the inner
        all-to-alls in `chunks` head chunks. The first kernel event that has calls (or the
        local one) runs chunk after chunk, each chunk's inputs (queries forward, output
        gradients backward) brought by the all-to-all posted before the chunk ahead of it
        (the first chunk's, and forward the K/V, come before the pass); the last such event
        runs chunk after chunk too, each chunk's outputs (output forward, dQ backward) taken
        by the all-to-all posted before the next chunk (the last chunk's, and backward dK/dV,
        after the pass); where the two are one event, one all-to-all does both. Those
        all-to-alls run under the kernels. Each other event is one unit (ALL_HEADS), whose
        calls the executor runs once per chunk. One chunk: the events as they are."""
        if chunks == 1:
            return tuple((kind, i, ALL_HEADS) for kind, i in events)
        # the local event starts the forward's accumulators (every rank holds tokens, whose
        # diagonal is a local call): it counts as one with calls
        with_calls = [n for n, (kind, i) in enumerate(events)
                      if kind == LOCAL or (kind == COMPUTE and self.transfers[i].calls)]
        first, last = with_calls[0], with_calls[-1]
        units: list[Unit] = []
        for n, (kind, i) in enumerate(events):
            if n not in (first, last):
                units.append((kind, i, ALL_HEADS))
                continue
            for c in range(chunks):
                brings = c + 1 if n == first and c + 1 < chunks else NO_CHUNK
                takes = c - 1 if n == last and c > 0 else NO_CHUNK
                if brings != NO_CHUNK or takes != NO_CHUNK:
                    units.append((POST, brings, takes))
                units.append((kind, i, c))
        return tuple(units)

    @property
    def sent_tokens(self) -> int:
        """K/V tokens this rank sends in the forward, over all its steps."""
        return sum(t.send_tokens for t in self.transfers)

    @property
    def recv_tokens(self) -> int:
        """K/V tokens this rank receives in the forward, over all its steps."""
        return sum(t.recv_tokens for t in self.transfers)


class _Layout:
    """Per-placement lookups shared by the compilation of every rank."""

    def __init__(self, placement: Placement):
        self.placement = placement
        self.local_start: dict[Piece, int] = {}
        self.owner: dict[Piece, int] = {}
        self.doc_pieces: dict[int, list[Piece]] = defaultdict(list)
        self.held: dict[tuple[int, int], list[Piece]] = defaultdict(list)  # (rank, document): its pieces, in order
        local_start, owner, doc_pieces, held = self.local_start, self.owner, self.doc_pieces, self.held
        for r, pieces in enumerate(placement.ranks):
            pos = 0
            for p in pieces:
                local_start[p] = pos
                owner[p] = r
                doc_pieces[p.doc].append(p)
                held[r, p.doc].append(p)
                pos += p.end - p.start
        # Latest start of each rank's pieces per document: a rank needs every earlier
        # piece of the document that ends at or before it.
        self.last_start: dict[int, dict[int, int]] = {}
        for d, pieces in doc_pieces.items():
            if len(pieces) == 1:  # a document kept whole
                self.last_start[d] = {owner[pieces[0]]: pieces[0].start}
                continue
            pieces.sort(key=lambda p: p.start)
            last: dict[int, int] = {}
            for p in pieces:
                last[owner[p]] = p.start
            self.last_start[d] = last

    def rows(self, p: Piece) -> range:
        s = self.local_start[p]
        return range(s, s + p.length)

    def peers(self, rank: int) -> set[int]:
        """The other ranks holding pieces of `rank`'s documents (the only ones it may exchange with)."""
        return {r for p in self.placement.ranks[rank] for r in self.last_start[p.doc]} - {rank}

    def needed(self, src: int, dst: int) -> list[Piece]:
        """Pieces of `src` whose K/V `dst` needs, in `src`'s local order."""
        out = []
        for p in self.placement.ranks[src]:
            latest = self.last_start[p.doc].get(dst)
            if latest is not None and p.end <= latest:
                out.append(p)
        return out

    def queries_of(self, rank: int, key: Piece) -> tuple[Piece, ...]:
        """Pieces of `rank` that attend to all of `key` (same document, after it)."""
        return tuple(p for p in self.held.get((rank, key.doc), ()) if p.start >= key.end)


def _offsets(lengths: list[int], device: torch.device) -> torch.Tensor:
    """`cu_seqlens` (int32) of segments of these lengths."""
    return torch.tensor(list(accumulate(lengths, initial=0)), dtype=torch.int32).to(device, non_blocking=True)


def _one_run(ranges: tuple[range, ...]) -> slice | None:
    """The rows of these ranges, in order, as one slice where they are consecutive rows
    (at least one), else None."""
    start = end = None
    for r in ranges:
        if not len(r):
            continue
        if end is None:
            start = r.start
        elif r.start != end:
            return None
        end = r.stop
    return None if start is None else slice(start, end)


def _rows(ranges: tuple[range, ...], device: torch.device) -> Rows:
    """The rows of these ranges, in order: one slice where they are consecutive, else an
    index tensor (int64)."""
    run = _one_run(ranges)
    return _index_tensor(ranges, device) if run is None else run


def _index_tensor(ranges: tuple[range, ...], device: torch.device, dtype: type = np.int64) -> torch.Tensor:
    """The rows of these ranges, in order, as one index tensor (int64 unless `dtype` says)."""
    rows = np.concatenate([np.arange(r.start, r.stop, dtype=dtype) for r in ranges]) if ranges else np.zeros(0, dtype=dtype)
    return torch.from_numpy(rows).to(device, non_blocking=True)


class _Staged:
    """Host arrays gathered into one buffer of `dtype` and copied to a device at once; each
    `add_*` returns the number of its array, which starts at a multiple of `align` elements."""

    def __init__(self, dtype: type, align: int = 1) -> None:
        self.dtype, self.align = dtype, align
        self.parts: list[np.ndarray] = []  # concatenated into the buffer
        self.sizes: list[int] = []  # the buffer's pieces: padding, or one array added
        self.arrays: list[int] = []  # which piece each array added is
        self.size = 0

    def _add(self, parts: list[np.ndarray]) -> int:
        pad = -self.size % self.align
        if pad:
            self.parts.append(np.zeros(pad, dtype=self.dtype))
            self.sizes.append(pad)
        size = sum(map(len, parts))
        self.parts += parts
        self.arrays.append(len(self.sizes))
        self.sizes.append(size)
        self.size += pad + size
        return len(self.arrays) - 1

    def add_ranges(self, ranges: tuple[range, ...]) -> int:
        return self._add([np.arange(r.start, r.stop, dtype=self.dtype) for r in ranges])

    def add_offsets(self, lengths: list[int]) -> int:
        return self._add([np.fromiter(accumulate(lengths, initial=0), dtype=self.dtype, count=len(lengths) + 1)])

    def to(self, device: torch.device) -> list[torch.Tensor]:
        """Every array added, in order, as views of one tensor on `device` (one copy)."""
        host = np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=self.dtype)
        pieces = torch.from_numpy(host).to(device, non_blocking=True).split(self.sizes)
        return [pieces[i] for i in self.arrays]


def _all_rows(ranges: list[range], count: int) -> bool:
    """Whether the ranges, in order, are exactly the rows 0..count-1."""
    end = 0
    for r in ranges:
        if r.start != end:
            return False
        end = r.stop
    return end == count


def _call(segments: list[tuple[list[range], list[range]]], causal: bool, num_q: int | None = None,
          num_k: int | None = None) -> KernelCall:
    """A kernel call of `segments` (query row ranges, key row ranges); rows are None where
    they are all `num_q` (`num_k`) rows in order."""
    q_ranges = tuple(r for q, _ in segments for r in q)
    k_ranges = tuple(r for _, k in segments for r in k)
    return KernelCall(
        q_ranges=None if num_q is not None and _all_rows(q_ranges, num_q) else q_ranges,
        k_ranges=None if num_k is not None and _all_rows(k_ranges, num_k) else k_ranges,
        causal=causal,
        seqlens=tuple((sum(map(len, q)), sum(map(len, k))) for q, k in segments),
    )


def _document_runs(pieces: tuple[Piece, ...], tile: int) -> list[list[Piece]]:
    """A rank's pieces (in its local order, so consecutive pieces are consecutive rows) in
    runs of consecutive pieces of one document in position order, where one segment is
    cheaper in tiles of `tile` tokens. One causal segment over a run computes exactly its
    pairs: each piece's own causal block and every later piece's full block over the earlier
    ones (the keys between them, on other ranks, come apart); as one segment they are
    tile-rounded once, not per piece and per block (the zigzag layout's head and tail chunks
    shorter than a tile: up to two thirds fewer tiles)."""
    runs: list[list[Piece]] = []
    run_rows = 0
    for p in pieces:
        n = p.end - p.start
        # One segment over the run and `p`, against the run's and `p` (its diagonal and its
        # full block over the run's rows: `tile_pairs` at that offset) apart.
        if (runs and runs[-1][-1].doc == p.doc and runs[-1][-1].end <= p.start
                and tile_pairs(tile, 0, run_rows + n) < tile_pairs(tile, 0, run_rows) + tile_pairs(tile, run_rows, n)):
            runs[-1].append(p)
            run_rows += n
        else:
            runs.append([p])
            run_rows = n
    return runs


def _full_calls(layout: _Layout, rank: int, keys: list[tuple[Piece, range]],
                run_of: Mapping[Piece, int] | None = None) -> tuple[KernelCall, ...]:
    """Kernel calls for full blocks: `keys` are key pieces with their rows in the source buffer.

    Key pieces attended by the same set of query pieces form one segment; segments go
    into as few calls as keep every query row unique within a call. A query piece in the
    key's own run (`run_of`: local keys, `_document_runs`) has that block in the run's
    causal segment already.
    """
    segments: dict[tuple[Piece, ...], list[range]] = {}
    for key, rows in keys:
        queries = layout.queries_of(rank, key)
        if run_of is not None:
            queries = tuple(q for q in queries if run_of[q] != run_of[key])
        if queries:
            segments.setdefault(queries, []).append(rows)
    calls: list[list[tuple[list[range], list[range]]]] = []
    used: list[set[Piece]] = []
    for queries, key_rows in segments.items():
        segment = ([layout.rows(q) for q in queries], key_rows)
        for call, seen in zip(calls, used):
            if seen.isdisjoint(queries):
                call.append(segment)
                seen.update(queries)
                break
        else:
            calls.append([segment])
            used.append(set(queries))
    return tuple(_call(call, causal=False) for call in calls)


def exchange_round(rank: int, peer: int, num_ranks: int) -> int:
    """The round in which outer ranks `rank` and `peer` exchange: (rank + peer) mod R, the
    same for both, and a different peer for `rank` in every round."""
    return (rank + peer) % num_ranks


def check_schedule(schedule: str, allow_auto: bool = False) -> str:
    """`schedule` if it names one of `SCHEDULES` (or "auto" where allowed), else ValueError."""
    known = SCHEDULES + (("auto",) if allow_auto else ())
    if schedule not in known:
        raise ValueError(f"unknown SAP schedule {schedule!r}; expected one of {known}")
    return schedule


def exchange_levels(order: Mapping[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """The level of every pair in `order` (pair -> position): going through the pairs in
    order, one more than the last level of either of its ranks (from 0). Each rank meets at
    most one peer per level and its levels rise along its exchanges, so events keyed by
    level (`RankProgram.backward_events`) come in one order that every rank follows."""
    pairs = sorted(order, key=order.__getitem__)
    last = [-1] * (1 + max((max(pair) for pair in pairs), default=0))
    levels: dict[tuple[int, int], int] = {}
    for pair in pairs:
        a, b = pair
        level = last[a] if last[a] > last[b] else last[b]
        levels[pair] = last[a] = last[b] = level + 1
    return levels


def compile_program(placement: Placement, rank: int, layout: _Layout | None = None,
                    schedule: str = "pipelined", order: Mapping[tuple[int, int], int] | None = None,
                    levels: Mapping[tuple[int, int], int] | None = None,
                    backward_levels: Mapping[tuple[int, int], int] | None = None, tile: int = 1,
                    ring: bool = False) -> RankProgram:
    """The program of outer rank `rank` for `placement`, in `schedule` (see `SCHEDULES`),
    its exchanges in `order` (the position of each pair (a, b), a < b, that exchanges
    anything: `order.exchange_order`; default: by exchange round), each at its level
    (`exchange_levels(order)`, given or computed; by round: the round), and backward at
    its level in `backward_levels` (`exchange_levels` of the backward's order; default:
    the same as forward). `ring`: the exchanges are ring shifts instead (`ring_exchanges`;
    `order` and the levels unused). `tile`: the kernels' tile, in tokens (`_document_runs`)."""
    check_schedule(schedule)
    layout = layout or _Layout(placement)
    R = placement.num_ranks
    pieces = placement.ranks[rank]
    if ring:
        exchanges = ring_exchanges(layout, rank)
        forward_levels = back_levels = [round_ for round_, *_ in exchanges]
    else:
        exchanges = []  # (round, send peer, receive peer, pieces sent, pieces received) of each step
        for round_, peer in sorted((exchange_round(rank, peer, R), peer) for peer in layout.peers(rank)):
            send, recv = layout.needed(rank, peer), layout.needed(peer, rank)
            if send or recv:
                exchanges.append((round_, peer, peer, send, recv))
        if order is not None:
            exchanges.sort(key=lambda e: order[min(rank, e[1]), max(rank, e[1])])
            levels = exchange_levels(order) if levels is None else levels
        pairs = [(min(rank, peer), max(rank, peer)) for _, peer, _, _, _ in exchanges]
        forward_levels = [e[0] for e in exchanges] if order is None else [levels[pair] for pair in pairs]
        back_levels = forward_levels if backward_levels is None else [backward_levels[pair] for pair in pairs]
    if schedule == "pipelined":
        local_calls: list[KernelCall] = []
        if pieces:
            runs = _document_runs(pieces, tile)
            diagonal = [([rows], [rows]) for run in runs
                        for rows in [range(layout.rows(run[0]).start, layout.rows(run[-1]).stop)]]
            local_calls.append(_call(diagonal, causal=True, num_q=placement.capacity, num_k=placement.capacity))
            run_of = {p: i for i, run in enumerate(runs) for p in run}
            local_calls.extend(_full_calls(layout, rank, [(p, layout.rows(p)) for p in pieces], run_of))
        step_calls = []
        for *_, recv in exchanges:
            offsets = accumulate((p.length for p in recv), initial=0)
            step_calls.append(_full_calls(layout, rank, [(p, range(o, o + p.length)) for p, o in zip(recv, offsets)]))
    else:
        local_calls, step_calls = _prefix_calls(layout, rank, [recv for *_, recv in exchanges])
    transfers = tuple(
        Transfer(
            round=round_,
            level=level,
            backward_level=back,
            send_peer=to if send else None,
            send_ranges=tuple(layout.rows(p) for p in send) if send else None,
            recv_peer=source if recv else None,
            recv_tokens=sum(p.length for p in recv),
            calls=tuple(calls),
        )
        for (round_, to, source, send, recv), calls, level, back in zip(exchanges, step_calls, forward_levels, back_levels)
    )
    return RankProgram(rank, placement.capacity, tuple(local_calls), transfers, schedule)


def ring_exchanges(layout: _Layout, rank: int) -> list[tuple[int, int, int, list[Piece], list[Piece]]]:
    """The steps of `rank` as ring shifts: in step d (1 to R - 1, its round and level) it
    sends rank r + d what that rank needs and receives from rank r - d (mod R) what it
    needs, skipping steps with neither. Every directed pair of ranks has its step, so R - 1
    steps carry everything, each rank sending on one link direction and receiving on the
    other at once; pairwise exchanges need R rounds where R is odd (no perfect matching).
    Each: (round, send peer, receive peer, pieces sent, pieces received)."""
    R = layout.placement.num_ranks
    peers = layout.peers(rank)
    steps = []
    for d in range(1, R):
        to, source = (rank + d) % R, (rank - d) % R
        send = layout.needed(rank, to) if to in peers else []
        recv = layout.needed(source, rank) if source in peers else []
        if send or recv:
            steps.append((d, to, source, send, recv))
    return steps


def _prefix_calls(layout: _Layout, rank: int,
                  received: list[list[Piece]]) -> tuple[list[KernelCall], list[list[KernelCall]]]:
    """The gathered schedule's calls: every piece of `rank` against all keys of its
    document up to its end, in one bottom-right causal segment, as soon as those keys are
    there. Local calls take the pieces whose earlier keys are all local (keys index the
    local rows); the calls of step i the pieces whose last keys arrive in step i (`received`
    per step; keys index the source buffer: the local rows, then every step's received rows
    in step order). A call holds one piece per document, so its query and key rows are
    unique."""
    capacity = layout.placement.capacity
    source_rows = {p: layout.rows(p) for p in layout.placement.ranks[rank]}
    arrives = {p: -1 for p in source_rows}  # the step after which a piece's rows are there (-1: local)
    end = capacity
    for step, recv in enumerate(received):
        for p in recv:
            source_rows[p] = range(end, end + p.length)
            arrives[p] = step
            end += p.length
    groups: dict[tuple[int, int], list[tuple[list[range], list[range]]]] = defaultdict(list)
    seen: dict[tuple[int, int], int] = defaultdict(int)  # pieces of a document per step so far
    for p in layout.placement.ranks[rank]:
        keys = [x for x in layout.doc_pieces[p.doc] if x.start <= p.start]
        step = max(arrives[x] for x in keys)
        nth = seen[step, p.doc]
        seen[step, p.doc] += 1
        groups[step, nth].append(([layout.rows(p)], [source_rows[x] for x in keys]))
    local_calls: list[KernelCall] = []
    step_calls: list[list[KernelCall]] = [[] for _ in received]
    for (step, _), segments in sorted(groups.items()):
        if step < 0:
            local_calls.append(_call(segments, causal=True, num_q=capacity, num_k=capacity))
        else:
            step_calls[step].append(_call(segments, causal=True, num_q=capacity))
    return local_calls, step_calls


def compile_all(placement: Placement, schedule: str = "pipelined",
                order: Mapping[tuple[int, int], int] | None = None, tile: int = 1,
                ring: bool = False) -> list[RankProgram]:
    """Programs of every outer rank, exchanges in `order` (default: by round) or as ring
    shifts (`ring`)."""
    layout = _Layout(placement)
    levels = None if order is None else exchange_levels(order)
    return [compile_program(placement, r, layout, schedule, order, levels, tile=tile, ring=ring)
            for r in range(placement.num_ranks)]
