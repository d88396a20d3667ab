"""The executor's own schedule, step by step, under the cost model.

The planner scores candidates with `evaluate`, which treats a rank's steps as equal
(its transfers and remote compute divided evenly over its messages) and counts each
rank's tiles as the fewer of its two schedules' calls (`Tally`), one rank at a time. This
module times the compiled programs instead, in the order `sap_attention` runs them:

- forward: the first step's exchange is posted and the local calls run under it; then
  each step posts the next one's exchange and runs its calls once its own K/V are in
  (gathered: every exchange is posted first);
- backward: every step's calls run and its gradients are posted back at once; the
  local calls run last; with `recompute_kv` the K/V are fetched again a window ahead,
  by exchange level, the local calls after the first refetches (with one hardware queue,
  once all but the last of those are done), and each return is
  waited for a window later.

The gathered schedule runs its own calls (each piece once, after the step that brings
its last keys); backward, all its step calls run, then the
gradients go back one step after another, the local calls under the first return (with
`recompute_kv` its backward runs the pipelined program). Each pass is timed from the
events the executor runs (`RankProgram.forward_events`, `backward_events`).

Exchanges of one rank go one after another (one NCCL stream per group); an exchange
takes its larger side (send or receive) over its link plus a latency per message (with
ring shifts, `program.ring_exchanges`, its send and its receive have peers of their own:
each message starts once the rank and that peer have posted the step, and the step is
done with the later of the two), and starts once the kernels queued before it are done
(NCCL's stream waits for them when it is posted). The GPU has one hardware queue, as
Megatron-LM runs with CP before Blackwell (CUDA_DEVICE_MAX_CONNECTIONS=1): a kernel queued after an exchange starts no sooner than
that exchange leaves the rank's queue, once the rank's stream is free and the kernels
queued before it are done (its NCCL kernel then waits for the peer while it runs; with
more queues the kernels can only start sooner). Kernel calls
are tile-rounded per segment, as the kernels run them; the pipelined schedule's take
`pipelined_kernel_factor` times as long.

`rank_schedule` times one rank alone, as if its peers were always ready (what the choice
of schedule compares, on the plan's slowest rank, beyond `plan.JOINT_SCHEDULE_RANKS` outer
ranks). `joint_schedule` times all outer ranks together (what it compares up to those): an
exchange starts only when both its ranks have posted it (a ring shift's message: its
two), the kernels queued before it are done (NCCL's stream waits for them when it is
posted) and their streams are free, so
a rank that is late holds up its partner. The benchmarks report the joint times for SAP.
Neither is bounded by the planner's estimate (`evaluate` also spreads a rank's transfers
over its steps, and charges a rank that only sends its compute alone).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence
from weakref import WeakKeyDictionary

from .cost_model import CostModel
from .evaluate import chunk_all_to_all_seconds, ulysses_cost
from .program import (ALL_HEADS, COMPUTE, FETCH, LOCAL, NO_CHUNK, POST, RETURN, KernelCall, RankProgram, Transfer,
                      Unit)

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


def _exchange_s(program: RankProgram, step: Transfer, inner_size: int, model: CostModel) -> tuple[float, float]:
    """Seconds of one step's message with its send peer and with its receive peer (0 where
    there is none), each over its link with its latency. Backward the gradients go the
    other way, the same tokens with the same peers."""
    kv_bytes = model.inner_kv_bytes_per_token(inner_size)

    def seconds(tokens: int, peer: int | None) -> float:
        if not tokens:
            return 0.0
        return model.transfer_seconds(tokens * kv_bytes, model.link_between(program.rank * inner_size, peer * inner_size))

    return seconds(step.send_tokens, step.send_peer), seconds(step.recv_tokens, step.recv_peer)


def _kernel_s(program: RankProgram, calls: Sequence[KernelCall], inner_size: int, model: CostModel) -> float:
    """Forward seconds of kernel calls of `program` (tile-rounded per segment, the
    pipelined schedule's at `pipelined_kernel_factor`)."""
    factor = model.pipelined_kernel_factor if program.schedule == "pipelined" else 1.0
    return factor * model.compute_seconds(float(sum(_call_pairs(c, model) for c in calls)), head_fraction=1.0 / inner_size)


_STEP_COSTS: WeakKeyDictionary = WeakKeyDictionary()  # program -> {(inner_size, model): `_step_costs`}


def _step_costs(program: RankProgram, inner_size: int,
                model: CostModel) -> tuple[list[tuple[float, float]], list[float], float]:
    """(seconds of each step's messages with its send and its receive peer, forward
    seconds of each step's calls, of the local calls) of `program`, worked out once: a
    program is timed forward and backward, and may be timed with the others, alone, or
    both."""
    per_model = _STEP_COSTS.setdefault(program, {})
    key = (inner_size, model)
    if key not in per_model:
        per_model[key] = ([_exchange_s(program, s, inner_size, model) for s in program.transfers],
                          [_kernel_s(program, s.calls, inner_size, model) for s in program.transfers],
                          _kernel_s(program, program.local_calls, inner_size, model))
    return per_model[key]


def rank_schedule(program: RankProgram, inner_size: int, capacity: int, model: CostModel,
                  recompute_kv: bool = False, backward_program: RankProgram | None = None,
                  inner_chunks: int = 1) -> RankSchedule:
    """The forward and backward seconds of one outer rank's `program` (see module
    docstring), run alone (its peers always ready); backward it runs `backward_program`
    (default: the same; `Plan.backward_program`); `inner_chunks` as in `joint_schedule`."""
    (times,) = joint_schedule([program], inner_size, capacity, model, recompute_kv,
                              None if backward_program is None else [backward_program], alone=True,
                              inner_chunks=inner_chunks)
    return times


def _run(programs: Sequence[RankProgram], units: Sequence[Sequence[Unit]], backward: bool,
         inner_size: int, model: CostModel, alone: bool, inner: _Chunks | None = None) -> list[float]:
    """When each rank is done with its `units` of one pass (`RankProgram.forward_events` or
    `backward_events`, through `RankProgram.chunked`), all run together (`alone`: each as if
    its peers were always ready). A rank's exchanges run one after another on its stream,
    each message once both its ranks have posted the step (a step is done with its later
    message: a ring shift's go to two peers) and the kernels queued before it on either
    rank are done (NCCL waits for the compute stream when an exchange is posted); kernels wait until
    the exchange queued last before them has left their rank's queue (its stream free, the
    kernels before it done: one hardware queue), a step's calls for its K/V where fetched, a
    collect for its returned gradients. With head chunks (`inner`) the passes start once
    the first all-to-all is done; the others run one after another on the inner group's
    stream, as the exchanges do on theirs, a chunk's calls (at its share of the time) wait
    for the one that brings their inputs, and the last follows the pass. Raises if the
    ranks' orders of exchanges disagree (they would wait for each other forever)."""
    R = len(programs)
    factor = model.backward_factor if backward else 1.0
    costs = [_step_costs(p, inner_size, model) for p in programs]
    sides = [messages for messages, _, _ in costs]
    step_s = [[factor * s for s in kernels] for _, kernels, _ in costs]
    local_s = [factor * local for _, _, local in costs]
    posted: list[dict[tuple[str, int], float]] = [{} for _ in range(R)]  # (kind, round) -> when it started
    at = [0] * R
    begin = 0.0 if inner is None else inner.first_s(backward)
    compute, link, gate = [begin] * R, [begin] * R, [begin] * R  # gate: when the exchange posted last started
    inner_free = [begin] * R
    arrived = [{0: begin} for _ in range(R)]  # a chunk's inputs in
    done: list[dict[tuple[str, int], float]] = [{} for _ in range(R)]
    moved = True
    while moved:
        moved = False
        for a in range(R):
            mine = units[a]
            while at[a] < len(mine):
                kind, i, chunk = mine[at[a]]
                share = 1.0 if chunk == ALL_HEADS else 1.0 / inner.chunks
                ready = compute[a] if chunk == ALL_HEADS else max(compute[a], arrived[a][chunk])
                if kind in (FETCH, RETURN):
                    if alone:
                        gate[a] = max(link[a], compute[a], gate[a])
                        end = gate[a] + max(sides[a][i])
                    else:
                        step = programs[a].transfers[i]
                        key = (kind, step.round)
                        if key not in posted[a]:  # posted now; the rank waits here until its peers have too
                            posted[a][key] = gate[a] = max(link[a], compute[a], gate[a])
                        peers = [(peer, seconds) for peer, seconds in zip((step.send_peer, step.recv_peer), sides[a][i])
                                 if peer is not None]
                        if any(key not in posted[peer] for peer, _ in peers):
                            break  # not posted by a peer yet
                        end = max(max(gate[a], posted[peer][key]) + seconds for peer, seconds in peers)
                    done[a][kind, i] = link[a] = end
                elif kind == POST:
                    gate[a] = max(inner_free[a], compute[a], gate[a])
                    inner_free[a] = gate[a] + inner.post_s(i, chunk)
                    if i != NO_CHUNK:
                        arrived[a][i] = inner_free[a]
                elif kind == LOCAL:
                    compute[a] = max(ready, gate[a]) + share * local_s[a]
                elif kind == COMPUTE:
                    compute[a] = max(ready, gate[a], done[a].get((FETCH, i), 0.0)) + share * step_s[a][i]
                else:  # COLLECT
                    compute[a] = max(compute[a], done[a][RETURN, i])
                at[a] += 1
                moved = True
    stuck = [a for a in range(R) if at[a] < len(units[a])]
    if stuck:
        raise RuntimeError(f"the programs of outer ranks {stuck} wait for each other: their exchange orders disagree")
    if inner is None:
        return [max(c, t) for c, t in zip(compute, link)]
    last = inner.last_s(backward)
    return [max(max(c, f) + last, t) for c, f, t in zip(compute, inner_free, link)]


@dataclass(frozen=True)
class _Chunks:
    """The inner all-to-alls of a pass in `chunks` head chunks: their seconds."""

    model: CostModel
    inner_size: int
    outer_size: int
    capacity: int
    chunks: int

    def _seconds(self, query_chunks: int, with_kv: bool) -> float:
        return chunk_all_to_all_seconds(self.model, self.capacity, self.inner_size, self.outer_size, self.chunks,
                                        query_chunks, with_kv)

    def first_s(self, backward: bool) -> float:
        """The first chunk's inputs, forward with the K/V."""
        return self._seconds(1, not backward)

    def last_s(self, backward: bool) -> float:
        """The last chunk's outputs, backward with dK/dV."""
        return self._seconds(1, backward)

    def post_s(self, brings: int, takes: int) -> float:
        return self._seconds((brings != NO_CHUNK) + (takes != NO_CHUNK), False)


def joint_schedule(programs: Sequence[RankProgram], inner_size: int, capacity: int, model: CostModel,
                   recompute_kv: bool = False, backward_programs: Sequence[RankProgram] | None = None,
                   alone: bool = False, inner_chunks: int = 1) -> list[RankSchedule]:
    """The forward and backward seconds of every outer rank's program (`programs[r]` is
    rank r's, each in its own schedule; backward `backward_programs[r]`, default the same),
    all run together: an exchange starts when both its ranks have posted it and both their
    streams are free (see the module docstring); `alone`: each rank as if its peers were
    always ready. `inner_chunks` > 1: the Ulysses all-to-alls in that many head chunks
    under the kernels (`RankProgram.chunked`; not with `recompute_kv`), else before and
    after each pass."""
    backward_programs = programs if backward_programs is None else backward_programs
    C = inner_chunks
    if C > 1 and recompute_kv:
        raise ValueError("the Ulysses all-to-alls run in head chunks only without recompute_kv")
    inner = _Chunks(model, inner_size, len(programs), capacity, C) if C > 1 else None
    forward = _run(programs, [p.chunked(p.forward_events(), C) for p in programs], False, inner_size, model,
                   alone, inner)
    backward = _run(backward_programs, [p.chunked(p.backward_events(recompute_kv), C) for p in backward_programs],
                    True, inner_size, model, alone, inner)
    if inner is not None:
        return [RankSchedule(f, b) for f, b in zip(forward, backward)]
    a2a_s = ulysses_cost(model, capacity, inner_size, len(programs))[1] / 2  # per pass
    return [RankSchedule(f + a2a_s, b + a2a_s) for f, b in zip(forward, backward)]


def plan_schedule(plan: Plan, recompute_kv: bool = False, model: CostModel | None = None,
                  schedule: str = "auto", inner_chunks: int = 1) -> list[RankSchedule]:
    """Every outer rank's times for `plan` run together (`joint_schedule`), in `schedule`
    ("auto": each rank's `plan.schedule`, with `recompute_kv`) and with the all-to-alls
    in `inner_chunks` head chunks, compiling its programs."""
    model = model or plan.cost_model
    programs = [plan.program(r, schedule=schedule, recompute_kv=recompute_kv) for r in range(plan.outer_size)]
    backward = [plan.backward_program(r, schedule=schedule, recompute_kv=recompute_kv) for r in range(plan.outer_size)]
    return joint_schedule(programs, plan.inner_size, plan.capacity, model, recompute_kv, backward,
                          inner_chunks=inner_chunks)
