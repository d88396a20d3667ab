"""SAP process groups (megatron_sap.comm.groups) on real gloo groups of 4 and 8 workers."""
from __future__ import annotations

import datetime
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout  # new_group's default, as Megatron calls it

from dist_pool import WorkerPool
from megatron_sap.comm.groups import SAPGroups, init_sap_groups
from megatron_sap.comm.layout import DEFAULT_ORDER, CPGroupLayout, sap_group_layout

CASES = [
    (4, dict(inner_size=1, outer_size=4)),
    (4, dict(inner_size=2, outer_size=2)),
    (4, dict(inner_size=4, outer_size=1)),
    (4, dict(inner_size=2)),  # outer_size derived: 2
    (4, dict(inner_size=1, outer_size=2)),  # DP = 2
    (4, dict(inner_size=2, outer_size=1, tensor_parallel_size=2)),
    (8, dict(inner_size=2, outer_size=4)),
    (8, dict(inner_size=4, outer_size=2)),
    (8, dict(inner_size=2, outer_size=2)),  # DP = 2: two CP groups of 4
    (8, dict(inner_size=2, outer_size=2, tensor_parallel_size=2)),
    (8, dict(inner_size=2, pipeline_parallel_size=2)),  # outer_size derived: 2
]


def case_id(case: tuple[int, dict]) -> str:
    world_size, kwargs = case
    return f"world{world_size}-" + "-".join(f"{key.split('_')[0]}{value}" for key, value in kwargs.items())


# ---- run on the workers ----


def membership(group: dist.ProcessGroup | None) -> tuple[tuple[int, ...], int] | None:
    """(members found by an all_reduce over the group, this rank's rank in it)."""
    if group is None:
        return None
    flags = torch.zeros(dist.get_world_size())
    flags[dist.get_rank()] = 1.0
    dist.all_reduce(flags, group=group)
    return tuple(flags.nonzero().flatten().tolist()), dist.get_rank(group)


def summarize(groups: SAPGroups) -> dict[str, Any]:
    """Everything checkable about a rank's groups, as plain data."""
    return {
        "sizes": (groups.inner_size, groups.outer_size, groups.world_size),
        "coords": (groups.cp_rank, groups.inner_rank, groups.outer_rank),
        "ranks": (groups.cp_ranks, groups.inner_ranks, groups.outer_ranks),
        "peers": (
            tuple(groups.inner_peer(i) for i in range(groups.inner_size)),
            tuple(groups.outer_peer(o) for o in range(groups.outer_size)),
        ),
        "members": tuple(membership(g) for g in (groups.cp_group, groups.inner_group, groups.outer_group)),
        "reuses_cp_group": (groups.inner_group is groups.cp_group, groups.outer_group is groups.cp_group),
        "timeout": groups.cp_group._get_backend(torch.device("cpu")).options._timeout,
    }


def destroy(*groups: dist.ProcessGroup | None) -> None:
    """Destroy the groups a job made, so that a long-lived pool does not pile them up; each
    once all its members have connected it (a member that closes its connections while
    another is still connecting makes that one fail)."""
    for group in {id(g): g for g in groups if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER}.values():
        dist.barrier(group=group)
        dist.destroy_process_group(group)


def init_and_summarize(rank: int, world_size: int, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    groups = init_sap_groups(**kwargs)
    if groups is None:
        return None
    try:
        return summarize(groups)
    finally:
        destroy(groups.cp_group, groups.inner_group, groups.outer_group)


def init_from_iterated_ranks(rank: int, world_size: int, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """`init_and_summarize` with `ranks` given as an iterator (read once)."""
    return init_and_summarize(rank, world_size, {**kwargs, "ranks": iter(kwargs["ranks"])})


def round_trip(rank: int, world_size: int, inner_size: int, outer_size: int) -> bool:
    groups = init_sap_groups(inner_size, outer_size, gpus_per_node=4)
    try:
        return SAPGroups.from_process_groups(groups.cp_group, groups.inner_group, groups.outer_group, 4) == groups
    finally:
        destroy(groups.cp_group, groups.inner_group, groups.outer_group)


def adopt_megatron_groups(rank: int, world_size: int, created: list[tuple[str, list[int]]]) -> dict[str, Any]:
    """Create groups in the order and with the ranks Megatron does, then adopt this rank's."""
    mine: dict[str, dist.ProcessGroup] = {}
    made = []
    for kind, ranks in created:
        group = dist.new_group(ranks)
        made.append(group)
        if rank in ranks:
            mine[kind] = group
    try:
        return summarize(SAPGroups.from_process_groups(mine["cp"], mine["inner"], mine["outer"]))
    finally:
        destroy(*made)


def error_messages(rank: int, world_size: int) -> list[str]:
    """Every misuse raises a ValueError; return their messages (the pool stays healthy)."""
    messages = []
    for kwargs in (
        dict(inner_size=3),
        dict(inner_size=2, outer_size=4),
        dict(inner_size=2, ranks=[0, 1, 2]),
        dict(inner_size=2, ranks=[0, 9]),
        dict(inner_size=2, outer_size=2, ranks=[0, 1]),
        dict(inner_size=2, ranks=[0, 1], tensor_parallel_size=2),
        dict(inner_size=0),
        dict(inner_size=2, outer_size=True),
        dict(ranks=[0.0, 1.0], outer_size=2),
    ):
        with pytest.raises(ValueError) as info:
            init_sap_groups(**kwargs)
        messages.append(str(info.value))
    groups = init_sap_groups(2, 2)
    cp, inner, outer = groups.cp_group, groups.inner_group, groups.outer_group
    try:
        for args in ((cp, outer, inner), (cp, inner), (cp, inner, cp)):
            with pytest.raises(ValueError) as info:
                SAPGroups.from_process_groups(*args)
            messages.append(str(info.value))
        with pytest.raises(IndexError) as index_error:
            groups.outer_peer(-1)
        messages.append(str(index_error.value))
    finally:
        destroy(cp, inner, outer)
    return messages


def adopt_a_group_without_this_rank(rank: int, world_size: int) -> str:
    """Every rank makes a CP group of ranks 0 and 1 (torch.distributed.new_group gives the
    others a placeholder) and adopts it: "ok" where it is a member, else the error."""
    cp = dist.new_group([0, 1])
    try:
        SAPGroups.from_process_groups(cp)
        return "ok"
    except ValueError as error:
        return str(error)
    finally:
        if isinstance(cp, dist.ProcessGroup):
            destroy(cp)


def warnings_of(rank: int, world_size: int, **kwargs: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = init_sap_groups(**kwargs)
    destroy(groups.cp_group, groups.inner_group, groups.outer_group)
    return [str(warning.message) for warning in caught]


# ---- expectations, from the layout (itself checked against Megatron in test_layout.py) ----


def expected_summary(layout: CPGroupLayout, rank: int, timeout: datetime.timedelta) -> dict[str, Any]:
    u, r = layout.inner_size, layout.outer_size
    outer_rank, inner_rank = layout.coordinates(rank)
    cp_rank = layout.cp_ranks.index(rank)
    inner, outer = layout.inner_groups[outer_rank], layout.outer_groups[inner_rank]
    return {
        "sizes": (u, r, u * r),
        "coords": (cp_rank, inner_rank, outer_rank),
        "ranks": (layout.cp_ranks, inner, outer),
        "peers": (inner, outer),
        "members": (
            (layout.cp_ranks, cp_rank),
            None if u == 1 else (inner, inner_rank),
            None if r == 1 else (outer, outer_rank),
        ),
        "reuses_cp_group": (u > 1 and r == 1, r > 1 and u == 1),
        "timeout": timeout,
    }


def layouts_for(world_size: int, kwargs: dict[str, Any]) -> list[CPGroupLayout]:
    sizes = dict(kwargs)
    tp, pp = sizes.get("tensor_parallel_size", 1), sizes.get("pipeline_parallel_size", 1)
    sizes.setdefault("outer_size", world_size // (sizes["inner_size"] * tp * pp))
    return sap_group_layout(world_size, **sizes)


def layout_of(layouts: list[CPGroupLayout], rank: int) -> CPGroupLayout:
    return next(layout for layout in layouts if rank in layout.cp_ranks)


# ---- tests ----


@pytest.mark.parametrize(("dist_pool", "kwargs"), CASES, ids=[case_id(c) for c in CASES], indirect=["dist_pool"])
def test_groups_have_the_layout(dist_pool: WorkerPool, kwargs: dict[str, Any]) -> None:
    n = dist_pool.world_size
    layouts = layouts_for(n, kwargs)
    results = dist_pool.run(init_and_summarize, kwargs)
    pool_timeout = datetime.timedelta(seconds=dist_pool.timeout)
    assert results == [expected_summary(layout_of(layouts, rank), rank, pool_timeout) for rank in range(n)]


@pytest.mark.parametrize("dist_pool", [8], indirect=True)
def test_tensor_parallel_example(dist_pool: WorkerPool) -> None:
    """TP=2, CP=4 (U=2, R=2) on 8 ranks: CP groups stride by TP."""
    results = dist_pool.run(init_and_summarize, dict(inner_size=2, outer_size=2, tensor_parallel_size=2))
    assert results[0]["ranks"] == ((0, 2, 4, 6), (0, 2), (0, 4))
    assert results[6]["ranks"] == ((0, 2, 4, 6), (4, 6), (2, 6))
    assert results[6]["coords"] == (3, 1, 1)
    assert results[3]["ranks"] == ((1, 3, 5, 7), (1, 3), (3, 7))


@pytest.mark.parametrize("dist_pool", [8], indirect=True)
def test_explicit_ranks(dist_pool: WorkerPool) -> None:
    """One CP group given by its ranks (in any order; cp_rank follows the global rank); others get None."""
    timeout = datetime.timedelta(seconds=7)
    results = dist_pool.run(init_and_summarize, dict(inner_size=2, ranks=[7, 3, 5, 1], timeout=timeout))
    layout = CPGroupLayout.from_cp_ranks([1, 3, 5, 7], inner_size=2)
    for rank, result in enumerate(results):
        assert result == (expected_summary(layout, rank, timeout) if rank % 2 else None)
    assert dist_pool.run(init_from_iterated_ranks, dict(inner_size=2, ranks=[7, 3, 5, 1], timeout=timeout)) == results


@pytest.mark.parametrize(("dist_pool", "sizes"), [(4, (2, 2)), (8, (2, 4)), (8, (8, 1))], indirect=["dist_pool"])
def test_from_process_groups_round_trip(dist_pool: WorkerPool, sizes: tuple[int, int]) -> None:
    assert dist_pool.run(round_trip, *sizes) == [True] * dist_pool.world_size


@pytest.mark.parametrize(
    ("dist_pool", "shape"), [(8, (1, 2, 2)), (8, (2, 2, 2)), (8, (1, 2, 4))], ids=["tp1-2x2", "tp2-2x2", "tp1-2x4"],
    indirect=["dist_pool"],
)
def test_adopts_megatron_hierarchical_cp_groups(
    dist_pool: WorkerPool, shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Megatron's own CP and hierarchical CP groups (sizes [U, R]) are accepted as they are."""
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    tp, u, r = shape
    n = dist_pool.world_size
    created: list[tuple[str, list[int]]] = []
    kinds = {"CONTEXT_PARALLEL_GROUP": "cp", "HIERARCHICAL_CP_L0": "inner", "HIERARCHICAL_CP_L1": "outer"}

    def record_group(ranks: list[int], group_desc: str, **_: object) -> None:
        created.append((kinds[group_desc], list(ranks)))

    monkeypatch.setattr(parallel_state, "create_group", record_group)
    generator = parallel_state.RankGenerator(tp=tp, ep=1, dp=n // (tp * u * r), pp=1, cp=u * r, order=DEFAULT_ORDER)
    for ranks in generator.get_ranks("cp"):  # as initialize_model_parallel does
        record_group(ranks, group_desc="CONTEXT_PARALLEL_GROUP")
        parallel_state.create_hierarchical_groups(ranks[0], ranks, [u, r], group_desc="CP")
    results = dist_pool.run(adopt_megatron_groups, created)
    layouts = sap_group_layout(n, inner_size=u, outer_size=r, tensor_parallel_size=tp)
    assert results == [expected_summary(layout_of(layouts, rank), rank, default_pg_timeout) for rank in range(n)]


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
def test_errors_are_clear(dist_pool: WorkerPool) -> None:
    messages = dist_pool.run(error_messages)
    expected = [
        "cannot derive outer_size: world_size=4 is not divisible by inner_size * tensor_parallel_size * "
        "pipeline_parallel_size = 3 * 1 * 1",
        "world_size=4 is not divisible by tensor_parallel_size * inner_size * outer_size * pipeline_parallel_size "
        "= 1 * 2 * 4 * 1 = 8",
        "the CP group of size 3 ([0, 1, 2]) is not divisible by inner_size=2",
        "ranks [0, 9] exceed the world of 4 ranks",
        "len(ranks)=2 != inner_size * outer_size = 2 * 2",
        "tensor_parallel_size and pipeline_parallel_size describe the job; do not combine with ranks",
        "sizes must be positive integers, got {'inner_size': 0}",
        "sizes must be positive integers, got {'outer_size': True}",
        "cp_ranks must be integer global ranks, got [0.0, 1.0]",
        "is not SAP's inner group",
        "the outer group is required: both levels have more than one rank",
        "an inner group of size 2 and an outer group of size 4 do not tile the CP group of size 4 [0, 1, 2, 3]",
        "outer rank -1 is outside the outer group",
    ]
    for rank_messages in messages:
        for message, fragment in zip(rank_messages, expected, strict=True):
            assert fragment in message


def ask_differently(rank: int, world_size: int, mine: dict[str, Any], others: dict[str, Any]) -> str:
    """Rank 0 calls init_sap_groups with `mine`, the others with `others`: the error each gets."""
    with pytest.raises(ValueError) as info:
        init_sap_groups(**(mine if rank == 0 else others))
    return str(info.value)


def test_ranks_compared_tell_apart_sets_of_equal_sums() -> None:
    """Equal lengths, sums and sums of squares; the group is made from the sorted ranks."""
    from megatron_sap.comm.groups import _ranks_asked

    one, other = _ranks_asked([0, 3, 5, 6]), _ranks_asked([1, 2, 4, 7])
    assert one["hash of ranks"] != other["hash of ranks"]
    assert (one["len(ranks)"], one["sum(ranks)"]) == (other["len(ranks)"], other["sum(ranks)"])
    assert _ranks_asked([6, 0, 5, 3]) == one and _ranks_asked(None) == _ranks_asked([])


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
@pytest.mark.parametrize(("mine", "others", "differ"), [
    (dict(inner_size=1, outer_size=2), dict(inner_size=2, outer_size=1), "inner_size from 1 to 2; outer_size from 1 to 2"),
    (dict(inner_size=2, outer_size=2), dict(inner_size=1, outer_size=4), "inner_size from 1 to 2; outer_size from 2 to 4"),
    (dict(inner_size=2, ranks=[0, 1]), dict(inner_size=2, ranks=[2, 3]), "sum(ranks) from 1 to 5"),
    # Arguments only rank 0 gets wrong: its own checks would raise there alone, the others wait.
    (dict(inner_size=2.0, outer_size=2), dict(inner_size=2, outer_size=2), "inner_size from a non-integer to 2"),
    (dict(inner_size=2, outer_size=None), dict(inner_size=2, outer_size=2), "outer_size from None to 2"),
    (dict(inner_size=2, ranks=[0, "1"]), dict(inner_size=2, ranks=[0, 1]), "len(ranks) from a non-integer to 2"),
    (dict(inner_size=3), dict(inner_size=2), "inner_size from 2 to 3"),
])
def test_ranks_that_ask_for_different_groups_all_fail_before_any_is_made(
    dist_pool: WorkerPool, mine: dict[str, Any], others: dict[str, Any], differ: str
) -> None:
    """Groups made from different sizes would give some ranks a wrong layout, others an
    error and others a wait; every rank gets the same clear error at once instead."""
    messages = dist_pool.run(ask_differently, mine, others)
    for rank, message in enumerate(messages):
        assert f"the ranks asked for different groups ({differ}" in message, message
        assert f"rank {rank} asked for inner_size={(mine if rank == 0 else others)['inner_size']}" in message
    assert dist_pool.run(init_and_summarize, dict(inner_size=2, outer_size=2))  # the pool still makes groups


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
def test_a_group_this_rank_is_not_in_is_named(dist_pool: WorkerPool) -> None:
    results = dist_pool.run(adopt_a_group_without_this_rank)
    assert results[:2] == ["ok", "ok"]
    for rank, message in enumerate(results[2:], start=2):
        assert f"the CP group given to global rank {rank} is -100, not a process group it belongs to" in message


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
def test_warns_when_an_inner_group_spans_nodes(dist_pool: WorkerPool) -> None:
    caught = dist_pool.run(warnings_of, inner_size=4, outer_size=1, gpus_per_node=2)
    for messages in caught:
        assert len(messages) == 1 and "inner group [0, 1, 2, 3] spans nodes of 2 GPUs" in messages[0]
    assert dist_pool.run(warnings_of, inner_size=2, outer_size=2, gpus_per_node=2) == [[]] * 4


@pytest.mark.skipif(dist.is_initialized(), reason="this process already joined a process group")
def test_needs_an_initialised_default_group() -> None:
    with pytest.raises(RuntimeError, match="initialised first"):
        init_sap_groups(2, 2)
