"""Rank layout of SAP's two-level context parallelism, as pure functions of the job's shape.

SAP splits a CP group of size CP = U * R into R inner groups of U consecutive CP ranks (one node,
fast links: Ulysses all-to-all) and U outer groups that stride by U (across nodes: sequence-aware
P2P), so that cp_rank = outer_rank * U + inner_rank. This is Megatron-Core's hierarchical CP with
`hierarchical_context_parallel_sizes=[U, R]`, and the CP groups themselves are Megatron's, from
its rank order (default "tp-cp-ep-dp-pp", TP innermost):

    global_rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))

Nodes hold `gpus_per_node` consecutive global ranks. With the default order and U > 1, every
inner group stays on one node iff gpus_per_node is a multiple of TP * U (or the job fits in one
node).
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from megatron_sap.validation import is_positive_int

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class CPGroupLayout:
    """One CP group and its split into inner and outer groups, all as global ranks.

    `cp_ranks[cp_rank]` is the global rank of a CP rank; `inner_groups[outer_rank]` and
    `outer_groups[inner_rank]` list their members in group-rank order.
    """

    cp_ranks: tuple[int, ...]
    inner_groups: tuple[tuple[int, ...], ...]  # R groups of U ranks
    outer_groups: tuple[tuple[int, ...], ...]  # U groups of R ranks

    @classmethod
    def from_cp_ranks(cls, cp_ranks: Sequence[int], inner_size: int) -> CPGroupLayout:
        """Split a CP group, given as global ranks in cp_rank order, into inner groups of `inner_size`."""
        ranks = tuple(cp_ranks)
        check_positive_sizes(inner_size=inner_size)
        if not ranks:
            raise ValueError("cp_ranks is empty")
        if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in ranks):
            raise ValueError(f"cp_ranks must be integer global ranks, got {list(ranks)}")
        ranks = tuple(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(f"cp_ranks must be distinct non-negative global ranks, got {list(ranks)}")
        if len(ranks) % inner_size:
            raise ValueError(
                f"the CP group of size {len(ranks)} ({list(ranks)}) is not divisible by inner_size={inner_size}"
            )
        return cls(
            cp_ranks=ranks,
            inner_groups=tuple(ranks[start : start + inner_size] for start in range(0, len(ranks), inner_size)),
            outer_groups=tuple(ranks[inner_rank::inner_size] for inner_rank in range(inner_size)),
        )

    @property
    def inner_size(self) -> int:
        """U: ranks per inner group."""
        return len(self.outer_groups)

    @property
    def outer_size(self) -> int:
        """R: ranks per outer group."""
        return len(self.inner_groups)

    def coordinates(self, global_rank: int) -> tuple[int, int]:
        """(outer_rank, inner_rank) of a member of this CP group."""
        if global_rank not in self.cp_ranks:
            raise ValueError(f"global rank {global_rank} is not in the CP group {list(self.cp_ranks)}")
        return divmod(self.cp_ranks.index(global_rank), self.inner_size)

    def inner_groups_spanning_nodes(self, gpus_per_node: int) -> tuple[tuple[int, ...], ...]:
        """The inner groups that do not fit on one node (their all-to-all would leave the node)."""
        return tuple(group for group in self.inner_groups if spans_nodes(group, gpus_per_node))


def sap_group_layout(
    world_size: int,
    *,
    inner_size: int,
    outer_size: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    order: str = DEFAULT_ORDER,
) -> list[CPGroupLayout]:
    """Every CP group of the job with its inner/outer split, in Megatron's group order.

    CP = inner_size * outer_size; DP = world_size / (TP * CP * PP). EP does not appear: for
    attention, Megatron folds expert parallelism into DP. The CP groups equal Megatron-Core's
    `RankGenerator(tp, 1, dp, pp, cp, order).get_ranks("cp")`.
    """
    check_positive_sizes(
        world_size=world_size,
        inner_size=inner_size,
        outer_size=outer_size,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
    )
    cp_size = inner_size * outer_size
    model_size = tensor_parallel_size * cp_size * pipeline_parallel_size
    if world_size % model_size:
        raise ValueError(
            f"world_size={world_size} is not divisible by tensor_parallel_size * inner_size * outer_size * "
            f"pipeline_parallel_size = {tensor_parallel_size} * {inner_size} * {outer_size} * "
            f"{pipeline_parallel_size} = {model_size}"
        )
    sizes = {
        "tp": tensor_parallel_size,
        "cp": cp_size,
        "ep": 1,
        "dp": world_size // model_size,
        "pp": pipeline_parallel_size,
    }
    tokens = _parse_order(order, sizes)
    cp_stride = prod(sizes[token] for token in tokens[: tokens.index("cp")]) if "cp" in tokens else 1
    return [
        CPGroupLayout.from_cp_ranks(range(base, base + cp_size * cp_stride, cp_stride), inner_size)
        for base in range(world_size)
        if (base // cp_stride) % cp_size == 0
    ]


def spans_nodes(ranks: Sequence[int], gpus_per_node: int) -> bool:
    """Whether global ranks lie on more than one node (nodes hold consecutive blocks of ranks)."""
    check_positive_sizes(gpus_per_node=gpus_per_node)
    return len({rank // gpus_per_node for rank in ranks}) > 1


def _parse_order(order: str, sizes: dict[str, int]) -> list[str]:
    """The dimensions of a Megatron order string, innermost first; omitted ones must have size 1."""
    tokens = order.lower().split("-")
    unknown = [token for token in tokens if token not in _DIMENSIONS]
    if unknown or len(set(tokens)) != len(tokens):
        raise ValueError(
            f"order={order!r} must name each of {', '.join(_DIMENSIONS)} at most once, separated by '-'"
        )
    missing = {token: size for token, size in sizes.items() if token not in tokens and size > 1}
    if missing:
        raise ValueError(f"order={order!r} omits dimensions of size > 1: {missing}")
    return tokens


def check_positive_sizes(**values: int) -> None:
    """ValueError naming every argument that is not a positive integer."""
    bad = {name: value for name, value in values.items() if not is_positive_int(value)}
    if bad:
        raise ValueError(f"sizes must be positive integers, got {bad}")
