"""The single-process simulation of every rank's program equals the dense reference."""
from __future__ import annotations

import random

import pytest
import torch

import megatron_sap as sap
from megatron_sap.reference import dense_attention
from megatron_sap.simulate import simulate_plan
from sap_cases import make_inputs, random_cu_seqlens


@pytest.mark.parametrize("outer", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("kind", ["one", "tiny", "long", "zeros", "mixture"])
def test_simulated_programs_match_reference(outer, kind):
    rng = random.Random(outer * 100 + len(kind))
    cu = random_cu_seqlens(rng, outer * rng.randint(8, 40), kind)
    q, k, v, dout = make_inputs(cu, 4, 2, 8, seed=outer)
    plan = sap.plan_sequences(cu, outer_size=outer, cache=None)
    sim = simulate_plan(q, k, v, plan, dout)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref, _ = dense_attention(q, k, v, torch.tensor(cu), causal=True)
    ref.backward(dout)
    for got, want in ((sim.out, ref), (sim.dq, q.grad), (sim.dk, k.grad), (sim.dv, v.grad)):
        assert (got - want).abs().max().item() < 1e-10
    assert len(sim.forward_seconds) == outer and len(sim.backward_seconds) == outer


def test_simulation_takes_inputs_that_require_grad():
    """The simulated programs compute gradients themselves; inputs tracked by autograd are fine."""
    cu = [0, 7, 30, 31, 64]
    q, k, v, dout = make_inputs(cu, 4, 2, 8, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    plan = sap.plan_sequences(cu, outer_size=2, cache=None)
    sim = simulate_plan(q, k, v, plan, dout)
    ref, _ = dense_attention(q.detach(), k.detach(), v.detach(), torch.tensor(cu), causal=True)
    assert (sim.out - ref).abs().max().item() < 1e-10 and not sim.out.requires_grad
