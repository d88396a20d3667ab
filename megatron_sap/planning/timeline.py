"""The executor's own schedule, step by step, under the cost model.

The planner scores candidates with `evaluate`, which treats a rank's steps as equal
(its transfers and remote compute divided evenly over its messages) and rounds each
piece's earlier keys to tiles as one block. This module times the compiled programs
instead, in the order `sap_attention` runs them:

- forward: every step's exchange is posted, the local calls run, then every step's
  calls once its exchange is done (the exchanges run one after another on the link,
  whatever the kernels are doing);
- backward: every step's calls run and its gradients are posted back at once; the
  local calls run last (with `recompute_kv`, the K/V are fetched again first and the
  local calls run while they arrive).

The gathered schedule runs the same forward with its own calls (each piece once,
after the step that brings its last keys); backward, all its step calls run (after the
refetch, with `recompute_kv`), then the gradients go back one step after another, the
local calls under them.

Exchanges of one rank go one after another (one NCCL stream per group); an exchange
takes its larger side (send or receive) over its link plus a latency per message.
Kernel calls are tile-rounded per segment, as the kernels run them; the pipelined
schedule's take `pipelined_kernel_factor` times as long.

`rank_schedule` times one rank alone, as if its peers were always ready (what a rank's
choice of schedule compares). `joint_schedule` times all outer ranks together: an
exchange starts only when both its ranks have posted it and their streams are free, so
a rank that is late holds up its partner. The benchmarks report the joint times for SAP.
Neither is bounded by the planner's estimate (`evaluate` also spreads a rank's transfers
over its steps, and charges a rank that only sends its compute alone).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from .cost_model import CostModel
from .evaluate import ulysses_cost
from .program import KernelCall, RankProgram, Transfer

if TYPE_CHECKING:  # plan imports this module
    from .plan import Plan


@dataclass(frozen=True)
class RankSchedule:
    """One outer rank's modelled forward and backward seconds (Ulysses all-to-alls included)."""

    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def _call_pairs(call: KernelCall, model: CostModel) -> int:
    """Tile-rounded pairs of one kernel call, segment by segment."""
    return sum(model.block_pairs(q, k, call.causal) for q, k in call.seqlens)


def _exchange_s(program: RankProgram, step: Transfer, inner_size: int, model: CostModel) -> float:
    """Seconds of one exchange: its larger side over its link, a latency per message."""
    kv_bytes = model.inner_kv_bytes_per_token(inner_size)
    sides = []
    for tokens, peer in ((step.send_tokens, step.send_peer), (step.recv_tokens, step.recv_peer)):
        if tokens:
            link = model.link_between(program.rank * inner_size, peer * inner_size)
            sides.append(model.transfer_seconds(tokens * kv_bytes, link))
    return max(sides, default=0.0)


def _kernel_s(program: RankProgram, calls: Sequence[KernelCall], inner_size: int, model: CostModel) -> float:
    """Forward seconds of kernel calls of `program` (tile-rounded per segment, the
    pipelined schedule's at `pipelined_kernel_factor`)."""
    factor = model.pipelined_kernel_factor if program.schedule == "pipelined" else 1.0
    return factor * model.compute_seconds(float(sum(_call_pairs(c, model) for c in calls)), head_fraction=1.0 / inner_size)


def rank_schedule(program: RankProgram, inner_size: int, capacity: int, model: CostModel,
                  recompute_kv: bool = False) -> RankSchedule:
    """The forward and backward seconds of one outer rank's `program` (see module docstring)."""
    U = inner_size

    def compute(calls, backward: bool) -> float:
        return _kernel_s(program, calls, U, model) * (model.backward_factor if backward else 1.0)

    steps = program.transfers
    x = [_exchange_s(program, s, U, model) for s in steps]
    a2a_s = ulysses_cost(model, capacity, U)[1] / 2  # per pass

    # Forward: every exchange posted, one after another on the link; the local calls, then
    # each step's calls once its exchange is done.
    done = 0.0
    t = compute(program.local_calls, False)
    for xi, step in zip(x, steps):
        done += xi
        t = max(t, done) + compute(step.calls, False)
    forward = t + a2a_s

    # Backward: with recompute_kv the K/V are fetched again (posted at once) under the local calls.
    t, link_free = 0.0, 0.0
    arrived = []
    if recompute_kv:
        for xi in x:
            link_free += xi
            arrived.append(link_free)
        t = compute(program.local_calls, True)
    if program.schedule == "gathered":
        # Every step's calls (a piece's keys may come from earlier steps too), then the
        # gradients go back one step after another.
        t = max([t] + arrived[-1:]) + sum(compute(step.calls, True) for step in steps)
        link_free = t + sum(x)
    else:
        for i, step in enumerate(steps):
            if recompute_kv:
                t = max(t, arrived[i])
            t += compute(step.calls, True)
            link_free = max(t, link_free) + x[i]  # the gradients go back to their owner
    if not recompute_kv:
        t += compute(program.local_calls, True)
    backward = max(t, link_free) + a2a_s
    return RankSchedule(forward, backward)


def _peer(step: Transfer) -> int:
    return step.send_peer if step.send_peer is not None else step.recv_peer


def _in_order(programs: Sequence[RankProgram], visit: Callable[[int, int, int, int], None]) -> None:
    """Call `visit(a, i, b, j)` for every exchange, step i of rank a with step j of rank b,
    in an order the ranks can run them in: an exchange is visited once it is the next
    step of both its ranks. Raises if some are never visited (the programs would wait
    for each other forever)."""
    nxt = [0] * len(programs)
    moved = True
    while moved:
        moved = False
        for a, program in enumerate(programs):
            i = nxt[a]
            if i == len(program.transfers):
                continue
            b = _peer(program.transfers[i])
            j = nxt[b]
            if b > a and j < len(programs[b].transfers) and _peer(programs[b].transfers[j]) == a:
                visit(a, i, b, j)
                nxt[a], nxt[b] = i + 1, j + 1
                moved = True
    stuck = [a for a, program in enumerate(programs) if nxt[a] < len(program.transfers)]
    if stuck:
        raise RuntimeError(f"the programs of outer ranks {stuck} wait for each other: their exchange orders disagree")


def joint_schedule(programs: Sequence[RankProgram], inner_size: int, capacity: int, model: CostModel,
                   recompute_kv: bool = False) -> list[RankSchedule]:
    """The forward and backward seconds of every outer rank's program (`programs[r]` is
    rank r's, each in its own schedule), all run together: an exchange starts when both
    its ranks have posted it and both their streams are free (see the module docstring)."""
    U, R = inner_size, len(programs)
    a2a_s = ulysses_cost(model, capacity, U)[1] / 2  # per pass

    x = [[_exchange_s(p, s, U, model) for s in p.transfers] for p in programs]
    forward_calls = [[_kernel_s(p, s.calls, U, model) for s in p.transfers] for p in programs]
    backward_calls = [[model.backward_factor * f for f in steps] for steps in forward_calls]
    local_forward = [_kernel_s(p, p.local_calls, U, model) for p in programs]
    local_backward = [model.backward_factor * f for f in local_forward]

    # Forward: every exchange posted at once; an exchange starts when both ranks' links are
    # done with their earlier ones, and a step's calls run once its exchange is done.
    t = local_forward[:]
    link = [0.0] * R

    def forward(a: int, i: int, b: int, j: int) -> None:
        link[a] = link[b] = done = max(link[a], link[b]) + max(x[a][i], x[b][j])
        for r, k in ((a, i), (b, j)):
            t[r] = max(t[r], done) + forward_calls[r][k]

    _in_order(programs, forward)
    forward_total = [f + a2a_s for f in t]

    # Backward: with recompute_kv the K/V are fetched again first (all posted at once).
    link = [0.0] * R
    arrived: list[list[float]] = [[] for _ in range(R)]

    def refetch(a: int, i: int, b: int, j: int) -> None:
        link[a] = link[b] = max(link[a], link[b]) + max(x[a][i], x[b][j])
        arrived[a].append(link[a])
        arrived[b].append(link[b])

    if recompute_kv:
        _in_order(programs, refetch)
    ready: list[list[float]] = []  # when each step's gradients can go back
    computed = []  # when each rank's kernels are done
    for r, program in enumerate(programs):
        t_r = local_backward[r] if recompute_kv else 0.0
        if program.schedule == "gathered":
            t_r = max([t_r] + arrived[r][-1:]) + sum(backward_calls[r])
            ready.append([t_r] * len(program.transfers))
        else:
            ready.append([])
            for k, seconds in enumerate(backward_calls[r]):
                if recompute_kv:
                    t_r = max(t_r, arrived[r][k])
                t_r += seconds
                ready[r].append(t_r)
        computed.append(t_r if recompute_kv else t_r + local_backward[r])

    def gradients(a: int, i: int, b: int, j: int) -> None:
        link[a] = link[b] = max(ready[a][i], ready[b][j], link[a], link[b]) + max(x[a][i], x[b][j])

    _in_order(programs, gradients)
    return [RankSchedule(forward_total[r], max(computed[r], link[r]) + a2a_s) for r in range(R)]


def plan_schedule(plan: Plan, recompute_kv: bool = False, model: CostModel | None = None,
                  schedule: str = "auto") -> list[RankSchedule]:
    """Every outer rank's times for `plan` run together (`joint_schedule`), in `schedule`
    ("auto": each rank's `plan.schedule`, with `recompute_kv`), compiling its programs."""
    model = model or plan.cost_model
    programs = [plan.program(r, schedule=schedule, recompute_kv=recompute_kv) for r in range(plan.outer_size)]
    return joint_schedule(programs, plan.inner_size, plan.capacity, model, recompute_kv)
