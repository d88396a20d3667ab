"""Acceptance: Megatron-Core's GPTModel trained with SAP context parallelism equals CP=1.

The real megatron-core GPTModel (local spec with SAP core attention, RoPE, GQA 4:2, SwiGLU,
RMSNorm, 2 layers, fp32, CPU) runs a packed row of real documents (byte-tokenised CPython
stdlib sources, one of them a single token) once with CP=1 and plain varlen attention, and once
on 4 gloo ranks with SAP (1x4 and 2x2), or on 3 (1x3, exchanging as ring shifts). Per-token
losses, the all-reduced gradients of every parameter, and the parameters after three Adam
steps must agree to float32 tolerance. With
tensor parallelism 2 beside SAP (CP 2), with and without sequence parallelism, the loss curve
must match CP=1. SAP with selective or full activation recomputation trains like CP=1, and
Megatron-Core's own DDP and `finalize_model_grads` reduce SAP's gradients to CP=1's.
Megatron-LM's pre-0.16 flow through the hooks, multi-latent attention and mixture-of-experts
MLPs (also with expert parallelism) give CP=1's per-token losses and gradients at CP 4.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from dist_pool import make_pool_fixture

pytest.importorskip("megatron.core")

pool4 = make_pool_fixture(4, timeout=300, destroy_job_groups=True)
pool3 = make_pool_fixture(3, timeout=300, destroy_job_groups=True)

STEPS = 3
LR = 1e-3
DOC_LENGTHS = (301, 17, 64, 95, 1, 34)  # 512 tokens: long, short, one-token documents
ODD_DOC_LENGTHS = (400, 17, 64, 30, 1, 1)  # 513 = 3 x 171 tokens: at CP 3 two ring shifts a rank


def _train(steps: int, batch: dict, cu: list[int], initial: dict | None, **config_fields) -> dict:
    """Build the tiny GPT (weights from `initial` if given; `config_fields` to its config), train
    `steps` Adam steps, record the first step."""
    from megatron_sap.megatron.demo_train import build_tiny_gpt, train_step

    model = build_tiny_gpt(**config_fields)
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


def run_rank(rank: int, world_size: int, inner: int, outer: int, doc_lengths: tuple[int, ...] = DOC_LENGTHS,
             **config_fields) -> dict:
    """CP=1 reference (every rank alone, data-parallel replicas), then SAP with CP = inner*outer
    (with `config_fields` in its model's config) on a row of `doc_lengths`."""
    from megatron.core import parallel_state

    from megatron_sap.megatron.demo_train import packed_batch, stdlib_documents
    from megatron_sap.megatron import initialize_sap_parallel, resolve_groups
    from megatron_sap.megatron.plans import plan_for

    torch.set_num_threads(1)
    tokens, cu = stdlib_documents(doc_lengths)
    batch = packed_batch(tokens, cu)
    try:
        initialize_sap_parallel(inner_size=1)
        reference = _train(STEPS, batch, cu, None)
        reference["indices"] = plan_for(torch.tensor(cu, dtype=torch.int32), None).local_indices(0)
        parallel_state.destroy_model_parallel()

        groups = initialize_sap_parallel(inner_size=inner, outer_size=outer)
        sap = _train(STEPS, batch, cu, reference["initial"], **config_fields)
        plan = plan_for(torch.tensor(cu, dtype=torch.int32), resolve_groups(None))
        indices = plan.local_indices(groups.cp_rank)
        layout = (groups.inner_size, groups.outer_size)
    finally:
        parallel_state.destroy_model_parallel()
    return {"reference": reference, "sap": sap, "indices": indices, "layout": layout, "total": cu[-1],
            "ring": plan.ring_exchanges}


@pytest.mark.parametrize("inner,outer", [(1, 4), (2, 2), (4, 1)], ids=["1x4", "2x2", "4x1"])
def test_gpt_sap_cp4_equals_cp1(pool4, inner: int, outer: int) -> None:
    _assert_sap_trains_like_cp1(pool4.run(run_rank, inner, outer), inner, outer)


def test_gpt_sap_at_an_odd_cp_size_equals_cp1(pool3) -> None:
    """CP = 3, where the plan exchanges as ring shifts (`Plan.ring_exchanges`), each rank sending
    to one peer and receiving from another in each step."""
    results = pool3.run(run_rank, 1, 3, doc_lengths=ODD_DOC_LENGTHS)
    assert all(r["ring"] for r in results)
    _assert_sap_trains_like_cp1(results, 1, 3)


def run_chunked_rank(rank: int, world_size: int, inner: int, outer: int) -> dict:
    """`run_rank` with SAP layers running the all-to-alls in two head chunks
    (`--sap-inner-chunks 2`), counting the chunked ops run."""
    from unittest import mock

    import megatron_sap.megatron
    from megatron_sap.megatron.options import reset_sap_options, set_sap_options
    from sap_cases import counting_chunked_ops

    initialize = megatron_sap.megatron.initialize_sap_parallel

    def initialize_then_chunk(**sizes):  # the CP=1 reference has no inner level to chunk
        if sizes["inner_size"] > 1:
            set_sap_options(inner_chunks=2)
        return initialize(**sizes)

    try:
        with counting_chunked_ops() as chunked, \
                mock.patch.object(megatron_sap.megatron, "initialize_sap_parallel", initialize_then_chunk):
            found = run_rank(rank, world_size, inner, outer)
    finally:
        reset_sap_options()
    return {**found, "chunked": chunked}


def test_gpt_sap_with_head_chunks_equals_cp1(pool4) -> None:
    """`--sap-inner-chunks 2` at `2 x 2` (2 query heads and 1 KV head per inner rank, one
    each per chunk): losses, gradients and trained weights are CP=1's, and every SAP
    attention ran in two chunks."""
    results = pool4.run(run_chunked_rank, 2, 2)
    _assert_sap_trains_like_cp1(results, 2, 2)
    assert all(r["chunked"] and set(r["chunked"]) == {2} for r in results)


def run_recompute_rank(rank: int, world_size: int, inner: int, outer: int, granularity: str) -> dict:
    """`run_rank` with SAP's model recomputing activations in backward: the core attention
    (selective, Megatron's default module) or every layer (full, one layer per checkpoint).
    Megatron's checkpoint saves and restores the CUDA RNG states; on the CPU they are stand-ins
    (dropout is off)."""
    import contextlib
    from unittest import mock

    from megatron.core.tensor_parallel import random as megatron_random

    from megatron_sap.megatron import SAPDotProductAttention

    fields = {"recompute_granularity": granularity}
    if granularity == "full":
        fields.update(recompute_method="uniform", recompute_num_layers=1)
    no_cuda_rng = mock.Mock(get_states=dict, set_states=lambda states: None,
                            fork=lambda *a, **k: contextlib.nullcontext())
    forward = SAPDotProductAttention.forward
    without_grad = []  # attention forwards whose activations a checkpoint drops (recomputed in backward)

    def counted(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            without_grad.append(1)
        return forward(self, *args, **kwargs)

    with mock.patch.object(megatron_random, "_get_cuda_rng_state", lambda *a, **k: None), \
            mock.patch.object(megatron_random, "_set_cuda_rng_state", lambda *a, **k: None), \
            mock.patch.object(megatron_random, "get_cuda_rng_tracker", lambda: no_cuda_rng), \
            mock.patch.object(SAPDotProductAttention, "forward", counted):
        found = run_rank(rank, world_size, inner, outer, **fields)
    return {**found, "checkpointed": len(without_grad)}


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_gpt_sap_with_activation_recomputation_equals_cp1(pool4, granularity: str) -> None:
    """`--recompute-granularity selective` / `full`: in backward each checkpointed core attention
    (or layer) runs SAP's forward again, transfers included, before its backward; losses,
    gradients and trained weights are CP=1's without recomputation."""
    results = pool4.run(run_recompute_rank, 2, 2, granularity)
    assert all(r["checkpointed"] == STEPS * 2 for r in results)  # both layers' attention, every step
    _assert_sap_trains_like_cp1(results, 2, 2)


def _assert_sap_trains_like_cp1(results: list[dict], inner: int, outer: int) -> None:
    """Every rank's per-token losses in place, losses, gradients and trained weights equal CP=1's."""
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
        # Adam steps every weight by about LR whatever its gradient's size, so the float32 noise of a
        # gradient near zero (other kernel tiles, other summation orders) can move its weight by a
        # small part of LR (up to 5% of a step seen, on Python 3.13's files as the row): 10% of a
        # step is allowed. The gradients' values are checked above; a weight stepped the wrong way
        # or not at all is off by a whole step.
        for name, param in reference["final"].items():
            torch.testing.assert_close(r["sap"]["final"][name], param, rtol=1e-4, atol=0.1 * LR, msg=lambda m: f"{name}: {m}")
    # Training moved the weights, so the final comparison is not vacuous.
    moved = max((reference["final"][n] - reference["initial"][n]).abs().max() for n in reference["final"])
    assert moved > LR


def _megatron_ddp_steps(build_model, sap_layout: tuple[int, int], use_distributed_optimizer: bool = False,
                        **parallel) -> Iterator[tuple[str, object, torch.nn.Module]]:
    """One step as Megatron-LM takes it, at CP=1 ("reference", the other ranks data-parallel
    replicas) and then with SAP at `sap_layout` (inner, outer): `build_model()` wrapped in
    Megatron-Core's `DistributedDataParallel`, the summed per-token loss
    (`--calculate-per-token-loss`) backpropagated and `finalize_model_grads` called with the
    rank's loss tokens. Yields (name, DDP model, model) before the parallel state (with
    `parallel`'s extra sizes) is torn down. DDP allocates its buffers on the current CUDA device:
    the CPU here."""
    from unittest import mock

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_sap.megatron import initialize_sap_parallel, sap_split_batch
    from megatron_sap.megatron.demo_train import packed_batch, stdlib_documents

    torch.set_num_threads(1)
    tokens, cu = stdlib_documents(DOC_LENGTHS)
    batch = packed_batch(tokens, cu)
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        for name, (inner, outer) in (("reference", (1, 1)), ("sap", sap_layout)):
            initialize_sap_parallel(inner_size=inner, outer_size=outer, **parallel)
            try:
                module = build_model()
                ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer)
                model = DistributedDataParallel(module.config, ddp_config, module)
                local, params = sap_split_batch(batch, cu)
                per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                                  packed_seq_params=params)
                (per_token * local["loss_mask"]).sum().backward()
                finalize_model_grads([model], local["loss_mask"].sum())
                yield name, model, module
            finally:
                parallel_state.destroy_model_parallel()


def run_megatron_ddp_rank(rank: int, world_size: int, inner: int, outer: int, distributed_optimizer: bool) -> dict:
    """`_megatron_ddp_steps` of the tiny GPT: this rank's share of the reduced gradient buffers
    (with the distributed optimizer each rank holds only its shard; else the shards of the
    whole buffer)."""
    from megatron.core import parallel_state

    from megatron_sap.megatron.demo_train import build_tiny_gpt

    shards = {}
    for name, model, _ in _megatron_ddp_steps(lambda: build_tiny_gpt(calculate_per_token_loss=True), (inner, outer),
                                              distributed_optimizer):
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        shards[name] = torch.cat([bucket.grad_data.chunk(group.size())[group.rank()]
                                  for buffer in model.buffers for bucket in buffer.buckets])
    return shards


def _megatron_ddp_needs_cuda() -> bool:
    """megatron-core 0.19's `DistributedDataParallel` takes the current CUDA stream in every
    gradient sync (to wait for CUDA-graph replays): it has no CPU path."""
    from megatron_sap.megatron.compat import megatron_core_version

    return megatron_core_version() >= (0, 19) and not torch.cuda.is_available()


needs_megatron_ddp = pytest.mark.skipif(_megatron_ddp_needs_cuda(),
                                        reason="megatron-core 0.19's DistributedDataParallel needs CUDA")


@needs_megatron_ddp
@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distributed-optimizer"])
def test_gpt_sap_gradients_through_megatron_ddp_equal_cp1(pool4, distributed_optimizer: bool) -> None:
    """Megatron's own gradient reduction completes SAP's: `DistributedDataParallel` sums every
    rank's gradients over data-parallel-with-CP (all-reduced, or reduce-scattered for the
    distributed optimizer) and `finalize_model_grads` divides by the loss tokens summed there.
    SAP 2x2 gives CP=1's reduced gradients, shard by shard."""
    for r in pool4.run(run_megatron_ddp_rank, 2, 2, distributed_optimizer):
        assert float(r["reference"].abs().max()) > 0
        torch.testing.assert_close(r["sap"], r["reference"], rtol=1e-4, atol=1e-6 * float(r["reference"].abs().max()))


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


def run_sequence_parallel_rank(rank: int, world_size: int, inner: int, outer: int) -> tuple[list[float], list[float]]:
    """Loss curves: TP=2 without CP or sequence parallelism, then TP=2 with sequence parallelism and
    SAP over CP = inner*outer."""
    import contextlib
    from unittest import mock

    from megatron.core import tensor_parallel

    from megatron_sap.megatron.demo_train import train_sap

    torch.set_num_threads(1)
    reference = train_sap(1, 1, STEPS, tensor_parallel=2)
    no_cuda_rng = mock.Mock(fork=lambda *a, **k: contextlib.nullcontext())  # dropout is off; CUDA RNG states need a GPU
    # The sequence-parallel gathers allocate on the current CUDA device: the CPU here.
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), \
            mock.patch.object(tensor_parallel, "get_cuda_rng_tracker", lambda: no_cuda_rng):
        return reference, train_sap(inner, outer, STEPS, tensor_parallel=2, sequence_parallel=True)


@pytest.mark.parametrize("inner,outer", [(2, 1), (1, 2)], ids=["tp2-sp-2x1", "tp2-sp-1x2"])
def test_gpt_sequence_parallel_with_sap_trains_like_cp1(pool4, inner: int, outer: int) -> None:
    """`--sequence-parallel` beside SAP: the activations outside attention split over the TP ranks
    along each CP rank's share of the row; the loss curve is TP=2's without CP or sequence
    parallelism (the norms' gradients summed over the TP group, as Megatron does)."""
    for tp_reference, sap in pool4.run(run_sequence_parallel_rank, inner, outer):
        torch.testing.assert_close(torch.tensor(sap), torch.tensor(tp_reference), rtol=1e-5, atol=1e-6)


def _one_step(layouts, build_model) -> dict:
    """Per (name, inner, outer, run_model) layout: one forward and backward of
    `run_model(model, row, cu)` -> (per-token losses, loss mask) on a fresh `build_model()` (the
    first layout's weights), with the gradients all-reduced as DDP does. Per layout: this rank's
    per-token losses, their global positions, the gradients; and the row's length."""
    from megatron.core import parallel_state

    from megatron_sap.megatron import initialize_sap_parallel, resolve_groups, sap_loss
    from megatron_sap.megatron.demo_train import packed_batch, reduce_gradients, stdlib_documents
    from megatron_sap.megatron.plans import plan_for

    torch.set_num_threads(1)
    tokens, cu = stdlib_documents(DOC_LENGTHS)
    batch = packed_batch(tokens, cu)
    starts = torch.tensor(cu[:-1]).repeat_interleave(torch.diff(torch.tensor(cu)))
    row = {"tokens": batch["tokens"], "labels": batch["labels"], "loss_mask": batch["loss_mask"],
           "attention_mask": None, "position_ids": (torch.arange(cu[-1]) - starts).unsqueeze(0)}
    results: dict = {"total": cu[-1]}
    weights = None
    try:
        for name, inner, outer, run_model in layouts:
            groups = initialize_sap_parallel(inner_size=inner, outer_size=outer)
            model = build_model()
            if weights is not None:
                model.load_state_dict(weights)
            weights = model.state_dict()
            per_token, loss_mask = run_model(model, row, cu)
            loss, _ = sap_loss(per_token, loss_mask)
            loss.backward()
            reduce_gradients(model)
            cp_rank = 0 if groups is None or groups.world_size == 1 else groups.cp_rank
            results[name] = {
                "per_token": per_token[0].detach(),
                "indices": plan_for(torch.tensor(cu, dtype=torch.int32), resolve_groups(None)).local_indices(cp_rank),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            }
            parallel_state.destroy_model_parallel()
    finally:
        parallel_state.destroy_model_parallel()
    return results


def _assert_one_step_equal(results: list[dict]) -> None:
    """SAP's per-token losses (gathered over the CP ranks) and gradients equal the reference's."""
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


def _split_and_run(model, row: dict, cu: list[int]) -> tuple:
    """The documents given: `sap_split_batch` with the true cu_seqlens, the parameters passed."""
    from megatron_sap.megatron import sap_split_batch

    local, params = sap_split_batch(row, cu)
    per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"], packed_seq_params=params)
    return per_token, local["loss_mask"]


def run_legacy_rank(rank: int, world_size: int, inner: int, outer: int) -> dict:
    """pretrain_gpt.py's flow before core_v0.16 through the SAP hooks: the CP split of a
    [1, S] row with restarting position ids, then the model called without packed parameters;
    beside CP=1 with the documents given (`_split_and_run`)."""
    from types import SimpleNamespace

    from megatron_sap.megatron.demo_train import build_tiny_gpt
    from megatron_sap.megatron.hooks import wrap_get_batch_on_this_cp_rank, wrap_gpt_forward

    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True)
    split = wrap_get_batch_on_this_cp_rank(lambda batch: pytest.fail("Megatron's split was called"), get_args=lambda: args)

    def legacy_flow(model, row: dict, cu: list[int]) -> tuple:
        forward = wrap_gpt_forward(type(model).forward, get_args=lambda: args)
        tokens, labels, loss_mask, attention_mask, position_ids = split(dict(row)).values()
        return forward(model, tokens, position_ids, attention_mask, labels=labels), loss_mask

    return _one_step([("reference", 1, 1, _split_and_run), ("sap", inner, outer, legacy_flow)], build_tiny_gpt)


def test_legacy_pretrain_gpt_flow_equals_cp1(pool4) -> None:
    """Megatron-LM core_v0.13 to v0.15 (no packed path in pretrain_gpt.get_batch): SAP at CP 4
    (2x2) through the hooks gives CP=1's per-token losses and gradients."""
    _assert_one_step_equal(pool4.run(run_legacy_rank, 2, 2))


def _mla_gpt(rope_type: str):
    """A 2-layer fp32 GPT with multi-latent attention (its own RoPE, `rope_type` "rope" or "yarn")
    and SAP core attention."""
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_sap.megatron import get_gpt_layer_sap_spec

    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    yarn = {"rotary_scaling_factor": 4.0,
            # the pre-scaling context length: renamed in megatron-core 0.14
            ("original_max_position_embeddings" if "original_max_position_embeddings" in fields
             else "max_position_embeddings"): 128}
    config = MLATransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, normalization="RMSNorm",
        gated_linear_unit=True, add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, apply_rope_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, q_lora_rank=None, kv_lora_rank=32,
        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type=rope_type,
        context_parallel_size=parallel_state.get_context_parallel_world_size(), cp_comm_type="sap",
        **(yarn if rope_type == "yarn" else {}),
    )
    torch.manual_seed(1234)
    return GPTModel(config, get_gpt_layer_sap_spec(normalization="RMSNorm", multi_latent_attention=True),
                    vocab_size=256, max_sequence_length=4096, position_embedding_type="none")


def run_mla_rank(rank: int, world_size: int, rope_type: str) -> dict:
    """For this job only: Megatron puts MLA's rotary tables on torch.cuda.current_device()
    whatever the config says (the CPU here), and megatron-core 0.16 takes Transformer Engine's
    CPU placeholders for the real classes when it checks for an fp8 path (there is none here)."""
    from unittest import mock

    import megatron.core.transformer.multi_latent_attention as mla

    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), mock.patch.object(mla, "HAVE_TE", False):
        return _one_step([("reference", 1, 1, _split_and_run), ("sap", 2, 2, _split_and_run)], lambda: _mla_gpt(rope_type))


def test_gpt_with_mla_at_cp4_equals_cp1(pool4) -> None:
    """Multi-latent attention (values of their own head dim, RoPE inside the layer) at CP 4 (2x2),
    a 301-token document over 128-token ranks: CP=1's per-token losses and gradients. (Its YaRN
    table needs CUDA to build, beyond the device patch here: not run on CPU.)"""
    from megatron_sap.megatron.compat import mla_keeps_packed_rope_table

    if not mla_keeps_packed_rope_table():
        pytest.skip("megatron-core 0.13 refuses MLA under CP (test_rotary_tables_cut_to_megatrons_layout_are_refused_under_context_parallelism)")
    _assert_one_step_equal(pool4.run(run_mla_rank, "rope"))


def _moe_gpt(**config_fields):
    """The tiny GPT with mixture-of-experts MLPs: 4 experts, top-2 routing, dropless, the
    all-gather dispatcher, a load-balancing loss (its expert counts all-reduced over TP x CP);
    `config_fields` override the config's."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_sap.megatron import get_gpt_layer_sap_spec, make_rotary_cpu_safe

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, kv_channels=16,
        normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=True, apply_rope_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1,
        context_parallel_size=parallel_state.get_context_parallel_world_size(), cp_comm_type="sap",
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
    )
    config = dataclasses.replace(config, **config_fields) if config_fields else config
    torch.manual_seed(1234)
    model = GPTModel(config, get_gpt_layer_sap_spec(normalization="RMSNorm", num_experts=4, moe_grouped_gemm=False),
                     vocab_size=256, max_sequence_length=4096, position_embedding_type="rope")
    make_rotary_cpu_safe(model.rotary_pos_emb)
    return model


def run_moe_rank(rank: int, world_size: int, inner: int, outer: int) -> dict:
    """For this job only: Megatron's router moves its weight to torch.cuda.current_device() (the
    CPU here), and without Transformer Engine megatron-core 0.16 reads an unbound `te_general_gemm`
    in the router's matmul (None is its own fallback)."""
    from unittest import mock

    import megatron.core.transformer.moe.moe_utils as moe_utils

    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), \
            mock.patch.object(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), create=True):
        return _one_step([("reference", 1, 1, _split_and_run), ("sap", inner, outer, _split_and_run)], _moe_gpt)


def run_moe_ddp_rank(rank: int, world_size: int, expert_parallel: int, aux_loss_coeff: float) -> dict:
    """`_megatron_ddp_steps` of the mixture-of-experts GPT with `expert_parallel` expert-parallel
    ranks, SAP at 2x2: every parameter's reduced gradient (`main_grad`). The router's weight also
    goes to the current CUDA device, and megatron-core 0.16 reads an unbound `te_general_gemm`
    without Transformer Engine (None is its own fallback)."""
    from unittest import mock

    import megatron.core.transformer.moe.moe_utils as moe_utils

    grads = {}
    with mock.patch.object(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), create=True):
        steps = _megatron_ddp_steps(lambda: _moe_gpt(moe_aux_loss_coeff=aux_loss_coeff, calculate_per_token_loss=True),
                                    (2, 2), expert_model_parallel_size=expert_parallel)
        for name, _, module in steps:
            grads[name] = {n: p.main_grad.clone() for n, p in module.named_parameters()}
    return grads


@needs_megatron_ddp
def test_gpt_with_moe_and_expert_parallelism_through_megatron_ddp_equals_cp1(pool4) -> None:
    """Experts split over two expert-parallel ranks beside SAP 2x2: each rank's experts and the
    rest of the model, reduced by Megatron's DDP (experts over their expert-data-parallel group),
    get CP=1's gradients. (The load-balancing loss is off here: see the next test.)"""
    for r in pool4.run(run_moe_ddp_rank, 2, 0.0):
        assert any(".experts." in name for name in r["sap"])
        for name, grad in r["reference"].items():
            torch.testing.assert_close(r["sap"][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@needs_megatron_ddp
def test_moe_load_balancing_gradient_under_per_token_loss_is_one_cp_th_of_cp1s(pool4) -> None:
    """Megatron's own scaling, not SAP's, measured so that docs/megatron.md can say it: with
    `--calculate-per-token-loss` the router scales its load-balancing loss by the rank's local
    tokens (T / CP under CP) while `finalize_model_grads` divides by the tokens summed over
    data-parallel-with-CP (T), so at CP 4 that loss's share of the router's gradient is a
    quarter of CP=1's, the rest of the gradient unchanged. Any CP method splits tokens so."""
    name = "decoder.layers.0.mlp.router.weight"
    with_loss, without = pool4.run(run_moe_ddp_rank, 1, 0.1), pool4.run(run_moe_ddp_rank, 1, 0.0)
    for a, b in zip(with_loss, without):
        torch.testing.assert_close(b["sap"][name], b["reference"][name], rtol=1e-4, atol=1e-6)
        reference_part, sap_part = a["reference"][name] - b["reference"][name], a["sap"][name] - b["sap"][name]
        assert float(reference_part.abs().max()) > 0
        torch.testing.assert_close(sap_part, reference_part / 4, rtol=1e-3, atol=1e-4 * float(reference_part.abs().max()))


@pytest.mark.parametrize("inner,outer", [(1, 4), (2, 2)], ids=["1x4", "2x2"])
def test_gpt_with_moe_at_cp4_equals_cp1(pool4, inner: int, outer: int) -> None:
    """Mixture-of-experts MLPs beside SAP: the experts see each rank's tokens in SAP's order, and
    the load-balancing loss is summed over the CP ranks. CP 4 gives CP=1's per-token losses and
    gradients, the router's included."""
    _assert_one_step_equal(pool4.run(run_moe_rank, inner, outer))
