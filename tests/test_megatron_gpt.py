"""Acceptance: Megatron-Core's GPTModel trained with SAP context parallelism equals CP=1.

The real megatron-core GPTModel (local spec with SAP core attention, RoPE, GQA 4:2, SwiGLU,
RMSNorm, 2 layers, fp32, CPU) runs a packed row of real documents (byte-tokenised CPython
stdlib sources, one of them a single token) once with CP=1 and plain varlen attention, and once
on 4 gloo ranks with SAP (1x4 and 2x2). Per-token losses, the all-reduced gradients of every
parameter, and the parameters after three Adam steps must agree to float32 tolerance. With
tensor parallelism 2 beside SAP (CP 2), the loss curve must match CP=1.
"""
from __future__ import annotations

import pytest
import torch

from dist_pool import make_pool_fixture

pytest.importorskip("megatron.core")

pool4 = make_pool_fixture(4, timeout=300)

STEPS = 3
LR = 1e-3
DOC_LENGTHS = (301, 17, 64, 95, 1, 34)  # 512 tokens: long, short, one-token documents


def _train(steps: int, batch: dict, cu: list[int], initial: dict | None) -> dict:
    """Build the tiny GPT (weights from `initial` if given), train `steps` Adam steps, record the first step."""
    from megatron_sap.megatron.demo_train import build_tiny_gpt, train_step

    model = build_tiny_gpt()
    if initial is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(initial[name])
    start = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    record: dict = {"initial": start, "losses": []}
    for step in range(steps):
        per_token, mean = train_step(model, optimizer, batch, cu)
        record["losses"].append(mean)
        if step == 0:
            record["per_token"] = per_token[0]
            record["grads"] = {name: param.grad.clone() for name, param in model.named_parameters()}
    record["final"] = {name: param.detach().clone() for name, param in model.named_parameters()}
    return record


def run_rank(rank: int, world_size: int, inner: int, outer: int) -> dict:
    """CP=1 reference (every rank alone, data-parallel replicas), then SAP with CP = inner*outer."""
    from megatron.core import parallel_state

    from megatron_sap.megatron.demo_train import packed_batch, stdlib_documents
    from megatron_sap.megatron import initialize_sap_parallel, resolve_groups
    from megatron_sap.megatron.plans import plan_for

    torch.set_num_threads(1)
    tokens, cu = stdlib_documents(DOC_LENGTHS)
    batch = packed_batch(tokens, cu)
    try:
        initialize_sap_parallel(inner_size=1)
        reference = _train(STEPS, batch, cu, None)
        reference["indices"] = plan_for(torch.tensor(cu, dtype=torch.int32), None).local_indices(0)
        parallel_state.destroy_model_parallel()

        groups = initialize_sap_parallel(inner_size=inner, outer_size=outer)
        sap = _train(STEPS, batch, cu, reference["initial"])
        indices = plan_for(torch.tensor(cu, dtype=torch.int32), resolve_groups(None)).local_indices(groups.cp_rank)
        layout = (groups.inner_size, groups.outer_size)
    finally:
        parallel_state.destroy_model_parallel()
    return {"reference": reference, "sap": sap, "indices": indices, "layout": layout, "total": cu[-1]}


@pytest.mark.parametrize("inner,outer", [(1, 4), (2, 2), (4, 1)], ids=["1x4", "2x2", "4x1"])
def test_gpt_sap_cp4_equals_cp1(pool4, inner: int, outer: int) -> None:
    results = pool4.run(run_rank, inner, outer)
    assert all(r["layout"] == (inner, outer) for r in results)
    reference = results[0]["reference"]
    total = results[0]["total"]

    # Each rank's per-token losses land on distinct global positions covering the row once.
    covered = torch.cat([r["indices"] for r in results]).sort().values
    assert torch.equal(covered, torch.arange(total))
    sap_tokens = torch.full((total,), float("nan"))
    for r in results:
        sap_tokens[r["indices"]] = r["sap"]["per_token"]
    reference_tokens = torch.empty(total)
    reference_tokens[reference["indices"]] = reference["per_token"]
    torch.testing.assert_close(sap_tokens, reference_tokens, rtol=1e-5, atol=1e-5)

    for r in results:  # the reduced loss, gradients and trained weights are the same on every rank
        torch.testing.assert_close(torch.tensor(r["sap"]["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
        assert r["sap"]["grads"].keys() == reference["grads"].keys()
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(r["sap"]["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for name, param in reference["final"].items():
            torch.testing.assert_close(r["sap"]["final"][name], param, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # Training moved the weights, so the final comparison is not vacuous.
    moved = max((reference["final"][n] - reference["initial"][n]).abs().max() for n in reference["final"])
    assert moved > LR


def run_tp_rank(rank: int, world_size: int, inner: int, outer: int) -> tuple[list[float], list[float], list[float]]:
    """Loss curves: CP=1 TP=1 (replicas), CP=1 TP=2, then TP=2 with SAP over CP = inner*outer."""
    from megatron_sap.megatron.demo_train import train_sap

    torch.set_num_threads(1)
    return (train_sap(1, 1, STEPS), train_sap(1, 1, STEPS, tensor_parallel=2),
            train_sap(inner, outer, STEPS, tensor_parallel=2))


@pytest.mark.parametrize("inner,outer", [(2, 1), (1, 2)], ids=["tp2-2x1", "tp2-1x2"])
def test_gpt_tp2_with_sap_trains_like_cp1(pool4, inner: int, outer: int) -> None:
    """Tensor parallelism beside SAP: the same loss curve as the same TP without CP. Megatron-Core
    0.16's CPU-initialized shards equal the full weights, so there it is also TP=1's curve;
    earlier versions initialize TP shards otherwise (TP=2 differs from TP=1 by about 1e-3 at CP=1
    too), so TP=1 is only close."""
    for reference, tp_reference, sap in pool4.run(run_tp_rank, inner, outer):
        torch.testing.assert_close(torch.tensor(sap), torch.tensor(tp_reference), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(sap), torch.tensor(reference), rtol=2e-3, atol=1e-6)


def run_legacy_rank(rank: int, world_size: int, inner: int, outer: int) -> dict:
    """pretrain_gpt.py's flow before core_v0.16 through the SAP hooks: the CP split of a
    [1, S] row with restarting position ids, then the model called without packed parameters;
    per-token losses and all-reduced gradients of one step, beside CP=1's with the documents
    given (`sap_split_batch` with the true cu_seqlens, the parameters passed)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_sap.megatron import initialize_sap_parallel, resolve_groups, sap_loss, sap_split_batch
    from megatron_sap.megatron.demo_train import build_tiny_gpt, packed_batch, stdlib_documents
    from megatron_sap.megatron.hooks import wrap_get_batch_on_this_cp_rank, wrap_gpt_forward
    from megatron_sap.megatron.plans import plan_for

    torch.set_num_threads(1)
    tokens, cu = stdlib_documents(DOC_LENGTHS)
    batch = packed_batch(tokens, cu)
    starts = torch.tensor(cu[:-1]).repeat_interleave(torch.diff(torch.tensor(cu)))
    row = {"tokens": batch["tokens"], "labels": batch["labels"], "loss_mask": batch["loss_mask"],
           "attention_mask": None, "position_ids": (torch.arange(cu[-1]) - starts).unsqueeze(0)}
    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True)
    split = wrap_get_batch_on_this_cp_rank(lambda batch: pytest.fail("Megatron's split was called"), get_args=lambda: args)
    results = {}
    weights = None
    try:
        for name, sizes in (("reference", (1, 1)), ("sap", (inner, outer))):
            groups = initialize_sap_parallel(inner_size=sizes[0], outer_size=sizes[1])
            model = build_tiny_gpt()
            if weights is not None:
                model.load_state_dict(weights)
            weights = model.state_dict()
            if name == "reference":
                local, params = sap_split_batch(row, cu)
                loss_mask = local["loss_mask"]
                per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                                  packed_seq_params=params)
            else:
                forward = wrap_gpt_forward(type(model).forward, get_args=lambda: args)
                local_tokens, labels, loss_mask, attention_mask, position_ids = split(dict(row)).values()
                per_token = forward(model, local_tokens, position_ids, attention_mask, labels=labels)
            loss, _ = sap_loss(per_token, loss_mask)
            loss.backward()
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            for param in model.parameters():
                dist.all_reduce(param.grad, group=group)
                param.grad /= parallel_state.get_data_parallel_world_size()
            cp_rank = 0 if groups is None or groups.world_size == 1 else groups.cp_rank
            results[name] = {
                "per_token": per_token[0].detach(),
                "indices": plan_for(torch.tensor(cu, dtype=torch.int32), resolve_groups(None)).local_indices(cp_rank),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            }
            parallel_state.destroy_model_parallel()
    finally:
        parallel_state.destroy_model_parallel()
    results["total"] = cu[-1]
    return results


def test_legacy_pretrain_gpt_flow_equals_cp1(pool4) -> None:
    """Megatron-LM core_v0.13 to v0.15 (no packed path in pretrain_gpt.get_batch): SAP at CP 4
    (2x2) through the hooks gives CP=1's per-token losses and gradients."""
    results = pool4.run(run_legacy_rank, 2, 2)
    total = results[0]["total"]
    reference = results[0]["reference"]
    reference_tokens = torch.empty(total)
    reference_tokens[reference["indices"]] = reference["per_token"]
    sap_tokens = torch.full((total,), float("nan"))
    for r in results:
        sap_tokens[r["sap"]["indices"]] = r["sap"]["per_token"]
    torch.testing.assert_close(sap_tokens, reference_tokens, rtol=1e-5, atol=1e-5)
    for r in results:
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(r["sap"]["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
