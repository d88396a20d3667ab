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
from sap_cases import make_inputs, random_cu_seqlens


@pytest.mark.parametrize("outer", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("kind", ["one", "tiny", "long", "zeros", "mixture"])
def test_simulated_programs_match_reference(outer, kind):
    rng = random.Random(outer * 100 + len(kind))
    cu = random_cu_seqlens(rng, outer * rng.randint(8, 40), kind)
    sim = simulation_matching_reference(cu, sap.plan_sequences(cu, outer_size=outer, cache=None), seed=outer)
    assert len(sim.forward_seconds) == outer and len(sim.backward_seconds) == outer


def simulation_matching_reference(cu: list[int], plan: sap.Plan, seed: int):
    """Every rank's program of `plan` run in turn on random inputs, checked against the
    float64 dense reference: outputs and the three gradients."""
    q, k, v, dout = make_inputs(cu, 4, 2, 8, seed=seed)
    sim = simulate_plan(q, k, v, plan, dout)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref, _ = dense_attention(q, k, v, torch.tensor(cu), causal=True)
    ref.backward(dout)
    for got, want in ((sim.out, ref), (sim.dq, q.grad), (sim.dk, k.grad), (sim.dv, v.grad)):
        assert (got - want).abs().max().item() < 1e-10
    return sim


def test_each_rank_runs_its_own_schedule_under_auto():
    """schedule="auto": every outer rank's program in the schedule it runs by default, as
    `sap_attention` does, on a plan whose ranks do not all choose alike."""
    cu = [0, 138, 408]
    plan = sap.plan_sequences(cu, outer_size=4, inner_size=2, cost_model="cpu", cache=None)
    schedules = [plan.schedule(r) for r in range(4)]
    assert set(schedules) == {"pipelined", "gathered"}, schedules
    q, k, v, dout = make_inputs(cu, 4, 2, 8, seed=5)
    sim = simulate_plan(q, k, v, plan, dout, schedule="auto")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref, _ = dense_attention(q, k, v, torch.tensor(cu), causal=True)
    ref.backward(dout)
    for got, want in ((sim.out, ref), (sim.dq, q.grad), (sim.dk, k.grad), (sim.dv, v.grad)):
        assert (got - want).abs().max().item() < 1e-10


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
