"""Compile a placement into the per-rank program the executor runs.

A rank's program is data, not code: index tensors and `cu_seqlens` prepared once per
batch signature, so the hot loop makes no host-device sync and no Python loop over
documents. Structure, for outer rank r:

- `local_calls`: kernel calls whose keys are local (every piece's causal diagonal,
  then full blocks against the rank's own earlier pieces of the same document);
- `transfers`: one step per exchange round s = 0..R-1 that moves anything for r. In
  round s, outer rank r and its partner p = (s - r) mod R (a matching of the ranks:
  p's partner in round s is r) exchange in one batched P2P call: r sends p the rows of
  its pieces that p needs and receives the rows of p's that it needs; then it runs
  `calls` on the received rows. Every pair of ranks meets in exactly one round, so a
  rank's sends to and receives from one peer travel together, in both directions of
  the link at once: its exchanges take the sum over peers of the larger side, where
  pairing a send to r+d with a receive from r-d (a ring schedule) took the sum over
  steps, up to twice as long where traffic is one-sided per peer.

The backward pass runs the same steps with the roles reversed: the gradients of the
received rows go back to their owner, which adds them at `send_rows`.

Within one call every query row and every key row appears at most once, so a call's
outputs merge into their rows by gather and write-back, and gradients accumulate
without atomics (the merges
are bitwise deterministic on every device; the flash kernels' own backward follows
torch's deterministic setting, see docs/architecture.md).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import torch

from .placement import Piece, Placement


@dataclass(frozen=True)
class KernelCall:
    """One varlen kernel call: segment i pairs query rows i with key rows i."""

    q_rows: torch.Tensor | None  # local rows used as queries, in segment order (None: all, in order)
    k_rows: torch.Tensor | None  # rows of the key/value source (None: all, in order)
    cu_seqlens_q: torch.Tensor  # int32
    cu_seqlens_k: torch.Tensor  # int32
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool

    def to(self, device: torch.device) -> "KernelCall":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return replace(
            self,
            q_rows=move(self.q_rows),
            k_rows=move(self.k_rows),
            cu_seqlens_q=move(self.cu_seqlens_q),
            cu_seqlens_k=move(self.cu_seqlens_k),
        )


@dataclass(frozen=True)
class Transfer:
    """One batched P2P step: send `send_rows` to `send_peer`, receive `recv_tokens` rows
    from `recv_peer` (outer ranks; None when that side is empty), then run `calls`."""

    round: int  # exchange round s: the peer is (s - rank) mod R on both sides
    send_peer: int | None
    send_rows: torch.Tensor | None
    recv_peer: int | None
    recv_tokens: int
    calls: tuple[KernelCall, ...]

    def to(self, device: torch.device) -> "Transfer":
        rows = None if self.send_rows is None else self.send_rows.to(device, non_blocking=True)
        return replace(self, send_rows=rows, calls=tuple(c.to(device) for c in self.calls))


@dataclass(frozen=True)
class RankProgram:
    """Everything one outer rank executes for one attention layer."""

    rank: int
    num_tokens: int
    local_calls: tuple[KernelCall, ...]
    transfers: tuple[Transfer, ...]

    def to(self, device: torch.device) -> "RankProgram":
        return replace(
            self,
            local_calls=tuple(c.to(device) for c in self.local_calls),
            transfers=tuple(t.to(device) for t in self.transfers),
        )

    @property
    def sent_tokens(self) -> int:
        return sum(0 if t.send_rows is None else len(t.send_rows) for t in self.transfers)

    @property
    def recv_tokens(self) -> int:
        return sum(t.recv_tokens for t in self.transfers)


class _Layout:
    """Per-placement lookups shared by the compilation of every rank."""

    def __init__(self, placement: Placement):
        self.placement = placement
        self.local_start: dict[Piece, int] = {}
        self.owner: dict[Piece, int] = {}
        self.doc_pieces: dict[int, list[Piece]] = defaultdict(list)
        for r, pieces in enumerate(placement.ranks):
            pos = 0
            for p in pieces:
                self.local_start[p] = pos
                self.owner[p] = r
                self.doc_pieces[p.doc].append(p)
                pos += p.length
        # Latest start of each rank's pieces per document: a rank needs every earlier
        # piece of the document that ends at or before it.
        self.last_start: dict[int, dict[int, int]] = {}
        for d, pieces in self.doc_pieces.items():
            pieces.sort(key=lambda p: p.start)
            last: dict[int, int] = {}
            for p in pieces:
                last[self.owner[p]] = p.start
            self.last_start[d] = last

    def rows(self, p: Piece) -> range:
        s = self.local_start[p]
        return range(s, s + p.length)

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
        return tuple(p for p in self.doc_pieces[key.doc] if self.owner[p] == rank and p.start >= key.end)


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _full_calls(layout: _Layout, rank: int, keys: list[tuple[Piece, range]]) -> tuple[KernelCall, ...]:
    """Kernel calls for full blocks: `keys` are key pieces with their rows in the source buffer.

    Key pieces attended by the same set of query pieces form one segment; segments go
    into as few calls as keep every query row unique within a call.
    """
    segments: dict[tuple[Piece, ...], list[range]] = {}
    for key, rows in keys:
        queries = layout.queries_of(rank, key)
        if queries:
            segments.setdefault(queries, []).append(rows)
    calls: list[list[tuple[tuple[Piece, ...], list[range]]]] = []
    used: list[set[Piece]] = []
    for queries, key_rows in segments.items():
        for call, seen in zip(calls, used):
            if seen.isdisjoint(queries):
                call.append((queries, key_rows))
                seen.update(queries)
                break
        else:
            calls.append([(queries, key_rows)])
            used.append(set(queries))
    out = []
    for call in calls:
        q_rows: list[int] = []
        k_rows: list[int] = []
        cu_q, cu_k = [0], [0]
        for queries, key_rows in call:
            for q in queries:
                q_rows.extend(layout.rows(q))
            for rows in key_rows:
                k_rows.extend(rows)
            cu_q.append(len(q_rows))
            cu_k.append(len(k_rows))
        out.append(
            KernelCall(
                q_rows=torch.tensor(q_rows, dtype=torch.long),
                k_rows=torch.tensor(k_rows, dtype=torch.long),
                cu_seqlens_q=_int32(cu_q),
                cu_seqlens_k=_int32(cu_k),
                max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
                max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])),
                causal=False,
            )
        )
    return tuple(out)


def exchange_partner(rank: int, round_: int, num_ranks: int) -> int:
    """The outer rank that `rank` exchanges with in round `round_` (itself: none)."""
    return (round_ - rank) % num_ranks


def compile_program(placement: Placement, rank: int, layout: _Layout | None = None) -> RankProgram:
    """The program of outer rank `rank` for `placement`."""
    layout = layout or _Layout(placement)
    R = placement.num_ranks
    pieces = placement.ranks[rank]
    lengths = [p.length for p in pieces]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    local_calls: list[KernelCall] = []
    if pieces:
        local_calls.append(
            KernelCall(None, None, _int32(cu), _int32(cu), max(lengths), max(lengths), causal=True)
        )
    local_calls.extend(_full_calls(layout, rank, [(p, layout.rows(p)) for p in pieces]))

    transfers: list[Transfer] = []
    for round_ in range(R):
        peer = exchange_partner(rank, round_, R)
        if peer == rank:
            continue
        send = layout.needed(rank, peer)
        recv = layout.needed(peer, rank)
        if not send and not recv:
            continue
        keys, pos = [], 0
        for p in recv:
            keys.append((p, range(pos, pos + p.length)))
            pos += p.length
        send_rows = [i for p in send for i in layout.rows(p)]
        transfers.append(
            Transfer(
                round=round_,
                send_peer=peer if send else None,
                send_rows=torch.tensor(send_rows, dtype=torch.long) if send else None,
                recv_peer=peer if recv else None,
                recv_tokens=pos,
                calls=_full_calls(layout, rank, keys),
            )
        )
    return RankProgram(rank, placement.capacity, tuple(local_calls), tuple(transfers))


def compile_all(placement: Placement) -> list[RankProgram]:
    """Programs of every outer rank (tests and statistics)."""
    layout = _Layout(placement)
    return [compile_program(placement, r, layout) for r in range(placement.num_ranks)]
