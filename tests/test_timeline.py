"""The executor's schedule of the compiled programs under the cost model (`planning.timeline`)."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

import megatron_sap as sap
from megatron_sap.planning import CostModel
from megatron_sap.planning.evaluate import step_pairs
from megatron_sap.bench.data import document_lengths
from megatron_sap.bench.packing import pack
from megatron_sap.planning.order import (exchange_order, exchange_seconds, layer_timing, matching_order,
                                         paced_exchange_order)
from megatron_sap.planning.program import compile_all, compile_program
from megatron_sap.planning.timeline import joint_schedule, plan_schedule, rank_schedule


def alone(plan, recompute_kv=False, schedule="auto"):
    """Every outer rank's times run alone (its peers always ready)."""
    return [rank_schedule(plan.program(r, schedule=schedule, recompute_kv=recompute_kv), plan.inner_size,
                          plan.capacity, plan.cost_model, recompute_kv,
                          plan.backward_program(r, schedule=schedule, recompute_kv=recompute_kv))
            for r in range(plan.outer_size)]


def test_two_ranks_by_hand():
    """One document of two tiles over two ranks: rank 0 holds the second tile and receives the
    first. Forward: its local diagonal runs under the transfer, then the full block. Backward:
    the full block first, its gradients go back under the local diagonal. Run together, the
    owner's backward ends when the gradients are back; alone, it would not wait for them."""
    model = CostModel.preset("h100")
    plan = sap.plan_sequences([0, 256], outer_size=2, cost_model=model, cache=None)
    assert plan.pieces(0) == [(0, 128, 256)] and plan.pieces(1) == [(0, 0, 128)]
    c_f = model.compute_seconds(128 * 128)
    c_b = model.compute_seconds(128 * 128, backward=True)
    x = model.transfer_seconds(128 * model.kv_bytes_per_token, "intra")
    holder, owner = plan_schedule(plan)
    assert holder.forward_s == pytest.approx(max(c_f, x) + c_f)
    assert holder.backward_s == pytest.approx(max(2 * c_b, c_b + x))
    assert owner.forward_s == pytest.approx(max(c_f, x))
    assert owner.backward_s == pytest.approx(c_b + x)
    assert plan.stats()["modelled_time_s"] == pytest.approx(max(holder.total_s, owner.total_s))
    assert alone(plan)[1].backward_s == pytest.approx(max(c_b, x))
    assert alone(plan)[0] == holder


def test_one_rank_is_its_compute():
    plan = sap.plan_sequences([0, 300, 1024], outer_size=1, cache=None)
    (only,) = plan_schedule(plan)
    assert only.total_s == pytest.approx(plan.evaluation.makespan_s)


@pytest.mark.parametrize("seed", range(6))
def test_schedule_bounds(seed):
    """Never below the ideal, nor a rank below the kernel time of its exact pairs (the
    planner's tile count can be above the programs': a run of one document's pieces on a
    rank is one kernel segment, `program._document_runs`)."""
    rng = random.Random(seed)
    outer, inner = rng.choice([(2, 1), (4, 1), (4, 2), (8, 1), (2, 4)])
    lengths = [rng.choice([1, 7, 130, 500, 2000, 5000]) for _ in range(rng.randint(1, 12))]
    total = sum(lengths)
    lengths[-1] += -total % (outer * inner)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    plan = sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cache=None)
    stats = plan.stats()
    schedule = plan_schedule(plan)
    assert stats["modelled_time_s"] >= stats["ideal_time_s"] * (1 - 1e-9)
    model = plan.cost_model
    pairs = plan.evaluation.exact_pairs
    for r, rank in enumerate(schedule):
        compute = (1 + model.backward_factor) * model.compute_seconds(float(pairs[r]), head_fraction=1 / inner)
        assert rank.total_s >= compute * (1 - 1e-9)  # tile rounding only adds pairs


def test_refetching_kv_costs_its_transfers_in_backward():
    """With recompute_kv a receiving rank waits for the K/V again before its remote blocks."""
    model = CostModel.preset("h100")
    plan = sap.plan_sequences([0, 256], outer_size=2, cost_model=model, cache=None)
    c_b = model.compute_seconds(128 * 128, backward=True)
    x = model.transfer_seconds(128 * model.kv_bytes_per_token, "intra")
    holder = plan_schedule(plan, recompute_kv=True)[0]
    # refetch (x) under the local diagonal (c_b), then the full block, then its gradients back
    assert holder.backward_s == pytest.approx(max(c_b, x) + c_b + x)


def test_gathered_schedule_by_hand():
    """The same two ranks in the gathered schedule: the holder's one causal segment (its tile
    over both) runs after the transfer, and its gradients go back after it; the owner's local
    call runs under its send."""
    model = CostModel.preset("h100")
    plan = sap.plan_sequences([0, 256], outer_size=2, cost_model=model, cache=None)
    c_f = model.compute_seconds(128 * 128)
    c_b = model.compute_seconds(128 * 128, backward=True)
    x = model.transfer_seconds(128 * model.kv_bytes_per_token, "intra")
    holder, owner = plan_schedule(plan, schedule="gathered")
    assert holder.forward_s == pytest.approx(x + 2 * c_f)
    assert holder.backward_s == pytest.approx(2 * c_b + x)
    assert owner.forward_s == pytest.approx(max(c_f, x))
    assert owner.backward_s == pytest.approx(2 * c_b + x)  # the gradients come back after the holder's call
    assert alone(plan, schedule="gathered")[1].backward_s == pytest.approx(max(c_b, x))
    # with recompute_kv the backward runs the pipelined program: the refetch under the
    # local diagonal, then the full block, then its gradients back
    refetch = plan_schedule(plan, recompute_kv=True, schedule="gathered")[0]
    assert refetch.forward_s == holder.forward_s
    assert refetch.backward_s == pytest.approx(max(c_b, x) + c_b + x)


def test_one_hardware_queue_by_hand():
    """One 24K-token document over three ranks: rank 0 receives keys from both its peers, one
    exchange each, each far shorter than the kernels. Its forward posts the second exchange
    only after the local calls, which run under the first; step 0's calls run under the
    second. Had it posted both first, the local calls, queued behind the second exchange,
    could start only once the first was done (with a queue per stream, at once)."""
    from megatron_sap.planning.program import FETCH, LOCAL
    from megatron_sap.planning.timeline import _run, _step_costs

    model = CostModel.preset("h100")
    n = 8192
    plan = sap.plan_sequences([0, 3 * n], outer_size=3, cost_model=model, cache=None)
    program = plan.program(0, schedule="pipelined")
    assert len(program.transfers) == 2 and all(t.recv_tokens for t in program.transfers)
    sides, (c0, c1), local = _step_costs(program, 1, model)
    x0, x1 = map(max, sides)
    assert max(x0, x1) < min(c0, c1, local) / 5
    holder = alone(plan, schedule="pipelined")[0]
    assert holder.forward_s == pytest.approx(max(x0, local) + max(x1, c0) + c1)
    (up_front,) = _run([program], [program.chunked([(FETCH, 0), (FETCH, 1), (LOCAL, -1)], 1)], False, 1, model,
                       alone=True)
    assert up_front == pytest.approx(x0 + max(x1, local))


def test_backward_ends_hold_kernels_behind_a_waiting_return():
    """Rank 0 meets rank 1, then rank 2. Its return to rank 1 waits until rank 1 has computed
    its step (10 s); its return to rank 2, posted after its step with 2, waits on the same
    stream for that one to be done (11 s), and its local calls (5 s), queued behind it,
    start only then: 16 s, where kernels free of the queue would be done at 12."""
    from megatron_sap.planning.order import backward_ends

    order = {(0, 1): 0, (0, 2): 1}
    exchange_s = {(0, 1): 1.0, (0, 2): 1.0}
    step_s = [[0.0, 1.0, 1.0], [10.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    total_s = [7.0, 10.0, 1.0]  # rank 0: its two steps and 5 s of local calls
    assert max(backward_ends(order, exchange_s, step_s, total_s)) == 16.0


def test_auto_schedule_follows_the_kernel_factor():
    """Every rank runs the schedule the model times faster for the slowest one (here each
    rank's own choice too): with kernels as fast in both, the
    pipelined one (it overlaps more); when its kernels take 4x as long, the gathered one
    wherever anything is received. The modelled time follows the choice."""
    for factor, holder_schedule in ((1.0, "pipelined"), (4.0, "gathered")):
        model = CostModel.preset("h100", pipelined_kernel_factor=factor)
        plan = sap.plan_sequences([0, 256], outer_size=2, cost_model=model, cache=None)
        assert plan.schedule(0) == holder_schedule
        assert plan.program(0).schedule == holder_schedule
        chosen = alone(plan)
        for r in range(2):
            times = {s: alone(plan, schedule=s)[r].total_s for s in ("pipelined", "gathered")}
            assert chosen[r].total_s == pytest.approx(min(times.values()))
        assert plan.stats()["schedule_per_outer_rank"][0] == holder_schedule


def test_auto_schedule_prefers_the_gathered_one_when_nearly_as_fast(monkeypatch):
    """Beyond JOINT_SCHEDULE_RANKS outer ranks: where the gathered schedule alone is at most
    GATHERED_PREFERENCE slower for the slowest rank, every rank runs it (its exchanges wait
    for no kernel, so the ranks do not wait for each other's); without the preference the
    pipelined one."""
    from megatron_sap.planning import plan as plan_module

    monkeypatch.setattr(plan_module, "JOINT_SCHEDULE_RANKS", 2)
    model = CostModel.preset("h100", pipelined_kernel_factor=1.34)
    plans = [sap.plan_sequences([0, 3072], outer_size=3, cost_model=model, cache=None) for _ in range(2)]
    pipelined, gathered = (alone(plans[0], schedule=s)[0].total_s for s in ("pipelined", "gathered"))
    assert pipelined < gathered <= pipelined * (1 + plan_module.GATHERED_PREFERENCE)
    assert [plans[0].schedule(r) for r in range(3)] == ["gathered"] * 3
    monkeypatch.setattr(plan_module, "GATHERED_PREFERENCE", 0.0)
    assert [plans[1].schedule(r) for r in range(3)] == ["pipelined"] * 3


def together_s(plan, order, schedule):
    """The slowest rank's time with every rank's program compiled with the forward exchange
    `order` (the backward's order and the levels as the plan derives them) in `schedule`,
    all run together."""
    order, levels, _, backward_levels = plan._orders_of(dict(order), plan._step_seconds())
    programs = [compile_program(plan.placement, r, None, schedule, order, levels, backward_levels,
                                tile=plan.cost_model.tile) for r in range(plan.outer_size)]
    return max(t.total_s for t in joint_schedule(programs, plan.inner_size, plan.capacity, plan.cost_model))


def order_options(plan):
    """The link, paced and matching orders of `plan`, from the public order functions, and
    the time all ranks together take in each option `auto` weighs."""
    ev, model, U = plan.evaluation, plan.cost_model, plan.inner_size
    link = exchange_order(ev.traffic_tokens, model, U)
    pair_s = model.pipelined_kernel_factor * model.compute_seconds(1.0, head_fraction=1 / U)
    steps = step_pairs(plan.placement, model.tile) * pair_s
    local = ev.pipelined_pairs * pair_s - steps.sum(1)
    exchange_s = exchange_seconds(ev.traffic_tokens, model, U)
    paced = paced_exchange_order(exchange_s, steps.tolist(), local.tolist())
    matching = matching_order(exchange_s, plan.outer_size)
    times = {("link", "gathered"): together_s(plan, link, "gathered"),
             ("link", "pipelined"): together_s(plan, link, "pipelined"),
             ("paced", "pipelined"): together_s(plan, paced, "pipelined"),
             ("matching", "pipelined"): together_s(plan, matching, "pipelined")}
    if plan.outer_size % 2 and plan.outer_size > 1:  # odd: ring shifts too, in either schedule
        for schedule in ("pipelined", "gathered"):
            programs = compile_all(plan.placement, schedule, tile=plan.cost_model.tile, ring=True)
            times["ring", schedule] = max(t.total_s for t in joint_schedule(programs, plan.inner_size, plan.capacity,
                                                                           plan.cost_model))
    return {"link": link, "paced": paced, "matching": matching, "ring": {}}, times


@pytest.mark.parametrize("cu, outer_size, inner_size, chosen, paced_gain", [
    ([0, 416, 694, 1342, 2347, 2604, 3072], 3, 1, ("ring", "pipelined"), None),
    ([0, 3948, 8334, 11608, 12288], 6, 1, ("matching", "pipelined"), None),
    ([0, 198, 297, 2195, 2667, 3072], 6, 1, ("paced", "pipelined"), 0.9),
    ([0, 3072], 3, 1, None, None),
    ([0, 900, 2500, 2600, 8192], 4, 2, None, None),
    ([0, 5000, 5100, 12000, 16384], 16, 1, None, None),
])
def test_auto_runs_the_order_and_schedule_all_ranks_together_finish_soonest(cu, outer_size, inner_size, chosen,
                                                                             paced_gain):
    """Up to JOINT_SCHEDULE_RANKS outer ranks, every rank runs the exchange order and
    schedule in which all ranks together finish soonest, of the link order in either
    schedule and the paced and matching orders in the pipelined one, and at odd outer sizes
    ring shifts in either schedule (the first on a tie); the plan's time is that one's. On the
    first row ring shifts win (5.6% faster than the pairs' best; exchanging pairwise, the
    slowest rank alone would choose the gathered schedule); on the second the matching order wins (3% faster than the paced one, 12%
    faster than the link order's best); on the third the paced order, by 12% over the link order's best."""
    plan = sap.plan_sequences(cu, outer_size=outer_size, inner_size=inner_size, cache=None)
    orders, times = order_options(plan)
    best = min(times, key=times.get)  # the first of equals: dicts keep their order
    assert chosen is None or best == chosen
    assert [plan.schedule(r) for r in range(outer_size)] == [best[1]] * outer_size
    assert dict(plan.exchange_order()) == orders[best[0]]
    assert plan.stats()["modelled_time_s"] == pytest.approx(times[best])
    assert plan.stats()["modelled_time_s"] == pytest.approx(max(r.total_s for r in plan_schedule(plan)))
    if paced_gain is not None:
        link_best = min(times["link", "gathered"], times["link", "pipelined"])
        assert times[best] < paced_gain * link_best


def step_model_seconds(plan, order):
    """`order.layer_timing`'s seconds of `plan` with its exchanges in `order`, from the public pieces."""
    ev, model, U = plan.evaluation, plan.cost_model, plan.inner_size
    rates = [model.pipelined_kernel_factor * model.compute_seconds(1.0, backward=b, head_fraction=1 / U)
             for b in (False, True)]
    steps = [step_pairs(plan.placement, model.tile) * rate for rate in rates]
    totals = [ev.pipelined_pairs * rate for rate in rates]
    return layer_timing(order, exchange_seconds(ev.traffic_tokens, model, U), steps[0].tolist(),
                        (totals[0] - steps[0].sum(1)).tolist(), steps[1].tolist(), totals[1].tolist())[0]


# `pack(document_lengths("stdlib"), 128K, 1, seed)[0]` of Python 3.11's files, by seed: the corpus's
# rows depend on the running Python's files.
STDLIB_ROWS_128K = {
    0: [0, 62, 1545, 2423, 24366, 24431, 24648, 31274, 32487, 32757, 32872, 33636, 62172, 62296, 63120, 65354,
        65598, 73224, 78378, 94537, 95622, 97785, 101102, 101108, 111567, 113081, 131072],
    2: [0, 5127, 9416, 11749, 12479, 12969, 13718, 18401, 18450, 19468, 23692, 23998, 46607, 46703, 50776, 68704,
        72725, 78958, 79914, 80531, 86695, 87166, 90036, 90226, 92709, 116158, 131072],
}


@pytest.mark.parametrize("corpus, factor, seed", [("stdlib", 1.0, 0), ("sharegpt", 1.0, 1), ("stdlib", 1.27, 2)])
def test_beyond_joint_schedule_ranks_the_slowest_rank_chooses_the_schedule_and_the_step_models_the_order(
        monkeypatch, corpus, factor, seed):
    """Beyond JOINT_SCHEDULE_RANKS outer ranks nothing is timed together: the schedule is the
    one the slowest rank alone runs faster in the link order (the gathered one within
    GATHERED_PREFERENCE); pipelined, the exchange order is the link or the paced one,
    whichever the step-level models end sooner (`order.layer_timing`), gathered the link
    order (the paced one is built for the pipelined forward). On these 128K-token rows at
    32 outer ranks, with the presets' kernel factor the paced order is chosen, and all
    ranks together run it at most 0.95x the link order's time; on the third, with the H200
    calibration's (1.27), the gathered schedule in the link order. Beyond MAX_PACED_PAIRS pairs the order
    is the link order."""
    from megatron_sap.planning import plan as plan_module

    model = CostModel.preset("h100", pipelined_kernel_factor=factor)
    cu = STDLIB_ROWS_128K[seed] if corpus == "stdlib" else pack(document_lengths(corpus), 128 * 1024, 1, seed=seed)[0]
    plan = sap.plan_sequences(cu, outer_size=32, cost_model=model, cache=None)
    orders, _ = order_options(plan)
    link, levels, _, backward_levels = plan._orders_of(orders["link"], plan._step_seconds())
    slowest = int(np.argmax(plan.evaluation.rank_time_s))
    alone_s = {s: rank_schedule(compile_program(plan.placement, slowest, None, s, link, levels, backward_levels,
                                                tile=model.tile), 1, plan.capacity, model).total_s
               for s in ("pipelined", "gathered")}
    expected = ("gathered" if alone_s["gathered"] <= alone_s["pipelined"] * (1 + plan_module.GATHERED_PREFERENCE)
                else "pipelined")
    assert [plan.schedule(r) for r in range(32)] == [expected] * 32
    assert expected == ("pipelined" if factor == 1.0 else "gathered")
    if expected == "gathered":
        assert dict(plan.exchange_order()) == orders["link"]
        return
    seconds = {name: step_model_seconds(plan, order) for name, order in orders.items()}
    assert seconds["paced"] < seconds["link"]
    assert dict(plan.exchange_order()) == orders["paced"]
    assert together_s(plan, orders["paced"], "pipelined") <= 0.95 * together_s(plan, orders["link"], "pipelined")
    monkeypatch.setattr(plan_module, "MAX_PACED_PAIRS", len(orders["link"]) - 1)
    assert dict(sap.plan_sequences(cu, outer_size=32, cost_model=model, cache=None).exchange_order()) == orders["link"]


def test_a_row_with_every_pair_of_64_outer_ranks_exchanging_is_paced():
    """A 1M-token ShareGPT row at `1 x 64` whose ranks all exchange with each other (2,016
    pairs, over the 1,024 up to which the paced order was once weighed): the plan runs the
    paced order, which all ranks together run in at most 0.7x the link order's time."""
    model = CostModel.preset("h100")
    cu = pack(document_lengths("sharegpt"), 1 << 20, 1, seed=0)[0]
    plan = sap.plan_sequences(cu, outer_size=64, cost_model=model, cache=None)
    orders, times = order_options(plan)
    assert len(orders["link"]) == 64 * 63 // 2
    assert plan.schedule(0) == "pipelined"
    assert dict(plan.exchange_order()) == orders["paced"]
    assert times["paced", "pipelined"] <= 0.7 * times["link", "pipelined"]


def test_beyond_always_paced_pairs_a_plan_whose_ranks_do_not_wait_keeps_the_link_order(monkeypatch):
    """One 128K-token document zigzagged over 64 outer ranks: every pair exchanges (2,016, over
    ALWAYS_PACED_PAIRS), every rank alike, and the link order's step-level model is within
    RECHECK_MARGIN of the estimate: the paced order, which could only tie, is not built."""
    from megatron_sap.planning import plan as plan_module

    def not_built(*args):
        raise AssertionError("the paced order was built")

    monkeypatch.setattr(plan_module, "paced_exchange_order", not_built)
    model = CostModel.preset("h100")
    plan = sap.plan_sequences([0, 128 * 1024], outer_size=64, cost_model=model, cache=None)
    link = exchange_order(plan.evaluation.traffic_tokens, model, 1)
    assert len(link) == 64 * 63 // 2 > plan_module.ALWAYS_PACED_PAIRS
    assert step_model_seconds(plan, link) <= plan.evaluation.makespan_s * (1 + plan_module.RECHECK_MARGIN)
    assert plan.schedule(0) == "pipelined"
    assert dict(plan.exchange_order()) == link


def test_choosing_the_schedule_together_keeps_only_the_asking_ranks_programs():
    """Timing every rank's programs for `auto` compiles them all in every option; the plan
    keeps the asking rank's in the order and schedule it runs only (pickled from a loader's
    worker, it carries the programs it holds), and the choice, so another rank asking later
    compiles nothing to choose."""
    plan = sap.plan_sequences([0, 700, 1500, 4096], outer_size=4, cache=None)
    program = plan.program(2)
    assert set(plan._programs) == {(2, "cpu", plan.schedule(2))} and program.schedule == plan.schedule(2)
    assert plan._chosen[0] == plan.schedule(2)
    plan.schedule(1)
    assert set(plan._programs) == {(2, "cpu", plan.schedule(2))}


def test_auto_schedule_with_recompute_kv_is_pipelined():
    """Keeping the K/V, each rank runs the schedule the model times faster (here the
    gathered one); with recompute_kv, which trades time for memory, the pipelined one, whose
    forward holds a window of steps, even where the gathered one would be faster."""
    model = CostModel.preset("h100", pipelined_kernel_factor=3.0)
    plan = sap.plan_sequences([0, 3072], outer_size=3, cost_model=model, cache=None)
    for recompute_kv in (False, True):
        times = {s: alone(plan, recompute_kv, schedule=s)[0].total_s for s in ("pipelined", "gathered")}
        assert times["gathered"] < times["pipelined"]
        expected = "pipelined" if recompute_kv else "gathered"
        assert plan.schedule(0, recompute_kv) == expected
        assert plan.program(0, recompute_kv=recompute_kv).schedule == expected
        assert alone(plan, recompute_kv)[0].total_s == pytest.approx(times[expected])


def test_unknown_schedule_is_refused():
    plan = sap.plan_sequences([0, 256], outer_size=2, cache=None)
    with pytest.raises(ValueError, match="unknown SAP schedule 'ring'"):
        plan.program(0, schedule="ring")


@pytest.mark.parametrize("seed", range(8))
def test_run_together_no_rank_is_faster_than_alone(seed):
    """Waiting for peers only delays: every rank's joint time is at least its time alone,
    in every schedule and with or without recompute_kv."""
    rng = random.Random(seed)
    outer, inner = rng.choice([(3, 1), (4, 1), (4, 2), (6, 1), (8, 1)])
    lengths = [rng.choice([1, 60, 130, 500, 1500, 4000]) for _ in range(rng.randint(2, 14))]
    lengths[-1] += -sum(lengths) % (outer * inner)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    plan = sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cache=None)
    for recompute_kv in (False, True):
        for schedule in ("auto", "pipelined", "gathered"):
            joint = plan_schedule(plan, recompute_kv, schedule=schedule)
            for together, by_itself in zip(joint, alone(plan, recompute_kv, schedule)):
                assert together.forward_s >= by_itself.forward_s * (1 - 1e-12)
                assert together.backward_s >= by_itself.backward_s * (1 - 1e-12)


def test_programs_that_would_wait_forever_are_refused():
    """Three ranks that each exchange with both others, each running its exchanges in a
    different rotation: every rank waits for a peer that waits for the third."""
    plan = sap.plan_sequences([0, 3 * 1024], outer_size=3, cache=None)
    programs = compile_all(plan.placement, "pipelined", tile=plan.cost_model.tile)  # pairwise, by round
    assert all(len(p.transfers) == 2 and all(t.send_peer == t.recv_peer for t in p.transfers) for p in programs)
    joint_schedule(programs, 1, plan.capacity, plan.cost_model)  # one order of pairs runs
    cyclic = []
    for r, program in enumerate(programs):  # rank r first meets r + 1
        steps = program.transfers if program.transfers[0].send_peer == (r + 1) % 3 else program.transfers[::-1]
        cyclic.append(dataclasses.replace(program, transfers=tuple(steps)))
    with pytest.raises(RuntimeError, match="wait for each other"):
        joint_schedule(cyclic, 1, plan.capacity, plan.cost_model)
    # Ring shifts: rank 0 taking its second shift first waits for rank 1's (which waits for
    # rank 0's first), where in shift order all run.
    ring = compile_all(plan.placement, "pipelined", tile=plan.cost_model.tile, ring=True)
    joint_schedule(ring, 1, plan.capacity, plan.cost_model)
    ring[0] = dataclasses.replace(ring[0], transfers=ring[0].transfers[::-1])
    with pytest.raises(RuntimeError, match="wait for each other"):
        joint_schedule(ring, 1, plan.capacity, plan.cost_model)


def test_head_chunked_all_to_alls_by_hand():
    """One outer rank of two inner ranks (no exchanges), the all-to-alls in two head chunks.
    Forward: the K/V and the first chunk's queries come first; the second chunk's queries
    come under the first chunk's kernels; the all-to-all that takes the first chunk's output
    is posted after them and the second chunk's kernels start once it has (one hardware
    queue); the second chunk's output goes last. Backward mirrors it, dK/dV going last."""
    from megatron_sap.planning.evaluate import ulysses_cost, ulysses_seconds
    from megatron_sap.planning.timeline import _step_costs

    model = CostModel.preset("h100")
    plan = sap.plan_sequences([0, 4096], outer_size=1, inner_size=2, cost_model=model, cache=None)
    program = plan.program(0)
    _, _, local = _step_costs(program, 2, model)
    q, kv = model.q_bytes_per_token, 2 * model.inner_kv_bytes_per_token(2)
    a2a = lambda per_token: ulysses_seconds(model, plan.capacity, 2, 1, per_token)  # noqa: E731
    half = a2a(q / 2)

    def by_hand(first, kernels, last):
        compute = first + kernels / 2  # chunk 0, under the all-to-all bringing chunk 1
        brought = first + half
        posted = max(brought, compute)  # takes chunk 0's outputs, after its kernels
        compute = max(compute, brought, posted) + kernels / 2
        return max(compute, posted + half) + last

    (chunked,) = joint_schedule([program], 2, plan.capacity, model, inner_chunks=2)
    assert chunked.forward_s == pytest.approx(by_hand(a2a(q / 2 + kv), local, half))
    assert chunked.backward_s == pytest.approx(by_hand(half, model.backward_factor * local, a2a(q / 2 + kv)))
    (whole,) = joint_schedule([program], 2, plan.capacity, model)
    assert whole.total_s == pytest.approx((1 + model.backward_factor) * local + ulysses_cost(model, plan.capacity, 2, 1)[1])
    assert chunked.total_s < whole.total_s  # the kernels are long enough to hide the middle all-to-alls
    with pytest.raises(ValueError, match="only without recompute_kv"):
        joint_schedule([program], 2, plan.capacity, model, recompute_kv=True, inner_chunks=2)


def test_plan_chooses_head_chunks_where_inner_groups_are_nodes():
    """`Plan.inner_chunks`: more than one only where U is the GPUs per node and the heads
    split; the plan's modelled time is that of the count it chose, no slower than one
    chunk's; 1 with recompute_kv."""
    cu = [0, 60000, 65536]
    for gpus_per_node, inner in ((8, 8), (8, 4), (4, 4), (2, 4)):
        model = dataclasses.replace(CostModel.preset("h100"), gpus_per_node=gpus_per_node)
        plan = sap.plan_sequences(cu, outer_size=2, inner_size=inner, cost_model=model, cache=None)
        chosen = plan.inner_chunks()
        assert plan.inner_chunks(recompute_kv=True) == 1
        if gpus_per_node != inner:
            assert chosen == 1
            continue
        assert chosen > 1  # 30K tokens of kernels per rank hide the all-to-alls
        stats = plan.stats()
        assert stats["inner_chunks"] == chosen
        times = {c: max(t.total_s for t in plan_schedule(plan, inner_chunks=c)) for c in (1, 2)}
        assert stats["modelled_time_s"] == pytest.approx(times[chosen]) and times[chosen] == min(times.values())
