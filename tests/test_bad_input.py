"""Bad input fails at the public entry points with a ValueError naming the problem and the values.

Entry points: `plan_sequences`, `sap_attention`, the kernels (`varlen_forward`,
`varlen_backward`) and the Megatron batch splitter (`sap_split_batch`). Every case matches a phrase that names the problem together with the
offending number, so a check that fires for the wrong reason does not pass.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import megatron_sap as sap
from megatron_sap.comm.groups import SAPGroups
from megatron_sap.kernels import varlen_backward, varlen_forward
from megatron_sap.planning import CostModel, PlanCache
from megatron_sap.reference import dense_attention


def _plan(cu: list[int] | torch.Tensor, outer: int = 1, inner: int = 1) -> sap.Plan:
    return sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cache=PlanCache())


def _qkv(tokens: int, heads: int = 4, kv_heads: int = 2, dim: int = 8, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v


def _fake_groups(inner: int, outer: int) -> SAPGroups:
    """SAPGroups of cp_rank 0 without process groups: input checks run before any communication."""
    world = inner * outer
    return SAPGroups(
        inner_size=inner,
        outer_size=outer,
        cp_rank=0,
        inner_rank=0,
        outer_rank=0,
        cp_group=None,
        inner_group=None,
        outer_group=None,
        cp_ranks=tuple(range(world)),
        inner_ranks=tuple(range(inner)),
        outer_ranks=tuple(range(0, world, inner)),
    )


# ---- plan_sequences: cu_seqlens and sizes ---------------------------------------------------------


@pytest.mark.parametrize(
    ("cu", "outer", "inner", "pattern"),
    [
        ([1, 4, 8], 1, 1, r"must start at 0, got 1"),
        ([0, 5, 3, 8], 1, 1, r"non-decreasing, but cu_seqlens\[2\]=3 < cu_seqlens\[1\]=5"),
        ([0, -3, 8], 1, 1, r"non-decreasing, but cu_seqlens\[1\]=-3 < cu_seqlens\[0\]=0"),
        ([0, 2**31], 1, 1, r"total 2147483648 is too large for int32"),
        (torch.tensor([[0, 4, 8]]), 1, 1, r"must be 1-D, got shape \(1, 3\)"),
        (torch.tensor([0.0, 4.0, 8.0]), 1, 1, r"integer dtype, got torch.float32"),
        (np.array([[0, 4], [4, 8]]), 1, 1, r"must be 1-D, got shape \(2, 2\)"),
        (np.array([0.0, 4.0, 8.0]), 1, 1, r"integer dtype, got float64"),
        (np.array([0, 1, 1], dtype=bool), 1, 1, r"integer dtype, got bool"),
        ([0, 4.0, 8], 1, 1, r"must hold integers, got 4.0 \(float\)"),
        ([0, True, 8], 1, 1, r"must hold integers, got True \(bool\)"),
        ([torch.tensor([0]), torch.tensor([8])], 1, 1, r"must hold integers, got an entry of shape \(1,\)"),
        ([0, np.array([4]), 8], 1, 1, r"must hold integers, got an entry of shape \(1,\)"),
        (torch.tensor([0, 4, 8]).to_sparse(), 1, 1, r"must be a dense 1-D tensor, got a sparse_coo tensor"),
        ([], 1, 1, r"cu_seqlens is empty"),
        ([0, 0, 0], 1, 1, r"empty batch \(0 tokens\)"),
        ([0, 5, 10], 3, 1, r"T = cu_seqlens\[-1\] \(10\) must be divisible by CP size P = outer_size\*inner_size = 3\*1 \(3\)"),
        ([0, 5, 10], 2, 2, r"\(10\) must be divisible by CP size P = outer_size\*inner_size = 2\*2 \(4\)"),
        ([0, 5, 12], 1, 0, r"inner_size must be a positive integer, got 0"),
        ([0, 5, 12], 2.0, 1, r"outer_size must be a positive integer, got 2.0"),
    ],
)
def test_plan_sequences_rejects(cu: list | torch.Tensor, outer: int, inner: int, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _plan(cu, outer, inner)


def test_the_largest_int32_total_is_accepted() -> None:
    """The kernels' int32 offsets hold a total of 2**31 - 1 tokens; one more is refused (above)."""
    from megatron_sap.validation import cu_seqlens_to_list

    assert cu_seqlens_to_list([0, 2**31 - 1]) == [0, 2**31 - 1]
    assert cu_seqlens_to_list(torch.tensor([0, 5, 2**31 - 1])) == [0, 5, 2**31 - 1]


def test_plan_sequences_rejects_bad_input_through_the_cache() -> None:
    """A rejected batch is never cached, so repeating it raises again instead of returning a plan."""
    cache = PlanCache()
    for _ in range(2):
        with pytest.raises(ValueError, match=r"must start at 0, got 2"):
            sap.plan_sequences([2, 4, 8], cache=cache)
    assert len(cache) == 0


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(cost_model=3), TypeError, "cost_model must be a CostModel or a preset name"),
        (dict(cost_model="a100"), ValueError, "unknown cost-model preset 'a100'"),
        (dict(slacks=(0.0, -0.5)), ValueError, "slacks must be finite non-negative"),
        (dict(slacks=("0.1",)), ValueError, "slacks must be finite non-negative numbers"),
        (dict(slacks=()), ValueError, "slacks must be finite non-negative numbers"),
        (dict(slacks=None), ValueError, "slacks must be finite non-negative numbers .*, got None"),
        (dict(slacks="0.1"), ValueError, "slacks must be finite non-negative numbers .*, got '0.1'"),
        (dict(slacks=(0.0, float("inf"))), ValueError, r"slacks must be finite non-negative numbers .*, got \(0.0, inf\)"),
    ],
)
def test_plan_sequences_rejects_bad_options(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        sap.plan_sequences([0, 5, 16], outer_size=2, cache=None, **kwargs)


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        (dict(attention_tflops=float("nan")), r"attention_tflops must be a finite number, got nan"),
        (dict(inter_node_gbps=float("inf")), r"inter_node_gbps must be a finite number, got inf"),
        (dict(backward_factor=True), r"backward_factor must be a finite number, got True"),
        (dict(intra_node_gbps="360"), r"intra_node_gbps must be a finite number, got '360'"),
        (dict(attention_tflops=-1.0), r"attention_tflops must be positive, got -1.0"),
        (dict(inter_node_gbps=0), r"inter_node_gbps must be positive, got 0"),
        (dict(message_latency_us=-1), r"message_latency_us must be >= 0, got -1"),
        (dict(tile=0), r"tile must be a positive integer, got 0"),
        (dict(head_dim=1.5), r"head_dim must be a positive integer, got 1.5"),
        (dict(gpus_per_node=np.bool_(True)), r"gpus_per_node must be a positive integer, got (np\.)?True"),  # np.True_ from numpy 2
        (dict(num_heads=12, num_kv_heads=8), r"num_heads \(12\) must be a multiple of num_kv_heads \(8\)"),
        (dict(name=5), r"CostModel.name must be a string, got 5"),
    ],
)
def test_cost_model_rejects_bad_fields(fields: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        sap.CostModel(**fields)


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        (dict(attention_tflops=5e-324), r"kernel times out of range: a pair's forward takes inf s with attention_tflops=4.94066e-324"),
        (dict(attention_tflops=1e-300), r"kernel times out of range: a row's forward takes inf s"),
        (dict(attention_tflops=1e300), r"kernel times out of range: a pair's forward takes 0 s"),
        (dict(backward_factor=1.7e308), r"a pair's backward takes inf s .*backward_factor=1.7e\+308"),
        (dict(pipelined_kernel_factor=1e300), r"a row's pipelined backward takes inf s"),
        (dict(inter_node_gbps=5e-324, gpus_per_node=1), r"inter_node_gbps = 4.94066e-324 gives transfer times out of range"),
        (dict(intra_node_gbps=1e300), r"intra_node_gbps = 1e\+300 gives transfer times out of range \(0 s per byte"),
        (dict(message_latency_us=1.7e308), r"message_latency_us = 1.7e\+308 gives message times out of range"),
        (dict(head_dim=10**400), r"CostModel fields too large for its times"),
    ],
)
def test_cost_model_rejects_rates_whose_times_overflow_or_vanish(fields: dict, pattern: str) -> None:
    # Each once planned (inf or NaN times: a KeyError compiling, `min()` of nothing choosing).
    with pytest.raises(ValueError, match=pattern):
        sap.CostModel.preset("h100", **fields)


def test_cost_model_takes_extreme_rates_whose_times_stay_finite() -> None:
    model = sap.CostModel.preset("h100", attention_tflops=1e-9, backward_factor=1e-9, inter_node_gbps=1e-6,
                                 intra_node_gbps=1e9, message_latency_us=5e-324, gpus_per_node=1)
    plan = sap.plan_sequences([0, 3, 40, 64], outer_size=4, cost_model=model, cache=None)
    assert math.isfinite(plan.stats()["modelled_time_s"]) and plan.program(1).num_tokens == 16


def test_cost_model_takes_numpy_numbers_and_no_latency() -> None:
    model = sap.CostModel(head_dim=np.int64(64), attention_tflops=np.float32(300), message_latency_us=0)
    assert model == sap.CostModel(head_dim=64, attention_tflops=300.0, message_latency_us=0.0)
    assert type(model.head_dim) is int and model.transfer_seconds(0, "intra", messages=0) == 0.0


def test_cost_model_rejects_unknown_calibration_fields_and_links() -> None:
    with pytest.raises(ValueError, match=r"unknown CostModel fields \['tflops'\]; known: \['attention_tflops'"):
        sap.CostModel.from_calibration({"tflops": 300})
    with pytest.raises(ValueError, match=r"calibration name must be a string, got \['h100'\]"):
        sap.CostModel.from_calibration({"name": ["h100"]})
    with pytest.raises(ValueError, match=r"bytes_per_element must be a positive integer, got 0"):
        sap.CostModel().with_shape(32, 8, 128, bytes_per_element=0)
    with pytest.raises(ValueError, match=r"unknown link class 'pcie'; expected 'intra' or 'inter'"):
        sap.CostModel().bandwidth("pcie")


def test_a_calibration_file_nested_too_deep_is_refused_by_name(tmp_path) -> None:
    """json's RecursionError on a pathological file is the documented ValueError too."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="cannot read the cost-model calibration file .*deep.json"):
        sap.CostModel.from_calibration(deep)


def test_plan_sequences_takes_a_preset_by_name() -> None:
    by_name = sap.plan_sequences([0, 5, 16], outer_size=2, cost_model="h200", cache=None)
    assert by_name.cost_model == sap.CostModel.preset("h200")
    assert sap.plan_sequences([0, 5, 16], outer_size=2, slacks=[0.0, 0.1]).placement is not None  # a list is fine
    assert sap.plan_sequences([0, 5, 16], outer_size=2, slacks=(np.float32(0.1),), cache=None).placement is not None


def test_zero_length_documents_are_valid() -> None:
    """Empty documents anywhere (first, middle, last, repeated) plan and attend like the reference."""
    cu = [0, 0, 3, 3, 3, 7, 8, 8]
    plan = _plan(cu)
    q, k, v = _qkv(8, dtype=torch.float64)
    out = sap.sap_attention(q, k, v, plan)
    ref, _ = dense_attention(q, k, v, torch.tensor(cu))
    assert torch.allclose(out, ref, atol=1e-12)
    assert _plan(cu, outer=2, inner=2).local_tokens == 2


# ---- sap_attention ------------------------------------------------------------------------------


def test_sap_attention_rejects_mismatched_dtypes() -> None:
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match=r"share a dtype, got torch.float32, torch.float64, torch.float32"):
        sap.sap_attention(q, k.double(), v, _plan([0, 8]))


def test_sap_attention_rejects_mismatched_devices() -> None:
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match=r"one device, got cpu, meta, cpu"):
        sap.sap_attention(q, k.to("meta"), v, _plan([0, 8]))


def test_sap_attention_rejects_mismatched_head_dims() -> None:
    q, _, _ = _qkv(8, dim=8)
    _, k, v = _qkv(8, dim=16)
    with pytest.raises(ValueError, match=r"same head_dim, got 8 and 16"):
        sap.sap_attention(q, k, v, _plan([0, 8]))


def test_sap_attention_rejects_an_empty_head_dim() -> None:
    q, k, v = _qkv(8, dim=0)
    with pytest.raises(ValueError, match=r"head_dim must be positive, got shape \(8, 4, 0\)"):
        sap.sap_attention(q, k, v, _plan([0, 8]))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_sap_attention_rejects_a_non_finite_softmax_scale(scale: float) -> None:
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
        sap.sap_attention(q, k, v, _plan([0, 8]), softmax_scale=scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_softmax_scale_beyond_the_score_dtype_is_refused(dtype: torch.dtype) -> None:
    """Half and single precision inputs have their scores computed in float32: a scale
    beyond its range made every output 0 or NaN without a word."""
    q, k, v = _qkv(8, dtype=dtype)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    pattern = r"softmax_scale -?1e\+39 overflows torch\.float32, the dtype the scores of torch\.\w+ inputs are computed in"
    with pytest.raises(ValueError, match=pattern):
        sap.sap_attention(q, k, v, _plan([0, 8]), softmax_scale=1e39)
    with pytest.raises(ValueError, match=pattern):
        varlen_forward(q, k, v, cu, cu, 8, 8, True, 1e39)
    with pytest.raises(ValueError, match=pattern):
        varlen_forward(q, k, v, cu, cu, 8, 8, True, -1e39)


def test_float64_inputs_take_a_float64_scale() -> None:
    """Their scores are float64: a scale beyond float32 is theirs to use."""
    q, k, v = _qkv(8, dtype=torch.float64)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    out, lse = varlen_forward(q * 1e-40, k, v, cu, cu, 8, 8, True, 1e40)
    reference, _ = varlen_forward(q, k, v, cu, cu, 8, 8, True, 1.0)
    torch.testing.assert_close(out, reference)


def test_stats_take_a_preset_by_name() -> None:
    plan = _plan([0, 5, 16], outer=2)
    assert plan.stats(cost_model="h200") == plan.stats(cost_model=sap.CostModel.preset("h200"))


def test_sap_attention_rejects_k_v_shape_mismatch() -> None:
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match=r"k and v must have the same shape, got \(8, 2, 8\) and \(8, 1, 8\)"):
        sap.sap_attention(q, k, v[:, :1], _plan([0, 8]))


def test_sap_attention_rejects_non_3d() -> None:
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match=r"q must be \[tokens, heads, head_dim\], got shape \(8, 32\)"):
        sap.sap_attention(q.flatten(1), k, v, _plan([0, 8]))


def test_sap_attention_rejects_inputs_that_are_not_tensors() -> None:
    q, k, v = _qkv(8)
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor \[tokens, heads, head_dim\], got ndarray"):
        sap.sap_attention(q.numpy(), k, v, _plan([0, 8]))
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor .*, got list"):
        sap.sap_attention(q, k, v.tolist(), _plan([0, 8]))


def test_sap_attention_rejects_gqa_mismatch() -> None:
    q, k, v = _qkv(8, heads=6, kv_heads=4)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of key/value heads \(4\)"):
        sap.sap_attention(q, k, v, _plan([0, 8]))


def test_sap_attention_rejects_zero_query_heads_before_any_exchange() -> None:
    """Checked with the other inputs, before a step is posted (a kernel that refused it
    after the exchanges would leave the peers waiting)."""
    plan = _plan([0, 7, 16], outer=2)
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match=r"query heads \(0\) must be a multiple of key/value heads \(2\)"):
        sap.sap_attention(q[:, :0], k, v, plan, _fake_groups(1, 2))


def test_sap_attention_rejects_wrong_token_count() -> None:
    """Each rank must hold T/P tokens: here 16/4 = 4, not the whole batch."""
    plan = _plan([0, 7, 16], outer=2, inner=2)
    q, k, v = _qkv(16)
    with pytest.raises(ValueError, match=r"q has 16 tokens but the plan gives each rank T/P = 16/4 = 4"):
        sap.sap_attention(q, k, v, plan, _fake_groups(2, 2))
    q, k, v = _qkv(4)
    with pytest.raises(ValueError, match=r"k has 3 tokens but the plan gives each rank T/P = 16/4 = 4"):
        sap.sap_attention(q, k[:3], v[:3], plan, _fake_groups(2, 2))


@pytest.mark.parametrize(
    ("plan_outer", "plan_inner", "groups_inner", "groups_outer", "pattern"),
    [
        (2, 1, None, None, r"built for inner x outer = 1 x 2 ranks, but the groups are 1 x 1"),
        (4, 1, 2, 2, r"built for inner x outer = 1 x 4 ranks, but the groups are 2 x 2"),
        (2, 2, 4, 1, r"built for inner x outer = 2 x 2 ranks, but the groups are 4 x 1"),
        (1, 2, 2, 2, r"built for inner x outer = 2 x 1 ranks, but the groups are 2 x 2"),
    ],
)
def test_sap_attention_rejects_plan_for_another_layout(
    plan_outer: int, plan_inner: int, groups_inner: int | None, groups_outer: int | None, pattern: str
) -> None:
    plan = _plan([0, 5, 16], outer=plan_outer, inner=plan_inner)
    groups = None if groups_inner is None else _fake_groups(groups_inner, groups_outer)
    q, k, v = _qkv(plan.local_tokens)
    with pytest.raises(ValueError, match=pattern):
        sap.sap_attention(q, k, v, plan, groups)


@pytest.mark.parametrize("rank", [torch.tensor(True), torch.tensor([[1]]), torch.tensor(1.0), 1.0, True,
                                  np.array(True), np.array([1]), np.array(1.0)])
def test_plan_ranks_must_be_integers(rank) -> None:
    plan = _plan([0, 3, 8], outer=2, inner=2)
    for method in (plan.local_indices, plan.position_ids, plan.work, plan.pieces):
        with pytest.raises(ValueError, match="must be an integer"):
            method(rank)
    for same in (torch.tensor(1), np.int64(1), np.array(1), np.array(1, dtype=np.uint8)):
        assert plan.local_indices(same).tolist() == plan.local_indices(1).tolist()


def test_plan_sequences_rejects_something_else_as_cache() -> None:
    with pytest.raises(TypeError, match="cache must be a PlanCache or None, got int"):
        sap.plan_sequences([0, 5, 16], outer_size=2, cache=3)


@pytest.mark.parametrize("size", [0, True, 2.5])
def test_plan_cache_size_must_be_a_positive_integer(size) -> None:
    with pytest.raises(ValueError, match="plan cache size must be an integer >= 1"):
        PlanCache(size)


def test_sap_attention_rejects_other_groups_and_flags() -> None:
    plan = _plan([0, 8])
    q, k, v = _qkv(8)
    with pytest.raises(TypeError, match="groups must be SAPGroups .* got int"):
        sap.sap_attention(q, k, v, plan, 3)
    with pytest.raises(TypeError, match="recompute_kv must be True or False, got 'yes'"):
        sap.sap_attention(q, k, v, plan, recompute_kv="yes")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(check_finite="no"), r"check_finite must be True, False or None \(MEGATRON_SAP_CHECK_FINITE\), got 'no'"),
        (dict(check_finite=1), r"check_finite must be True, False or None .*, got 1"),
        (dict(check_agreement="no"), r"check_agreement must be True or False, got 'no'"),
        (dict(causal="no"), r"causal must be True or False, got 'no'"),
        (dict(causal=None), r"causal must be True or False, got None"),
        (dict(softmax_scale="0.3"), r"softmax_scale must be a finite number, got '0.3'"),
        (dict(softmax_scale=b"0.3"), r"softmax_scale must be a finite number, got b'0.3'"),
        (dict(softmax_scale=True), r"softmax_scale must be a finite number, got True"),
        (dict(softmax_scale=1 + 0j), r"softmax_scale must be a finite number, got \(1\+0j\)"),
    ],
)
def test_sap_attention_rejects_flags_and_scales_of_another_type(kwargs: dict, pattern: str) -> None:
    """A string flag would read as True (and the finite check is collective: a flag that
    differs between ranks hangs them), a string or bool scale as a number."""
    with pytest.raises(TypeError, match=pattern):
        sap.sap_attention(*_qkv(8), _plan([0, 8]), **kwargs)


def test_sap_attention_takes_numpy_and_integer_scales() -> None:
    q, k, v = _qkv(8)
    plan = _plan([0, 8])
    want = sap.sap_attention(q, k, v, plan, softmax_scale=0.5)
    for scale in (np.float32(0.5), np.float64(0.5)):
        assert torch.equal(sap.sap_attention(q, k, v, plan, softmax_scale=scale), want)
    one = sap.sap_attention(q, k, v, plan, softmax_scale=1)
    assert torch.equal(one, sap.sap_attention(q, k, v, plan, softmax_scale=1.0))
    assert not torch.equal(one, sap.sap_attention(q, k, v, plan))  # 1, not the default 1/sqrt(d)


def test_plan_methods_reject_a_non_bool_recompute_kv_and_an_absent_device() -> None:
    plan = _plan([0, 5, 16], outer=2)
    with pytest.raises(TypeError, match="recompute_kv must be True or False, got 'no'"):
        plan.schedule(0, recompute_kv="no")
    with pytest.raises(TypeError, match="recompute_kv must be True or False, got 0"):
        plan.program(0, schedule="pipelined", recompute_kv=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device cuda:0 is not available here \(torch.cuda.is_available\(\) is False\)"):
            plan.program(0, device="cuda:0")


def test_memory_bytes_takes_a_preset_by_name() -> None:
    plan = _plan([0, 5, 16], outer=2)
    assert plan.memory_bytes(1, "h200") == plan.memory_bytes(1, CostModel.preset("h200"))
    with pytest.raises(TypeError, match="cost_model must be a CostModel or a preset name, got int"):
        plan.memory_bytes(1, 3)


def test_simulate_plan_checks_its_tensors_as_sap_attention_does() -> None:
    from megatron_sap.simulate import simulate_plan

    plan = _plan([0, 5, 16], outer=2)
    q, k, v = _qkv(16)
    with pytest.raises(ValueError, match=r"head_dim must be positive"):
        simulate_plan(q[..., :0], k[..., :0], v[..., :0], plan)
    with pytest.raises(ValueError, match=r"k and v must have the same shape, got \(16, 2, 8\) and \(16, 2, 4\)"):
        simulate_plan(q, k, v[..., :4], plan)
    with pytest.raises(ValueError, match=r"plan must be a megatron_sap Plan from plan_sequences, got list"):
        simulate_plan(q, k, v, [0, 16])


def test_simulate_plan_needs_the_whole_batch() -> None:
    from megatron_sap.simulate import simulate_plan

    plan = _plan([0, 5, 16], outer=2)
    q, k, v = _qkv(16)
    with pytest.raises(ValueError, match=r"q must be the whole batch \[T=16, heads, head_dim\], got shape \(8, 4, 8\)"):
        simulate_plan(q[:8], k, v, plan)


def test_a_meta_cu_seqlens_is_rejected() -> None:
    with pytest.raises(ValueError, match="meta tensor"):
        sap.plan_sequences(torch.tensor([0, 8], device="meta"), cache=None)


def test_sap_attention_rejects_something_else_as_plan() -> None:
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match=r"plan must be a megatron_sap Plan from plan_sequences, got list"):
        sap.sap_attention(q, k, v, [0, 8])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "inner", "pattern"),
    [
        (6, 2, 4, r"query heads \(6\) must be divisible by the inner \(Ulysses\) size \(4\)"),
        (12, 6, 4, r"key/value heads \(6\) must be divisible by the inner size \(4\)"),
        (12, 3, 4, r"key/value heads \(3\) fewer than the inner size \(4\) must divide it"),
    ],
)
def test_sap_attention_rejects_heads_that_do_not_split(heads: int, kv_heads: int, inner: int, pattern: str) -> None:
    plan = _plan([0, 9, 16], outer=1, inner=inner)
    q, k, v = _qkv(plan.local_tokens, heads=heads, kv_heads=kv_heads)
    with pytest.raises(ValueError, match=pattern):
        sap.sap_attention(q, k, v, plan, _fake_groups(inner, 1))


@pytest.mark.parametrize(
    ("backend", "dtype", "pattern"),
    [
        ("bogus", torch.float32, r"unknown attention backend 'bogus'"),
        ("auto", torch.int32, r"unsupported dtype torch.int32"),
        ("aten-flash", torch.float32, r"attention backend 'aten-flash' is not available on cpu"),
    ],
)
def test_sap_attention_rejects_backend_and_dtype_before_communicating(backend: str, dtype: torch.dtype, pattern: str) -> None:
    """Checked before any exchange is posted (the fake groups have no process groups to
    post on): a pending transfer would leave the peers waiting for it."""
    plan = _plan([0, 9, 16], outer=2)
    q, k, v = _qkv(plan.local_tokens, dtype=dtype)
    with pytest.raises(ValueError, match=pattern):
        sap.sap_attention(q, k, v, plan, _fake_groups(1, 2), backend=backend, check_agreement=False)


def test_sap_attention_rejects_non_causal() -> None:
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match=r"causal attention only \(causal=False is not supported\)"):
        sap.sap_attention(q, k, v, _plan([0, 8]), causal=False)


def test_meta_tensors_are_refused_by_name() -> None:
    """Shapes without data (a model built on the meta device, not yet materialised)."""
    q, k, v = (t.to("meta") for t in _qkv(8))
    with pytest.raises(ValueError, match=r"q, k, v are meta tensors \(shapes without data\)"):
        sap.sap_attention(q, k, v, _plan([0, 8]))
    cu = torch.tensor([0, 8], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"q, k, v are meta tensors"):
        varlen_forward(q, k, v, cu, cu, 8, 8, causal=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_flag(bad: float) -> None:
    q, k, v = _qkv(8)
    k[5, 1, 3] = bad
    k[6, 0, 0] = bad
    with pytest.raises(ValueError, match=r"k contains 2 NaN or Inf values, the first at local token 5, head 1"):
        sap.sap_attention(q, k, v, _plan([0, 8]), check_finite=True)


def test_check_finite_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """MEGATRON_SAP_CHECK_FINITE=1 turns the check on; check_finite=False overrides it; off by default."""
    q, k, v = _qkv(8)
    q[2, 3, 0] = float("nan")
    plan = _plan([0, 3, 8])
    monkeypatch.delenv("MEGATRON_SAP_CHECK_FINITE", raising=False)
    out = sap.sap_attention(q, k, v, plan)  # off: NaN stays in its own row and head
    assert torch.isnan(out[2, 3]).all()
    out[2, 3] = 0.0
    assert torch.isfinite(out).all()
    monkeypatch.setenv("MEGATRON_SAP_CHECK_FINITE", "1")
    with pytest.raises(ValueError, match=r"q contains 1 NaN or Inf values, the first at local token 2, head 3"):
        sap.sap_attention(q, k, v, plan)
    sap.sap_attention(q, k, v, plan, check_finite=False)


# ---- kernels ------------------------------------------------------------------------------------


def _cu(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize(
    ("cu_q", "cu_k", "pattern"),
    [
        (_cu([1, 4, 8]), _cu([0, 4, 8]), r"cu_seqlens_q must start at 0, got 1"),
        (_cu([0, 4, 8]), _cu([0, 6, 2, 8]), r"same number of segments, got 2 and 3"),
        (_cu([0, 6, 2, 8]), _cu([0, 6, 2, 8]), r"cu_seqlens_q must be non-decreasing, but cu_seqlens_q\[1\]=6 > cu_seqlens_q\[2\]=2"),
        (_cu([0, 4, 7]), _cu([0, 4, 8]), r"cu_seqlens_q must end at the number of tokens 8, got 7"),
        (_cu([0, 4, 8]), _cu([0, 4, 9]), r"cu_seqlens_k must end at the number of tokens 8, got 9"),
        (_cu([0, 4, 8]).float(), _cu([0, 4, 8]), r"cu_seqlens_q must be a 1-D int32/int64 tensor, got shape \(3,\) dtype torch.float32"),
        (_cu([0, 4, 8]), _cu([[0, 4, 8]]), r"cu_seqlens_k must be a 1-D int32/int64 tensor, got shape \(1, 3\)"),
        (_cu([0, 4, 8]), _cu([0, 4, 8]).to("meta"), r"must be on one device, got \['cpu', 'meta'\]"),
        ([0, 4, 8], _cu([0, 4, 8]), r"cu_seqlens_q must be a tensor, got list"),
        (_cu([]), _cu([0, 4, 8]), r"cu_seqlens_q must hold at least one entry \(0\), got an empty tensor"),
    ],
)
def test_kernels_reject_bad_cu_seqlens(cu_q: torch.Tensor | list, cu_k: torch.Tensor, pattern: str) -> None:
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match=pattern):
        varlen_forward(q, k, v, cu_q, cu_k, 8, 8, causal=True)
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])
    with pytest.raises(ValueError, match=pattern):
        varlen_backward(q, q, k, v, out, lse, cu_q, cu_k, 8, 8, causal=True)


@pytest.mark.parametrize(("max_q", "max_k", "pattern"), [(4, 8, r"max_seqlen for cu_seqlens_q is 4, below its longest segment \(5\)"),
                                                         (5, 2, r"max_seqlen for cu_seqlens_k is 2, below its longest segment \(5\)")])
def test_kernels_reject_max_seqlen_below_the_longest_segment(max_q: int, max_k: int, pattern: str) -> None:
    """The flash kernels would silently skip the rest of a longer segment."""
    q, k, v = _qkv(8)
    cu = _cu([0, 3, 8])
    with pytest.raises(ValueError, match=pattern):
        varlen_forward(q, k, v, cu, cu, max_q, max_k, causal=True)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (lambda q, k, v: (q.half(), k, v), r"share a dtype, got torch.float16, torch.float32, torch.float32"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), r"unsupported dtype torch.int32"),
        (lambda q, k, v: (q[..., :4], k, v), r"same head_dim, got 4 and 8"),
        (lambda q, k, v: (q[:, :3], k, v), r"query heads \(3\) must be a positive multiple of key/value heads \(2\)"),
        (lambda q, k, v: (q, k, v[:, :1]), r"k and v must have the same shape, got \(8, 2, 8\) and \(8, 1, 8\)"),
        (lambda q, k, v: (q, k.to("meta"), v.to("meta")), r"must be on one device, got \['cpu', 'meta'\]"),
        (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), r"head_dim must be positive"),
        (lambda q, k, v: (q[:, :0], k, v), r"query heads \(0\) must be a positive multiple"),
    ],
)
def test_kernels_reject_bad_tensors(change, pattern: str) -> None:
    q, k, v = change(*_qkv(8))
    cu = _cu([0, 3, 8])
    with pytest.raises(ValueError, match=pattern):
        varlen_forward(q, k, v, cu, cu, 5, 5, causal=True)


def test_kernel_backward_rejects_mismatched_out_and_lse() -> None:
    q, k, v = _qkv(8)
    cu = _cu([0, 3, 8])
    out, lse = varlen_forward(q, k, v, cu, cu, 5, 5, causal=True)
    with pytest.raises(ValueError, match=r"dout \(7, 4, 8\) and out \(8, 4, 8\) must have q's shape \(8, 4, 8\)"):
        varlen_backward(q[:7], q, k, v, out, lse, cu, cu, 5, 5, causal=True)
    with pytest.raises(ValueError, match=r"lse must be \[Hq, Tq\] = \(4, 8\), got \(8, 4\)"):
        varlen_backward(q, q, k, v, out, lse.T, cu, cu, 5, 5, causal=True)
    with pytest.raises(ValueError, match=r"dout and out must have q's dtype torch.float32 .*got torch.float64 and torch.float32"):
        varlen_backward(q.double(), q, k, v, out, lse, cu, cu, 5, 5, causal=True)
    with pytest.raises(ValueError, match=r"dout and out must have q's dtype torch.float32 .*got torch.float32 and torch.bfloat16"):
        varlen_backward(q, q, k, v, out.bfloat16(), lse, cu, cu, 5, 5, causal=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(causal="no"), TypeError, "causal must be True or False, got 'no'"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be a finite number, got nan"),
        (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be a finite number, got inf"),
        (dict(max_seqlen_q=6.5), TypeError, "max_seqlen_q must be an integer on the host"),
        (dict(max_seqlen_k=torch.tensor(5)), TypeError, "max_seqlen_k must be an integer on the host"),
    ],
)
def test_kernels_reject_bad_call_arguments(kwargs: dict, error: type, pattern: str) -> None:
    q, k, v = _qkv(8)
    cu = _cu([0, 3, 8])
    call = dict(max_seqlen_q=5, max_seqlen_k=5, causal=True, softmax_scale=None) | kwargs
    lengths = (call.pop("max_seqlen_q"), call.pop("max_seqlen_k"))
    with pytest.raises(error, match=pattern):
        varlen_forward(q, k, v, cu, cu, *lengths, **call)
    out, lse = varlen_forward(q, k, v, cu, cu, 5, 5, causal=True)
    with pytest.raises(error, match=pattern):
        varlen_backward(q, q, k, v, out, lse, cu, cu, *lengths, **call)


def test_kernel_backward_takes_the_forwards_lse_dtype() -> None:
    q, k, v = _qkv(8)
    cu = _cu([0, 3, 8])
    out, lse = varlen_forward(q, k, v, cu, cu, 5, 5, causal=True)
    with pytest.raises(ValueError, match="lse must be float32 or float64 .*, got torch.bfloat16"):
        varlen_backward(q, q, k, v, out, lse.bfloat16(), cu, cu, 5, 5, causal=True)


def test_merge_into_rejects_parts_of_another_shape() -> None:
    from megatron_sap.kernels import merge_into

    acc_out, acc_lse = torch.zeros(6, 4, 8), torch.full((4, 6), float("-inf"))
    rows = torch.tensor([0, 2, 5])
    for part in (torch.zeros(3, 1, 8), torch.zeros(3, 4, 1)):
        with pytest.raises(ValueError, match="must describe the same n rows of acc_out"):
            merge_into(acc_out, acc_lse, rows, part, torch.zeros(4, 3))
    for run in (slice(0, 2), slice(4, 7), slice(0, 6, 2)):  # two rows, past the end, a stride
        with pytest.raises(ValueError, match="must describe the same n rows of acc_out"):
            merge_into(acc_out, acc_lse, run, torch.zeros(3, 4, 8), torch.zeros(4, 3))
    # An lse accumulator of one head (or too many rows) would broadcast over the heads: wrong, not an error.
    for wrong in (torch.full((1, 6), float("-inf")), torch.full((4, 7), float("-inf"))):
        with pytest.raises(ValueError, match=r"acc_lse must be \[H, T\] = \(4, 6\) for acc_out \(6, 4, 8\)"):
            merge_into(acc_out, wrong, None, torch.zeros(6, 4, 8), torch.zeros(wrong.shape[0], 6))


def test_merge_partials_rejects_parts_of_another_shape() -> None:
    from megatron_sap.kernels import merge_partials

    out, lse = torch.zeros(4, 2, 8), torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"shapes differ: out \(4, 2, 8\) vs \(3, 2, 8\)"):
        merge_partials(out, lse, torch.zeros(3, 2, 8), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"lse must be \[H, T\] = \(2, 4\) for out \(4, 2, 8\), got \(4, 2\)"):
        merge_partials(out, lse.T, out, lse.T)


def test_kernels_accept_zero_length_segments() -> None:
    q, k, v = _qkv(8, dtype=torch.float64)
    cu = [0, 0, 3, 3, 8, 8]
    out, lse = varlen_forward(q, k, v, _cu(cu), _cu(cu), 5, 5, causal=True)
    ref, ref_lse = dense_attention(q, k, v, torch.tensor(cu))
    assert torch.allclose(out, ref, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)


def test_kernels_take_calls_without_query_or_key_rows() -> None:
    """A call with no query rows, or none of keys (a rank's empty share of a step), gives
    zero gradients of the right shapes, and no keys give a zero output with lse -inf."""
    q, k, v = _qkv(5, dtype=torch.float64)
    none, five = _cu([0, 0]), _cu([0, 5])
    out, lse = varlen_forward(q[:0], k, v, none, five, 0, 5, causal=False)
    dq, dk, dv = varlen_backward(out, q[:0], k, v, out, lse, none, five, 0, 5, causal=False)
    assert dq.shape == (0, 4, 8) and torch.equal(dk, torch.zeros_like(k)) and torch.equal(dv, torch.zeros_like(v))
    out, lse = varlen_forward(q, k[:0], v[:0], five, none, 5, 0, causal=False)
    assert torch.equal(out, torch.zeros_like(q)) and bool(torch.all(lse == float("-inf")))
    dq, dk, dv = varlen_backward(torch.ones_like(q), q, k[:0], v[:0], out, lse, five, none, 5, 0, causal=False)
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == dv.shape == (0, 2, 8)


# ---- Megatron batch splitter --------------------------------------------------------------------


def _split(cu: list[int], batch: dict[str, torch.Tensor] | None = None, groups: SAPGroups | None = None) -> None:
    from megatron_sap.megatron import sap_split_batch

    row = torch.arange(8).unsqueeze(0)
    sap_split_batch({"tokens": row, "labels": row} if batch is None else batch, cu, groups)


@pytest.mark.parametrize(
    ("cu", "pattern"),
    [
        ([1, 4, 8], r"cu_seqlens must start at 0, got 1"),
        ([0, 4, 7], r"must end at the batch length 8, got 7"),
        ([0, 4, 9], r"must end at the batch length 8, got 9"),
        ([0, 5, 3, 8], r"cu_seqlens must be non-decreasing, but cu_seqlens\[2\]=3 < cu_seqlens\[1\]=5"),
        ([0], r"must end at the batch length 8, got 0"),
        (torch.tensor([0.0, 4.7, 8.0]), r"cu_seqlens must have an integer dtype, got torch.float32"),
        ([0, 4.7, 8], r"cu_seqlens must hold integers, got 4.7"),
        (torch.tensor([[0, 4], [4, 8]]), r"cu_seqlens must be 1-D, got shape \(2, 2\)"),
    ],
)
def test_batch_splitter_rejects_bad_cu_seqlens(cu: list[int], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _split(cu)


def test_batch_splitter_rejects_arguments_of_another_kind() -> None:
    from megatron_sap.megatron import sap_split_batch

    row = torch.arange(8).unsqueeze(0)
    with pytest.raises(TypeError, match="cp_group must be a CP process group, SAPGroups or None, got int"):
        sap_split_batch({"tokens": row}, [0, 8], 3)
    for batch in ([row], row):
        with pytest.raises(TypeError, match=r"batch must be a mapping of names to \[1, T\] tensors .*, got (list|Tensor)"):
            sap_split_batch(batch, [0, 8])


def test_batch_splitter_rejects_bad_batches() -> None:
    with pytest.raises(ValueError, match=r"packed length 10 is not divisible by the CP size 4; pad the batch"):
        _split([0, 3, 10], {"tokens": torch.zeros(1, 10)}, _fake_groups(2, 2))
    with pytest.raises(ValueError, match=r"batch\['tokens'\] must be \[1, T\] \(packed, micro-batch size 1\), got \(2, 4\)"):
        _split([0, 8], {"tokens": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match=r"disagree on the packed length: \{'tokens': 8, 'labels': 6\}"):
        _split([0, 8], {"tokens": torch.zeros(1, 8), "labels": torch.zeros(1, 6)})


@pytest.mark.parametrize(("inner", "heads", "kv_heads", "kwargs", "pattern"), [
    (2, 4, 2, {"inner_chunks": 0}, "inner_chunks must be 'auto' or a positive int"),
    (2, 4, 2, {"inner_chunks": True}, "inner_chunks must be 'auto' or a positive int"),
    (2, 4, 2, {"inner_chunks": "2"}, "inner_chunks must be 'auto' or a positive int"),
    (1, 4, 2, {"inner_chunks": 2}, "which an inner size of 1 does not have"),
    (2, 4, 2, {"inner_chunks": 2, "recompute_kv": True}, "needs recompute_kv off"),
    (2, 4, 2, {"inner_chunks": 4}, "does not split the heads: each of the 2 inner ranks holds 2 query heads"),
    (2, 12, 4, {"inner_chunks": 3}, "does not split the heads"),
])
def test_sap_attention_rejects_head_chunks_that_cannot_run(inner, heads, kv_heads, kwargs, pattern) -> None:
    """A count of head chunks that cannot run is refused by name before any exchange."""
    plan = _plan([0, 64], outer=1, inner=inner)
    q, k, v = _qkv(64 // inner, heads, kv_heads)
    with pytest.raises(ValueError, match=pattern):
        sap.sap_attention(q, k, v, plan, _fake_groups(inner, 1) if inner > 1 else None, **kwargs)
