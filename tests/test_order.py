"""The one order of rank pairs in which every outer rank runs its exchanges (`planning.order`)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megatron_sap as sap
from megatron_sap.bench.data import document_lengths
from megatron_sap.bench.packing import pack
from megatron_sap.planning import CostModel, compile_all
from megatron_sap.planning.evaluate import evaluate, ulysses_cost
from megatron_sap.planning.greedy import greedy
from megatron_sap.planning.order import (MAX_ORDERED_PAIRS, backward_ends, backward_order, exchange_order,
                                         matching_order, matching_round, paced_exchange_order, paced_forward,
                                         ring_layer_seconds)
from megatron_sap.planning.plan import RING, rings_weighed, step_seconds
from megatron_sap.planning.program import _Layout, compile_program, exchange_levels, exchange_round
from megatron_sap.planning.timeline import joint_schedule
from test_program import outer_batches


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outer_batches(max_outer=12))
def test_every_exchanging_pair_has_one_place(batch):
    cu, outer = batch
    plan = sap.plan_sequences(cu, outer_size=outer, cache=None)
    layout = _Layout(plan.placement)
    exchanging = {(a, b) for a in range(outer) for b in range(a + 1, outer)
                  if layout.needed(a, b) or layout.needed(b, a)}
    order = plan.exchange_order()
    if plan.ring_exchanges:  # ring shifts instead (odd outer sizes): no order of pairs
        assert outer % 2 and not order
        return
    assert set(order) == exchanging
    assert sorted(order.values()) == list(range(len(exchanging)))


def test_ranks_wait_less_than_in_exchange_rounds():
    """On packed rows of both corpora across nodes, run together, the layer is faster with
    the ranks' exchanges in the planned order than in exchange rounds ((r + p) mod R),
    where early rounds hold up later ones."""
    model = CostModel.preset("h100")
    totals = {"planned": 0.0, "rounds": 0.0}
    for corpus in ("stdlib", "sharegpt"):
        for cu in pack(document_lengths(corpus), 32 * 1024, 2, seed=0):
            for outer, inner in ((8, 4), (16, 1)):
                plan = sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cost_model=model, cache=None)
                for name, seconds in layer_times(plan, model).items():
                    totals[name] += seconds
    assert totals["planned"] < 0.95 * totals["rounds"]


def layer_times(plan: sap.Plan, model: CostModel) -> dict[str, float]:
    """The layer's time with all ranks run together (pipelined), in the plan's exchange
    order and in exchange rounds."""
    times = {}
    for name, order in (("planned", plan.exchange_order()), ("rounds", None)):
        programs = compile_all(plan.placement, "pipelined", order, tile=model.tile)
        times[name] = max(r.total_s for r in joint_schedule(programs, plan.inner_size, plan.capacity, model))
    return times


def test_thousands_of_pairs_are_ordered_too():
    """At 128 outer ranks (P = 1,024 at 8 inner ranks) the greedy without fill lays a
    packed 1M-token ShareGPT row out with about 4,400 exchanging pairs (a plan with its fill
    passes has far fewer). In exchange rounds, long exchanges in early rounds hold up the
    later ones along chains of ranks: run together, the layer takes about 2.4 times the
    planned order's time. (ShareGPT's rows are the same under every Python; stdlib's are
    that Python's own files.)"""
    model = CostModel.preset("h100")
    cu = pack(document_lengths("sharegpt"), 1 << 20, 1, seed=1)[0]
    outer, inner = 128, 8
    placement = greedy(cu[:-1], np.diff(cu).tolist(), outer, cu[-1] // outer, model, 0.25, inner, split="zigzag")
    order = exchange_order(evaluate(placement, inner, model).traffic_tokens, model, inner)
    assert 4096 < len(order) <= MAX_ORDERED_PAIRS  # over the limit this row once fell back at
    times = {name: max(r.total_s for r in joint_schedule(compile_all(placement, "pipelined", o, tile=model.tile), inner,
                                                         placement.capacity, model))
             for name, o in (("planned", order), ("rounds", None))}
    assert times["planned"] < 0.6 * times["rounds"]


def by_rank(order: dict[tuple[int, int], int], R: int) -> list[list[int]]:
    """Each rank's peers in the order it meets them."""
    return [[b if a == r else a for (a, b) in sorted(order, key=order.get) if r in (a, b)] for r in range(R)]


def test_longest_exchanges_first_while_links_are_free():
    """Four ranks: two long exchanges (0-1, 2-3) and two short ones (0-2, 1-3). Every link
    is free at the start, so each rank first takes its longest exchange; the short ones
    follow once both links are free again."""
    model = CostModel.preset("h100")
    traffic = np.zeros((4, 4), dtype=np.int64)
    traffic[0, 1] = traffic[2, 3] = 10_000
    traffic[0, 2] = traffic[3, 1] = 100
    order = exchange_order(traffic, model, 1)
    assert sorted(order, key=order.get) == [(0, 1), (2, 3), (0, 2), (1, 3)]


def test_a_free_peer_goes_before_a_longer_busy_one():
    """Rank 0 takes its longest exchange (with 3) first; rank 1's longest peer is then
    busy, so it takes the free one (2) instead of waiting, and meets 0 afterwards."""
    model = CostModel.preset("h100")
    traffic = np.zeros((4, 4), dtype=np.int64)
    traffic[0, 3] = 100_000
    traffic[1, 0] = 50_000
    traffic[1, 2] = 10_000
    peers = by_rank(exchange_order(traffic, model, 1), 4)
    assert peers[0] == [3, 1] and peers[1] == [2, 0]


def test_many_pairs_exchange_in_rounds():
    """Beyond MAX_ORDERED_PAIRS pairs the order is by exchange round: every rank meets its
    peers in increasing rounds, and each round is a matching."""
    R = 130
    assert R * (R - 1) // 2 > MAX_ORDERED_PAIRS
    traffic = np.ones((R, R), dtype=np.int64) - np.eye(R, dtype=np.int64)
    order = exchange_order(traffic, CostModel.preset("h100"), 1)
    assert sorted(order.values()) == list(range(R * (R - 1) // 2))
    for r, peers in enumerate(by_rank(order, R)):
        rounds = [exchange_round(r, p, R) for p in peers]
        assert rounds == sorted(rounds) and len(set(rounds)) == len(rounds)


@pytest.mark.parametrize("R", [2, 3, 4, 5, 7, 8, 16, 31, 64])
def test_matching_rounds_are_perfect_matchings_meeting_every_pair_once(R):
    """Round-robin rounds: every pair in one round, no rank twice in a round; R - 1 rounds
    where R is even (every rank busy in each), R where it is odd (one rank idle in each)."""
    rounds: dict[int, list[tuple[int, int]]] = {}
    for a in range(R):
        for b in range(a + 1, R):
            rounds.setdefault(matching_round(a, b, R), []).append((a, b))
    assert sorted(rounds) == list(range(R - 1 if R % 2 == 0 else R))
    for pairs in rounds.values():
        ranks = [r for pair in pairs for r in pair]
        assert len(ranks) == len(set(ranks)) == (R if R % 2 == 0 else R - 1)


def test_the_ring_layout_runs_as_fast_as_the_rings_model_in_matching_rounds():
    """Three documents over 8 ranks, the plan the zigzag layout (a KV ring's, every pair
    exchanging alike): in the link order some ranks meet a peer still busy with another,
    0.7% over the p2p ring's model; in matching rounds every rank meets one peer a round,
    as the ring's steps, and the layer takes the ring's time (the paced order, built from
    the same steps, ties; the plan runs the first of the two)."""
    from megatron_sap import baselines

    cu, model = [0, 32687, 56784, 65536], CostModel.preset("h100")
    plan = sap.plan_sequences(cu, outer_size=8, cost_model=model, cache=None)
    assert plan.strategy == "zigzag"
    steps = plan._step_seconds()
    ring = baselines.get("p2p").model_stats(cu, 8, model)["modelled_time_s"]
    assert steps.seconds("matching") == pytest.approx(ring, rel=1e-9)
    assert plan.stats()["modelled_time_s"] <= ring * (1 + 1e-9)
    assert dict(plan.exchange_order()) in (steps.paced, steps.matching)
    assert steps.seconds("link") > 1.005 * ring


def test_beyond_the_joint_schedule_a_plan_whose_every_pair_exchanges_weighs_the_matching_order():
    """Four documents over 32 ranks (one of 180K tokens in a 256K row): every pair of ranks
    exchanges, as on a KV ring. Beyond JOINT_SCHEDULE_RANKS the plan's order was the better
    of the link and paced orders on the step-level models, in which ranks met peers still
    busy with others: 1.02x the p2p ring's model. The matching order is weighed there too
    where every pair exchanges, and the plan runs under the ring's model."""
    from megatron_sap import baselines
    from megatron_sap.planning.plan import JOINT_SCHEDULE_RANKS

    cu, model = [0, 179660, 206120, 234539, 262144], CostModel.preset("h100")
    plan = sap.plan_sequences(cu, outer_size=32, cost_model=model, cache=None)
    assert plan.outer_size > JOINT_SCHEDULE_RANKS
    steps = plan._step_seconds()
    assert steps.every_pair_exchanges
    matching = matching_order(steps.exchange_s, 32)
    assert dict(plan.exchange_order()) == matching
    link = exchange_order(plan.evaluation.traffic_tokens, model, 1)
    assert steps.layer(matching)[0] < min(steps.layer(link)[0], steps.layer(steps.paced)[0])
    ring = baselines.get("p2p").model_stats(cu, 32, model)["modelled_time_s"]
    assert plan.stats()["modelled_time_s"] <= ring


def test_the_plans_order_is_read_only():
    """Plans are shared through the cache: their exchange order cannot be changed in place."""
    plan = sap.plan_sequences([0, 4 * 1024], outer_size=4, cache=None)
    order = plan.exchange_order()
    assert plan.exchange_order() is order and len(order) == 6
    with pytest.raises(TypeError):
        order[0, 1] = 5


def test_paced_order_lets_ready_ranks_meet_while_a_busy_one_computes():
    """Three ranks, every exchange 1 s; rank 0 has 10 s of local calls, the others none.
    (0, 1) starts first (all ready; the lower ranks). Rank 0's local calls then run until
    10 s, so its next exchange cannot start before; ranks 1 and 2 meet at 1 s instead, and
    (0, 2) goes last. The link order, blind to the kernels, puts (0, 2) second, where rank 2
    would wait for rank 0's local calls."""
    exchange_s = {(0, 1): 1.0, (0, 2): 1.0, (1, 2): 1.0}
    step_s = [[0.0] * 3 for _ in range(3)]
    assert paced_exchange_order(exchange_s, step_s, [10.0, 0.0, 0.0]) == {(0, 1): 0, (1, 2): 1, (0, 2): 2}
    traffic = np.ones((3, 3), dtype=np.int64) - np.eye(3, dtype=np.int64)
    assert exchange_order(traffic, CostModel.preset("h100"), 1) == {(0, 1): 0, (0, 2): 1, (1, 2): 2}


def test_paced_order_waits_for_the_step_in_flight():
    """Four ranks, every exchange 1 s; rank 0's step with 1 takes 4 s, rank 1's with 0 1 s,
    nothing else. (0, 1) and (2, 3) go at 0 s, then (0, 2) and (1, 3) at 1 s. Rank 0's step
    with 1 runs once (0, 2) has started, until 5 s, and its next exchange waits for it;
    rank 1's ends at 2 s: (1, 2) goes at 2 s and (0, 3) last, at 5 s."""
    exchange_s = {(0, 1): 1.0, (0, 2): 1.0, (0, 3): 1.0, (1, 2): 1.0, (1, 3): 1.0, (2, 3): 1.0}
    step_s = [[0.0, 4.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4]
    order = paced_exchange_order(exchange_s, step_s, [0.0] * 4)
    assert sorted(order, key=order.get) == [(0, 1), (2, 3), (0, 2), (1, 3), (1, 2), (0, 3)]


def _soonest_pair_by_scanning(exchange_s, step_s, local_s):
    """The paced order by its definition, every remaining pair weighed at every take: the
    one that can start soonest (the later of its ranks' free times), then the longer
    exchange, then the lower ranks; a take moves its ranks as `paced_forward` does."""
    R = len(local_s)
    link, computed, free, previous = [0.0] * R, [0.0] * R, [0.0] * R, [None] * R
    left, order = set(exchange_s), {}
    while left:
        a, b = min(left, key=lambda p: (max(free[p[0]], free[p[1]]), -exchange_s[p], p))
        start = max(free[a], free[b])
        left.remove((a, b))
        order[a, b] = len(order)
        for r, peer in ((a, b), (b, a)):
            computed[r] = free[r] + (local_s[r] if previous[r] is None else step_s[r][previous[r]])
            previous[r] = peer
        link[a] = link[b] = start + exchange_s[a, b]
        free[a], free[b] = max(link[a], computed[a]), max(link[b], computed[b])
    return order


def test_paced_order_takes_the_soonest_pair_every_time():
    """Random pair sets (sparse and complete, up to 14 ranks), exchange and kernel seconds
    with many ties (zeros, equal values): the paced order is the definition's, pair by pair,
    and its rank ends follow from it (`paced_forward` given that order)."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        R = int(rng.integers(1, 15))
        density = rng.choice([0.2, 0.6, 1.0])
        values = lambda *shape: rng.choice([0.0, 0.5, 1.0, 2.0, float(rng.random())], size=shape)  # noqa: E731
        exchange_s = {(a, b): float(values()) for a in range(R) for b in range(a + 1, R) if rng.random() < density}
        step_s, local_s = values(R, R).tolist(), values(R).tolist()
        order, ends = paced_forward(exchange_s, step_s, local_s)
        expected = _soonest_pair_by_scanning(exchange_s, step_s, local_s)
        assert list(order.items()) == list(expected.items())
        assert ends == paced_forward(exchange_s, step_s, local_s, expected)[1]


@pytest.mark.parametrize("corpus", ["stdlib", "sharegpt"])
def test_paced_forward_is_the_timelines_pipelined_forward(corpus):
    """Fed the compiled programs' own costs, the paced order's model of the pipelined forward
    ends each rank when the timeline (`joint_schedule`'s forward) does, in the link order
    and in the paced one: the order is built on the model the choice is timed with (most
    plans here have a paced order other than the link order)."""
    from megatron_sap.planning import timeline

    model = CostModel.preset("h100")
    differ = 0
    for cu in pack(document_lengths(corpus), 32 * 1024, 2, seed=3):
        for outer, inner in ((8, 1), (4, 2), (16, 1)):
            plan = sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cost_model=model, cache=None)
            link = exchange_order(plan.evaluation.traffic_tokens, model, inner)
            programs = [compile_program(plan.placement, r, None, "pipelined", link, exchange_levels(link),
                                        tile=model.tile) for r in range(outer)]
            exchange_s, step_s, local_s = {}, [[0.0] * outer for _ in range(outer)], []
            for r, program in enumerate(programs):
                exchanges, kernels, local = timeline._step_costs(program, inner, model)
                local_s.append(local)
                for step, x, k in zip(program.transfers, exchanges, kernels):
                    peer = step.send_peer if step.send_peer is not None else step.recv_peer
                    step_s[r][peer] = k
                    pair = (min(r, peer), max(r, peer))
                    exchange_s[pair] = max(exchange_s.get(pair, 0.0), *x)
            paced = paced_exchange_order(exchange_s, step_s, local_s)
            differ += paced != link
            for order in (link, paced):
                programs = [compile_program(plan.placement, r, None, "pipelined", order, exchange_levels(order),
                                            tile=model.tile) for r in range(outer)]
                ends = timeline._run(programs, [p.chunked(p.forward_events(), 1) for p in programs], False, inner,
                                     model, alone=False)
                assert paced_forward(exchange_s, step_s, local_s, order)[1] == pytest.approx(ends, rel=1e-12)
    assert differ >= 4  # of the 6 plans


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outer_batches(max_outer=9, max_tokens=4096), st.sampled_from([1, 2]), st.sampled_from([1.0, 1.27]))
def test_the_step_level_models_time_the_compiled_pipelined_programs(batch, inner, pipelined_factor):
    """The step-level models (`Plan._step_seconds`) read each step's kernels tile-rounded as
    the pipelined programs run them, and every rank's total from the pipelined calls: in
    each exchange order the plan weighs (and as ring shifts, at odd outer sizes) their
    layer is the slowest rank's forward and backward of the compiled pipelined programs
    run together (`joint_schedule`, the all-to-alls left out), the
    backward in the order `backward_order` takes; with pipelined kernels slower than the
    gathered ones (`pipelined_kernel_factor`, as calibrated) too."""
    cu, outer = batch
    model = replace(CostModel.preset("h100"), pipelined_kernel_factor=pipelined_factor)
    cu = [c * inner for c in cu]
    plan = sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cost_model=model, cache=None)
    steps = step_seconds(plan.placement, plan.evaluation, model, inner)
    options = {name: plan._orders_of(order, steps) for name, order in steps.orders().items()}
    if rings_weighed(outer):
        options[RING] = None
    a2a_s = ulysses_cost(model, plan.capacity, inner, outer)[1]
    for name, orders in options.items():
        if orders is None:
            programs = compile_all(plan.placement, "pipelined", tile=model.tile, ring=True)
        else:
            order, levels, _, backward_levels = orders
            programs = [compile_program(plan.placement, r, None, "pipelined", order, levels, backward_levels,
                                        tile=model.tile) for r in range(outer)]
        times = joint_schedule(programs, inner, plan.capacity, model)
        together = max(t.total_s for t in times) - a2a_s
        assert steps.seconds(name) == pytest.approx(together, rel=1e-9, abs=1e-15), name


def test_ring_shifts_step_by_step():
    """Three ranks, in shift 1 rank 0 sending 1 a 2 s message and 1 sending 2 a 1 s one
    (shift 2 empty). Forward, every rank posts the shift at 0 and runs its local calls
    (1 s); rank 1's message from 0 is in at 2, its step's calls (3 s) end at 5; rank 2's is
    in at 1, its calls (4 s) end at 5. Backward (each step's calls twice as long), rank 1
    computes 6 s and returns 0's gradients (2 s) by 8; rank 2 computes 8 s, its return to 1
    (1 s) ends at 9, its local calls (2 s) at 10: 5 + 10."""
    directed = [[0.0, 2.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    step_s = [[0.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 4.0, 0.0]]
    local_s = [1.0, 1.0, 1.0]
    backward_step_s = [[2 * s for s in row] for row in step_s]
    backward_total_s = [2.0, 8.0, 10.0]
    assert ring_layer_seconds(directed, step_s, local_s, backward_step_s, backward_total_s) == 15.0


def test_backward_ends_step_through_the_order():
    """Three ranks, pairs (0, 1) then (1, 2). Rank 0 computes its step for 1 in 3 s and 1
    its step for 0 in 1 s: their return starts at 3 and ends at 4. Rank 2 computes its step
    for 1 in 5 s: that return starts at 5 and ends at 7, after every rank's kernels. Run
    the other way round, (0, 1) waits for the (1, 2) return: 8 s, so the order stays."""
    order = {(0, 1): 0, (1, 2): 1}
    exchange_s = {(0, 1): 1.0, (1, 2): 2.0}
    step_s = [[0.0, 3.0, 0.0], [1.0, 0.0, 1.0], [0.0, 5.0, 0.0]]
    total_s = [4.0, 3.0, 6.0]
    reverse = {(1, 2): 0, (0, 1): 1}
    assert max(backward_ends(order, exchange_s, step_s, total_s)) == 7.0
    assert max(backward_ends(reverse, exchange_s, step_s, total_s)) == 8.0
    assert backward_order(order, exchange_s, np.array(step_s), total_s)[1] == order


def test_backward_runs_the_reverse_where_heavy_first_steps_hold_up_the_others():
    """Rank 1's first step (with 0) takes 4 s to compute, so the (1, 2) exchange after it
    waits until 6 s although rank 2 is ready at once: 7 s. Reversed, (1, 2) goes first and
    is done under rank 0's kernels: 6 s."""
    order = {(0, 1): 0, (1, 2): 1}
    exchange_s = {(0, 1): 1.0, (1, 2): 1.0}
    step_s = np.array([[0.0, 5.0, 0.0], [4.0, 0.0, 0.1], [0.0, 0.1, 0.0]])
    total_s = [5.0, 4.1, 0.1]
    assert max(backward_ends(order, exchange_s, step_s.tolist(), total_s)) == 7.0
    assert max(backward_ends({(1, 2): 0, (0, 1): 1}, exchange_s, step_s.tolist(), total_s)) == 6.0
    assert backward_order(order, exchange_s, step_s, total_s)[1] == {(1, 2): 0, (0, 1): 1}


def test_the_plans_backward_order_is_the_forward_one_or_its_reverse():
    """On packed rows of both corpora, each plan's backward exchange order holds the same
    pairs as its forward one, in that order or reversed, whichever ends the slowest rank's
    layer sooner on the step-level models (its forward, `paced_forward`, and backward,
    `backward_ends`); both occur."""
    model = CostModel.preset("h100")
    chosen = {"forward": 0, "reverse": 0}
    for corpus in ("stdlib", "sharegpt"):
        for cu in pack(document_lengths(corpus), 32 * 1024, 3, seed=4):
            for outer, inner in ((16, 1), (32, 1), (8, 4)):
                plan = sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cost_model=model, cache=None)
                forward, backward = dict(plan.exchange_order()), dict(plan.backward_exchange_order())
                last = len(forward) - 1
                reverse = {pair: last - i for pair, i in forward.items()}
                assert backward in (forward, reverse)
                kind = "forward" if backward == forward else "reverse"
                chosen[kind] += 1
                if forward != reverse:  # as the plan weighs them
                    steps = step_seconds(plan.placement, plan.evaluation, model, inner)
                    ends = paced_forward(steps.exchange_s, steps.forward, steps.local, forward)[1]
                    times = {name: max(f + b for f, b in zip(ends, backward_ends(o, steps.exchange_s, steps.backward.tolist(),
                                                                                 steps.backward_total)))
                             for name, o in (("forward", forward), ("reverse", reverse))}
                    assert times[kind] == min(times.values()) and (kind == "reverse") == (times["reverse"] < times["forward"])
    assert chosen["forward"] and chosen["reverse"], chosen


def test_the_backward_order_shortens_the_ranks_joint_layer():
    """Run together (`joint_schedule`), the ranks' layers on packed rows at 32 outer ranks
    end sooner in all in the plans' backward order than with the backward in their forward
    order (the programs compiled so), and none later: the step-level models that choose
    the backward's order time the pipelined programs as they run (the slowest rank's
    forward and backward together). Two stdlib rows (of Python 3.11's files: the corpus's
    rows depend on the running Python's) and two ShareGPT rows."""
    model = CostModel.preset("h100")
    stdlib_rows = ([0, 157, 900, 4502, 18051, 23143, 37558, 47930, 51363, 65536],  # pack(stdlib, 64K, 2, seed=6)
                   [0, 6627, 6845, 7073, 7521, 11881, 13747, 13790, 18607, 29254, 30969, 33379, 38274, 39899, 44967, 65536])
    totals = {"planned": 0.0, "forward": 0.0}
    for cu in [*stdlib_rows, *pack(document_lengths("sharegpt"), 64 * 1024, 2, seed=6)]:
        plan = sap.plan_sequences(cu, outer_size=32, cost_model=model, cache=None)
        planned = [plan.program(r, schedule="pipelined") for r in range(32)]
        forward = compile_all(plan.placement, "pipelined", plan.exchange_order(), tile=model.tile)
        times = {name: max(r.total_s for r in joint_schedule(programs, 1, plan.capacity, model))
                 for name, programs in (("planned", planned), ("forward", forward))}
        assert times["planned"] <= times["forward"] * (1 + 1e-9), (cu, times)
        for name, seconds in times.items():
            totals[name] += seconds
    assert totals["planned"] < 0.95 * totals["forward"], totals
