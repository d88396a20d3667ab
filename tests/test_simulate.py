"""The single-process simulation of every rank's program equals the dense reference."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import megatron_sap as sap
from megatron_sap.planning import CostModel
from megatron_sap.planning.candidates import FILL_MIN_RANKS, candidates
from megatron_sap.planning.evaluate import evaluate
from megatron_sap.planning.placement import build_all
from megatron_sap.planning.plan import DEFAULT_SLACKS
from megatron_sap.reference import dense_attention
from megatron_sap.simulate import simulate_plan
from sap_cases import force_ring_exchanges, make_inputs, random_cu_seqlens


@pytest.mark.parametrize("outer", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("kind", ["one", "tiny", "long", "zeros", "mixture"])
def test_simulated_programs_match_reference(outer, kind):
    rng = random.Random(outer * 100 + len(kind))
    cu = random_cu_seqlens(rng, outer * rng.randint(8, 40), kind)
    sim = simulation_matching_reference(cu, sap.plan_sequences(cu, outer_size=outer, cache=None), seed=outer)
    assert len(sim.forward_seconds) == outer and len(sim.backward_seconds) == outer


@pytest.mark.parametrize("outer", [3, 5, 6, 7])
@pytest.mark.parametrize("schedule", ["pipelined", "gathered"])
def test_ring_exchanges_match_reference(outer, schedule):
    """Programs whose exchanges are ring shifts (forced, at odd and even outer sizes), run
    in turn with each step's rows taken from its receive peer's send in the same shift."""
    rng = random.Random(outer * 10 + len(schedule))
    for kind in ("one", "long", "mixture"):
        cu = random_cu_seqlens(rng, outer * rng.randint(8, 40), kind)
        plan = force_ring_exchanges(sap.plan_sequences(cu, outer_size=outer, cache=None))
        simulation_matching_reference(cu, plan, seed=outer, schedule=schedule)


def simulation_matching_reference(cu: list[int], plan: sap.Plan, seed: int, heads: int = 4, kv_heads: int = 2,
                                  schedule: str = "pipelined"):
    """Every rank's program of `plan` run in turn (in `schedule`) on random inputs, checked
    against the float64 dense reference: outputs and the three gradients."""
    q, k, v, dout = make_inputs(cu, heads, kv_heads, 8, seed=seed)
    sim = simulate_plan(q, k, v, plan, dout, schedule=schedule)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref, _ = dense_attention(q, k, v, torch.tensor(cu), causal=True)
    ref.backward(dout)
    for got, want in ((sim.out, ref), (sim.dq, q.grad), (sim.dk, k.grad), (sim.dv, v.grad)):
        assert (got - want).abs().max().item() < 1e-10
    return sim


def test_every_rank_runs_the_slowest_ranks_schedule_under_auto(monkeypatch):
    """schedule="auto", beyond JOINT_SCHEDULE_RANKS outer ranks: every outer rank runs the
    schedule the model times faster for the plan's slowest rank (by the estimate) alone (the
    gathered one within GATHERED_PREFERENCE), as `sap_attention` does, on a plan whose ranks,
    each timed alone, would not all choose alike; the result is the reference's."""
    from megatron_sap.planning import plan as plan_module
    from megatron_sap.planning.plan import GATHERED_PREFERENCE

    monkeypatch.setattr(plan_module, "JOINT_SCHEDULE_RANKS", 3)
    from megatron_sap.planning.timeline import rank_schedule

    cu = [0, 138, 408]
    plan = sap.plan_sequences(cu, outer_size=4, inner_size=2, cost_model="cpu", cache=None)

    def faster_alone(r: int, preference: float = 0.0) -> str:
        times = {s: rank_schedule(plan.program(r, schedule=s), 2, plan.capacity, plan.cost_model).total_s
                 for s in ("pipelined", "gathered")}
        return "gathered" if times["gathered"] <= times["pipelined"] * (1 + preference) else "pipelined"

    assert {faster_alone(r) for r in range(4)} == {"pipelined", "gathered"}
    chosen = faster_alone(int(np.argmax(plan.evaluation.rank_time_s)), GATHERED_PREFERENCE)
    assert [plan.schedule(r) for r in range(4)] == [chosen] * 4
    assert plan.stats()["schedule_per_outer_rank"] == [chosen] * 4
    simulation_matching_reference(cu, plan, seed=5, schedule="auto")


def test_simulation_takes_inputs_that_require_grad():
    """The simulated programs compute gradients themselves; inputs tracked by autograd are fine."""
    cu = [0, 7, 30, 31, 64]
    q, k, v, dout = make_inputs(cu, 4, 2, 8, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    plan = sap.plan_sequences(cu, outer_size=2, cache=None)
    sim = simulate_plan(q, k, v, plan, dout)
    ref, _ = dense_attention(q.detach(), k.detach(), v.detach(), torch.tensor(cu), causal=True)
    assert (sim.out - ref).abs().max().item() < 1e-10 and not sim.out.requires_grad


def test_fill_placements_match_reference():
    """A fill pass's placement (its last documents cut through the rooms left, in a chain),
    run rank by rank, equals the dense reference."""
    rng = np.random.default_rng(0)
    outer = FILL_MIN_RANKS
    total = 24 * outer
    cu = [0, *np.sort(rng.integers(0, total, size=30)).tolist(), total]
    model = CostModel.preset("h100")
    placements = build_all(candidates(cu[:-1], np.diff(cu).tolist(), outer, total // outer, model, DEFAULT_SLACKS))
    placement = placements["greedy(slack=0, zigzag, fill)"]
    assert placement.ranks != placements["greedy(slack=0, zigzag)"].ranks
    simulation_matching_reference(cu, sap.Plan(tuple(cu), outer, 1, model, placement, evaluate(placement, 1, model), {}), seed=1)


@pytest.mark.parametrize("seed", range(40))
def test_plans_under_drawn_cost_models_match_reference(seed):
    """Cost models far from the presets (a node of 1, 2 or 3 GPUs, so that inner groups and
    splits straddle nodes; slow or fast links; no or a large message latency; kernel tiles
    of 1 to 128 tokens) steer the planner to other candidates and cuts: whatever it picks
    holds T / P tokens per rank, and every rank's program, in either schedule, equals the
    float64 reference."""
    rng = random.Random(seed)
    inner = rng.choice([1, 1, 2, 3])
    outer = rng.choice([1, 2, 3, 4, 5, 7, 8, 12])
    world = outer * inner
    cu = random_cu_seqlens(rng, world * rng.randint(1, max(1, 240 // world)), rng.choice(["one", "tiny", "long", "zeros", "mixture"]))
    kv_heads = inner * rng.choice([1, 2])
    model = CostModel.preset(
        rng.choice(["h100", "h200", "cpu"]),
        gpus_per_node=rng.choice([1, 2, 3, 8]),
        inter_node_gbps=rng.choice([1.0, 45.0, 1000.0]),
        message_latency_us=rng.choice([0.0, 15.0, 500.0]),
        tile=rng.choice([1, 4, 16, 128]),
        pipelined_kernel_factor=rng.choice([1.0, 1.5]),
    ).with_shape(kv_heads * rng.choice([1, 2]), kv_heads, 8)
    plan = sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cost_model=model, cache=None)
    held = [plan.local_indices(r) for r in range(world)]
    assert all(idx.numel() == cu[-1] // world for idx in held)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(cu[-1]))
    simulation_matching_reference(cu, plan, seed, model.num_heads, kv_heads, rng.choice(["pipelined", "gathered", "auto"]))
