"""`plan_sequences`: place one packed batch, pick the fastest candidate, cache the plan."""
from __future__ import annotations

import gc
import hashlib
import heapq
import math
import numbers
import operator
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..validation import check_bool, check_divisible, cu_seqlens_to_list, positive_int
from .cost_model import CostModel
from .evaluate import Evaluation, evaluate, inner_peer_links, step_pairs, ulysses_cost, whole_documents_s
from .order import (ALWAYS_PACED_PAIRS, MAX_PACED_PAIRS, directed_seconds, exchange_seconds, layer_timing, link_order,
                    matching_order, paced_exchange_order, ring_layer_seconds)
from .candidates import candidates
from .placement import Build, Placement
from .program import (CPU, COMPUTE, FETCH, LOCAL, RETURN, SCHEDULES, Event, RankProgram, _index_tensor, _Layout,
                      _one_run, check_schedule, compile_program, exchange_levels, head_chunks)
from .timeline import RankSchedule, joint_schedule, plan_schedule, rank_schedule

DEFAULT_SLACKS = (0.0, 0.02, 0.05, 0.1, 0.25, 1.0)
# Beyond JOINT_SCHEDULE_RANKS outer ranks, `Plan.schedule` takes the gathered schedule
# where the slowest rank alone runs it at most this much slower than the pipelined one:
# its exchanges wait for no kernel, so the ranks keep out of each other's way, which timing
# one rank alone does not show. Timed together on 76 rows (docs/planner.md, "Where the
# ranks wait for each other"), 2% gave the geometric mean closest to the faster schedule
# of every row.
GATHERED_PREFERENCE = 0.02
# Up to this many outer ranks the plan times every rank's programs together
# (`timeline.joint_schedule`) in four options, the link order in either schedule and the
# paced and matching orders pipelined (at odd outer sizes ring shifts too, in either
# schedule), and runs the fastest (`Plan._choose_together`): 2-12
# ms per fresh plan at 8 outer ranks, 3-41 ms at 16 with the first three (docs/planner.md,
# "Where the ranks wait for each other"), about a third more with the fourth; beyond, the
# schedule the slowest rank alone runs faster and, pipelined, the order the step-level
# models end sooner (`Plan._choose_by_steps`; compiling all ranks grows as R^2).
JOINT_SCHEDULE_RANKS = 16
# The name of the ring shifts (`program.ring_exchanges`) among the exchange orders that
# `Plan._choose_together` weighs, at odd outer sizes only (pairwise: R rounds, the shifts R - 1).
RING = "ring"
DEFAULT_COST_MODEL = CostModel.preset("h100")
TIME_TOLERANCE = 0.01  # candidates this close to the fastest compete on the step-level models, then bytes moved
# Up to this many outer ranks the candidates within TIME_TOLERANCE of the fastest estimate
# compete on the step-level models of all ranks together (`order.layer_timing`: 0.4-0.9 ms a
# candidate at 8 outer ranks), then on the bytes they move; beyond, on bytes (at 16 outer ranks
# the models gained nothing on average, docs/planner.md "Choice"), but on rows of a few long
# documents (`step_checks`).
STEP_CHOICE_RANKS = 8
# Up to this many CP ranks (and STEP_CHOICE_RANKS outer ranks) the choice is timed on the
# step-level models too (0.3-0.9 ms at 8 outer ranks), and where they time it over
# RECHECK_MARGIN beyond the fastest estimate, the candidate they end soonest is timed
# against it with every rank's program, all ranks together (see `_fresh_plan`). Beyond,
# that recheck would gain 1.4% on average (up to 22%) for 1.6-3x the planning time, past the
# 5 ms target at P = 64 (docs/planner.md, "Choice"); `choose_by="timeline"` offers it. Rows
# of a few long documents are rechecked at any size (`step_checks`).
RECHECK_RANKS = 16
RECHECK_MARGIN = 0.05
# Beyond STEP_CHOICE_RANKS outer ranks both run on rows of a few long documents
# (`step_checks`): no more documents than outer ranks (the mean document at least one rank's
# share), and a fastest estimate of at least STEP_CHECK_PAIR_S per pair of outer ranks, about
# what the step-level models of one candidate take per pair on the benchmark's CPU (10 ms at
# 32 outer ranks, every pair exchanging), so that the checks cost a layer or two while they
# can gain a few percent of every layer. There the estimate misjudges the most (documents
# spread over many ranks, whose ranks wait for each other): on rows of one to six long
# documents at 16-64 CP ranks the near candidate moving the fewest bytes ran up to 1.15x the
# a2a+p2p baseline's model, all ranks together. Rows of many documents are left out: on the
# corpora's 1M-token rows the checks took 3-10x the planning time and the models misranked a
# few plans; the 128K-token rows at P = 64 keep their median planning time (docs/planner.md,
# "The matching order"). Beyond JOINT_SCHEDULE_RANKS the recheck takes the models' candidate
# without timing it.
STEP_CHECK_PAIR_S = 20e-6
# The head chunks `Plan.inner_chunks` weighs beside 1 (where the heads split so). More
# chunks hide more of the all-to-alls under the kernels but add an all-to-all (U - 1
# messages) per pass and run each kernel call on fewer heads, whose cost per call the
# model leaves out: on the CPU benchmark's gloo ranks (2 x 2, 8 query heads) four chunks
# ran ShareGPT's row 1.29x slower than one, two within 2% (docs/architecture.md, "Head
# chunks"); at the scale model's points four gain at most 1% over two.
INNER_CHUNK_CHOICES = (2,)
TIME_RESOLUTION_S = 10e-6  # a candidate this close to the lower bound ends the search (see `at_bound`)
# How `plan_sequences` chooses among the candidates: by the planner's own estimate
# (`evaluate`), or by the executor's schedule of their compiled programs, all ranks
# together (`timeline.plan_schedule`), timing at most TIMELINE_CANDIDATES of those
# within TIMELINE_BAND of the fastest estimate.
CHOOSE_BY = ("estimate", "timeline")
TIMELINE_BAND = 0.10
TIMELINE_CANDIDATES = 6


def check_choose_by(choose_by: str) -> str:
    """`choose_by` if it names one of `CHOOSE_BY`, else ValueError."""
    if choose_by not in CHOOSE_BY:
        raise ValueError(f"choose_by must be one of {', '.join(map(repr, CHOOSE_BY))}, got {choose_by!r}")
    return choose_by


def rings_weighed(outer_size: int) -> bool:
    """Whether a plan of `outer_size` outer ranks weighs ring shifts (RING) among its exchange
    orders: at odd sizes, up to JOINT_SCHEDULE_RANKS (`Plan._choose_together`)."""
    return outer_size % 2 == 1 and 1 < outer_size <= JOINT_SCHEDULE_RANKS


def misjudged(level_s: float, estimate_s: float) -> bool:
    """Whether the step-level models (with the all-to-alls, which they leave out) time a
    layer over its estimate by more than RECHECK_MARGIN (relative) and TIME_RESOLUTION_S
    (absolute): its ranks wait for each other beyond what the estimate sees."""
    return level_s > estimate_s + max(estimate_s * RECHECK_MARGIN, TIME_RESOLUTION_S)


def step_checks(outer_size: int, world: int, estimate_s: float, documents: int) -> tuple[bool, bool]:
    """(Whether the near candidates compete on the step-level models, whether a choice
    they time over its estimate is rechecked): up to STEP_CHOICE_RANKS outer ranks (the
    recheck up to RECHECK_RANKS CP ranks); beyond, on a row of a few long documents: at
    most one of its (non-empty) `documents` an outer rank, and a fastest estimate
    `estimate_s` of at least STEP_CHECK_PAIR_S per pair of outer ranks."""
    if outer_size <= STEP_CHOICE_RANKS:
        return True, world <= RECHECK_RANKS
    few_long = documents <= outer_size and estimate_s >= STEP_CHECK_PAIR_S * outer_size * (outer_size - 1) / 2
    return few_long, few_long


def at_bound(time_s: float, bound_s: float) -> bool:
    """Whether a modelled layer time is within TIME_TOLERANCE (relative) or
    TIME_RESOLUTION_S (absolute, whichever is larger) of the lower bound: no other
    candidate can be faster by more than that. The absolute part is about the launch
    cost of one kernel, which the model leaves out: rows of many short documents, whose
    whole layer takes tens of microseconds, need not be searched to a fraction of one."""
    return time_s <= bound_s + max(bound_s * TIME_TOLERANCE, TIME_RESOLUTION_S)


@dataclass(eq=False)
class _StepSeconds:
    """What the step-level models of a plan read (`order`), in the pipelined schedule the
    model assumes (its calls tile-rounded as its programs run them, `evaluate.step_pairs`
    and `Evaluation.pipelined_pairs`, at `pipelined_kernel_factor`): each rank's message
    seconds to each other ([R, R] array, `order.directed_seconds`) and each exchanging
    pair's exchange seconds, each rank's forward kernel seconds of its step with each peer
    and of its local calls, and backward of its step with each peer ([R, R] array) and of
    all its calls; and the link order of the exchanges (`order.exchange_order`). The
    candidate choice and the plan's choice of order and of the backward's order weigh the
    same orders: each is made, and timed, once (`layer`)."""

    directed: np.ndarray
    exchange_s: dict[tuple[int, int], float]
    forward: list[list[float]]
    local: list[float]
    backward: np.ndarray
    backward_total: list[float]
    link: dict[tuple[int, int], int]
    # id of an order timed -> (that order, `layer`'s seconds and backward order)
    _layers: dict[int, tuple[Mapping[tuple[int, int], int], float, dict[tuple[int, int], int]]] = field(
        default_factory=dict, repr=False)

    @cached_property
    def paced(self) -> dict[tuple[int, int], int]:
        """`order.paced_exchange_order` of these steps."""
        return paced_exchange_order(self.exchange_s, self.forward, self.local)

    @cached_property
    def matching(self) -> dict[tuple[int, int], int]:
        """`order.matching_order` of these steps' exchanges."""
        return matching_order(self.exchange_s, len(self.local))

    @property
    def every_pair_exchanges(self) -> bool:
        """Whether every two outer ranks exchange (a zigzag layout's, a long document's over
        all ranks): where the matching order can keep every rank in lockstep."""
        ranks = len(self.local)
        return len(self.exchange_s) == ranks * (ranks - 1) // 2

    def orders(self, names: Sequence[str] = ("link", "paced", "matching")) -> dict[str, dict[tuple[int, int], int]]:
        """The exchange orders of `names` (`link`, `paced`, `matching`), in that order, each
        only where it differs from those before it."""
        orders: dict[str, dict[tuple[int, int], int]] = {}
        for name in names:
            order = getattr(self, name)
            if all(order != other for other in orders.values()):
                orders[name] = order
        return orders

    def layer(self, order: Mapping[tuple[int, int], int]) -> tuple[float, dict[tuple[int, int], int]]:
        """`order.layer_timing` of these steps with the exchanges in `order`: (the layer's
        seconds, the backward's order), worked out once per order (`link`, `paced` and
        `matching` are made once)."""
        timed = self._layers.get(id(order))
        if timed is None or timed[0] is not order:
            timed = self._layers[id(order)] = (order, *layer_timing(
                order, self.exchange_s, self.forward, self.local, self.backward.tolist(), self.backward_total))
        return timed[1], timed[2]

    @cached_property
    def ring_seconds(self) -> float:
        """The layer with the exchanges as ring shifts (`order.ring_layer_seconds`)."""
        return ring_layer_seconds(self.directed.tolist(), self.forward, self.local, self.backward.tolist(),
                                  self.backward_total)

    def seconds(self, name: str) -> float:
        """The layer's seconds (`layer`) in the order of `name` (`link`, `paced`, `matching`),
        or with the exchanges as ring shifts (RING, `ring_seconds`)."""
        return self.ring_seconds if name == RING else self.layer(getattr(self, name))[0]

    def level_seconds(self) -> float:
        """The pipelined layer, all ranks together, under the step-level models
        (`layer`), in the link order or the paced one, or as ring shifts at odd outer
        sizes up to JOINT_SCHEDULE_RANKS (`rings_weighed`), whichever ends sooner.
        Unlike the estimate, it sees a rank wait for a peer busy with its own kernels or
        exchanges (a contiguous split's chain of exchanges, say); the all-to-alls, the same
        for every candidate, are left out. The matching order, which the plan weighs too
        (`orders`), is weighed here only where every pair of ranks exchanges, as the plan's
        own choice of order does beyond JOINT_SCHEDULE_RANKS: weighed everywhere, in the
        choice among candidates it changed 2 of 728 rows' layouts for the worse (by up to 1%)
        and none for the better (docs/planner.md, "The matching order")."""
        names = ("link", "paced", "matching") if self.every_pair_exchanges else ("link", "paced")
        ring = [self.seconds(RING)] if rings_weighed(len(self.local)) else []
        return min([self.seconds(name) for name in self.orders(names)] + ring)


@dataclass(eq=False)
class Plan:
    """Where every token of one packed batch lives and what every rank computes.

    `cp_rank = outer_rank * inner_size + inner_rank`. The R outer ranks each hold
    `capacity = T / R` tokens (the placement); inside an outer group the U inner ranks
    hold consecutive slices of T / P tokens of the group's order and all run the outer
    rank's program on their own heads.
    """

    cu_seqlens: tuple[int, ...]
    outer_size: int
    inner_size: int
    cost_model: CostModel
    placement: Placement
    evaluation: Evaluation
    considered: dict[str, float]  # modelled makespan of every candidate evaluated, by strategy
    pruned: dict[str, float] = field(default_factory=dict)  # floor on the modelled makespan of the others
    slacks: tuple[float, ...] = DEFAULT_SLACKS  # the greedy passes' load slacks it was planned with
    choose_by: str = "estimate"  # how it was chosen among the candidates (CHOOSE_BY)
    # the candidates timed with their compiled programs, all ranks together (choose_by="timeline", or a recheck)
    timed: dict[str, float] = field(default_factory=dict)
    # the step-level seconds of the candidates those models chose among (near ones, or a recheck's), where they did
    stepped: dict[str, float] = field(default_factory=dict)
    _layout: _Layout | None = field(default=None, repr=False)
    _order: Mapping[tuple[int, int], int] | None = field(default=None, repr=False)
    _levels: Mapping[tuple[int, int], int] | None = field(default=None, repr=False)
    _backward_order: Mapping[tuple[int, int], int] | None = field(default=None, repr=False)
    _backward_levels: Mapping[tuple[int, int], int] | None = field(default=None, repr=False)
    _ring: bool = field(default=False, repr=False)  # exchanges as ring shifts (`ring_exchanges`)
    _programs: dict[tuple[int, str, str], RankProgram] = field(default_factory=dict, repr=False)
    _indices: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    # what the step-level models read, where the choice among the candidates worked it out
    # (`_step_seconds`); not pickled
    _steps: _StepSeconds | None = field(default=None, repr=False)
    # the schedule every rank runs keeping the K/V (`_choose`), up to JOINT_SCHEDULE_RANKS
    # outer ranks all ranks' times in it, run together, and the head chunks of the all-to-alls
    _chosen: tuple[str, list[RankSchedule] | None, int] | None = field(default=None, repr=False)

    # ---- sizes --------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.outer_size * self.inner_size

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def capacity(self) -> int:
        """Tokens per outer group (T / R)."""
        return self.placement.capacity

    @property
    def local_tokens(self) -> int:
        """Tokens per CP rank (T / P)."""
        return self.total_tokens // self.world_size

    @property
    def strategy(self) -> str:
        return self.placement.strategy

    def signature(self) -> str:
        """A short hash of the batch, the layout, where every piece lives and the cost
        model: equal on ranks that planned the same batch alike (ranks with different cost
        models can choose the same strategy with other pieces, or the same pieces with
        their exchanges in another order)."""
        if "_signature" not in self.__dict__:
            pieces = [[(p.start, p.end) for p in rank] for rank in self.placement.ranks]
            text = (f"{self.cu_seqlens}|{self.outer_size}|{self.inner_size}|{self.placement.strategy}|{pieces}|"
                    f"{self.cost_model!r}")
            self.__dict__["_signature"] = hashlib.sha1(text.encode()).hexdigest()[:16]
        return self.__dict__["_signature"]

    def __eq__(self, other: object) -> bool:
        """Plans are equal when they place and exchange alike (`signature`)."""
        if not isinstance(other, Plan):
            return NotImplemented
        return self is other or self.signature() == other.signature()

    def __hash__(self) -> int:
        return hash(self.signature())

    # ---- placement ----------------------------------------------------------------
    def _check_rank(self, rank: int, count: int | None = None, name: str = "cp_rank") -> int:
        """`rank` as an int (numpy integers, 0-d integer arrays and tensors too), checked to be in
        range(count) (default: the CP ranks)."""
        count = self.world_size if count is None else count
        if isinstance(rank, np.ndarray) and rank.ndim == 0 and rank.dtype.kind in "iu":
            rank = rank.item()  # a 0-d integer array, as a 0-d tensor is taken
        if isinstance(rank, bool) or not isinstance(rank, (numbers.Integral, torch.Tensor)) or (
            isinstance(rank, torch.Tensor)
            and (rank.dim() != 0 or rank.dtype.is_floating_point or rank.dtype.is_complex or rank.dtype == torch.bool)
        ):
            raise ValueError(f"{name} must be an integer, got {rank!r}")
        try:
            value = operator.index(rank)
        except TypeError:
            raise ValueError(f"{name} must be an integer, got {rank!r}") from None
        if not 0 <= value < count:
            kind = "CP" if name == "cp_rank" else "outer"
            raise ValueError(f"{name} {value} out of range for a plan over {count} {kind} ranks")
        return value

    def _check_outer(self, outer_rank: int) -> int:
        """`outer_rank` as an int, checked to be in range."""
        return self._check_rank(outer_rank, self.outer_size, "outer_rank")

    def pieces(self, outer_rank: int) -> list[tuple[int, int, int]]:
        """(document, start, end) pieces the outer group holds, in its local order; start and
        end are global packed positions (the document's offset is start - cu_seqlens[document])."""
        return [(p.doc, p.start, p.end) for p in self.placement.ranks[self._check_outer(outer_rank)]]

    def _group_indices(self, outer_rank: int) -> torch.Tensor:
        """`group_indices`, the plan's own (cached) tensor, int32 where the positions fit (half
        the bytes of a plan pickled in a loader's worker, which carries it; the accessors
        return int64 copies)."""
        if outer_rank not in self._indices:
            dtype = np.int32 if self.total_tokens <= np.iinfo(np.int32).max else np.int64
            ranges = tuple(range(p.start, p.end) for p in self.placement.ranks[outer_rank])
            self._indices[outer_rank] = _index_tensor(ranges, CPU, dtype)
        return self._indices[outer_rank]

    def group_indices(self, outer_rank: int) -> torch.Tensor:
        """Global positions of the outer group's T / R tokens, in its local order (a new
        int64 tensor: plans are shared through the cache)."""
        return self._group_indices(self._check_outer(outer_rank)).to(torch.int64, copy=True)

    def local_indices(self, cp_rank: int) -> torch.Tensor:
        """Global packed positions this CP rank holds, in its local order (T / P of them; a
        new tensor: plans are shared through the cache)."""
        cp_rank = self._check_rank(cp_rank)
        outer, inner = divmod(cp_rank, self.inner_size)
        n = self.local_tokens
        return self._group_indices(outer)[inner * n : (inner + 1) * n].to(torch.int64, copy=True)

    def position_ids(self, cp_rank: int) -> torch.Tensor:
        """Each local token's position inside its own document (for RoPE)."""
        idx = self.local_indices(cp_rank)
        starts = torch.tensor(self.cu_seqlens[:-1], dtype=torch.long)
        doc = torch.searchsorted(torch.tensor(self.cu_seqlens[1:], dtype=torch.long), idx, right=True)
        return idx - starts[doc]

    def work(self, cp_rank: int) -> list[tuple[int, int, int, int, bool]]:
        """Attention blocks (q_start, q_end, k_start, k_end, causal) the rank computes.

        Global packed positions; each piece contributes its causal diagonal and one full
        block over every earlier key of its document. Ranks of one inner group list
        the same blocks (each computes them for its own heads).
        """
        cp_rank = self._check_rank(cp_rank)
        doc_start = self.cu_seqlens
        blocks = []
        for p in self.placement.ranks[cp_rank // self.inner_size]:
            blocks.append((p.start, p.end, p.start, p.end, True))
            if p.start > doc_start[p.doc]:
                blocks.append((p.start, p.end, doc_start[p.doc], p.start, False))
        return blocks

    # ---- program ------------------------------------------------------------------
    def program(self, outer_rank: int, device: torch.device | str | None = None,
                schedule: str = "auto", recompute_kv: bool = False) -> RankProgram:
        """The compiled program of an outer rank on `device` (compiled once, then cached), in
        `schedule`: "pipelined" or "gathered" (see `planning.program`), or "auto" for
        `self.schedule(outer_rank, recompute_kv)`."""
        check_schedule(schedule, allow_auto=True)
        outer_rank = self._check_outer(outer_rank)
        check_bool(recompute_kv, "recompute_kv")
        if schedule == "auto":
            schedule = self.schedule(outer_rank, recompute_kv)
        device = torch.device(device or "cpu")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device} is not available here (torch.cuda.is_available() is False)")
        key = (outer_rank, str(device), schedule)
        if key not in self._programs:
            cpu_key = (outer_rank, "cpu", schedule)
            if cpu_key not in self._programs:
                self._programs[cpu_key] = self._compile(outer_rank, schedule)
            if key != cpu_key:
                self._programs[key] = self._programs[cpu_key].to(device)
        return self._programs[key]

    def _compile(self, outer_rank: int, schedule: str) -> RankProgram:
        """An outer rank's program in `schedule`, compiled on the CPU (not cached)."""
        with _gc_paused():
            return compile_program(self.placement, outer_rank, self._get_layout(), schedule, self.exchange_order(),
                                   self._exchange_levels(), self._backward_exchange_levels(), tile=self.cost_model.tile,
                                   ring=self.ring_exchanges)

    def _get_layout(self) -> _Layout:
        if self._layout is None:
            self._layout = _Layout(self.placement)
        return self._layout

    def exchange_order(self) -> Mapping[tuple[int, int], int]:
        """The position of every exchanging pair of outer ranks (a, b), a < b, in the order
        every rank runs its exchanges (`planning.order`; computed once, read-only: plans
        are shared through the cache): the link order (`order.exchange_order`), the one
        paced by the kernels (`order.paced_exchange_order`) or the round-robin one
        (`order.matching_order`; beyond JOINT_SCHEDULE_RANKS outer ranks where every pair of
        them exchanges), chosen with the schedule
        (`_choose`); empty where the ranks exchange as ring shifts (`ring_exchanges`)."""
        if self._order is None:
            self._choose(None)
        return self._order

    @property
    def ring_exchanges(self) -> bool:
        """Whether the outer ranks exchange as ring shifts (`program.ring_exchanges`: in
        step d each sends to rank r + d and receives from r - d) instead of pairwise in
        `exchange_order()`. Weighed at odd outer sizes up to JOINT_SCHEDULE_RANKS, where the
        pairwise exchanges need R rounds against the shifts' R - 1, and chosen with the
        schedule (`_choose_together`)."""
        self.exchange_order()
        return self._ring

    def _exchange_levels(self) -> Mapping[tuple[int, int], int]:
        """`program.exchange_levels` of the exchange order (set with it, read-only)."""
        self.exchange_order()
        return self._levels

    def backward_exchange_order(self) -> Mapping[tuple[int, int], int]:
        """The position of every exchanging pair in the order every rank runs its backward
        exchanges: `exchange_order()` or its reverse, whichever the backward modelled step by
        step ends sooner (`order.backward_order`; set with the forward's, read-only)."""
        self.exchange_order()
        return self._backward_order

    def _backward_exchange_levels(self) -> Mapping[tuple[int, int], int]:
        """`program.exchange_levels` of the backward's exchange order (set with it, read-only)."""
        self.exchange_order()
        return self._backward_levels

    def _step_seconds(self) -> _StepSeconds:
        """What the step-level models read (`_StepSeconds`), for the one choice of order and
        schedule (`_choose`): the choice among the candidates' where it weighed this one
        (then let go), else worked out now."""
        steps, self._steps = self._steps, None
        return steps or step_seconds(self.placement, self.evaluation, self.cost_model, self.inner_size)

    def _orders_of(self, order: dict[tuple[int, int], int], steps: _StepSeconds) -> tuple[Mapping[tuple[int, int], int], ...]:
        """A forward `order`, its levels, the backward's order (`order.backward_order`, given
        each rank's forward in `order`: `_StepSeconds.layer`) and its levels, read-only."""
        backward = steps.layer(order)[1]
        return tuple(MappingProxyType(o) for o in (order, exchange_levels(order), backward, exchange_levels(backward)))

    def _choose(self, keep_rank: int | None) -> None:
        """Choose the exchange order and the schedule every rank runs keeping the K/V, once:
        up to JOINT_SCHEDULE_RANKS outer ranks by all ranks' compiled programs timed
        together (`_choose_together`), beyond by the slowest rank and the step-level models
        (`_choose_by_steps`). Sets the orders, their levels and `_chosen`. The order is the
        plan's whether a rank runs with `recompute_kv` or not (every rank must follow one)."""
        choose = self._choose_together if self.outer_size <= JOINT_SCHEDULE_RANKS else self._choose_by_steps
        choose(keep_rank, self._step_seconds())

    def _choose_by_steps(self, keep_rank: int | None, steps: _StepSeconds) -> None:
        """The schedule the plan's slowest rank by the estimate (`evaluation.rank_time_s`,
        the lowest such rank) runs faster alone in the `link` order (`timeline.rank_schedule`),
        the gathered one also where it is at most GATHERED_PREFERENCE slower: its exchanges
        wait for no kernel, so the ranks do not wait for each other's kernels, which a rank
        run alone cannot show. Then, pipelined, the paced order where the step-level models
        end the layer sooner (`order.layer_timing`, built for the pipelined schedule; the
        link order on a tie), weighed up to ALWAYS_PACED_PAIRS pairs, and up to
        MAX_PACED_PAIRS where the link order's ranks wait for each other (`misjudged`:
        under it the paced order gained nothing on the rows measured, docs/planner.md, "The
        order of the exchanges"), and the matching order where every pair of ranks exchanges
        (`_StepSeconds.every_pair_exchanges`: a long document over all ranks, whose ring-like
        steps it keeps in lockstep); gathered, the link order. Of the
        programs compiled the plan keeps `keep_rank`'s where it is the slowest rank and
        runs them."""
        link = steps.link
        orders = self._orders_of(link, steps)
        order, levels, _, backward_levels = orders
        slowest = int(np.argmax(self.evaluation.rank_time_s))
        with _gc_paused():
            programs = {s: compile_program(self.placement, slowest, self._get_layout(), s, order, levels,
                                           backward_levels, tile=self.cost_model.tile) for s in SCHEDULES}
        alone = {s: rank_schedule(p, self.inner_size, self.capacity, self.cost_model).total_s
                 for s, p in programs.items()}
        schedule = "gathered" if alone["gathered"] <= alone["pipelined"] * (1 + GATHERED_PREFERENCE) else "pipelined"
        if schedule == "pipelined" and len(link) <= MAX_PACED_PAIRS:
            a2a_s = ulysses_cost(self.cost_model, self.capacity, self.inner_size, self.outer_size)[1]
            names = ["link"]
            if len(link) <= ALWAYS_PACED_PAIRS or misjudged(steps.seconds("link") + a2a_s, self.evaluation.makespan_s):
                names.append("paced")
            if steps.every_pair_exchanges:
                names.append("matching")
            weighed = steps.orders(names)
            best = min(weighed, key=steps.seconds) if len(weighed) > 1 else "link"  # the link order on a tie
            if best != "link":
                orders = self._orders_of(weighed[best], steps)
        self._order, self._levels, self._backward_order, self._backward_levels = orders
        chunks = min(inner_chunk_choices(self.cost_model, self.inner_size), key=lambda c: rank_schedule(
            programs[schedule], self.inner_size, self.capacity, self.cost_model, inner_chunks=c).total_s)
        self._chosen = (schedule, None, chunks)
        if keep_rank == slowest and orders[0] is order:
            self._programs.setdefault((keep_rank, "cpu", schedule), programs[schedule])

    def _choose_together(self, keep_rank: int | None, steps: _StepSeconds) -> None:
        """Choose the exchange order and the schedule every rank runs by all ranks' compiled
        programs timed together (`timeline.joint_schedule`), keeping the K/V: the `link`
        order in either schedule, or in the pipelined one the order paced by the kernels
        (`order.paced_exchange_order`, built for the pipelined forward) or the round-robin
        one (`order.matching_order`), and at odd outer sizes ring shifts in either schedule
        (`program.ring_exchanges`: R - 1 steps where pairs need R rounds; their orders
        empty); the first of those on a tie (`_StepSeconds.orders`). Of
        the programs compiled the plan keeps only `keep_rank`'s, in the order and schedule it
        will run (another rank's, or one it will not run, would go with the plan wherever it
        is pickled)."""
        orders = steps.orders()
        # each: the forward order, its levels, the backward's order and its levels
        ordered = {name: self._orders_of(order, steps) for name, order in orders.items()}
        options = [("link", "gathered"), ("link", "pipelined"), ("paced", "pipelined"), ("matching", "pipelined")]
        if rings_weighed(self.outer_size):
            ordered[RING] = (MappingProxyType({}),) * 4
            options += [(RING, "pipelined"), (RING, "gathered")]
        best = None
        for name, schedule in (option for option in options if option[0] in ordered):
            order, levels, _, backward_levels = ordered[name]
            with _gc_paused():
                programs = [compile_program(self.placement, r, self._get_layout(), schedule, order, levels,
                                            backward_levels, tile=self.cost_model.tile, ring=name == RING)
                            for r in range(self.outer_size)]
            times = joint_schedule(programs, self.inner_size, self.capacity, self.cost_model)
            if best is None or max(t.total_s for t in times) < max(t.total_s for t in best[3]):
                best = (name, ordered[name], schedule, times, programs)
        name, (self._order, self._levels, self._backward_order, self._backward_levels), schedule, times, programs = best
        self._ring = name == RING
        chunks = 1
        for c in inner_chunk_choices(self.cost_model, self.inner_size)[1:]:
            chunked = joint_schedule(programs, self.inner_size, self.capacity, self.cost_model, inner_chunks=c)
            if max(t.total_s for t in chunked) < max(t.total_s for t in times):
                times, chunks = chunked, c
        self._chosen = (schedule, times, chunks)
        if keep_rank is not None:
            self._programs.setdefault((keep_rank, "cpu", schedule), programs[keep_rank])

    def __getstate__(self) -> dict[str, Any]:
        """What pickling keeps (a plan made in a data loader's worker goes to the training
        process): the exchange orders and levels, forward and backward, as plain dicts, and
        not the pieces' layout, which only compiling another program reads and which comes
        back from the placement then (`_get_layout`): a tenth of the time to unpickle a
        128K-token plan, for a rank that runs the program the plan carries; nor the
        step-level inputs (`_step_seconds` works them out where the choice of order and
        schedule is still to make)."""
        state = dict(self.__dict__)
        state["_layout"] = state["_steps"] = None
        for name in ("_order", "_levels", "_backward_order", "_backward_levels"):
            if state.get(name) is not None:
                state[name] = dict(state[name])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in ("_order", "_levels", "_backward_order", "_backward_levels"):
            if state.get(name) is not None:
                state[name] = MappingProxyType(state[name])
        self.__dict__.update(state)

    def schedule(self, outer_rank: int, recompute_kv: bool = False) -> str:
        """The schedule an outer rank runs by default, one for every rank of the plan, chosen
        with the exchange order (`_choose`). Keeping the K/V for backward, with at most
        JOINT_SCHEDULE_RANKS outer ranks: the one, with its order, whose slowest rank the
        cost model times sooner done with all ranks run together (`timeline.joint_schedule`).
        With more: the one the plan's slowest rank runs faster alone (`_choose_by_steps`).
        Timing is with `pipelined_kernel_factor`. One for all because,
        with one hardware queue, mixed schedules hold each other up: a gathered rank posts its
        gradients back only after all its calls, and a pipelined peer's next kernels queue
        behind its exchange with it (docs/planner.md, "Where the ranks wait for each other").
        With `recompute_kv`, which trades time for memory: pipelined, whose forward holds a
        window of steps where the gathered one holds every received row."""
        self._check_outer(outer_rank)
        if check_bool(recompute_kv, "recompute_kv"):
            return "pipelined"
        if self._chosen is None:
            self._choose(outer_rank)
        return self._chosen[0]

    def inner_chunks(self, outer_rank: int = 0, recompute_kv: bool = False) -> int:
        """In how many head chunks the ranks run the Ulysses all-to-alls by default, under
        the kernels (`RankProgram.chunked`), chosen with the schedule (`_choose`): the
        count of INNER_CHUNK_CHOICES (or 1) the cost model times soonest done, with every
        rank's programs run together (the slowest rank's alone beyond JOINT_SCHEDULE_RANKS
        outer ranks). More than one only where the inner groups are the nodes (U = GPUs per
        node): the all-to-alls then use the links inside a node and the outer exchanges
        those between nodes, which the model takes as apart. 1 with `recompute_kv` (each
        chunk would fetch the K/V again) or at U = 1. One count for every rank, like
        `schedule`: `outer_rank` is the rank that asks (whose program the choice keeps)."""
        self._check_outer(outer_rank)
        if check_bool(recompute_kv, "recompute_kv") or self.inner_size == 1:
            return 1
        if self._chosen is None:
            self._choose(outer_rank)
        return self._chosen[2]

    def chunks_for_heads(self, num_heads: int, num_kv_heads: int, outer_rank: int = 0,
                         recompute_kv: bool = False) -> int:
        """The head chunks attention of `num_heads` query and `num_kv_heads` KV heads runs
        by default (`sap_attention(inner_chunks="auto")`): the plan's `inner_chunks`, or 1
        where those heads do not split so (`program.head_chunks`)."""
        chunks = self.inner_chunks(outer_rank, recompute_kv)
        return chunks if head_chunks(num_heads, num_kv_heads, self.inner_size, chunks) else 1

    def backward_program(self, outer_rank: int, device: torch.device | str | None = None,
                         schedule: str = "auto", recompute_kv: bool = False) -> RankProgram:
        """The program an outer rank runs backward after `program(outer_rank, device,
        schedule, recompute_kv)` ran forward: the same one, but the pipelined one with
        `recompute_kv` (`RankProgram.backward_events`: its refetches and returns keyed by
        the levels every rank shares, which a gathered backward cannot follow; the
        pipelined calls' gradients need only the final output and lse, which a gathered
        forward writes alike)."""
        return self.program(outer_rank, device, "pipelined" if recompute_kv else schedule, recompute_kv)

    def _default_schedule_times(self, model: CostModel) -> list[RankSchedule]:
        """Every outer rank's times run together, each in the schedule it runs by default,
        keeping the K/V (`timeline.plan_schedule`), under `model`: up to
        JOINT_SCHEDULE_RANKS outer ranks under the plan's own model, the times `schedule`
        chose by, without compiling every rank's program again."""
        if self.outer_size <= JOINT_SCHEDULE_RANKS and model == self.cost_model:
            if self._chosen is None:
                self._choose(None)
            return self._chosen[1]
        return plan_schedule(self, model=model, inner_chunks=self.chunks_for_heads(model.num_heads, model.num_kv_heads))

    # ---- statistics ---------------------------------------------------------------
    def stats(self, cost_model: CostModel | str | None = None, recompute_kv: bool = False) -> dict[str, Any]:
        """Per-CP-rank tokens, pairs, bytes (forward + backward) and modelled times.

        Bytes use the cost model's shape (heads, head dim, element size); pass another
        `cost_model` (or a preset name) to count for a different shape. Inner ranks each move
        their own head slice (1/U of the outer traffic) with the same inner rank of
        the other outer groups, counted intra- or inter-node by those two CP ranks' nodes,
        and add the Ulysses all-to-all (by each inner peer's node). `pairs_per_rank` counts
        the causal (q, k) pairs over all heads, as a share of heads: every inner rank of an
        outer group computes that group's `work` on 1/U of the heads, so its entry is the
        work's pairs / U (possibly fractional). With `recompute_kv`, as the ranks run it: the
        backward's second K/V exchange in the bytes, its schedule in the times, its memory.
        """
        check_bool(recompute_kv, "recompute_kv")
        if cost_model is not None:
            cost_model = _cost_model(cost_model)
        m = cost_model or self.cost_model
        ev = self.evaluation if cost_model is None else evaluate(self.placement, self.inner_size, m)
        U = self.inner_size
        traffic = ev.traffic_tokens
        kv = m.inner_kv_bytes_per_token(U)
        # forward sends KV it owns (and, with recompute_kv, the backward again); backward
        # sends dK/dV of what it received
        fetches = 2 if recompute_kv else 1
        sent = (fetches * traffic.sum(1) + traffic.sum(0)) * kv
        received = (fetches * traffic.sum(0) + traffic.sum(1)) * kv
        # Inner rank i of an outer group exchanges with inner rank i of the others: by the
        # links of those CP ranks (where U neither divides nor is a multiple of a node's GPUs,
        # inner ranks of one outer pair can sit on one node or on two).
        sent_intra = np.empty((self.outer_size, U))
        for i in range(U):
            node = np.array([m.node_of(r * U + i) for r in range(self.outer_size)])
            same = node[:, None] == node[None, :]
            sent_intra[:, i] = (fetches * (traffic * same).sum(1) + (traffic * same).sum(0)) * kv
        sent_inter = sent[:, None] - sent_intra
        expand = lambda a: [float(x) for x in np.repeat(np.asarray(a, dtype=np.float64), U)]  # noqa: E731
        # Each inner rank's all-to-all bytes, an equal share per peer, by the peer's link.
        links = inner_peer_links(m.gpus_per_node, U, self.outer_size)
        a2a_by_link = [[ev.a2a_bytes * peers[i] / max(U - 1, 1) for peers in links] for i in (0, 1)]
        pairs = expand(ev.exact_pairs / U)
        mean = float(np.mean(pairs)) if pairs else 0.0
        memory = [self.memory_bytes(r, m, recompute_kv=recompute_kv) for r in range(self.outer_size)]
        schedule = plan_schedule(self, True, m) if recompute_kv else self._default_schedule_times(m)
        return {
            "method": "sap",
            "candidate": self.placement.strategy,
            "world_size": self.world_size,
            "outer_size": self.outer_size,
            "inner_size": U,
            "total_tokens": self.total_tokens,
            "tokens_per_rank": [self.local_tokens] * self.world_size,
            # Rows the ranks hold beyond the batch's tokens: none, as every piece is of a document.
            "padding_tokens": sum(p.end - p.start for rank in self.placement.ranks for p in rank) - self.total_tokens,
            "pairs_per_rank": pairs,
            "imbalance": (max(pairs) / mean) if mean > 0 else 1.0,
            "sent_tokens_per_outer_rank": [int(x) for x in traffic.sum(1)],
            "recv_tokens_per_outer_rank": [int(x) for x in traffic.sum(0)],
            "sent_bytes_per_rank": [x + ev.a2a_bytes for x in expand(sent)],
            # without recompute_kv, what it sends: its forward K/V in-traffic is its backward dK/dV out-traffic
            "recv_bytes_per_rank": [x + ev.a2a_bytes for x in expand(received)],
            "sent_bytes_intra_per_rank": [float(x) + a2a for x, a2a in zip(sent_intra.ravel(), a2a_by_link[0])],
            "sent_bytes_inter_per_rank": [float(x) + a2a for x, a2a in zip(sent_inter.ravel(), a2a_by_link[1])],
            "peak_extra_bytes_per_rank": expand([max(x["forward"], x["backward"]) for x in memory]),
            # The executor's schedule of the compiled programs, all ranks together
            # (`timeline.joint_schedule`), each rank in the schedule it runs by default
            # (`schedule`); beside it the planner's own estimate, which chose among the
            # candidates (neither bounds the other).
            "modelled_time_s": max(r.total_s for r in schedule),
            "outer_rank_time_s": [r.total_s for r in schedule],
            "schedule_per_outer_rank": [self.schedule(r, recompute_kv) for r in range(self.outer_size)],
            "inner_chunks": self.chunks_for_heads(m.num_heads, m.num_kv_heads, recompute_kv=recompute_kv),
            "planner_estimate_s": ev.makespan_s,
            "ideal_time_s": ev.ideal_s,
            "candidates_modelled_time_s": dict(self.considered),
            "candidates_pruned_floor_s": dict(self.pruned),
            # choose_by="timeline", or a recheck (RECHECK_MARGIN): the timed candidates' modelled_time_s
            "candidates_timeline_s": dict(self.timed),
            # up to STEP_CHOICE_RANKS outer ranks, the near candidates (or a recheck's) weighed on the step-level models
            # (`_StepSeconds.level_seconds`, all-to-alls left out), where more than one was
            "candidates_step_level_s": dict(self.stepped),
        }


    def memory_bytes(self, outer_rank: int, cost_model: CostModel | str | None = None,
                     schedule: str = "auto", recompute_kv: bool = False) -> dict[str, float]:
        """Modelled extra memory of the op on one rank of an outer group (docs/architecture.md),
        in `schedule` ("auto": the rank's `schedule` with this `recompute_kv`), for the shape
        of `cost_model` (a CostModel or a preset name; default the plan's).

        Buffers alive at the peak of the forward and of the backward pass, beyond q, k,
        v and the output, for the cost model's shape; accumulators are fp32. Kernel
        workspaces and one call's gathered rows come on top (bounded by one call).
        `received_kv` is what the op keeps from forward to backward. The exchange buffers
        are counted by going through the pass's events (`RankProgram.forward_events`,
        `backward_events`) as the executor runs them (`exchange_peak`). With `recompute_kv`
        nothing is kept, and the pipelined forward (`FETCH_AHEAD`) and every backward
        (`RECOMPUTE_KV_AHEAD`) hold the rows of a window of steps, each at most one peer's T/R
        rows, however long the documents. With the plan's head chunks (`inner_chunks`), the
        all-to-alls in flight too.
        """
        m = self.cost_model if cost_model is None else _cost_model(cost_model)
        outer_rank = self._check_outer(outer_rank)
        check_bool(recompute_kv, "recompute_kv")
        if schedule == "auto":
            schedule = self.schedule(outer_rank, recompute_kv)
        check_schedule(schedule)
        forward_program = self.program(outer_rank, schedule=schedule)
        backward_program = self.backward_program(outer_rank, schedule=schedule, recompute_kv=recompute_kv)
        gathered = schedule == "gathered"
        U = self.inner_size
        rows = self.capacity
        heads = m.num_heads / U
        kv_heads = max(m.num_kv_heads, U) / U  # replicated when fewer KV heads than U
        b, a = m.bytes_per_element, 4
        kv_row = 2 * kv_heads * m.head_dim
        received = float(self.evaluation.traffic_tokens[:, outer_rank].sum())
        stacked_kv = rows * kv_row * b
        # head-sharded q, k, v and output of the inner all-to-all; their gradients in backward
        ulysses = rows * (2 * heads + 2 * kv_heads) * m.head_dim * b if U > 1 else 0.0
        # all-to-alls in head chunks (`inner_chunks`) in flight under the kernels, each pass:
        # sent and received, every chunk's outputs (waited for after the pass) and one
        # chunk's inputs
        chunks = self.chunks_for_heads(m.num_heads, m.num_kv_heads, outer_rank, recompute_kv)
        in_flight = 2 * rows * heads * m.head_dim * b * (1 + 1 / chunks) if chunks > 1 else 0.0
        kept = 0.0 if recompute_kv else received * kv_row * b
        # gathered: the local and received K/V share one buffer (stacked_kv + the received
        # rows, counted by the events), and the output is written in place: no fp32 output
        # accumulator, only the lse
        accumulators = rows * heads * a if gathered else rows * heads * (m.head_dim + 1) * a
        forward = stacked_kv + accumulators + ulysses + in_flight + exchange_peak(
            forward_program, forward_program.forward_events(), kv_row * b, kv_row * a, False, recompute_kv)
        backward = (
            stacked_kv
            + kept
            # dQ: an fp32 accumulator, or gathered, written once per row in the input dtype
            + rows * heads * m.head_dim * (b if backward_program.schedule == "gathered" else a)
            + rows * kv_row * a  # dK/dV accumulator
            + rows * heads * a  # saved lse
            + 2 * ulysses
            + in_flight
            + exchange_peak(backward_program, backward_program.backward_events(recompute_kv), kv_row * b, kv_row * a,
                            True, recompute_kv)
        )
        return {"forward": forward, "backward": backward, "received_kv": kept}


def inner_chunk_choices(model: CostModel, inner_size: int) -> list[int]:
    """The head chunks `Plan.inner_chunks` weighs: 1, and those of INNER_CHUNK_CHOICES the
    model's heads split into, where the inner groups are the nodes (U = GPUs per node)."""
    if inner_size != model.gpus_per_node:
        return [1]
    return [1] + [c for c in INNER_CHUNK_CHOICES
                  if head_chunks(model.num_heads, model.num_kv_heads, inner_size, c) is not None]


def exchange_peak(program: RankProgram, events: Sequence[Event], row_bytes: float, grad_row_bytes: float,
                  backward: bool, recompute_kv: bool) -> float:
    """The most bytes of exchange buffers alive at once while one rank runs the `events` of
    one pass of `program`, as `sap_attention` allocates and frees them. A fetch holds the
    rows it receives and a copy of the rows it sends (`row_bytes` per row) where they are
    not one run of consecutive rows (one run is sent as a view); the copy goes once the
    exchange is done, the received rows once its step's calls have run, unless the
    forward keeps them (without `recompute_kv`) or gathers them into one buffer (gathered).
    Backward, a pipelined step's calls add into an fp32 gradient of its received rows
    (`grad_row_bytes` per row; gathered: one buffer for every step's, alive throughout);
    its return copies that to send and takes a buffer for the gradients of the rows the
    step sent, coming back; its collect adds those (converted to fp32, where the rows are
    of another dtype) into dK/dV and frees both."""
    steps = program.transfers
    gathered = program.schedule == "gathered"
    converted = grad_row_bytes if grad_row_bytes != row_bytes else 0.0
    copied = [0 if _one_run(s.send_ranges or ()) is not None else s.send_tokens for s in steps]
    alive = sum(s.recv_tokens for s in steps) * grad_row_bytes if backward and gathered else 0.0
    peak = alive
    fetched = set()
    for kind, i in events:
        if kind == LOCAL:
            continue
        recv, send = steps[i].recv_tokens, steps[i].send_tokens
        if kind == FETCH:
            fetched.add(i)
            alive += (recv + copied[i]) * row_bytes
        elif kind == COMPUTE:
            if i in fetched:
                alive -= copied[i] * row_bytes
            if backward and not gathered:
                alive += recv * grad_row_bytes
            peak = max(peak, alive)
            if i in fetched and recompute_kv and not gathered:
                alive -= recv * row_bytes
        elif kind == RETURN:
            alive += (recv + send) * row_bytes
            peak = max(peak, alive)
            if not gathered:
                alive -= recv * grad_row_bytes
        else:  # COLLECT
            peak = max(peak, alive + send * converted)
            alive -= (recv + send) * row_bytes
        peak = max(peak, alive)
    return peak


class PlanCache:
    """LRU of plans keyed by batch signature and layout, with hit/miss counters."""

    def __init__(self, maxsize: int = 64) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, numbers.Integral) or maxsize < 1:
            raise ValueError(f"plan cache size must be an integer >= 1, got {maxsize!r}")
        maxsize = int(maxsize)
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Plan | None:
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                self.misses += 1
                return None
            self.hits += 1
            self._plans.move_to_end(key)
            return plan

    def add(self, plan: Plan) -> None:
        """Keep a plan made elsewhere (another process: a data loader's worker) under the key
        `plan_sequences` looks it up by."""
        self.put(_cache_key(plan.cu_seqlens, plan.outer_size, plan.inner_size, plan.cost_model, plan.slacks,
                            plan.choose_by), plan)

    def put(self, key: tuple, plan: Plan) -> None:
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.maxsize:
                self._plans.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._plans)


DEFAULT_CACHE = PlanCache()


def _cache_key(cu_seqlens: tuple[int, ...], outer_size: int, inner_size: int, model: CostModel,
               slacks: tuple[float, ...], choose_by: str) -> tuple:
    """What a plan is cached under: everything `plan_sequences` plans from."""
    return (cu_seqlens, outer_size, inner_size, model, slacks, choose_by)


def _cache_key_values(cu_seqlens: Sequence[int] | torch.Tensor) -> tuple[int, ...] | None:
    """The cu_seqlens as a tuple of ints when that is cheap and unambiguous, else None."""
    if isinstance(cu_seqlens, torch.Tensor):
        dtype = cu_seqlens.dtype
        if (cu_seqlens.is_nested or cu_seqlens.layout != torch.strided or cu_seqlens.dim() != 1
                or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool or cu_seqlens.is_meta):
            return None  # cu_seqlens_to_list names the problem
        return tuple(cu_seqlens.tolist())
    if isinstance(cu_seqlens, np.ndarray):
        if cu_seqlens.ndim != 1 or cu_seqlens.dtype.kind not in "iu":
            return None
        return tuple(cu_seqlens.tolist())
    if not isinstance(cu_seqlens, (list, tuple, range)):
        return None
    values = tuple(cu_seqlens)
    if all(type(v) is int for v in values):
        return values
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        return tuple(int(v) for v in values)
    return None


def step_seconds(placement: Placement, ev: Evaluation, model: CostModel, inner_size: int) -> _StepSeconds:
    """What the step-level models of `placement` (evaluated as `ev`) read (`_StepSeconds`)."""
    pairs = step_pairs(placement, model.tile)
    forward, backward = (model.pipelined_kernel_factor * model.compute_seconds(1.0, backward=b, head_fraction=1.0 / inner_size)
                         for b in (False, True))
    directed = directed_seconds(ev.traffic_tokens, model, inner_size)
    exchange_s = exchange_seconds(ev.traffic_tokens, model, inner_size, directed)
    total = ev.pipelined_pairs
    return _StepSeconds(directed, exchange_s, (pairs * forward).tolist(), (total * forward - (pairs * forward).sum(1)).tolist(),
                        pairs * backward, (total * backward).tolist(), link_order(exchange_s, placement.num_ranks))


def _outmoved(build: Build, floor_s: float, evaluated: list[tuple[int, Placement, Evaluation]]) -> bool:
    """Whether a finished candidate no slower than `build` can finish (its floor) moves
    fewer KV tokens than `build` already does: then `build` loses to it whenever both
    are near the fastest, is out of reach whenever it is not, and cannot lower the
    fastest time; it can never be chosen."""
    tokens = build.tally.tokens
    return any(ev.makespan_s <= floor_s and ev.traffic_total < tokens for _, _, ev in evaluated)


def _cost_model(cost_model: CostModel | str | None) -> CostModel:
    """The cost model to plan with: the default, a given one, or a preset by name."""
    if cost_model is None:
        return DEFAULT_COST_MODEL
    if isinstance(cost_model, str):
        return CostModel.preset(cost_model)
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel or a preset name, got {type(cost_model).__name__}")
    return cost_model


def plan_sequences(
    cu_seqlens: Sequence[int] | torch.Tensor,
    outer_size: int = 1,
    inner_size: int = 1,
    *,
    cost_model: CostModel | str | None = None,
    cache: PlanCache | None = DEFAULT_CACHE,
    slacks: tuple[float, ...] = DEFAULT_SLACKS,
    choose_by: str = "estimate",
) -> Plan:
    """Plan one packed batch for a CP group of `outer_size * inner_size` ranks.

    Every rank holds exactly T / P tokens. Candidate placements (sequence-aware greedy
    at several load slacks and two split modes, a spread greedy pass, zigzag over all
    ranks, contiguous, every document whole, contiguous slices of the documents in two
    balancing orders, and the greedy passes that fill the last rooms in a chain: below 32
    outer ranks weighing the ranks by their projected loads, from 32 by their loads) are
    evaluated with the cost model; the one
    with the lowest modelled forward+backward layer time wins (within 1%, the one that
    moves fewer bytes; up to STEP_CHOICE_RANKS outer ranks, of those no other is as fast
    with fewer bytes, the one the step-level models of all ranks together end soonest;
    up to RECHECK_RANKS CP ranks, where those models time the choice over RECHECK_MARGIN
    beyond its estimate, the candidate they end soonest, of those up to 10% slower by
    estimate and including those given up for their bytes, is timed against it with every
    rank's program, all ranks together (with the soonest of the others, where that one was
    given up for its bytes), and the sooner wins; beyond, both on rows of a few long
    documents, `step_checks`, the recheck beyond 16 outer ranks by those models alone,
    among the candidates not given up for their bytes).
    The search stops at the first candidate within 1% or 10 us of
    the lower bound (every document computed whole, spread evenly, no communication but
    the Ulysses all-to-alls), which no other candidate could beat by more than that; a
    candidate is given up as soon as the floor of its ranks' pipelines makes it over 1%
    slower than the fastest so far, or when it already moves more KV tokens than a
    finished candidate no slower than its floor (`Plan.pruned`).
    `cost_model` is a `CostModel` or a preset name (default: the `h100` preset); `slacks`
    the load slacks of the greedy passes (non-negative).
    `choose_by="timeline"` chooses by the executor's schedule instead: the candidates are
    built until over 10% slower than the fastest estimate (not 1%, and none given up for its
    bytes); the estimate's choice and the 5 other layouts fastest by estimate within 10% of
    it are compiled and timed, all ranks together (`timeline.plan_schedule`, the time
    `stats()` reports as `modelled_time_s`); the fastest wins (ties: fewer bytes), never
    slower than the estimate's choice by that time. The estimate
    treats a rank's exchanges as equal and independent of its peers, and can favour a
    layout whose exchanges wait on each other; timing the near candidates costs compiling
    every rank's programs each, up to three times where they have at most
    JOINT_SCHEDULE_RANKS outer ranks (`docs/planner.md`, "Choosing by the timeline"), which
    planning in a data loader's workers hides.
    Plans are cached by (cu_seqlens, sizes, cost model, slacks, choose_by): a repeated
    batch shape costs a dictionary lookup. Pass `cache=None` to bypass the cache.
    """
    outer_size, inner_size = positive_int(outer_size, "outer_size"), positive_int(inner_size, "inner_size")
    model = _cost_model(cost_model)
    try:
        if isinstance(slacks, (str, bytes)):
            raise TypeError
        slacks = tuple(slacks)
    except TypeError:
        raise ValueError(f"slacks must be finite non-negative numbers (load over the ideal a pass allows), got {slacks!r}") from None
    if not slacks or any(not isinstance(s, numbers.Real) or isinstance(s, bool) or not 0 <= s < math.inf for s in slacks):
        raise ValueError(f"slacks must be finite non-negative numbers (load over the ideal a pass allows), got {slacks}")
    slacks = tuple(float(s) for s in slacks)
    check_choose_by(choose_by)
    if cache is not None and not isinstance(cache, PlanCache):
        raise TypeError(f"cache must be a PlanCache or None, got {type(cache).__name__}")
    values, cu = _cache_key_values(cu_seqlens), None
    if values is None:  # any other accepted form (0-d tensors, array.array, ...): by its checked values
        cu = cu_seqlens_to_list(cu_seqlens)
        values = tuple(cu)
    key = None
    if cache is not None:
        key = _cache_key(values, outer_size, inner_size, model, slacks, choose_by)
        plan = cache.get(key)
        if plan is not None:
            return plan
    if cu is None:
        cu = cu_seqlens_to_list(cu_seqlens)
    with _gc_paused():
        plan = _fresh_plan(cu, outer_size, inner_size, model, slacks, choose_by)
    if cache is not None:
        cache.put(key, plan)
    return plan


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused (where it runs): planning and compiling a
    program make many short-lived objects (cuts, records, lists per step, per-piece rows),
    which reference counting frees, and each collection their allocations trigger scans the
    young objects, and at times all the process holds (a full collection in a process with
    torch: 50-170 ms), to find nothing. Paused, the count of live allocations falls back as
    they are freed, and most of those collections never happen."""
    if not gc.isenabled():  # e.g. Megatron-LM's --manual-gc
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _fresh_plan(cu: list[int], outer_size: int, inner_size: int, model: CostModel, slacks: tuple[float, ...],
                choose_by: str) -> Plan:
    """`plan_sequences` of a valid `cu_seqlens` list, planned (not looked up)."""
    total = cu[-1]
    world = outer_size * inner_size
    if total == 0:
        raise ValueError("cu_seqlens describes an empty batch (0 tokens)")
    check_divisible(total, world, "total tokens T = cu_seqlens[-1]", f"CP size P = outer_size*inner_size = {outer_size}*{inner_size}")
    capacity = total // outer_size
    doc_starts = cu[:-1]
    lengths = [b - a for a, b in zip(cu, cu[1:])]

    evaluated: list[tuple[int, Placement, Evaluation]] = []  # (candidate index, ...)
    considered: dict[str, float] = {}
    a2a_s = ulysses_cost(model, capacity, inner_size, outer_size)[1]
    # No placement beats every document computed whole, spread evenly, with no
    # communication but the all-to-alls every candidate pays (splitting only adds tile
    # rounding): once a candidate is at that bound (`at_bound`), the rest cannot be
    # meaningfully faster.
    bound = whole_documents_s(lengths, world, model) + a2a_s
    # Greedy passes at nearby slacks often agree: equal records (memoised cuts on the
    # same ranks) are one layout, evaluated once.
    by_layout: dict[tuple, Evaluation] = {}
    pruned: dict[str, float] = {}
    fastest = float("inf")

    def weigh(build: Build) -> bool:
        """Evaluate a finished candidate; True once one is at the bound (`at_bound`)."""
        nonlocal fastest
        placement = build.placement
        ev = by_layout.get(placement.records)
        if ev is None:
            ev = by_layout[placement.records] = evaluate(placement, inner_size, model)
            evaluated.append((build.index, placement, ev))
        considered.update((name, ev.makespan_s) for name in build.names)
        fastest = min(fastest, ev.makespan_s)
        return at_bound(ev.makespan_s, bound)

    builds = candidates(doc_starts, lengths, outer_size, capacity, model, slacks, inner_size)
    # Cheap candidates already at the bound on their starting floor (`Build.eager`) are
    # finished first, the lowest floor first: one that stays there ends the search at once.
    done = False
    for build in sorted(builds, key=lambda b: (b.floor_s, b.index)):
        if build.eager and at_bound(build.floor_s + a2a_s, bound):
            while build.placement is None:
                (build,) = build.step()
            done = weigh(build)
            if done:
                break
    # Candidates are built a document at a time, the one with the lowest floor next
    # (ties: the earlier candidate). A candidate whose floor (its tally's, plus the
    # all-to-alls) is over TIME_TOLERANCE (choosing by the timeline, TIMELINE_BAND) slower
    # than the fastest built so far can be neither chosen nor near the choice: it is given
    # up there. Once the lowest floor is out of reach, so are all the others.
    by_timeline = choose_by == "timeline"
    band = TIMELINE_BAND if by_timeline else TIME_TOLERANCE
    queue = [(b.floor_s, b.index, b) for b in builds if b.placement is None]
    heapq.heapify(queue)
    outmoved: list[Build] = []  # given up by `_outmoved`: out of the choice by estimate, not of the recheck (below)

    def search(limit_s: Callable[[], float], outmove: bool, stop_at_bound: bool) -> None:
        """Build the queued candidates, the lowest floor first, until that floor is over
        `limit_s()` (the rest are pruned there, kept in the queue) or, with
        `stop_at_bound`, one finished candidate is at the bound."""
        while queue:
            floor_s, _, build = queue[0]
            if floor_s + a2a_s > limit_s():
                pruned.update((name, f + a2a_s) for f, _, b in queue for name in b.names)
                return
            if (outmove and build.placement is None and floor_s + a2a_s >= fastest
                    and _outmoved(build, floor_s + a2a_s, evaluated)):
                outmoved.append(heapq.heappop(queue)[2])
                pruned.update((name, floor_s + a2a_s) for name in build.names)
                continue
            if build.placement is None:
                following = build.step()
                if len(following) == 1:
                    heapq.heapreplace(queue, (following[0].floor_s, following[0].index, following[0]))
                    continue
                heapq.heappop(queue)
                for b in following:
                    heapq.heappush(queue, (b.floor_s, b.index, b))
                continue
            heapq.heappop(queue)
            if weigh(build) and stop_at_bound:
                return

    if not done:
        search(lambda: fastest * (1 + band), outmove=not by_timeline, stop_at_bound=True)
    if by_timeline:
        return _timed_choice(cu, outer_size, inner_size, model, slacks, evaluated, fastest, considered, pruned)
    stepped: dict[str, float] = {}
    steps: dict[str, _StepSeconds] = {}

    def steps_of(placement: Placement, ev: Evaluation) -> float:
        if placement.strategy not in stepped:
            steps[placement.strategy] = step_seconds(placement, ev, model, inner_size)
            stepped[placement.strategy] = steps[placement.strategy].level_seconds()
        return stepped[placement.strategy]

    def finished(chosen: Plan) -> Plan:
        """`chosen` with the step-level times of the candidates they chose among, where they did."""
        chosen.stepped = stepped if len(stepped) > 1 else {}
        return chosen

    step_choice, recheck = step_checks(outer_size, world, fastest, sum(1 for n in lengths if n))
    _, placement, ev = _estimate_choice(evaluated, fastest, steps_of if step_choice else None)
    plan = Plan(tuple(cu), outer_size, inner_size, model, placement, ev, considered, pruned, slacks,
                _steps=steps.get(placement.strategy))
    if not recheck:
        return finished(plan)
    # Where the step-level models see the choice's ranks wait for each other well beyond
    # its estimate (RECHECK_MARGIN, and TIME_RESOLUTION_S), the estimate misjudged it: the
    # candidates up to that time (at most TIMELINE_BAND over the fastest estimate) are
    # built, and the one the step-level models end soonest is timed against the choice
    # with every rank's program, all ranks together; the sooner is the plan
    # (docs/planner.md, "Choice"). Up to JOINT_SCHEDULE_RANKS outer ranks that includes
    # the candidates given up for the bytes they move (`_outmoved`); where the models
    # prefer one of those, the soonest of the others is timed too, so that the plan is
    # never slower than the soonest of the others alone would have made it.
    level_s = min(steps_of(placement, ev) + a2a_s, fastest * (1 + TIMELINE_BAND))  # the models leave the all-to-alls out
    plan._steps = steps[placement.strategy]
    if not misjudged(level_s, fastest):
        return finished(plan)
    revived = set()
    if outer_size <= JOINT_SCHEDULE_RANKS:  # beyond, the models' rival is not timed (below)
        for build in outmoved:
            revived.update(build.names)
            heapq.heappush(queue, (build.floor_s, build.index, build))
    search(lambda: level_s, outmove=False, stop_at_bound=False)
    for name in considered:
        pruned.pop(name, None)
    others = [(i, p, e) for i, p, e in evaluated if e.makespan_s <= level_s and p is not placement]
    def by_steps(ipe: tuple[int, Placement, Evaluation]) -> tuple:
        return steps_of(ipe[1], ipe[2]), ipe[2].traffic_total, ipe[2].makespan_s, ipe[0]

    rivals = [min(others, key=by_steps)] if others else []
    if rivals and rivals[0][1].strategy in revived:
        kept = [o for o in others if o[1].strategy not in revived]
        rivals += [min(kept, key=by_steps)] if kept else []
    rivals = [Plan(tuple(cu), outer_size, inner_size, model, other, other_ev, considered, pruned, slacks,
                   _steps=steps[other.strategy])
              for _, other, other_ev in rivals if stepped[other.strategy] < stepped[placement.strategy]]
    if not rivals:
        return finished(plan)
    if outer_size > JOINT_SCHEDULE_RANKS:  # beyond, the plans choose their exchange orders by these models too
        return finished(rivals[0])
    timed = {p.strategy: max(rank.total_s for rank in p._default_schedule_times(model)) for p in (plan, *rivals)}
    chosen = min((plan, *rivals), key=lambda p: timed[p.strategy])  # the first on a tie: the choice, then the models'
    chosen.timed = timed
    chosen._programs.clear()  # beyond JOINT_SCHEDULE_RANKS, every rank's, compiled to time them
    return finished(chosen)


def _estimate_choice(evaluated: list[tuple[int, Placement, Evaluation]], fastest: float,
                     steps_of: Callable[[Placement, Evaluation], float] | None = None) -> tuple[int, Placement, Evaluation]:
    """The choice by estimate: the fastest candidate; among those within TIME_TOLERANCE of
    it, the one that moves the fewest bytes (less contention with other traffic for the
    same modelled time), then the faster, then the earlier candidate. With `steps_of`, of
    those near candidates that no other is at least as fast as and moves fewer bytes than,
    the one the step-level models end sooner (`_StepSeconds.level_seconds`, which sees ranks wait for
    each other) comes first. A candidate another near one outmoves that way is out either
    way (`_outmoved` gives it up unfinished)."""
    near = [(i, p, ev) for i, p, ev in evaluated if ev.makespan_s <= fastest * (1 + TIME_TOLERANCE)]
    if steps_of is not None and len(near) > 1:
        near = [(i, p, ev) for i, p, ev in near
                if not any(o.makespan_s <= ev.makespan_s and o.traffic_total < ev.traffic_total for _, _, o in near)]
        if len(near) > 1:
            return min(near, key=lambda ipe: (steps_of(ipe[1], ipe[2]), ipe[2].traffic_total, ipe[2].makespan_s, ipe[0]))
    return min(near, key=lambda ipe: (ipe[2].traffic_total, ipe[2].makespan_s, ipe[0]))


def _timed_choice(cu: list[int], outer_size: int, inner_size: int, model: CostModel, slacks: tuple[float, ...],
                  evaluated: list[tuple[int, Placement, Evaluation]], fastest: float, considered: dict[str, float],
                  pruned: dict[str, float]) -> Plan:
    """The choice by estimate (`_estimate_choice`) and the fastest by estimate of the other
    evaluated candidates within TIMELINE_BAND of the `fastest` estimate, TIMELINE_CANDIDATES
    in all, timed with their compiled programs (`plan_schedule`); the fastest by that time
    wins (ties: fewer bytes, then the estimate, then the earlier candidate), so it is never
    slower than the choice by estimate. The winner keeps its ranks' schedule times but not
    the programs compiled to time them (a rank needs its own only; a plan cache or a
    pickled plan would hold every rank's)."""
    chosen = _estimate_choice(evaluated, fastest)
    others = sorted((e for e in evaluated if e is not chosen and e[2].makespan_s <= fastest * (1 + TIMELINE_BAND)),
                    key=lambda e: (e[2].makespan_s, e[0]))
    timed: dict[str, float] = {}
    best: tuple[tuple, Plan] | None = None
    for i, placement, ev in [chosen, *others[: TIMELINE_CANDIDATES - 1]]:
        plan = Plan(tuple(cu), outer_size, inner_size, model, placement, ev, considered, pruned, slacks, "timeline", timed)
        time_s = max(rank.total_s for rank in plan._default_schedule_times(model))
        timed[placement.strategy] = time_s
        key = (time_s, ev.traffic_total, ev.makespan_s, i)
        if best is None or key < best[0]:
            best = (key, plan)
    plan = best[1]
    plan._programs.clear()
    return plan
