"""SAP flags, the Megatron-LM training hooks and the launcher.

The hook functions are tested on stand-ins for Megatron-LM's entry points (same signatures); the
last tests run against a real Megatron-LM checkout named by $MEGATRON_LM_PATH and are skipped
without one.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import itertools
import os
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.backends import LocalSpecProvider  # noqa: E402

import megatron_sap as sap  # noqa: E402

from megatron_sap.megatron import SAPDotProductAttention, add_sap_args, chain_args_providers, get_sap_options  # noqa: E402
from megatron_sap.megatron.arguments import sap_settings_from_args  # noqa: E402
from megatron_sap.megatron.hooks import (  # noqa: E402
    host_boundaries,
    pack_unpacked_batch,
    sap_requested,
    wrap_core_get_batch_on_this_tp_rank,
    wrap_flatten_batch_for_packed_sequences,
    wrap_forward_step,
    wrap_get_batch_on_this_cp_rank,
    wrap_get_batch_on_this_tp_rank,
    wrap_get_thd_batch_on_this_cp_rank,
    wrap_gpt_forward,
    wrap_initialize_model_parallel,
    wrap_parse_args,
    wrap_pretrain,
    wrap_spec_builder,
)
from megatron_sap.megatron.options import reset_sap_options  # noqa: E402
from megatron_sap.megatron.rope import uninstall_sap_rope  # noqa: E402

MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
needs_megatron_lm = pytest.mark.skipif(
    not MEGATRON_LM, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.13 to v0.19) to test the real hooks"
)


@pytest.fixture(autouse=True)
def _restore_globals():
    """Hooks change process-wide state (options, spec providers, RoPE): put it back after each test."""
    provider = LocalSpecProvider.__dict__["core_attention"]
    yield
    LocalSpecProvider.core_attention = provider
    reset_sap_options()
    uninstall_sap_rope()


def _megatron_like_parser() -> argparse.ArgumentParser:
    """The few Megatron-LM flags SAP reads, declared as Megatron-LM declares them."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--context-parallel-size", type=int, default=1)
    group.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None)
    group.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-attention-heads", type=int, default=None)
    group.add_argument("--hidden-size", type=int, default=None)
    group.add_argument("--kv-channels", type=int, default=None)
    group.add_argument("--group-query-attention", action="store_true")
    group.add_argument("--num-query-groups", type=int, default=1)
    return parser


def _modelopt_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument_group(title="modelopt").add_argument("--export-te-mcore-model", action="store_true")
    return parser


def _parse(flags: str) -> argparse.Namespace:
    provider = chain_args_providers(_modelopt_provider, None, add_sap_args)
    return provider(_megatron_like_parser()).parse_args(flags.split())


def test_the_chained_provider_adds_the_sap_flags_to_an_existing_one() -> None:
    """`chain_args_providers(existing)`: the script's provider and the `sap` group, once."""
    parser = chain_args_providers(_modelopt_provider)(_megatron_like_parser())
    args = parser.parse_args("--export-te-mcore-model --sap-inner-size 2 --cp-comm-type sap".split())
    assert args.export_te_mcore_model and args.sap_inner_size == 2
    assert [g.title for g in parser._action_groups].count("sap") == 1
    twice = chain_args_providers(add_sap_args, _modelopt_provider, add_sap_args)(_megatron_like_parser())
    assert [g.title for g in twice._action_groups].count("sap") == 1


def test_flags_parse_and_chain_with_an_existing_provider() -> None:
    args = _parse(
        "--context-parallel-size 8 --cp-comm-type sap --export-te-mcore-model --sap-inner-size 4 "
        "--sap-backend torch --sap-cost-preset h200 --sap-plan-cache-size 8 --no-sap-check-agreement "
        "--sap-recompute-kv --sap-schedule gathered --no-sap-plan-in-data-loader"
    )
    assert args.export_te_mcore_model and args.sap_inner_size == 4 and args.sap_outer_size is None
    assert (args.sap_backend, args.sap_cost_preset, args.sap_plan_cache_size) == ("torch", "h200", 8)
    assert args.sap_check_agreement is False and args.sap_recompute_kv is True and args.sap_plan_in_data_loader is False
    assert _parse("--context-parallel-size 2").sap_plan_in_data_loader is True
    settings = sap_settings_from_args(args)
    assert (settings.inner_size, settings.outer_size) == (4, 2)
    assert settings.options.recompute_kv and settings.options.schedule == "gathered"
    assert get_sap_options() == settings.options and settings.options.backend == "torch"
    assert sap_settings_from_args(_parse("--context-parallel-size 2")).options.schedule == "auto"


@pytest.mark.parametrize(
    "flags, levels",
    [
        ("--context-parallel-size 8 --hierarchical-context-parallel-sizes 2 4", (2, 4)),
        ("--context-parallel-size 4", (1, 4)),
        ("--context-parallel-size 8 --sap-outer-size 2", (4, 2)),
        ("", (1, 1)),
    ],
)
def test_levels_default_from_hierarchical_sizes(flags: str, levels: tuple[int, int]) -> None:
    settings = sap_settings_from_args(_parse(flags))
    assert (settings.inner_size, settings.outer_size) == levels


@pytest.mark.parametrize(
    "flags, match",
    [
        ("--context-parallel-size 8 --sap-inner-size 3", "--sap-inner-size 3 must divide --context-parallel-size 8"),
        ("--context-parallel-size 8 --sap-outer-size 16", "--sap-outer-size 16 must divide --context-parallel-size 8"),
        ("--context-parallel-size 8 --sap-inner-size 4 --sap-outer-size 4",
         "--sap-inner-size 4 x --sap-outer-size 4: the product must equal --context-parallel-size 8"),
        ("--context-parallel-size 8 --hierarchical-context-parallel-sizes 2 2",
         "--hierarchical-context-parallel-sizes 2 2: the product must equal --context-parallel-size 8"),
        ("--context-parallel-size 8 --hierarchical-context-parallel-sizes 4 2 --num-attention-heads 6 --hidden-size 384",
         r"heads of one tensor-parallel rank do not split over the SAP inner \(Ulysses\) size 4: query heads \(6\)"),
        ("--context-parallel-size 4 --sap-inner-size 2 --num-attention-heads 8 --hidden-size 512 --group-query-attention "
         "--num-query-groups 3", r"key/value heads \(3\) must be divisible by the inner size \(2\)"),
        ("--context-parallel-size 8 --hierarchical-context-parallel-sizes 2 4 --sap-inner-size 4", "contradict"),
        ("--context-parallel-size 8 --hierarchical-context-parallel-sizes 2 2 2", "two hierarchical"),
        ("--sap-cost-preset h100 --sap-calibration-file cal.json", "not both"),
        ("--sap-plan-cache-size 0", "plan_cache_size"),
        ("--context-parallel-size 4 --sap-inner-size 0", ">= 1"),
        ("--sap-calibration-file /nonexistent/calibration.json", "cannot read the cost-model calibration file"),
    ],
)
def test_bad_flag_combinations_are_rejected(flags: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sap_settings_from_args(_parse(flags))


@pytest.mark.parametrize(
    "flags, match",
    [
        ("--context-parallel-size 8 --hierarchical-context-parallel-sizes 4 4",
         "--hierarchical-context-parallel-sizes 4 4: the product must equal --context-parallel-size 8"),
        ("--context-parallel-size 8 --hierarchical-context-parallel-sizes -2 -4",
         "--hierarchical-context-parallel-sizes -2 -4: each size must be >= 1"),
        ("--context-parallel-size 8 --hierarchical-context-parallel-sizes 8", "two hierarchical CP levels"),
    ],
)
def test_sap_levels_are_checked_when_the_flags_are_parsed(flags: str, match: str) -> None:
    """With --cp-comm-type sap the levels are checked by the parser, before Megatron-LM's
    `validate_args` asserts their product without a message; other CP methods are left to it."""
    with pytest.raises(ValueError, match=match):
        _parse(f"{flags} --cp-comm-type sap")
    with pytest.raises(ValueError, match=match):
        sap_settings_from_args(_parse(flags))
    assert _parse(f"{flags} --cp-comm-type p2p").hierarchical_context_parallel_sizes
    namespace, extras = chain_args_providers(add_sap_args)(_megatron_like_parser()).parse_known_args(
        "--context-parallel-size 8 --cp-comm-type sap --hierarchical-context-parallel-sizes 2 4 --unknown".split())
    assert namespace.hierarchical_context_parallel_sizes == [2, 4] and extras == ["--unknown"]


def test_a_calibration_file_is_read_when_the_flags_are(tmp_path) -> None:
    """A broken calibration file fails at start-up, not at the first batch; a good one is taken."""
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the cost-model calibration file .*broken.json"):
        sap_settings_from_args(_parse(f"--sap-calibration-file {broken}"))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object of CostModel fields"):
        sap_settings_from_args(_parse(f"--sap-calibration-file {listed}"))
    good = tmp_path / "calibration.json"
    good.write_text('{"cost_model": {"attention_tflops": 123.0}}')
    options = sap_settings_from_args(_parse(f"--sap-calibration-file {good}")).options
    assert options.calibration_file == str(good)


@pytest.mark.parametrize(
    "model, shape",
    [
        (dict(num_attention_heads=32, group_query_attention=True, num_query_groups=8, kv_channels=128,
              tensor_model_parallel_size=2, bf16=True), (16, 4, 128, 2)),
        (dict(num_attention_heads=16, num_query_groups=4, hidden_size=1024), (16, 16, 64, 4)),  # no GQA flag: MHA
        (dict(num_attention_heads=8, group_query_attention=True, num_query_groups=2, kv_channels=64,
              tensor_model_parallel_size=4, fp16=True), (2, 1, 64, 2)),
        # MLA (DeepSeek-V3's dims): keys of qk + rope dims, one per query head; hidden / heads is not the head dim.
        (dict(num_attention_heads=128, hidden_size=7168, kv_channels=56, multi_latent_attention=True, qk_head_dim=128,
              qk_pos_emb_head_dim=64, v_head_dim=128, group_query_attention=True, num_query_groups=8,
              tensor_model_parallel_size=8, bf16=True), (16, 16, 192, 2)),
        (dict(num_attention_heads=4, multi_latent_attention=True, qk_head_dim=16, qk_pos_emb_head_dim=8,
              v_head_dim=32), (4, 4, 32, 4)),  # values wider than keys: q and k padded to them
        ({}, None),
    ],
)
def test_cost_model_takes_the_model_shape_and_tp_from_the_flags(monkeypatch, model: dict, shape) -> None:
    """The planner weighs the attention one CP rank computes (the model's heads over TP, its
    head dim and precision) and counts the CP ranks of a node as its GPUs over TP."""
    from megatron_sap.megatron.plans import plan_for

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = _parse("--context-parallel-size 4")
    for name, value in model.items():
        setattr(args, name, value)
    options = sap_settings_from_args(args).options
    assert options.model_shape == shape
    assert options.attention_dtype == ("bfloat16" if model.get("bf16") else "float16" if model.get("fp16") else "float32")
    tp = model.get("tensor_model_parallel_size", 1)
    assert (options.gpus_per_node, options.tensor_parallel_size) == (8, tp)
    cost_model = plan_for([0, 100, 400], None).cost_model
    if shape is not None:
        assert (cost_model.num_heads, cost_model.num_kv_heads, cost_model.head_dim, cost_model.bytes_per_element) == shape
    assert cost_model.gpus_per_node == 8 // tp


def test_unknown_backend_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse("--sap-backend nonsense")
    assert exit_info.value.code == 2 and "--sap-backend: invalid choice: 'nonsense'" in capsys.readouterr().err


def test_sap_requested() -> None:
    assert sap_requested(SimpleNamespace(cp_comm_type=["sap"]))
    assert sap_requested(SimpleNamespace(cp_comm_type="sap"))
    assert not sap_requested(SimpleNamespace(cp_comm_type=["p2p"]))
    with pytest.raises(ValueError, match="mixed"):
        sap_requested(SimpleNamespace(cp_comm_type=["sap", "p2p"]))


def _fake_pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                   process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, store=None):
    """Megatron-LM's pretrain signature; parses like parse_args(extra_args_provider)."""
    parser = _megatron_like_parser()
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_args(["--sap-inner-size", "2"])


@pytest.mark.parametrize("how", ["keyword", "positional", "none"])
def test_pretrain_wrapper_chains_the_script_provider(how: str) -> None:
    wrapped = wrap_pretrain(_fake_pretrain)
    if how == "keyword":
        args = wrapped(None, None, None, None, extra_args_provider=_modelopt_provider, store=None)
    elif how == "positional":
        args = wrapped(None, None, None, None, None, _modelopt_provider)
    else:
        args = wrapped(None, None, None, None)
    assert args.sap_inner_size == 2
    assert hasattr(args, "export_te_mcore_model") == (how != "none")


@pytest.mark.parametrize("coefficient", [0.01, [0.0, 0.01]], ids=["one", "per-type"])
def test_moe_load_balancing_under_per_token_loss_warns_of_its_cp_weight(coefficient) -> None:
    from megatron_sap.megatron.hooks import configure_sap

    args = _parse("--context-parallel-size 4 --cp-comm-type sap")
    args.calculate_per_token_loss, args.num_experts, args.moe_aux_loss_coeff = True, 8, coefficient
    with pytest.warns(UserWarning, match="multiply --moe-aux-loss-coeff by 4"):
        configure_sap(args)
    for settings in (dict(moe_aux_loss_coeff=0.0), dict(moe_aux_loss_coeff=coefficient, moe_router_load_balancing_type="none")):
        for name, value in settings.items():
            setattr(args, name, value)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            configure_sap(args)


def test_initialize_hook_lays_out_cp_and_switches_specs() -> None:
    calls = []
    args = _parse("--context-parallel-size 4 --cp-comm-type sap --sap-inner-size 2")
    wrapped = wrap_initialize_model_parallel(lambda *a, **k: calls.append((a, k)), get_args=lambda: args)
    with pytest.warns(UserWarning, match="calculate-per-token-loss"):
        wrapped(1, 1, context_parallel_size=4, hierarchical_context_parallel_sizes=None)
    assert calls == [((1, 1), {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]})]
    assert args.hierarchical_context_parallel_sizes == [2, 2]
    assert LocalSpecProvider().core_attention() is SAPDotProductAttention
    from megatron.core.transformer import attention

    assert hasattr(attention.apply_rotary_pos_emb, "__wrapped__")


def test_initialize_hook_is_transparent_without_sap() -> None:
    calls = []
    args = _parse("--context-parallel-size 4 --cp-comm-type p2p")
    wrapped = wrap_initialize_model_parallel(lambda *a, **k: calls.append((a, k)), get_args=lambda: args)
    wrapped(1, context_parallel_size=4, hierarchical_context_parallel_sizes=None)
    assert calls == [((1,), {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": None})]
    assert LocalSpecProvider().core_attention() is not SAPDotProductAttention


def _row(position_ids: list[int]) -> dict:
    n = len(position_ids)
    return {"tokens": torch.arange(n).unsqueeze(0), "labels": torch.arange(1, n + 1).unsqueeze(0),
            "loss_mask": torch.ones(1, n), "attention_mask": None,
            "position_ids": torch.tensor([position_ids]), "cu_seqlens": None, "max_seqlen": None}


def test_unpacked_batches_become_packed() -> None:
    reset = pack_unpacked_batch(_row([0, 1, 2, 0, 1, 0, 1, 2]), reset_position_ids=True)
    assert reset["cu_seqlens"].tolist() == [[0, 3, 5, 8]] and reset["max_seqlen"].tolist() == [3]
    whole = pack_unpacked_batch(_row(list(range(8))), reset_position_ids=False)
    assert whole["cu_seqlens"].tolist() == [[0, 8]]
    with pytest.raises(ValueError, match="micro-batch-size 1"):
        pack_unpacked_batch({"tokens": torch.zeros(2, 8), "cu_seqlens": None}, reset_position_ids=False)


def test_batch_hooks_split_packed_rows_with_sap() -> None:
    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True)
    get_batch = wrap_get_batch_on_this_tp_rank(lambda iterator: _row([0, 1, 2, 0, 1, 0, 1, 2]), get_args=lambda: args)
    split = wrap_get_thd_batch_on_this_cp_rank(lambda *a, **k: pytest.fail("Megatron's split was called"),
                                               get_args=lambda: args)
    batch = get_batch(None)
    cu, padded, max_seqlen = batch.pop("cu_seqlens"), batch.pop("cu_seqlens_padded", None), batch.pop("max_seqlen")
    with pytest.raises(ValueError, match="its own CP group \\(size 1, this rank 0\\), got cp_size=2"):
        split(dict(batch), cu, padded, max_seqlen, cp_size=2, cp_rank=1)
    local, params = split(batch, cu, padded, max_seqlen, cp_size=1, cp_rank=0)
    assert list(local) == ["tokens", "labels", "loss_mask", "attention_mask", "position_ids"]
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 8] and params.max_seqlen_q == 3
    assert torch.equal(local["tokens"], torch.arange(8)[None])  # one CP rank: the whole row, in order
    assert torch.equal(local["labels"], local["tokens"] + 1)
    assert local["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]] and bool(local["loss_mask"].all())


def test_legacy_batch_hooks_split_rows_and_hand_the_model_their_params() -> None:
    """Megatron-LM before core_v0.16 and from core_v0.18: the CP split becomes SAP's (entries in
    their order, as `get_batch` returns `batch.values()`), and the model called on its tokens gets
    that split's packed parameters, in place of none (before core_v0.16) or of those the script
    built from the row's cu_seqlens (core_v0.18 on)."""
    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True)
    split = wrap_get_batch_on_this_cp_rank(lambda batch: pytest.fail("Megatron's split was called"), get_args=lambda: args)
    row = _row([0, 1, 2, 0, 1, 0, 1, 2])
    del row["cu_seqlens"], row["max_seqlen"]
    local = split(row)
    assert list(local) == ["tokens", "labels", "loss_mask", "attention_mask", "position_ids"]
    assert torch.equal(local["labels"], local["tokens"] + 1)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, packed_seq_params=None):
        return packed_seq_params

    model_forward = wrap_gpt_forward(forward, get_args=lambda: args)
    params = model_forward(None, local["tokens"], local["position_ids"], None, labels=local["labels"])
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 5, 8] and params.max_seqlen_q == 3
    assert model_forward(None, local["tokens"].clone(), None, None) is None  # tokens no split made
    assert model_forward(None, local["tokens"], None, None, packed_seq_params="given") is params
    assert model_forward(None, local["tokens"].clone(), None, None, packed_seq_params="given") == "given"
    whole = wrap_get_batch_on_this_cp_rank(lambda batch: None, get_args=lambda: SimpleNamespace(cp_comm_type="sap"))
    assert model_forward(None, whole(_row([0, 1, 0, 1]))["tokens"], None, None).cu_seqlens_q.tolist() == [0, 4]
    with pytest.raises(ValueError, match="got neither them nor the tokens"):
        split({"tokens": None, "labels": torch.zeros(1, 4)})


def _on_device(batch: dict) -> dict:
    """A batch as `get_batch_on_this_tp_rank` moves it to the GPU, with the entries the host
    would have to read back from there (position ids, cu_seqlens) on the meta device, which
    has no values: reading them fails."""
    return {key: value.to("meta") if key in ("position_ids", "cu_seqlens") and value is not None else value
            for key, value in batch.items()}


def _tp_source(data_iterator) -> dict:
    """`get_batch_on_this_tp_rank` on the rank that reads the data."""
    return _on_device(next(data_iterator))


@pytest.mark.parametrize("reset", [True, False])
def test_batch_hooks_plan_from_the_loaders_host_copy(reset: bool) -> None:
    """On the rank that reads the data, the split plans from the loader's CPU tensors: the
    batch's device copies are never read (core_v0.16 flow)."""
    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=reset)
    get_batch = wrap_get_batch_on_this_tp_rank(_tp_source, get_args=lambda: args)
    split = wrap_get_thd_batch_on_this_cp_rank(lambda *a, **k: pytest.fail("Megatron's split was called"),
                                               get_args=lambda: args)
    sample = _row([0, 1, 2, 0, 1, 0, 1, 2])
    with pytest.raises((NotImplementedError, RuntimeError, ValueError)):  # the premise: a device read fails here
        pack_unpacked_batch(_on_device(sample), reset_position_ids=True)
    batch = get_batch(iter([sample]))
    cu, max_seqlen = batch.pop("cu_seqlens"), batch.pop("max_seqlen")
    documents = [0, 3, 5, 8] if reset else [0, 8]
    assert cu.tolist() == [documents] and max_seqlen.tolist() == [max(b - a for a, b in zip(documents, documents[1:]))]
    local, params = split(batch, cu, None, max_seqlen)
    assert params.cu_seqlens_q.tolist() == documents
    positions = torch.cat([torch.arange(b - a) for a, b in zip(documents, documents[1:])])
    assert torch.equal(local["position_ids"][0], positions[local["tokens"][0]])

    # The loader's own cu_seqlens (SFT data), and boundaries other than the batch's (read as given).
    given = {**_row(list(range(8))), "cu_seqlens": torch.tensor([[0, 4, 8]], dtype=torch.int32)}
    batch = get_batch(iter([given]))
    cu, max_seqlen = batch.pop("cu_seqlens"), batch.pop("max_seqlen")
    assert split(dict(batch), cu, None, max_seqlen)[1].cu_seqlens_q.tolist() == [0, 4, 8]
    padded = torch.tensor([[0, 2, 8]], dtype=torch.int32)
    assert split(batch, cu, padded, max_seqlen)[1].cu_seqlens_q.tolist() == [0, 2, 8]


def test_legacy_batch_hooks_plan_from_the_loaders_host_copy() -> None:
    """Before core_v0.16 the batch keeps its entries (`get_batch` returns `batch.values()`) and
    the CP split plans from the loader's CPU tensors too."""
    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True)
    get_batch = wrap_get_batch_on_this_tp_rank(_tp_source, get_args=lambda: args, pack=False)
    split = wrap_get_batch_on_this_cp_rank(lambda batch: pytest.fail("Megatron's split was called"), get_args=lambda: args)
    sample = _row([0, 1, 2, 0, 1, 0, 1, 2])
    del sample["cu_seqlens"], sample["max_seqlen"]
    batch = get_batch(data_iterator=iter([sample]))
    assert list(batch) == list(sample)
    local = split(batch)
    assert list(local) == list(sample)
    assert torch.equal(local["position_ids"][0], torch.tensor([0, 1, 2, 0, 1, 0, 1, 2])[local["tokens"][0]])


def test_a_loader_on_the_device_still_gives_every_tp_rank_the_documents() -> None:
    """A data loader whose micro-batches are already on the GPU leaves no host copy to read:
    the TP source reads the documents back from the device once and shares them, so the last
    stage's other TP ranks (no tokens) split by them too instead of by Megatron's own split."""
    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True, context_parallel_size=2)
    shared = []

    def broadcast(box, src, group):
        shared.append(box[0])

    def on_the_device(item, reset, from_device=False):  # the item's tensors read only where a device read is allowed
        return host_boundaries(item, reset) if from_device else None

    get_batch = wrap_get_batch_on_this_tp_rank(lambda iterator: dict(next(iterator)), get_args=lambda: args,
                                               host_group=lambda: ("tp twin", 0))
    with mock.patch("megatron_sap.megatron.hooks.host_boundaries", on_the_device), \
            mock.patch("megatron_sap.megatron.hooks.dist.broadcast_object_list", broadcast):
        batch = get_batch(iter([_row([0, 1, 2, 0, 1, 0, 1, 2])]))
    assert shared == [([0, 3, 5, 8], None)] and batch["cu_seqlens"].tolist() == [[0, 3, 5, 8]]


@pytest.mark.parametrize("cp", [1, 2])
def test_last_stage_tp_ranks_that_get_no_documents_fail_clearly(cp: int) -> None:
    """Where the source shares no documents, a TP rank without tokens cannot pack its batch:
    under CP it would take Megatron's own split while the source takes SAP's (labels in
    another order than the logits, no error), so it raises; at CP 1 both orders are the row's."""
    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True, context_parallel_size=cp)
    receiver = {"tokens": None, "labels": torch.arange(1, 9).unsqueeze(0), "loss_mask": torch.ones(1, 8),
                "attention_mask": None, "position_ids": None}
    get_batch = wrap_get_batch_on_this_tp_rank(lambda iterator: dict(receiver), get_args=lambda: args,
                                               host_group=lambda: ("tp twin", 0))
    with mock.patch("megatron_sap.megatron.hooks.dist.broadcast_object_list",
                    lambda box, src, group: box.__setitem__(0, (None, None))):
        if cp == 1:
            assert get_batch(None).get("cu_seqlens") is None
        else:
            with pytest.raises(ValueError, match=r"this rank got neither them nor the tokens .* \(its TP source could not"):
                get_batch(None)


@pytest.mark.parametrize("pack", [True, False], ids=["core_v0.16", "before"])
def test_last_stage_tp_ranks_without_tokens_split_by_the_shared_documents(pack: bool) -> None:
    """A last pipeline stage's TP ranks other than the source get labels and loss mask but no
    tokens or position ids; the documents the source read, shared over the TP host group, split
    their batch (core_v0.16: packed, then SAP's THD split; before: the CP split, and the model
    finds the split's parameters by the labels)."""
    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True)
    documents = [0, 3, 5, 8]

    def last_stage_receiver(data_iterator) -> dict:
        assert data_iterator is None
        return {"tokens": None, "labels": torch.arange(1, 9).unsqueeze(0), "loss_mask": torch.ones(1, 8),
                "attention_mask": None, "position_ids": None}

    get_batch = wrap_get_batch_on_this_tp_rank(last_stage_receiver, get_args=lambda: args, pack=pack,
                                               host_group=lambda: ("tp twin", 0))
    with mock.patch("megatron_sap.megatron.hooks.dist.broadcast_object_list",
                    lambda box, src, group: box.__setitem__(0, (documents, None))):
        batch = get_batch(None)
    if pack:
        cu, max_seqlen = batch.pop("cu_seqlens"), batch.pop("max_seqlen")
        assert cu.tolist() == [documents] and max_seqlen.tolist() == [3]
        split = wrap_get_thd_batch_on_this_cp_rank(lambda *a, **k: pytest.fail("Megatron's split was called"),
                                                   get_args=lambda: args)
        local, params = split(batch, cu, None, max_seqlen)
    else:
        split = wrap_get_batch_on_this_cp_rank(lambda batch: pytest.fail("Megatron's split was called"),
                                               get_args=lambda: args)
        local = split(batch)

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, packed_seq_params=None):
            return packed_seq_params

        params = wrap_gpt_forward(forward, get_args=lambda: args)(None, None, None, None, labels=local["labels"])
    assert local["tokens"] is None and local["position_ids"] is None
    assert params.cu_seqlens_q.tolist() == documents and torch.equal(local["labels"], batch["labels"])


BATCH_KEYS = ["attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
              "loss_mask", "max_seqlen", "position_ids", "tokens"]  # Megatron-LM core_v0.19's get_batch returns these


def _core_v019_forward_step(args: SimpleNamespace):
    """A stand-in for Megatron-LM core_v0.19's `pretrain_gpt.forward_step` on the rank that reads
    the data, through the SAP hooks of megatron-core's batch functions (same signatures): the
    loader's micro-batch moved to the device in place (`_on_device`: what the host would read
    back fails), TP broadcast, flattening, CP split, and the model called with packed parameters
    the script builds from the batch's `cu_seqlens` where it has them. Returns what the model got."""
    from megatron.core.packed_seq_params import PackedSeqParams

    def get_batch_on_this_tp_rank(batch, has_cu_seqlens, is_hybrid_cp, create_attention_mask_in_dataloader,
                                  broadcast_src_rank, broadcast_group, cp_size, tp_rank, micro_batch_size, seq_length,
                                  mtp_on_this_rank, pipeline_model_parallel_size=1, is_pipeline_first_stage=False,
                                  is_pipeline_last_stage=False):
        return batch

    get_tp = wrap_core_get_batch_on_this_tp_rank(get_batch_on_this_tp_rank, get_args=lambda: args)
    flatten = wrap_flatten_batch_for_packed_sequences(lambda batch: pytest.fail("Megatron's flattening was called"),
                                                      get_args=lambda: args)
    split = wrap_get_batch_on_this_cp_rank(lambda *a, **k: pytest.fail("Megatron's split was called"),
                                           get_args=lambda: args)
    model = wrap_gpt_forward(lambda self, input_ids, position_ids, attention_mask, labels=None, packed_seq_params=None:
                             (input_ids, position_ids, packed_seq_params), get_args=lambda: args)

    def forward_step(data_iterator, model_chunk):
        batch = next(data_iterator)
        moved = _on_device({key: batch.get(key) for key in BATCH_KEYS})
        batch.update(moved)  # in place, as core_v0.19's get_batch does
        batch = get_tp(batch, has_cu_seqlens=False, is_hybrid_cp=False, create_attention_mask_in_dataloader=False,
                       broadcast_src_rank=0, broadcast_group=None, cp_size=1, tp_rank=0, micro_batch_size=1,
                       seq_length=batch["tokens"].size(1), mtp_on_this_rank=False)
        batch = flatten(batch)
        batch = split(batch, is_hybrid_cp=False, cp_group=None, hybrid_cp_group_func=None,
                      use_per_sequence_balancing=False)
        values = dict(zip(BATCH_KEYS, [batch[key] for key in BATCH_KEYS]))
        params = None
        if values["cu_seqlens"] is not None:
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=values["cu_seqlens"].squeeze(0),
                                     cu_seqlens_kv=values["cu_seqlens"].squeeze(0), max_seqlen_q=0, max_seqlen_kv=0)
        return model(None, values["tokens"], values["position_ids"], None, labels=values["labels"],
                     packed_seq_params=params)

    return wrap_forward_step(forward_step, get_args=lambda: args)


@pytest.mark.parametrize("reset", [True, False])
def test_core_batch_hooks_plan_from_the_recorded_host_copy(reset: bool) -> None:
    """Megatron-LM core_v0.18 on: the forward step's data iterator is recorded, so the split plans
    from the loader's CPU tensors although the script moved them to the device in place; the model
    gets the split's packed parameters, in place of those the script built from `cu_seqlens`; SFT
    rows' `cu_seqlens`, padded with repeats of the row length, plan without those documents of
    no tokens, and the flattening that would read them back is skipped."""
    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=reset)
    forward_step = _core_v019_forward_step(args)
    sample = _row([0, 1, 2, 0, 1, 0, 1, 2])
    tokens, positions, params = forward_step(iter([sample]), None)
    documents = [0, 3, 5, 8] if reset else [0, 8]
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == documents
    expected = torch.cat([torch.arange(b - a) for a, b in zip(documents, documents[1:])])
    assert torch.equal(positions[0], expected[tokens[0]])

    sft = {**_row(list(range(8))), "cu_seqlens": torch.tensor([[0, 4, 6, 8, 8, 8]], dtype=torch.int32),
           "max_seqlen": torch.tensor([4])}
    tokens, positions, params = forward_step(iter([sft]), None)
    assert params.cu_seqlens_q.tolist() == [0, 4, 6, 8] and params.max_seqlen_q == 4
    assert torch.equal(positions[0], torch.tensor([0, 1, 2, 3, 0, 1, 0, 1])[tokens[0]])


def test_core_batch_hooks_take_the_plan_the_loader_made() -> None:
    """Megatron-LM core_v0.18 on, through the data loader hook: the split finds the worker's plan
    (a cache hit, no miss), read from the recorded host copy."""
    from megatron_sap.megatron.hooks import wrap_build_pretraining_data_loader
    from megatron_sap.planning.plan import DEFAULT_CACHE

    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True, dataloader_type="single", num_workers=1)
    build = wrap_build_pretraining_data_loader(
        lambda dataset, consumed: torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=args.num_workers),
        get_args=lambda: args)
    loader = iter(build(_Rows([[5, 9, 2]]), 0))
    DEFAULT_CACHE.clear()
    try:
        _, _, params = _core_v019_forward_step(args)(loader, None)
        assert params.cu_seqlens_q.tolist() == [0, 5, 14, 16]
        assert (DEFAULT_CACHE.hits, DEFAULT_CACHE.misses) == (1, 0)
    finally:
        DEFAULT_CACHE.clear()


def test_loader_of_a_stage_that_reads_no_data_plans_nothing(monkeypatch) -> None:
    """A middle pipeline stage's model chunks take the first stage's documents and plans; with
    --sft from core_v0.18 it still builds a data loader (for the rows' boundaries), whose
    workers would plan rows nobody uses: its dataset is not wrapped."""
    from megatron_sap.megatron import hooks
    from megatron_sap.megatron.loader import PLAN_KEY

    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True, dataloader_type="single", num_workers=1)
    build = hooks.wrap_build_pretraining_data_loader(
        lambda dataset, consumed: torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=args.num_workers),
        get_args=lambda: args)
    assert PLAN_KEY in next(iter(build(_Rows([[5, 9, 2]]), 0)))
    monkeypatch.setattr(hooks, "rank_reads_no_data", lambda: True)
    assert PLAN_KEY not in next(iter(build(_Rows([[5, 9, 2]]), 0)))


def _core_v019_pretrain(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
                        model_provider=None, process_non_loss_data_func=None, store=None):
    """Megatron-LM core_v0.19's `pretrain` signature: a config container, no `extra_args_provider`."""
    return forward_step_func


def test_core_pretrain_wrapper_records_the_forward_step_and_parse_args_takes_the_flags() -> None:
    """From core_v0.18 `pretrain` takes no flags (the script parses them with `parse_args`, which
    gets the SAP flags instead) and its forward step is wrapped to record the data iterator."""
    args = SimpleNamespace(cp_comm_type=["sap"])
    seen = []
    step = wrap_pretrain(_core_v019_pretrain, record_batches=True, get_args=lambda: args)(
        None, None, None, lambda it, model: seen.append(it))
    step(iter([{"tokens": torch.zeros(1, 2)}]), None)
    assert type(seen[0]).__name__ == "_Recorder"

    from megatron_sap.megatron import hooks

    chunks = []
    step = wrap_forward_step(lambda it, model: chunks.append((it, hooks._RECORDING[-1].chunk)), get_args=lambda: args)
    step(None, SimpleNamespace(module=SimpleNamespace(vp_stage=1)))  # a TP rank without data: the chunk all the same
    assert chunks == [(None, 1)] and not hooks._RECORDING
    assert wrap_pretrain(_core_v019_pretrain)(None, None, None, "step") == "step"  # before core_v0.18: as given
    parse = wrap_parse_args(lambda extra_args_provider=None, ignore_unknown_args=False:
                            extra_args_provider(_megatron_like_parser()).parse_args(["--sap-inner-size", "2"]))
    assert parse().sap_inner_size == 2 and wrap_parse_args(parse) is parse


def test_core_batch_hooks_defer_to_megatron_without_sap() -> None:
    args = SimpleNamespace(cp_comm_type=["p2p"], reset_position_ids=True)
    assert wrap_flatten_batch_for_packed_sequences(lambda batch: "megatron", get_args=lambda: args)({}) == "megatron"
    get_tp = wrap_core_get_batch_on_this_tp_rank(lambda batch, tp_rank: "megatron", get_args=lambda: args)
    assert get_tp({}, tp_rank=0) == "megatron"
    step = wrap_forward_step(lambda it, model: it, get_args=lambda: args)
    source = iter([])
    assert step(source, None) is source


def test_host_boundaries_of_loader_samples() -> None:
    row = _row([0, 1, 0, 1, 2, 0])
    assert host_boundaries(row, reset_position_ids=True) == [0, 2, 5, 6]
    assert host_boundaries(row, reset_position_ids=False) == [0, 6]
    assert host_boundaries({**row, "cu_seqlens": torch.tensor([[0, 3, 6]])}, reset_position_ids=True) == [0, 3, 6]
    padded = torch.tensor([[0, 3, 3, 6, 6, 6, 6]])  # SFT rows (core_v0.19): padded with the row length
    assert host_boundaries({**row, "cu_seqlens": padded}, reset_position_ids=True) == [0, 3, 3, 6]
    assert host_boundaries({**row, "cu_seqlens": torch.tensor([[0, 6, 6]])}, reset_position_ids=True) == [0, 6]
    assert host_boundaries(_on_device(row), reset_position_ids=True) is None  # not on the host: read on the device
    assert host_boundaries({**row, "tokens": torch.zeros(2, 3)}, reset_position_ids=False) is None  # not one row
    assert host_boundaries(None, reset_position_ids=False) is None
    with pytest.raises(ValueError, match="must start a document"):
        host_boundaries(_row([1, 2, 0]), reset_position_ids=True)


class _Rows(torch.utils.data.Dataset):
    """Megatron-like samples: one [S] row each, position ids restarting per document."""

    split = "train"  # an attribute of the dataset's own, as Megatron's samplers read

    def __init__(self, documents: list[list[int]]) -> None:
        self.documents = documents

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, index: int) -> dict:
        positions = torch.cat([torch.arange(n) for n in self.documents[index]])
        return {"tokens": torch.arange(len(positions)), "labels": torch.arange(1, len(positions) + 1),
                "loss_mask": torch.ones(len(positions)), "position_ids": positions}


def test_loader_workers_plan_every_row() -> None:
    """Each sample's plan, made in a worker process for a 2 x 4 layout, is the plan the training
    process would make, with the rank's program compiled; the dataset's attributes stay reachable."""
    import pickle

    from megatron_sap.megatron.loader import LoaderPlanning, PlannedDataset, loader_plan_bytes

    rows = _Rows([[700, 300, 1048], [2048], [1, 2, 3, 2042]])
    planning = LoaderPlanning(4, 2, sap.CostModel.preset("h100"), outer_rank=3, schedule="pipelined",
                              recompute_kv=False, reset_position_ids=True)
    dataset = PlannedDataset(rows, planning)
    assert dataset.split == "train" and len(dataset) == 3
    assert pickle.loads(pickle.dumps(dataset)).split == "train"  # as a spawned worker gets it
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=2)
    for documents, batch in zip(rows.documents, loader):
        plan = pickle.loads(loader_plan_bytes(batch))
        cu = [0, *itertools.accumulate(documents)]
        expected = sap.plan_sequences(cu, outer_size=4, inner_size=2, cost_model="h100", cache=None)
        assert list(plan.cu_seqlens) == cu and plan.signature() == expected.signature()
        assert (3, "cpu", "pipelined") in plan._programs  # compiled in the worker
        assert torch.equal(plan.local_indices(7), expected.local_indices(7))


def test_the_same_plan_bytes_are_unpickled_once(monkeypatch) -> None:
    """The model chunks of a stage that read no data adopt each micro-batch's plan from the bytes
    the first stage sent: unpickled once, the same plan; equal bytes of another object again."""
    import pickle

    from megatron_sap.megatron import loader
    from megatron_sap.planning.plan import DEFAULT_CACHE

    cu = [0, 5, 14, 16]
    data = pickle.dumps(sap.plan_sequences(cu, outer_size=1, cache=None))
    loads, unpickle = [], pickle.loads
    monkeypatch.setattr(loader.pickle, "loads", lambda b: loads.append(b) or unpickle(b))
    monkeypatch.setattr(loader, "_ADOPTED", {})
    monkeypatch.setattr(loader, "_refusal_logged", False)  # restored after: the refusal below logs once per process
    DEFAULT_CACHE.clear()
    try:
        first = loader.adopt_loader_plan(data, cu)
        assert first is not None and loader.adopt_loader_plan(data, cu) is first and len(loads) == 1
        again = loader.adopt_loader_plan(bytes(bytearray(data)), cu)
        assert again is not None and again is not first and len(loads) == 2
        assert loader.adopt_loader_plan(data, [0, 16]) is None  # another row's documents: refused still
        for i in range(loader.ADOPTED_KEPT + 2):  # bounded
            loader.adopt_loader_plan(bytes(bytearray(data)), cu)
        assert len(loader._ADOPTED) == loader.ADOPTED_KEPT
    finally:
        DEFAULT_CACHE.clear()


def test_a_loader_plan_for_another_layout_is_refused_and_a_sized_cache_gets_the_first(caplog) -> None:
    """A worker's plan of the right row for other SAP levels (a loader set up before the
    groups) is refused and said so, not cached beside the one the split makes; with
    --sap-plan-cache-size the first plan goes to that cache (empty, it is falsy)."""
    import pickle

    import megatron_sap as sap
    from megatron_sap.megatron import plans
    from megatron_sap.megatron.loader import adopt_loader_plan
    from megatron_sap.megatron.options import reset_sap_options, set_sap_options

    row = [0, 5, 14, 16]
    with caplog.at_level("WARNING", logger="megatron_sap.megatron.loader"), \
            mock.patch("megatron_sap.megatron.loader._refusal_logged", False):
        elsewhere = sap.plan_sequences(row, outer_size=2, inner_size=2, cache=None)
        assert adopt_loader_plan(pickle.dumps(elsewhere), row) is None  # this process runs one rank
    assert "another row, SAP layout" in caplog.text
    set_sap_options(plan_cache_size=4)
    try:
        cache = plans._planning()[0]
        assert cache is not None and len(cache) == 0
        mine = sap.plan_sequences(row, cache=None)
        assert adopt_loader_plan(pickle.dumps(mine), row) == mine and len(cache) == 1
        assert plans.plan_for(row, None) == mine and (cache.hits, cache.misses) == (1, 0)
    finally:
        reset_sap_options()


def test_a_loader_plan_of_another_cost_model_or_slacks_is_refused(caplog) -> None:
    """A worker's plan of the right row and layout, but made with another cost model, other
    load slacks or another choice among the candidates (`choose_by`) than this rank plans
    with, is refused (and said so), never cached."""
    import pickle

    import megatron_sap as sap
    from megatron_sap.megatron import plans
    from megatron_sap.megatron.loader import adopt_loader_plan
    from megatron_sap.megatron.options import reset_sap_options, set_sap_options

    row = [0, 5, 14, 16]
    set_sap_options(plan_cache_size=4)
    try:
        cache = plans._planning()[0]
        cache.clear()  # one cache per size, shared with the tests before
        for other in (sap.plan_sequences(row, cache=None, cost_model="h200"),
                      sap.plan_sequences(row, cache=None, slacks=(0.5,)),
                      sap.plan_sequences(row, cache=None, choose_by="timeline")):
            with caplog.at_level("WARNING", logger="megatron_sap.megatron.loader"), \
                    mock.patch("megatron_sap.megatron.loader._refusal_logged", False):
                caplog.clear()
                assert adopt_loader_plan(pickle.dumps(other), row) is None
            assert "cost model, load slacks or --sap-choose-by" in caplog.text and len(cache) == 0
    finally:
        reset_sap_options()


def test_the_batch_split_takes_the_plan_a_loader_sample_carries() -> None:
    """A micro-batch of a `PlannedDataset` goes to `sap_split_batch` as it comes: the plan the
    worker made is adopted (the split plans nothing itself) and its entry is not in the split
    batch, whose tensors are the plan's positions."""
    from megatron_sap.megatron import plans
    from megatron_sap.megatron.batch import sap_split_batch
    from megatron_sap.megatron.loader import PLAN_KEY, LoaderPlanning, PlannedDataset
    from megatron_sap.megatron.options import reset_sap_options, set_sap_options

    set_sap_options(plan_cache_size=3)
    try:
        cache = plans._planning()[0]
        cache.clear()  # one cache per size, shared with other tests
        planning = LoaderPlanning(1, 1, plans.planning_cost_model(), outer_rank=0, schedule="pipelined",
                                  recompute_kv=False, reset_position_ids=True)
        rows = _Rows([[700, 300, 1048], [1, 2, 3, 2042]])
        loader = torch.utils.data.DataLoader(PlannedDataset(rows, planning), batch_size=1)
        for documents, batch in zip(rows.documents, loader):
            assert PLAN_KEY in batch
            cu = [0, *itertools.accumulate(documents)]
            local, params = sap_split_batch(batch, cu)
            assert PLAN_KEY not in local and set(local) == {"tokens", "labels", "loss_mask", "position_ids"}
            plan = plans.plan_for(cu, None)
            assert torch.equal(local["tokens"], batch["tokens"][:, plan.local_indices(0)])
            assert params.cu_seqlens_q.tolist() == cu
        assert cache.misses == 0 and len(cache) == 2  # every plan came from the loader
    finally:
        reset_sap_options()


def test_choose_by_goes_from_the_flag_to_every_plan_made(capsys) -> None:
    """--sap-choose-by (default: estimate) sets how the batch split's plans and the loader
    workers' are chosen among the candidates; a loader plan chosen alike is taken."""
    import pickle

    from megatron_sap.megatron import plans
    from megatron_sap.megatron.loader import LoaderPlanning, adopt_loader_plan
    from megatron_sap.megatron.options import SAPOptions, reset_sap_options

    parser = chain_args_providers(None, add_sap_args)(argparse.ArgumentParser())
    parser.add_argument("--context-parallel-size", type=int, default=1)
    assert sap_settings_from_args(parser.parse_args([])).options.choose_by == "estimate"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--sap-choose-by", "fastest"])
    assert exit_info.value.code == 2 and "--sap-choose-by: invalid choice: 'fastest'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="choose_by must be one of"):
        SAPOptions(choose_by="fastest")
    row = [0, 700, 1000, 2048]
    try:
        assert sap_settings_from_args(parser.parse_args(["--sap-choose-by", "timeline"])).options.choose_by == "timeline"
        assert plans.plan_for(row, None).choose_by == "timeline"
        planning = LoaderPlanning(1, 1, plans.planning_cost_model(), outer_rank=0, schedule="auto", recompute_kv=False,
                                  reset_position_ids=True, choose_by="timeline")
        made = planning.plan({"tokens": torch.arange(2048), "position_ids": torch.cat([torch.arange(n) for n in (700, 300, 1048)])})
        assert made.choose_by == "timeline" and list(made.cu_seqlens) == row
        assert adopt_loader_plan(pickle.dumps(made), row) is not None
    finally:
        reset_sap_options()


def test_batch_hooks_take_the_plan_the_loader_made(caplog) -> None:
    """Through the data loader hook and the batch hooks: the split finds the worker's plan in
    the plan cache (a hit, no miss), and a plan for another row is not taken."""
    import pickle

    from megatron_sap.megatron.hooks import wrap_build_pretraining_data_loader
    from megatron_sap.megatron.loader import PLAN_KEY, adopt_loader_plan, loader_plan_bytes
    from megatron_sap.planning.plan import DEFAULT_CACHE

    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True, dataloader_type="single", num_workers=1)
    build = wrap_build_pretraining_data_loader(
        lambda dataset, consumed: torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=args.num_workers),
        get_args=lambda: args)
    get_batch = wrap_get_batch_on_this_tp_rank(_tp_source, get_args=lambda: args)
    split = wrap_get_thd_batch_on_this_cp_rank(lambda *a, **k: pytest.fail("Megatron's split was called"),
                                               get_args=lambda: args)
    loader = iter(build(_Rows([[5, 9, 2], [16]]), 0))
    DEFAULT_CACHE.clear()
    batch = get_batch(loader)
    assert len(DEFAULT_CACHE) == 1 and DEFAULT_CACHE.misses == 0
    cu, max_seqlen = batch.pop("cu_seqlens"), batch.pop("max_seqlen")
    local, params = split(batch, cu, None, max_seqlen)
    assert params.cu_seqlens_q.tolist() == [0, 5, 14, 16]
    assert (DEFAULT_CACHE.hits, DEFAULT_CACHE.misses) == (1, 0)  # the worker's plan, not planned here
    assert PLAN_KEY not in local

    other = next(loader)  # the next row's plan does not pass for this row's, and says so once
    with caplog.at_level("WARNING", logger="megatron_sap.megatron.loader"):
        assert adopt_loader_plan(loader_plan_bytes(other), [0, 5, 14, 16]) is None
    assert "does not fit this micro-batch" in caplog.text
    assert pickle.loads(loader_plan_bytes(other)).cu_seqlens == (0, 16)
    args.sap_plan_in_data_loader = False
    assert PLAN_KEY not in next(iter(build(_Rows([[16]]), 0)))
    args.sap_plan_in_data_loader, args.num_workers = True, 0  # no workers: the training process plans directly
    assert PLAN_KEY not in next(iter(build(_Rows([[16]]), 0)))
    DEFAULT_CACHE.clear()


def test_batch_hooks_defer_to_megatron_without_sap() -> None:
    args = SimpleNamespace(cp_comm_type=["p2p"], reset_position_ids=True)
    get_batch = wrap_get_batch_on_this_tp_rank(lambda iterator: _row([0, 1, 0, 1]), get_args=lambda: args)
    assert get_batch(None)["cu_seqlens"] is None
    split = wrap_get_thd_batch_on_this_cp_rank(lambda *a, **k: "megatron", get_args=lambda: args)
    assert split({}, None, None, None) == "megatron"
    assert wrap_get_batch_on_this_cp_rank(lambda batch: "megatron", get_args=lambda: args)({}) == "megatron"
    forward = wrap_gpt_forward(lambda self, input_ids, packed_seq_params=None: packed_seq_params, get_args=lambda: args)
    assert forward(None, torch.zeros(1, 4)) is None


def test_spec_builder_hook_swaps_only_with_sap() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    def core_attention(spec):
        return spec.submodules.self_attention.submodules.core_attention

    args = SimpleNamespace(cp_comm_type=["sap"])
    assert core_attention(wrap_spec_builder(get_gpt_layer_local_spec, get_args=lambda: args)()) is SAPDotProductAttention
    args.cp_comm_type = ["p2p"]
    assert core_attention(wrap_spec_builder(get_gpt_layer_local_spec, get_args=lambda: args)()) is not SAPDotProductAttention


def test_launcher_rejects_a_missing_script(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "megatron_sap.launch", "/nonexistent/pretrain_gpt.py"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "not found" in result.stderr and "MEGATRON_LM_PATH" not in result.stderr
    # `$MEGATRON_LM_PATH/pretrain_gpt.py` with the variable unset reads as /pretrain_gpt.py: the error says so.
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_PATH"}
    result = subprocess.run([sys.executable, "-m", "megatron_sap.launch", "/pretrain_gpt.py"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0 and "MEGATRON_LM_PATH is not set" in result.stderr
    result = subprocess.run([sys.executable, "-m", "megatron_sap.launch", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "is a directory, not a training script" in result.stderr


def test_launcher_help_and_a_missing_megatron_lm(tmp_path) -> None:
    run = lambda *argv, **env: subprocess.run([sys.executable, "-m", "megatron_sap.launch", *argv], capture_output=True,  # noqa: E731
                                              text=True, timeout=120, env={**os.environ, **env})
    shown = run("--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: python -m megatron_sap.launch")
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("print('ran')\n")
    # The script's --help (Megatron-LM's) lists its own flags only: the launcher lists SAP's first.
    shown = run(str(script), "--help", MEGATRON_LM_PATH="")
    assert shown.stdout.startswith("SAP flags, which the launcher adds") and "--sap-inner-chunks" in shown.stdout
    # megatron-core 0.19's wheel ships a `megatron.training` too, which needs Python 3.12: where it
    # cannot be imported, the launcher must refuse it as well.
    probe = subprocess.run([sys.executable, "-W", "ignore", "-c",
                            "import megatron.training.utils as u; "
                            "from megatron_sap.megatron.compat import training_layout as h; print(h(u) is not None)"],
                           capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() == "True":
        assert run(str(script)).stdout.strip().endswith("ran")
    else:
        result = run(str(script), MEGATRON_LM_PATH="")
        assert result.returncode != 0 and "ran" not in result.stdout
        assert "cannot install the SAP hooks" in result.stderr
        if importlib.util.find_spec("megatron.training") is None:
            assert "MEGATRON_LM_PATH" in result.stderr


def test_launcher_refuses_a_megatron_lm_whose_training_code_the_hooks_do_not_follow(tmp_path) -> None:
    """A checkout whose batch functions are neither in `megatron.training.utils` (core_v0.13 to
    v0.17) nor in megatron-core (core_v0.18 on) is refused by name before anything is patched, not
    with an AttributeError."""
    from megatron_sap.megatron.compat import batch_functions_in_core

    if batch_functions_in_core():
        pytest.skip("this megatron-core has the batch functions: any checkout beside it is laid out as core_v0.18 on")
    training = tmp_path / "megatron" / "training"
    (training / "utils").mkdir(parents=True)
    (training / "__init__.py").write_text("def pretrain(*args, **kwargs):\n    pass\n")
    (training / "training.py").write_text("def build_pretraining_data_loader(*args, **kwargs):\n    pass\n")
    (training / "utils" / "__init__.py").write_text("def is_first_or_last_pipeline_stage(vp_stage=None):\n    return True\n")
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("print('ran')\n")
    result = subprocess.run([sys.executable, "-m", "megatron_sap.launch", str(script)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "MEGATRON_LM_PATH": str(tmp_path)})
    assert result.returncode != 0 and "ran" not in result.stdout
    assert "cannot install the SAP hooks" in result.stderr and "core_v0.13 to core_v0.19" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@needs_megatron_lm
@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPU machines the smoke training run covers the launcher")
def test_launcher_runs_pretrain_gpt_through_the_hooks() -> None:
    """On CPU the run gets through the wrapped pretrain, SAP flags included, to Megatron's CUDA check."""
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
             "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 1 --mock-data "
             "--tokenizer-type NullTokenizer --vocab-size 256 --train-iters 1 "
             "--cp-comm-type sap --sap-inner-size 1 --no-sap-check-agreement").split()
    script = os.path.join(MEGATRON_LM, "pretrain_gpt.py")
    result = subprocess.run([sys.executable, "-m", "megatron_sap.launch", script, *flags],
                            capture_output=True, text=True, timeout=600)
    assert "in pretrain_with_sap_args" in result.stderr, result.stderr[-3000:]
    assert "Megatron requires CUDA" in result.stderr, result.stderr[-3000:]


@needs_megatron_lm
def test_hooks_patch_the_names_pretrain_gpt_imports() -> None:
    """After install_training_hooks, the names pretrain_gpt.py binds at import are the SAP versions."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from megatron_sap.megatron.hooks import install_training_hooks\n"
        "install_training_hooks()\n"
        "import pretrain_gpt\n"
        "import megatron.core.utils as core_utils\n"
        "from megatron.core import parallel_state\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "import megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs as heterogeneous\n"
        "hooked = [pretrain_gpt.pretrain, parallel_state.initialize_model_parallel,\n"
        "          heterogeneous.get_gpt_heterogeneous_layer_spec]\n"
        "if hasattr(core_utils, 'get_thd_batch_on_this_cp_rank'):  # core_v0.16\n"
        "    import gpt_builders\n"
        "    hooked += [pretrain_gpt.get_thd_batch_on_this_cp_rank, pretrain_gpt.get_batch_on_this_tp_rank,\n"
        "               gpt_builders.get_gpt_heterogeneous_layer_spec]\n"
        "elif hasattr(core_utils, 'get_batch_on_this_tp_rank'):  # core_v0.18 on\n"
        "    import megatron.training.arguments as arguments\n"
        "    hooked += [pretrain_gpt.get_batch_on_this_tp_rank, pretrain_gpt.get_batch_on_this_cp_rank, GPTModel.forward,\n"
        "               arguments.parse_args, __import__('gpt_builders').get_gpt_heterogeneous_layer_spec]\n"
        "    if hasattr(core_utils, 'flatten_batch_for_packed_sequences'):  # core_v0.19\n"
        "        hooked.append(pretrain_gpt.flatten_batch_for_packed_sequences)\n"
        "    sys.argv = ['x', '--cp-comm-type', 'sap']\n"
        "    assert arguments.parse_args().sap_backend == 'auto'  # the flags without a provider\n"
        "else:\n"
        "    hooked += [pretrain_gpt.get_batch_on_this_cp_rank, GPTModel.forward]\n"
        "    builder = getattr(pretrain_gpt, 'get_gpt_heterogeneous_layer_spec', None)\n"
        "    hooked.append(builder or __import__('gpt_builders').get_gpt_heterogeneous_layer_spec)\n"
        "for f in hooked:\n"
        "    assert f.__code__.co_filename.endswith('megatron_sap/megatron/hooks.py'), f\n"
        "from megatron.training.arguments import parse_args\n"
        "from megatron_sap.megatron import add_sap_args\n"
        "sys.argv = ['x', '--context-parallel-size', '4', '--hierarchical-context-parallel-sizes', '2', '2',\n"
        "            '--cp-comm-type', 'sap']\n"
        "args = parse_args(add_sap_args)\n"
        "assert args.cp_comm_type == ['sap'] and args.sap_inner_size is None\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code, MEGATRON_LM], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


PATCH = os.path.join(os.path.dirname(__file__), os.pardir, "patches", "megatron-lm-core_v0.16.1-sap.patch")


def _checkout_version() -> tuple[int, int]:
    """(major, minor) of the Megatron-LM checkout, from its megatron/core/package_info.py."""
    import re

    with open(os.path.join(MEGATRON_LM, "megatron", "core", "package_info.py")) as info:
        text = info.read()
    return tuple(int(re.search(rf"^{name} = (\d+)", text, re.M).group(1)) for name in ("MAJOR", "MINOR"))


@needs_megatron_lm
def test_fork_patch_applies_and_compiles(tmp_path) -> None:
    """The patch applies to the checkout's pretrain_gpt.py, initialize.py and training.py, and the results compile."""
    import py_compile
    import shutil

    if _checkout_version() != (0, 16):
        pytest.skip("the fork patch is for core_v0.16; forks of other versions call install_training_hooks()")

    files = ["pretrain_gpt.py", os.path.join("megatron", "training", "initialize.py"),
             os.path.join("megatron", "training", "training.py")]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(MEGATRON_LM, name), tmp_path / name)
    result = subprocess.run(["git", "apply", os.path.abspath(PATCH)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for name in files:
        py_compile.compile(str(tmp_path / name), doraise=True)
    assert "wrap_get_thd_batch_on_this_cp_rank(get_thd_batch_on_this_cp_rank)" in (tmp_path / "pretrain_gpt.py").read_text()


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(context_parallel_size=2, mtp_num_layers=1), "multi-token prediction"),
        (dict(hybrid_context_parallel=True), "hybrid-context-parallel"),
        (dict(experimental_attention_variant="dsa"), "DeepSeek sparse attention"),
        (dict(qk_clip=True), "max attention logits that qk_clip \\(--qk-clip\\) needs"),
        (dict(log_max_attention_logit=True), "max attention logits that log_max_attention_logit \\(--log-max-attention-logit\\)"),
        (dict(reset_attention_mask=True, reset_position_ids=False), "add --reset-position-ids"),
        (dict(context_parallel_size=1, reset_attention_mask=True), "add --reset-position-ids"),
        (dict(reset_position_ids=True), "add --reset-attention-mask to --reset-position-ids"),
        (dict(context_parallel_size=1, reset_position_ids=True, reset_attention_mask=False),
         "add --reset-attention-mask to --reset-position-ids"),
        (dict(micro_batch_size=2), "use --micro-batch-size 1 \\(got 2\\)"),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True, seq_length=4098),
         "--sequence-parallel needs --seq-length divisible by CP x TP = 2 x 2 \\(got 4098\\)"),
        (dict(context_parallel_size=1, tensor_model_parallel_size=4, sequence_parallel=True, seq_length=258),
         "--sequence-parallel needs --seq-length divisible by CP x TP = 1 x 4 \\(got 258\\)"),
        (dict(attention_dropout=0.1), "no attention dropout.*--attention-dropout 0"),
        (dict(window_size=(128, 0)), "does not support sliding windows: drop --window-size"),
        (dict(overlap_moe_expert_parallel_comm=True), "--overlap-moe-expert-parallel-comm"),
        (dict(context_parallel_size=1, overlap_moe_expert_parallel_comm=True), "--overlap-moe-expert-parallel-comm"),
        (dict(enable_cuda_graph=True, cuda_graph_scope="full"), "CUDA graphs that capture attention"),
        (dict(external_cuda_graph=True, cuda_graph_scope="attn"), "CUDA graphs that capture attention"),
        (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=[]), "CUDA graphs that capture attention"),
        (dict(cuda_graph_impl="local", cuda_graph_scope=[SimpleNamespace(name="mlp"), SimpleNamespace(name="attn")]),
         "CUDA graphs that capture attention"),
        # core_v0.19: --cuda-graph-modules ([] the whole layer), the whole iteration an implementation of its own
        (dict(cuda_graph_impl="local", cuda_graph_modules=[]), "CUDA graphs that capture attention"),
        (dict(cuda_graph_impl="local", cuda_graph_modules=[SimpleNamespace(name="mlp"), SimpleNamespace(name="attn")]),
         "CUDA graphs that capture attention"),
        (dict(cuda_graph_impl="full_iteration", cuda_graph_modules=[]), "CUDA graphs that capture attention"),
    ],
)
def test_settings_sap_would_get_wrong_are_refused(settings: dict, match: str) -> None:
    from megatron_sap.megatron.hooks import configure_sap

    args = _parse("--context-parallel-size 2 --cp-comm-type sap")
    for name, value in settings.items():
        setattr(args, name, value)
    with pytest.raises(ValueError, match=match):
        configure_sap(args)


@pytest.mark.parametrize(
    "settings, refused, match",
    [
        (dict(context_parallel_size=1, mtp_num_layers=1), "legacy", "before Megatron-LM core_v0.16"),
        (dict(sft=True, tensor_model_parallel_size=2), "packed", "--sft needs TP 1 \\(got TP=2\\)"),
        (dict(sft=True, pipeline_model_parallel_size=2), "sft-stages", "--sft and pipeline parallelism \\(got PP=2\\)"),
        (dict(multi_latent_attention=True), "mla", "megatron-core 0.14 or later for multi-latent attention"),
        (dict(position_embedding_type="yarn"), "yarn", "megatron-core 0.16 or later for YaRN"),
        (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), "chunks",
         "virtual \\(interleaved\\) pipeline .* from Megatron-LM core_v0.15"),
    ],
    ids=["mtp-cp1", "sft-tp2", "sft-pp2", "mla-cp2", "yarn-cp2", "vpp"],
)
def test_release_specific_settings_are_refused_where_they_would_fail(settings: dict, refused: str, match: str) -> None:
    """Refused on the releases where they go wrong (see docs/megatron.md), accepted elsewhere:
    MTP at CP 1 before core_v0.16 (the hooks pack every row; those MTP layers refuse packed
    rows), SFT at TP > 1 on core_v0.16 and v0.17 (their broadcasts), SFT with pipeline stages on
    core_v0.17 (each stage splits its own copy), MLA under CP on megatron-core 0.13 and GPT's
    YaRN under CP before 0.16 (their rotary tables), a virtual pipeline before core_v0.15
    (every chunk of the first and last stages reads its own batch). `make test` runs the
    0.16.1 side, `make test-compat` the others."""
    from megatron_sap.megatron.compat import (chunk_aware_get_batch, gpt_yarn_keeps_packed_rope_table,
                                              mla_keeps_packed_rope_table, mtp_takes_packed_rows, packed_get_batch,
                                              sft_split_on_every_stage)
    from megatron_sap.megatron.hooks import configure_sap

    args = _parse("--context-parallel-size 2 --cp-comm-type sap")
    for name, value in settings.items():
        setattr(args, name, value)
    expected = {"legacy": not mtp_takes_packed_rows(), "packed": packed_get_batch(), "sft-stages": sft_split_on_every_stage(), "mla": not mla_keeps_packed_rope_table(),
                "yarn": not gpt_yarn_keeps_packed_rope_table(), "chunks": not chunk_aware_get_batch()}
    if expected[refused]:
        with pytest.raises(ValueError, match=match):
            configure_sap(args)
    else:
        configure_sap(args)


@pytest.mark.parametrize("cp", [1, 2])
def test_a_per_layer_sap_list_becomes_one_type_for_every_layer(cp: int) -> None:
    """`--cp-comm-type sap sap` (one per layer, as Megatron-LM's check wants such a list)
    reaches the layers as one `sap`: up to core_v0.16 a layer reads a per-layer list at its
    1-based number, past the end for the last layer."""
    from megatron_sap.megatron.hooks import configure_sap

    args = _parse(f"--context-parallel-size {cp} --cp-comm-type sap sap")
    assert args.cp_comm_type == ["sap", "sap"]
    configure_sap(args)
    assert args.cp_comm_type == ["sap"]


def test_pipelines_with_tp_are_fine_and_mla_rope_fusion_is_turned_off() -> None:
    from megatron_sap.megatron.compat import mla_keeps_packed_rope_table
    from megatron_sap.megatron.hooks import configure_sap

    args = _parse("--context-parallel-size 2 --cp-comm-type sap")
    for pp, tp in ((2, 1), (2, 2), (4, 2)):
        args.pipeline_model_parallel_size, args.tensor_model_parallel_size = pp, tp
        assert configure_sap(args) == [1, 2]
    args.pipeline_model_parallel_size, args.tensor_model_parallel_size = 2, 1
    if not mla_keeps_packed_rope_table():
        pytest.skip("megatron-core 0.13 refuses MLA under CP (test_release_specific_settings_are_refused_where_they_would_fail)")
    args.multi_latent_attention, args.apply_rope_fusion = True, True
    with pytest.warns(UserWarning, match=r"turns off RoPE fusion \(as --no-rope-fusion would\) for MLA"):
        assert configure_sap(args) == [1, 2]
    assert args.apply_rope_fusion is False


@pytest.mark.parametrize(
    "flags, local_gpus, hint",
    [
        ("--context-parallel-size 16", "8", "on 2 nodes \\(8 per node\\).*--cp-size 16 --tensor-parallel-size 1 --gpus-per-node 8 --lengths-file.*sizes 8 2 "),
        ("--context-parallel-size 16 --tensor-model-parallel-size 2", "8",
         "on 4 nodes \\(4 per node\\).*--tensor-parallel-size 2 --gpus-per-node 8 .*sizes 4 4 "),
        ("--context-parallel-size 24 --num-attention-heads 12 --hidden-size 768 --sap-cost-preset h200", "8",
         "--num-heads 12 --num-kv-heads 12 --head-dim 64 --preset h200 .*sizes 6 4 "),  # 12 heads do not split over 8
        ("--context-parallel-size 16 --num-attention-heads 32 --hidden-size 4096 --group-query-attention "
         "--num-query-groups 8", "8", "--num-heads 32 --num-kv-heads 8 --head-dim 128 --lengths-file.*sizes 8 2 "),
        ("--context-parallel-size 8", "8", None),  # one node
        ("--context-parallel-size 16", None, None),  # node size unknown
        ("--context-parallel-size 16 --sap-inner-size 1", "8", None),  # flat on purpose
        ("--context-parallel-size 16 --sap-outer-size 16", "8", None),
        ("--context-parallel-size 16 --hierarchical-context-parallel-sizes 1 16", "8", None),
        ("--context-parallel-size 16 --sap-inner-size 8", "8", None),
        ("--context-parallel-size 22", "8", "sizes 2 11 "),  # the only inner size of 8 or less that divides 22
        # without the model's heads, the preset's (32 query heads): 6 does not split them, as the printed command finds
        ("--context-parallel-size 18", "8", "sizes 2 9 "),
    ],
)
def test_a_flat_layout_across_nodes_by_default_gets_a_hint(flags: str, local_gpus: str | None, hint: str | None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no SAP level is given and the CP ranks span nodes (LOCAL_WORLD_SIZE GPUs each, over
    TP), configure_sap warns that an inner level inside a node is usually faster, with the
    plan command to compare on the user's data and the largest inner size the heads allow."""
    from megatron_sap.megatron.hooks import configure_sap

    parser = _megatron_like_parser()
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    args = chain_args_providers(None, add_sap_args)(parser).parse_args(f"{flags} --cp-comm-type sap".split())
    args.calculate_per_token_loss = True
    if local_gpus is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_gpus)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configure_sap(args)
    flat = [str(w.message) for w in caught if "SAP runs flat" in str(w.message)]
    if hint is None:
        assert not flat
    else:
        assert len(flat) == 1 and re.search(hint, flat[0]), flat


@pytest.mark.parametrize("cp", [1, 2])
def test_documents_come_from_both_reset_flags_or_from_the_rows_own_cu_seqlens(cp: int) -> None:
    """Position-id restarts mark documents only with --reset-attention-mask (Megatron's own
    promise that none attends to another); SFT rows and core_v0.19's inter-document masking
    bring their own cu_seqlens, so --reset-position-ids alone is fine there."""
    from megatron_sap.megatron.hooks import configure_sap

    expected = None if cp == 1 else [1, cp]
    for settings in (dict(reset_position_ids=True, reset_attention_mask=True),
                     dict(reset_position_ids=True, sft=True),
                     dict(reset_position_ids=True, dataloader_inter_document_masking=True),
                     dict()):
        args = _parse(f"--context-parallel-size {cp} --cp-comm-type sap")
        args.calculate_per_token_loss = True
        for name, value in settings.items():
            setattr(args, name, value)
        assert configure_sap(args) == expected, settings


def test_cuda_graphs_of_other_parts_than_attention_are_fine() -> None:
    from megatron_sap.megatron.hooks import configure_sap

    args = _parse("--context-parallel-size 2 --cp-comm-type sap")
    args.cuda_graph_impl, args.cuda_graph_scope = "local", [SimpleNamespace(name="mlp"), SimpleNamespace(name="moe_router")]
    assert configure_sap(args) == [1, 2]
    args.cuda_graph_impl, args.cuda_graph_scope = "none", []
    assert configure_sap(args) == [1, 2]
    # core_v0.19 parses --cuda-graph-modules and no scope
    del args.cuda_graph_scope
    args.cuda_graph_impl, args.cuda_graph_modules = "transformer_engine", [SimpleNamespace(name="mlp")]
    assert configure_sap(args) == [1, 2]


def test_cuda_graph_flags_as_megatron_parses_them() -> None:
    """The CUDA graph flags through the installed Megatron-LM parser (the megatron-core wheel ships
    `megatron.training` from core_v0.19, whose `--cuda-graph-modules` replaces the scope): MLP
    graphs are fine, attention or whole-layer graphs refused."""
    # 0.19's training code imports typing.override (Python 3.12; here with scripts/py311_compat)
    arguments = pytest.importorskip("megatron.training.arguments", exc_type=ImportError)
    from megatron_sap.megatron.hooks import _cuda_graphs_capture_attention

    flag = "--cuda-graph-modules" if "--cuda-graph-modules" in inspect.getsource(arguments) else "--cuda-graph-scope"

    def parsed(*modules: str) -> argparse.Namespace:
        with mock.patch.object(sys, "argv", ["pretrain_gpt.py", "--cuda-graph-impl", "local", *(
                [flag, *modules] if modules else [])]):
            return arguments.parse_args(add_sap_args)

    assert not _cuda_graphs_capture_attention(parsed("mlp"))
    assert _cuda_graphs_capture_attention(parsed("mlp", "attn"))
    assert _cuda_graphs_capture_attention(parsed())  # the whole layer


def test_flags_are_added_once_and_the_dataloader_mask_is_turned_off() -> None:
    """A patched pretrain_gpt.py adds the SAP flags itself and the launcher adds them again:
    the second time is a no-op. SAP drops attention masks, so none is built per sample."""
    from megatron_sap.megatron.hooks import configure_sap

    parser = add_sap_args(_megatron_like_parser())
    assert add_sap_args(parser) is parser
    args = parser.parse_args("--context-parallel-size 2 --cp-comm-type sap".split())
    args.create_attention_mask_in_dataloader = True
    configure_sap(args)
    assert args.create_attention_mask_in_dataloader is False


def test_a_model_shape_given_as_a_list_is_kept_as_a_tuple() -> None:
    from megatron_sap.megatron import set_sap_options
    from megatron_sap.megatron.plans import plan_for

    assert set_sap_options(model_shape=[16, 4, 64, 2]).model_shape == (16, 4, 64, 2)
    assert plan_for([0, 100, 400], None).cost_model.num_heads == 16  # hashable: the cost model is cached


@pytest.mark.parametrize(("given", "kept"), [("bfloat16", "bfloat16"), (torch.float16, "float16"), ("half", "float16"), ("float32", "float32")])
def test_the_attention_dtype_is_kept_by_name(given, kept) -> None:
    from megatron_sap.megatron import set_sap_options

    assert set_sap_options(attention_dtype=given).attention_dtype == kept


@pytest.mark.parametrize("bad", ["bf16", "int8", "cuda"])
def test_an_attention_dtype_that_is_no_float_dtype_raises(bad) -> None:
    from megatron_sap.megatron import set_sap_options

    with pytest.raises(ValueError, match="attention_dtype must name a floating-point torch dtype"):
        set_sap_options(attention_dtype=bad)


def test_an_unknown_cost_preset_raises_when_set_not_at_the_first_batch() -> None:
    from megatron_sap.megatron import get_sap_options, set_sap_options

    before = get_sap_options()
    with pytest.raises(ValueError, match=r"unknown cost-model preset 'a100'; known: \['cpu', 'h100', 'h200'\]"):
        set_sap_options(cost_preset="a100")
    assert get_sap_options() == before
    assert set_sap_options(cost_preset="h200").cost_preset == "h200"


def test_inner_chunks_flag_reaches_the_options_and_refuses_what_cannot_run(capsys) -> None:
    """--sap-inner-chunks (default auto) sets the head chunks SAP layers run the Ulysses
    all-to-alls in; counts that cannot run (with --sap-recompute-kv, at inner size 1, heads
    that do not split) fail at start-up, not at the first attention."""
    parser = chain_args_providers(None, add_sap_args)(argparse.ArgumentParser())
    for flag, default in (("--context-parallel-size", 1), ("--num-attention-heads", None),
                          ("--num-query-groups", None), ("--kv-channels", None)):
        parser.add_argument(flag, type=int, default=default)
    try:
        assert sap_settings_from_args(parser.parse_args([])).options.inner_chunks == "auto"
        for bad, said in (("0", "got 0"), ("two", "got 'two'"), ("-1", "got -1")):
            with pytest.raises(SystemExit):
                parser.parse_args(["--sap-inner-chunks", bad])
            assert f"--sap-inner-chunks must be 'auto' or a positive int, {said}" in capsys.readouterr().err
        cp8 = ["--context-parallel-size", "8", "--sap-inner-size", "8"]
        assert sap_settings_from_args(parser.parse_args([*cp8, "--sap-inner-chunks", "2"])).options.inner_chunks == 2
        with pytest.raises(ValueError, match="--sap-inner-chunks 2 needs --sap-recompute-kv off"):
            sap_settings_from_args(parser.parse_args([*cp8, "--sap-inner-chunks", "2", "--sap-recompute-kv"]))
        with pytest.raises(ValueError, match="needs --sap-inner-size > 1"):
            sap_settings_from_args(parser.parse_args(["--context-parallel-size", "2", "--sap-inner-chunks", "2"]))
        heads = ["--num-attention-heads", "24", "--num-query-groups", "8", "--kv-channels", "64"]
        with pytest.raises(ValueError, match="does not split the 3 query heads"):
            sap_settings_from_args(parser.parse_args([*cp8, *heads, "--sap-inner-chunks", "2"]))
        assert sap_settings_from_args(parser.parse_args([*cp8, *heads, "--sap-inner-chunks", "3"])).options.inner_chunks == 3
    finally:
        reset_sap_options()
    with pytest.raises(ValueError, match="inner_chunks must be 'auto' or a positive int"):
        sap.megatron.SAPOptions(inner_chunks=0)
