"""Placement: which document pieces each (outer) rank holds, and the candidates under construction.

Every rank holds exactly `capacity` tokens. A placement is stored as one `Record` per
document: the document's `Cut` (`cuts.py`: its slots, each the pieces one rank holds)
and the rank of each slot. The evaluation works on the cuts' chunk sizes in a few array
operations, and the pieces per rank are built only when asked for (the chosen
candidate).

Candidates are built as `Build`s, a document at a time with a `Tally` of their compute
and transfers, so that the planner can give up one as soon as it can no longer be the
fastest. The strategies (`candidates.py` lists them all):

- ``greedy`` (`greedy.py`): sequence-aware; documents whole where they fit, long ones
  split over the fewest ranks the load slack allows, in head-to-tail chunk pairs or
  consecutive chunks;
- ``zigzag``, ``contiguous`` and ``whole`` (`layouts.py`): the ring layout without
  padding, the all-gather layout (and two reorderings of the documents under it), and
  every document whole.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import chain
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from .cuts import Cut
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


def finish_placement(capacity: int, num_ranks: int, records: list[Record], strategy: str, tally: Tally | None = None) -> Placement:
    """The placement of these records (tallied in `tally`), checked to give every rank
    `capacity` tokens."""
    ranks = list(chain.from_iterable(rec.ranks for rec in records))
    sizes = list(chain.from_iterable(rec.cut.sizes for rec in records))
    held = np.bincount(ranks, weights=sizes, minlength=num_ranks)
    wrong = np.flatnonzero(held != capacity)
    if len(wrong):
        r = int(wrong[0])
        raise AssertionError(f"placement {strategy} gave rank {r} {int(held[r])} tokens, expected {capacity}")
    if tally is not None:
        return Placement(capacity, num_ranks, tuple(records), strategy, tuple(tally.tiles), tally)
    # Without a tally (the contiguous layout: unpaired cuts, whose pipelined calls never
    # take fewer tiles than the gathered ones, `Cut.pipelined_costs`), the gathered sums.
    costs = list(chain.from_iterable(rec.cut.costs for rec in records))
    pairs = np.bincount(ranks, weights=costs, minlength=num_ranks)
    return Placement(capacity, num_ranks, tuple(records), strategy, tuple([int(x) for x in pairs]), tally)

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
