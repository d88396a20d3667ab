"""SAP's group layout (megatron_sap.comm.layout) against its definition and Megatron-Core's own."""
from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from megatron_sap.comm.layout import CPGroupLayout, sap_group_layout, spans_nodes

parallel_state = pytest.importorskip("megatron.core.parallel_state")

ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-dp-cp-pp", "cp-tp-pp-dp", "tp-pp-dp-cp"]


def shapes() -> Iterator[tuple[int, int, int, int, int]]:
    """(world_size, TP, U, R, PP): every divisible shape of small worlds, then 1,024-rank jobs."""
    for world_size in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        for tp, u, r, pp in itertools.product(divisors, repeat=4):
            if world_size % (tp * u * r * pp) == 0:
                yield world_size, tp, u, r, pp
    for tp, u, r, pp in [(1, 1, 1, 1), (1, 8, 128, 1), (8, 8, 16, 1), (2, 4, 8, 4), (4, 2, 2, 8), (1, 1, 64, 2)]:
        yield 1024, tp, u, r, pp


SHAPES = list(shapes())


def layout_of(shape: tuple[int, int, int, int, int], order: str = "tp-cp-ep-dp-pp") -> list[CPGroupLayout]:
    world_size, tp, u, r, pp = shape
    return sap_group_layout(
        world_size, inner_size=u, outer_size=r, tensor_parallel_size=tp, pipeline_parallel_size=pp, order=order
    )


def test_shapes_cover_the_interesting_cases() -> None:
    assert len(SHAPES) > 500
    assert any(world == 1024 and tp > 1 and u > 1 and r > 1 and pp > 1 for world, tp, u, r, pp in SHAPES)


@pytest.mark.parametrize("order", ORDERS)
def test_groups_partition_the_world(order: str) -> None:
    for shape in SHAPES:
        world_size, tp, u, r, pp = shape
        layouts = layout_of(shape, order)
        assert len(layouts) == world_size // (u * r)
        assert sorted(rank for layout in layouts for rank in layout.cp_ranks) == list(range(world_size))
        for layout in layouts:
            assert (layout.inner_size, layout.outer_size) == (u, r)
            assert len(layout.inner_groups) == r and all(len(g) == u for g in layout.inner_groups)
            assert len(layout.outer_groups) == u and all(len(g) == r for g in layout.outer_groups)
            # cp_rank = outer_rank * U + inner_rank, read both ways.
            for cp_rank, rank in enumerate(layout.cp_ranks):
                outer_rank, inner_rank = layout.coordinates(rank)
                assert cp_rank == outer_rank * u + inner_rank
                assert layout.inner_groups[outer_rank][inner_rank] == rank
                assert layout.outer_groups[inner_rank][outer_rank] == rank


def test_default_order_follows_megatrons_rank_formula() -> None:
    for shape in SHAPES:
        world_size, tp, u, r, pp = shape
        cp = u * r
        dp = world_size // (tp * cp * pp)
        expected = [
            tuple(t + tp * (c + cp * (d + dp * p)) for c in range(cp))
            for p, d, t in itertools.product(range(pp), range(dp), range(tp))
        ]
        assert [layout.cp_ranks for layout in layout_of(shape)] == expected


@pytest.mark.parametrize("order", ORDERS)
def test_cp_groups_match_megatron_rank_generator(order: str) -> None:
    for shape in SHAPES:
        world_size, tp, u, r, pp = shape
        generator = parallel_state.RankGenerator(
            tp=tp, ep=1, dp=world_size // (tp * u * r * pp), pp=pp, cp=u * r, order=order
        )
        assert [list(layout.cp_ranks) for layout in layout_of(shape, order)] == generator.get_ranks("cp")


def test_inner_and_outer_groups_match_megatron_hierarchical_cp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's create_hierarchical_groups with sizes [U, R] builds exactly SAP's inner and outer groups."""
    created: list[tuple[str, tuple[int, ...]]] = []

    def record_group(ranks: list[int], group_desc: str, **_: object) -> tuple[int, ...]:
        created.append((group_desc, tuple(ranks)))
        return tuple(ranks)

    monkeypatch.setattr(parallel_state, "create_group", record_group)
    for shape in SHAPES:
        _, _, u, r, _ = shape
        for layout in layout_of(shape):
            created.clear()
            rank = layout.cp_ranks[-1]
            mine, _ = parallel_state.create_hierarchical_groups(
                rank, list(layout.cp_ranks), [u, r], group_desc="CONTEXT_PARALLEL_GROUP"
            )
            levels = {desc: [ranks for d, ranks in created if d == desc] for desc, _ in created}
            assert levels["HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L0"] == list(layout.inner_groups)
            assert levels["HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L1"] == list(layout.outer_groups)
            outer_rank, inner_rank = layout.coordinates(rank)
            assert mine == [layout.inner_groups[outer_rank], layout.outer_groups[inner_rank]]


def test_tensor_parallel_strides_cp_groups() -> None:
    layouts = sap_group_layout(8, inner_size=2, outer_size=2, tensor_parallel_size=2)
    assert layouts == [
        CPGroupLayout(cp_ranks=(0, 2, 4, 6), inner_groups=((0, 2), (4, 6)), outer_groups=((0, 4), (2, 6))),
        CPGroupLayout(cp_ranks=(1, 3, 5, 7), inner_groups=((1, 3), (5, 7)), outer_groups=((1, 5), (3, 7))),
    ]


def test_data_parallel_replicas_get_their_own_cp_groups() -> None:
    layouts = sap_group_layout(16, inner_size=2, outer_size=2, pipeline_parallel_size=2)
    assert [layout.cp_ranks for layout in layouts] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert layouts[3].inner_groups == ((12, 13), (14, 15))
    assert layouts[3].outer_groups == ((12, 14), (13, 15))


def test_inner_groups_stay_on_a_node_iff_the_node_holds_whole_tp_times_u_blocks() -> None:
    for shape in SHAPES:
        world_size, tp, u, _, _ = shape
        for gpus_per_node in (1, 2, 3, 4, 6, 8, 16):
            spanning = [g for layout in layout_of(shape) for g in layout.inner_groups_spanning_nodes(gpus_per_node)]
            if u == 1 or world_size <= gpus_per_node:
                assert not spanning
            else:
                assert (not spanning) == (gpus_per_node % (tp * u) == 0), (shape, gpus_per_node)


def test_inner_groups_spanning_nodes_names_the_offenders() -> None:
    (layout,) = sap_group_layout(12, inner_size=3, outer_size=4)
    assert layout.inner_groups_spanning_nodes(8) == ((6, 7, 8),)
    assert layout.inner_groups_spanning_nodes(6) == ()


def test_spans_nodes() -> None:
    assert not spans_nodes((0, 7), gpus_per_node=8)
    assert spans_nodes((7, 8), gpus_per_node=8)
    assert not spans_nodes((9, 9), gpus_per_node=1)
    assert not spans_nodes((8, 12, 15), gpus_per_node=8)
    assert spans_nodes((0, 8), gpus_per_node=8)
    with pytest.raises(ValueError, match="gpus_per_node"):
        spans_nodes((0, 1), gpus_per_node=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(world_size=12, inner_size=2, outer_size=2, tensor_parallel_size=2),
            r"world_size=12 is not divisible by tensor_parallel_size \* inner_size \* outer_size \* "
            r"pipeline_parallel_size = 2 \* 2 \* 2 \* 1 = 8",
        ),
        (dict(world_size=8, inner_size=0, outer_size=2), r"positive integers, got \{'inner_size': 0\}"),
        (dict(world_size=8, inner_size=2, outer_size=2, pipeline_parallel_size=-1), "'pipeline_parallel_size': -1"),
        (dict(world_size=8, inner_size=True, outer_size=8), r"positive integers, got \{'inner_size': True\}"),
        (dict(world_size=True, inner_size=1, outer_size=1), r"positive integers, got \{'world_size': True\}"),
        (dict(world_size=8, inner_size=2, outer_size=2, order="tp-cp-xp-dp-pp"), "order='tp-cp-xp-dp-pp' must name"),
        (dict(world_size=8, inner_size=2, outer_size=2, order="tp-cp-cp-pp"), "at most once"),
        (dict(world_size=8, inner_size=2, outer_size=2, order="tp-dp-pp"), r"omits dimensions of size > 1: \{'cp': 4"),
    ],
)
def test_layout_errors_name_the_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sap_group_layout(**kwargs)


def test_explicit_cp_group() -> None:
    layout = CPGroupLayout.from_cp_ranks([9, 3, 5, 1, 7, 11], inner_size=3)
    assert layout.inner_groups == ((9, 3, 5), (1, 7, 11))
    assert layout.outer_groups == ((9, 1), (3, 7), (5, 11))
    assert layout.coordinates(7) == (1, 1)
    with pytest.raises(ValueError, match=r"global rank 4 is not in the CP group \[9, 3, 5, 1, 7, 11\]"):
        layout.coordinates(4)
    with pytest.raises(ValueError, match=r"size 6 \(\[9, 3, 5, 1, 7, 11\]\) is not divisible by inner_size=4"):
        CPGroupLayout.from_cp_ranks([9, 3, 5, 1, 7, 11], inner_size=4)
    with pytest.raises(ValueError, match="distinct non-negative"):
        CPGroupLayout.from_cp_ranks([0, 1, 1, 2], inner_size=2)
    with pytest.raises(ValueError, match="empty"):
        CPGroupLayout.from_cp_ranks([], inner_size=1)
    with pytest.raises(ValueError, match=r"integer global ranks, got \[0.0, 1.0\]"):
        CPGroupLayout.from_cp_ranks([0.0, 1.0], inner_size=1)
    with pytest.raises(ValueError, match=r"positive integers, got \{'inner_size': True\}"):
        CPGroupLayout.from_cp_ranks([0, 1], inner_size=True)
