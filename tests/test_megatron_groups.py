"""SAP groups come from Megatron's own (hierarchical) context-parallel groups, TP included."""
from __future__ import annotations

import pytest

from dist_pool import make_pool_fixture

pytest.importorskip("megatron.core")

pool4 = make_pool_fixture(4, timeout=180, destroy_job_groups=True)


def _ranks(group) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def layout_rank(rank: int, world_size: int, inner: int, outer: int, tp: int) -> dict:
    """Groups from initialize_sap_parallel beside Megatron's parallel_state and process group
    collection (`ProcessGroupCollection`; `ModelCommProcessGroups` before megatron-core 0.15)."""
    from megatron.core import parallel_state, process_groups_config

    collection = getattr(process_groups_config, "ProcessGroupCollection", None) or process_groups_config.ModelCommProcessGroups

    from megatron_sap.megatron import initialize_sap_parallel, sap_groups_from_pg_collection

    try:
        groups = initialize_sap_parallel(inner_size=inner, outer_size=outer, tensor_model_parallel_size=tp)
        hcp = parallel_state.get_hierarchical_context_parallel_groups()
        from_collection = sap_groups_from_pg_collection(collection.use_mpu_process_groups())
        return {
            "sizes": (groups.inner_size, groups.outer_size),
            "cp_ranks": groups.cp_ranks,
            "megatron_cp_ranks": tuple(parallel_state.get_context_parallel_global_ranks()),
            "cp_rank": groups.cp_rank,
            "megatron_cp_rank": parallel_state.get_context_parallel_rank(),
            "inner": groups.inner_ranks,
            "outer": groups.outer_ranks,
            "megatron_hcp": (_ranks(hcp[0]), _ranks(hcp[1])),
            "collection": (from_collection.cp_ranks, from_collection.inner_ranks, from_collection.outer_ranks),
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("inner,outer,tp", [(2, 2, 1), (1, 4, 1), (2, 1, 2)], ids=["2x2", "1x4", "tp2-2x1"])
def test_groups_are_megatrons_hierarchical_cp_groups(pool4, inner: int, outer: int, tp: int) -> None:
    for r in pool4.run(layout_rank, inner, outer, tp):
        assert r["sizes"] == (inner, outer)
        assert r["cp_ranks"] == r["megatron_cp_ranks"] and r["cp_rank"] == r["megatron_cp_rank"]
        assert (r["inner"], r["outer"]) == r["megatron_hcp"]
        assert r["collection"] == (r["cp_ranks"], r["inner"], r["outer"])
        assert r["cp_rank"] == r["outer"].index(r["cp_ranks"][r["cp_rank"]]) * inner + r["inner"].index(
            r["cp_ranks"][r["cp_rank"]]
        )


def flat_cp_rank(rank: int, world_size: int) -> tuple[int, int]:
    """Plain --context-parallel-size without hierarchical sizes: one outer ring, inner size 1."""
    from megatron.core import parallel_state

    from megatron_sap.megatron import sap_groups_from_parallel_state

    try:
        parallel_state.initialize_model_parallel(context_parallel_size=world_size)
        groups = sap_groups_from_parallel_state()
        return groups.inner_size, groups.outer_size
    finally:
        parallel_state.destroy_model_parallel()


def test_flat_cp_is_one_outer_ring(pool4) -> None:
    assert pool4.run(flat_cp_rank) == [(1, 4)] * 4


def node_size_rank(rank: int, world_size: int, gpus_per_node: int | None) -> tuple[int, list[str]]:
    """SAPGroups' node size from the SAP options (LOCAL_WORLD_SIZE through the flags), and the
    warnings when the 4-rank inner group leaves a node of that size."""
    import warnings

    from megatron.core import parallel_state

    from megatron_sap.megatron import sap_groups_from_parallel_state
    from megatron_sap.megatron.options import reset_sap_options, set_sap_options

    try:
        if gpus_per_node is not None:
            set_sap_options(gpus_per_node=gpus_per_node)
        parallel_state.initialize_model_parallel(context_parallel_size=world_size,
                                                 hierarchical_context_parallel_sizes=[world_size, 1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            groups = sap_groups_from_parallel_state()
        return groups.gpus_per_node, [str(w.message) for w in caught if "spans nodes" in str(w.message)]
    finally:
        parallel_state.destroy_model_parallel()
        reset_sap_options()


def test_groups_take_the_node_size_from_the_options(pool4) -> None:
    assert [r[0] for r in pool4.run(node_size_rank, None)] == [8] * 4
    assert all(not r[1] for r in pool4.run(node_size_rank, None))
    spanning = pool4.run(node_size_rank, 2)
    assert [r[0] for r in spanning] == [2] * 4 and all(r[1] for r in spanning)


def bad_levels_rank(rank: int, world_size: int) -> str:
    from megatron_sap.megatron import initialize_sap_parallel

    with pytest.raises(ValueError, match="derived"):
        initialize_sap_parallel(inner_size=2, outer_size=2, context_parallel_size=4)
    with pytest.raises(ValueError, match=">= 1"):
        initialize_sap_parallel(inner_size=0)
    with pytest.raises(TypeError, match="inner_size must be an integer, got 2.0"):
        initialize_sap_parallel(inner_size=2.0)
    with pytest.raises(TypeError, match="outer_size must be an integer, got '2'"):
        initialize_sap_parallel(inner_size=2, outer_size="2")
    with pytest.raises(ValueError, match=r"world_size=4 is not divisible by tensor_model_parallel_size \* inner_size \* "
                                         r"outer_size \* pipeline_model_parallel_size = 1 \* 3 \* 1 \* 1 = 3"):
        initialize_sap_parallel(inner_size=3)
    with pytest.raises(ValueError, match=r"= 1 \* 2 \* 2 \* 2 = 8"):
        initialize_sap_parallel(inner_size=2, outer_size=2, pipeline_model_parallel_size=2)
    return "ok"


def test_initialize_rejects_bad_levels(pool4) -> None:
    assert pool4.run(bad_levels_rank) == ["ok"] * 4


def differing_levels_rank(rank: int, world_size: int, inner_size: object, outer_size: object) -> str:
    """Rank 1 asks for `inner_size` and `outer_size`, the rest for 2 and 2; then all ask alike."""
    from megatron.core import parallel_state

    from megatron_sap.megatron import initialize_sap_parallel

    try:
        initialize_sap_parallel(inner_size=inner_size if rank == 1 else 2, outer_size=outer_size if rank == 1 else 2)
        first = "ok"
    except ValueError as error:
        first = str(error)
    initialize_sap_parallel(inner_size=2, outer_size=2)
    parallel_state.destroy_model_parallel()
    return first


@pytest.mark.parametrize(("inner_size", "outer_size", "differ"), [
    (4, 1, "inner_size from 2 to 4; outer_size from 1 to 2"),
    # A size only rank 1 gets wrong: its own checks would raise there alone, the others wait.
    (2.0, 2, "inner_size from a non-integer to 2"),
    (2, 0, "outer_size from 0 to 2"),
])
def test_ranks_asking_for_other_levels_are_told_on_every_rank(pool4, inner_size, outer_size, differ) -> None:
    """Compared before Megatron makes any group: a rank asking for others made groups that
    did not match, and every rank waited until the timeout, with a bare 'Wait timeout'."""
    for rank, message in enumerate(pool4.run(differing_levels_rank, inner_size, outer_size, timeout=60)):
        assert message.startswith("initialize_sap_parallel: the ranks asked for different groups "
                                  f"({differ} across ranks"), message
        assert f"rank {rank} asked for inner_size={inner_size if rank == 1 else 2!r}" in message


def unpacked_at_cp4_rank(rank: int, world_size: int) -> str:
    """Without packed params a CP > 1 layer cannot know the token layout: it must refuse."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_sap.megatron import SAPDotProductAttention, initialize_sap_parallel

    try:
        initialize_sap_parallel(inner_size=2, outer_size=2)
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, attention_dropout=0.0,
                                   use_cpu_initialization=True, context_parallel_size=4, cp_comm_type="sap")
        attention = SAPDotProductAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                           attention_type="self", cp_comm_type="sap")
        q = torch.zeros(4, 1, 2, 16)
        with pytest.raises(ValueError, match="packed batches"):
            attention(q, q, q, None)
        return "ok"
    finally:
        parallel_state.destroy_model_parallel()


def test_unpacked_input_with_cp_is_refused(pool4) -> None:
    assert pool4.run(unpacked_at_cp4_rank) == ["ok"] * 4


def tp_batch_rank(rank: int, world_size: int) -> dict:
    """TP 2 x CP 2 through the batch hooks: only TP rank 0 reads the loader's row; every rank's
    batch has its position ids on the meta device (no values), as if only on the GPU, so the
    other TP rank can split only with the documents the source sends over the host group."""
    from types import SimpleNamespace

    import torch
    from megatron.core import parallel_state

    from megatron_sap.megatron.groups import tensor_parallel_host_group
    from megatron_sap.megatron.hooks import wrap_get_batch_on_this_tp_rank, wrap_get_thd_batch_on_this_cp_rank

    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True)
    get_batch = wrap_get_batch_on_this_tp_rank(
        lambda data_iterator: {**(row if data_iterator is None else next(data_iterator)), "position_ids": meta},
        get_args=lambda: args)
    split = wrap_get_thd_batch_on_this_cp_rank(lambda *a, **k: pytest.fail("Megatron's split was called"),
                                               get_args=lambda: args)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]])
    row = {"tokens": torch.arange(12).unsqueeze(0), "labels": torch.arange(1, 13).unsqueeze(0), "position_ids": positions}
    meta = positions.to("meta")
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
        source = parallel_state.get_tensor_model_parallel_rank() == 0
        host = tensor_parallel_host_group()
        batch = get_batch(iter([dict(row)]) if source else None)
        cu, max_seqlen = batch.pop("cu_seqlens"), batch.pop("max_seqlen")
        local, params = split(batch, cu, None, max_seqlen)
        return {"documents": params.cu_seqlens_q.tolist(), "max_seqlen": int(max_seqlen[0]),
                "positions": local["position_ids"][0].tolist(), "tokens": local["tokens"][0].tolist(),
                "host_ranks": _ranks(host[0]), "source": host[1], "same_group": tensor_parallel_host_group()[0] is host[0]}
    finally:
        parallel_state.destroy_model_parallel()


def test_tp_ranks_get_the_rows_documents_from_the_source_on_the_host(pool4) -> None:
    results = pool4.run(tp_batch_rank)
    positions = [0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]
    for rank, r in enumerate(results):
        assert r["documents"] == [0, 3, 5, 9, 12] and r["max_seqlen"] == 4
        assert r["positions"] == [positions[t] for t in r["tokens"]]
        assert r["host_ranks"] == (rank - rank % 2, rank - rank % 2 + 1) and r["source"] == rank - rank % 2
        assert r["same_group"]
    assert results[0]["tokens"] == results[1]["tokens"]  # TP peers hold the same CP share
    assert sorted(results[0]["tokens"] + results[2]["tokens"]) == list(range(12))


def host_twin_rank(rank: int, world_size: int) -> dict:
    """The agreement check over a gloo twin of the CP group. Every group here is gloo (CPU), so
    the CP group is taken for an NCCL one (its collectives on a GPU) to make the twin."""
    import datetime
    from unittest import mock

    import torch
    import torch.distributed as dist

    import megatron_sap as sap
    from megatron_sap.attention import verify_plan_agreement
    from megatron_sap.megatron import groups as megatron_groups

    groups = sap.init_sap_groups(inner_size=1, outer_size=world_size, timeout=datetime.timedelta(seconds=123))
    assert megatron_groups.host_twin(groups.cp_group) is groups.cp_group  # gloo already: itself
    with mock.patch.object(megatron_groups, "collective_device", lambda group: torch.device("cuda", 0)):
        twin = megatron_groups.host_twin(groups.cp_group)
        again = megatron_groups.host_twin(groups.cp_group)
    plan = sap.plan_sequences([0, 100, 4096], outer_size=world_size)
    verify_plan_agreement(plan, groups, over=twin)
    other = sap.plan_sequences([0, 100 + (rank == 1), 4096], outer_size=world_size)
    try:
        verify_plan_agreement(other, groups, over=twin)
        disagreement = None
    except RuntimeError as error:
        disagreement = str(error)
    from megatron_sap.comm.groups import group_timeout

    return {"twin": twin is not groups.cp_group and again is twin, "ranks": tuple(dist.get_process_group_ranks(twin)),
            "disagreement": disagreement, "timeout": group_timeout(twin).total_seconds()}


def test_the_agreement_check_runs_over_a_gloo_twin_of_the_cp_group(pool4) -> None:
    for r in pool4.run(host_twin_rank):
        assert r["twin"] and r["ranks"] == (0, 1, 2, 3) and r["timeout"] == 123  # the CP group's
        assert "CP ranks disagree on the batch" in r["disagreement"]
