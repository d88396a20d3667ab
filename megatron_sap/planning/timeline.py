"""The executor's own schedule, step by step, under the cost model.

The planner scores candidates with `evaluate`, which treats a rank's steps as equal
(its transfers and remote compute divided evenly over its messages) and rounds each
piece's earlier keys to tiles as one block. This module times the compiled programs
instead, in the order `sap_attention` runs them:

- forward: step 0's exchange is posted, the local calls run, then for every step the
  next exchange is posted, the current one waited for and its calls run;
- backward: every step's calls run and its gradients are posted back at once; the
  local calls run last (with `recompute_kv`, the K/V are fetched again first and the
  local calls run while they arrive).

The gathered schedule runs the same forward loop with its own calls (each piece once,
after the step that brings its last keys); backward, all its step calls run (after the
refetch, with `recompute_kv`), then the gradients go back one step after another, the
local calls under them.

Exchanges of one rank go one after another (one NCCL stream per group); an exchange
takes its larger side (send or receive) over its link plus a latency per message.
Kernel calls are tile-rounded per segment, as the kernels run them; the pipelined
schedule's take `pipelined_kernel_factor` times as long. Waits for peers
that are late are not modelled. Neither estimate bounds the other (`evaluate` also
spreads a rank's transfers over its steps, and charges a rank that only sends its
compute alone), but this one follows the executor; the benchmarks report it for SAP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .cost_model import CostModel
from .evaluate import ulysses_cost
from .program import KernelCall, RankProgram

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


def rank_schedule(program: RankProgram, inner_size: int, capacity: int, model: CostModel,
                  recompute_kv: bool = False) -> RankSchedule:
    """The forward and backward seconds of one outer rank's `program` (see module docstring)."""
    U = inner_size
    fraction = 1.0 / U

    factor = model.pipelined_kernel_factor if program.schedule == "pipelined" else 1.0

    def compute(calls, backward: bool) -> float:
        return factor * model.compute_seconds(float(sum(_call_pairs(c, model) for c in calls)), backward=backward,
                                              head_fraction=fraction)

    kv_bytes = model.inner_kv_bytes_per_token(U)

    def exchange(step) -> float:
        sides = []
        if step.send_tokens:
            sides.append(model.transfer_seconds(step.send_tokens * kv_bytes,
                                                model.link_between(program.rank * U, step.send_peer * U)))
        if step.recv_tokens:
            sides.append(model.transfer_seconds(step.recv_tokens * kv_bytes,
                                                model.link_between(program.rank * U, step.recv_peer * U)))
        return max(sides, default=0.0)

    steps = program.transfers
    x = [exchange(s) for s in steps]
    a2a_s = ulysses_cost(model, capacity, U)[1] / 2  # per pass

    # Forward: post 0; local calls; per step: post the next (it starts when the previous
    # exchange is done), wait for this one, run its calls.
    done = x[:1]  # when each step's exchange completes
    t = compute(program.local_calls, False)
    for i, step in enumerate(steps):
        if i + 1 < len(steps):
            done.append(max(t, done[i]) + x[i + 1])
        t = max(t, done[i]) + compute(step.calls, False)
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


def plan_schedule(plan: Plan, recompute_kv: bool = False, model: CostModel | None = None,
                  schedule: str = "auto") -> list[RankSchedule]:
    """Every outer rank's schedule for `plan` in `schedule` ("auto": each
    rank's `plan.schedule`, with `recompute_kv`), compiling its programs."""
    model = model or plan.cost_model
    return [rank_schedule(plan.program(r, schedule=schedule, recompute_kv=recompute_kv), plan.inner_size, plan.capacity, model, recompute_kv)
            for r in range(plan.outer_size)]
