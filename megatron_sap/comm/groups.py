"""Process groups of SAP attention: a CP group, its inner (Ulysses) and outer (P2P) sub-groups.

`init_sap_groups` creates the groups of `layout.sap_group_layout` for the whole job;
`SAPGroups.from_process_groups` adopts groups that already exist (Megatron's CP group and its
hierarchical CP groups) after checking that they have SAP's layout: inner groups of U
consecutive CP ranks, outer groups striding by U, cp_rank = outer_rank * U + inner_rank.
"""
from __future__ import annotations

import datetime
import hashlib
import numbers
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron_sap.comm.layout import CPGroupLayout, check_positive_sizes, sap_group_layout, spans_nodes
from megatron_sap.comm.p2p import collective_device


@dataclass
class SAPGroups:
    """This rank's CP group and sub-groups; ranks are global, listed in group-rank order.

    `inner_group` is None when inner_size is 1 and `outer_group` None when outer_size is 1;
    when exactly one of the sizes is 1, the other sub-group is the CP group itself.
    """

    inner_size: int
    outer_size: int
    cp_rank: int
    inner_rank: int
    outer_rank: int
    cp_group: ProcessGroup
    inner_group: ProcessGroup | None
    outer_group: ProcessGroup | None
    cp_ranks: tuple[int, ...]
    inner_ranks: tuple[int, ...]
    outer_ranks: tuple[int, ...]
    gpus_per_node: int = 8

    @property
    def world_size(self) -> int:
        """Size of the CP group, inner_size * outer_size."""
        return self.inner_size * self.outer_size

    def inner_peer(self, inner_rank: int) -> int:
        """Global rank of member `inner_rank` of this rank's inner group."""
        return _member(self.inner_ranks, inner_rank, "inner")

    def outer_peer(self, outer_rank: int) -> int:
        """Global rank of member `outer_rank` of this rank's outer group."""
        return _member(self.outer_ranks, outer_rank, "outer")

    @classmethod
    def from_process_groups(
        cls,
        cp_group: ProcessGroup,
        inner_group: ProcessGroup | None = None,
        outer_group: ProcessGroup | None = None,
        gpus_per_node: int = 8,
    ) -> SAPGroups:
        """Adopt existing groups, e.g. Megatron's CP group and hierarchical CP groups [inner, outer].

        A missing sub-group is derived from the other's size; with neither, the CP group is one
        outer group (inner_size 1), like Megatron's plain context parallelism. ValueError when the
        groups do not form SAP's layout around this rank.
        """
        for level, group in (("CP", cp_group), ("inner", inner_group), ("outer", outer_group)):
            if not (isinstance(group, ProcessGroup) or (group is None and level != "CP")):
                raise ValueError(
                    f"the {level} group given to global rank {dist.get_rank()} is {group!r}, not a process group it "
                    f"belongs to (torch.distributed.new_group gives ranks outside a group a placeholder): pass each "
                    f"rank the groups that hold it"
                )
        cp_ranks = tuple(dist.get_process_group_ranks(cp_group))
        cp_size = len(cp_ranks)
        inner_size = None if inner_group is None else inner_group.size()
        outer_size = None if outer_group is None else outer_group.size()
        if inner_size is None:
            inner_size = 1 if outer_size is None else cp_size // outer_size
        if outer_size is None:
            outer_size = cp_size // inner_size
        if inner_size * outer_size != cp_size:
            raise ValueError(
                f"an inner group of size {inner_size} and an outer group of size {outer_size} do not tile "
                f"the CP group of size {cp_size} {list(cp_ranks)}"
            )
        layout = CPGroupLayout.from_cp_ranks(cp_ranks, inner_size)
        inner_group = _sub_group("inner", inner_group, layout.inner_size, layout.outer_size, cp_group)
        outer_group = _sub_group("outer", outer_group, layout.outer_size, layout.inner_size, cp_group)
        groups = _for_this_rank(layout, cp_group, inner_group, outer_group, gpus_per_node)
        for level, group, expected in (
            ("inner", inner_group, groups.inner_ranks),
            ("outer", outer_group, groups.outer_ranks),
        ):
            actual = None if group is None else tuple(dist.get_process_group_ranks(group))
            if actual is not None and actual != expected:
                raise ValueError(
                    f"the {level} group {list(actual)} of global rank {dist.get_rank()} is not SAP's {level} group "
                    f"{list(expected)} of the CP group {list(cp_ranks)}: inner groups hold consecutive CP ranks, "
                    f"outer groups stride by inner_size={layout.inner_size}"
                )
        _warn_if_inner_group_spans_nodes(groups)
        return groups


@overload
def init_sap_groups(
    inner_size: int = 1,
    outer_size: int | None = None,
    ranks: None = None,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    gpus_per_node: int = 8,
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
) -> SAPGroups: ...


@overload
def init_sap_groups(
    inner_size: int = 1,
    outer_size: int | None = None,
    ranks: Sequence[int] = ...,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    gpus_per_node: int = 8,
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
) -> SAPGroups | None: ...


def init_sap_groups(
    inner_size: int = 1,
    outer_size: int | None = None,
    ranks: Sequence[int] | None = None,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    gpus_per_node: int = 8,
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
) -> SAPGroups | None:
    """Create SAP's process groups; collective: every rank of the world calls it alike.

    Without `ranks`, the groups of the whole job (Megatron's rank order, TP innermost) are made
    and outer_size defaults to world_size / (inner_size * TP * PP). With `ranks` (one CP group's
    global ranks; cp_rank follows the global rank, as the group rank of every torch group does),
    only that group is made and ranks outside it get None.
    Groups inherit the default group's timeout unless `timeout` is given; `backend` defaults to
    the default group's. Warns when this rank's inner group spans nodes of `gpus_per_node`.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_sap_groups needs torch.distributed to be initialised first")
    if isinstance(ranks, Iterable):
        ranks = list(ranks)  # read once: compared, then made into the group
    check_every_rank_asks_alike(inner_size, outer_size, tensor_parallel_size, pipeline_parallel_size, ranks)
    world_size = dist.get_world_size()
    check_positive_sizes(inner_size=inner_size, tensor_parallel_size=tensor_parallel_size,
                         pipeline_parallel_size=pipeline_parallel_size,
                         **({} if outer_size is None else {"outer_size": outer_size}))
    if ranks is None:
        if outer_size is None:
            per_outer_rank = inner_size * tensor_parallel_size * pipeline_parallel_size
            if world_size % per_outer_rank:
                raise ValueError(
                    f"cannot derive outer_size: world_size={world_size} is not divisible by inner_size * "
                    f"tensor_parallel_size * pipeline_parallel_size = {inner_size} * {tensor_parallel_size} * "
                    f"{pipeline_parallel_size}"
                )
            outer_size = world_size // per_outer_rank
        layouts = sap_group_layout(
            world_size,
            inner_size=inner_size,
            outer_size=outer_size,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
        )
    else:
        if (tensor_parallel_size, pipeline_parallel_size) != (1, 1):
            raise ValueError(
                "tensor_parallel_size and pipeline_parallel_size describe the job; do not combine with ranks"
            )
        layout = CPGroupLayout.from_cp_ranks(sorted(ranks), inner_size)
        if outer_size is not None and outer_size != layout.outer_size:
            raise ValueError(
                f"len(ranks)={len(layout.cp_ranks)} != inner_size * outer_size = {inner_size} * {outer_size}"
            )
        if max(layout.cp_ranks) >= world_size:
            raise ValueError(f"ranks {list(layout.cp_ranks)} exceed the world of {world_size} ranks")
        layouts = [layout]
    if timeout is None:
        timeout = group_timeout(dist.group.WORLD)

    def new_group(group_ranks: tuple[int, ...]) -> ProcessGroup:
        try:
            return dist.new_group(list(group_ranks), timeout=timeout, backend=backend)
        except RuntimeError as exc:  # typically a timeout: the ranks asked for different groups
            raise RuntimeError(
                f"init_sap_groups: creating the group of ranks {list(group_ranks)} failed on rank {dist.get_rank()}: "
                f"{exc}. Every rank must call init_sap_groups alike (the same sizes and ranks)"
            ) from exc

    mine = None
    for layout in layouts:  # the same groups in the same order on every rank, as new_group requires
        cp_group = new_group(layout.cp_ranks)
        both_levels = layout.inner_size > 1 and layout.outer_size > 1
        inner_groups = [new_group(group) for group in layout.inner_groups] if both_levels else None
        outer_groups = [new_group(group) for group in layout.outer_groups] if both_levels else None
        if dist.get_rank() in layout.cp_ranks:
            outer_rank, inner_rank = layout.coordinates(dist.get_rank())
            inner = inner_groups[outer_rank] if inner_groups else None
            outer = outer_groups[inner_rank] if outer_groups else None
            mine = _for_this_rank(
                layout,
                cp_group,
                _sub_group("inner", inner, layout.inner_size, layout.outer_size, cp_group),
                _sub_group("outer", outer, layout.outer_size, layout.inner_size, cp_group),
                gpus_per_node,
            )
            _warn_if_inner_group_spans_nodes(mine)
    return mine


# How the ranks compare what they asked for (`check_every_rank_asks_alike`): an integer as
# itself, None (outer_size derived) and anything not an integer as values no size takes.
_ASKED_NONE = -(1 << 61)
_NOT_AN_INTEGER = -(1 << 62)


def _asked(value: object) -> int:
    if value is None:
        return _ASKED_NONE
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or abs(int(value)) >= 1 << 60:
        return _NOT_AN_INTEGER
    return int(value)


def _shown(value: int) -> str:
    return {_ASKED_NONE: "None", _NOT_AN_INTEGER: "a non-integer"}.get(value, str(value))


def _ranks_asked(ranks: object) -> dict[str, int]:
    """What the ranks compare of a `ranks` list (its set: the group is made from it sorted):
    its length and sum, for the message, and a 62-bit hash of it, since sums (and sums of
    squares) of different sets can agree: [0, 3, 5, 6] and [1, 2, 4, 7]. A `ranks` that is
    not a list of integers is compared by its text."""
    try:
        listed = sorted(_asked(r) for r in ranks) if ranks is not None else []
    except TypeError:  # not iterable
        listed = None
    if listed is None or _NOT_AN_INTEGER in listed:
        digest = hashlib.sha1(repr(ranks).encode()).hexdigest()
        return {"len(ranks)": _NOT_AN_INTEGER, "sum(ranks)": _NOT_AN_INTEGER,
                "hash of ranks": int(digest[:16], 16) & ((1 << 62) - 1)}
    digest = hashlib.sha1(repr(listed).encode()).hexdigest()
    total = sum(listed)
    return {"len(ranks)": len(listed), "sum(ranks)": total if abs(total) < 1 << 60 else _NOT_AN_INTEGER,
            "hash of ranks": int(digest[:16], 16) & ((1 << 62) - 1)}


def check_every_rank_asks_alike(inner_size: object, outer_size: object, tensor_parallel_size: object,
                                pipeline_parallel_size: object, ranks: object,
                                caller: str = "init_sap_groups") -> None:
    """Compare the call's arguments (sizes, `ranks`) over the world before anything checks
    or makes a group: ranks that asked for different groups would otherwise make groups that
    do not match (a wrong layout on some ranks, an error on others, or a wait until the
    timeout), and a rank whose arguments are invalid would raise alone while the others
    wait. Once they agree, every rank's checks raise alike. `caller` names the function in
    the errors."""
    sizes = {"inner_size": inner_size, "outer_size": outer_size, "tensor_parallel_size": tensor_parallel_size,
             "pipeline_parallel_size": pipeline_parallel_size}
    asked = {**{name: _asked(value) for name, value in sizes.items()}, **_ranks_asked(ranks)}
    values = list(asked.values())
    extremes = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=collective_device(None))
    try:
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    except Exception as exc:  # a dead or stuck rank: the backend's error type varies (gloo, NCCL)
        raise RuntimeError(
            f"{caller}: comparing the sizes every rank asked for failed on rank {dist.get_rank()}: {exc}. "
            f"Every rank of the world must call {caller} alike"
        ) from exc
    highest, lowest = extremes[: len(values)].tolist(), [-v for v in extremes[len(values):].tolist()]
    differ = [f"{name} from {_shown(low)} to {_shown(high)}" for name, low, high in zip(asked, lowest, highest)
              if low != high]
    if differ:
        mine = ", ".join(f"{name}={value!r}" for name, value in sizes.items())
        raise ValueError(
            f"{caller}: the ranks asked for different groups ({'; '.join(differ)} across ranks; rank "
            f"{dist.get_rank()} asked for {mine}{'' if ranks is None else f', ranks={ranks!r}'}). "
            f"Every rank of the world must call {caller} alike (the same sizes{'' if ranks is None else ' and ranks'})"
        )


def _sub_group(
    level: str, group: ProcessGroup | None, size: int, other_size: int, cp_group: ProcessGroup
) -> ProcessGroup | None:
    """The group to use for one level: None at size 1, the CP group when the other level is trivial."""
    if size == 1:
        return None
    if group is not None:
        return group
    if other_size == 1:
        return cp_group
    raise ValueError(f"the {level} group is required: both levels have more than one rank")


def _for_this_rank(
    layout: CPGroupLayout,
    cp_group: ProcessGroup,
    inner_group: ProcessGroup | None,
    outer_group: ProcessGroup | None,
    gpus_per_node: int,
) -> SAPGroups:
    """SAPGroups of the calling rank in `layout`."""
    rank = dist.get_rank()
    outer_rank, inner_rank = layout.coordinates(rank)
    return SAPGroups(
        inner_size=layout.inner_size,
        outer_size=layout.outer_size,
        cp_rank=layout.cp_ranks.index(rank),
        inner_rank=inner_rank,
        outer_rank=outer_rank,
        cp_group=cp_group,
        inner_group=inner_group,
        outer_group=outer_group,
        cp_ranks=layout.cp_ranks,
        inner_ranks=layout.inner_groups[outer_rank],
        outer_ranks=layout.outer_groups[inner_rank],
        gpus_per_node=gpus_per_node,
    )


def _warn_if_inner_group_spans_nodes(groups: SAPGroups) -> None:
    """Warn (at the caller of the public function) when the inner all-to-all would leave the node."""
    if spans_nodes(groups.inner_ranks, groups.gpus_per_node):
        warnings.warn(
            f"SAP inner group {list(groups.inner_ranks)} spans nodes of {groups.gpus_per_node} GPUs: its "
            "all-to-all leaves the node; choose inner_size so that tensor_parallel_size * inner_size divides "
            "the GPUs of a node (or pass the right gpus_per_node)",
            stacklevel=3,
        )


def _member(ranks: tuple[int, ...], index: int, level: str) -> int:
    """ranks[index], refusing the negative indices that would silently wrap around."""
    if not 0 <= index < len(ranks):
        raise IndexError(f"{level} rank {index} is outside the {level} group {list(ranks)}")
    return ranks[index]


def group_timeout(group: ProcessGroup) -> datetime.timedelta:
    """The timeout an existing group was created with (torch's new_group does not inherit it)."""
    device = next(iter(group._device_types))
    return group._get_backend(device).options._timeout


def group_ranks(group: ProcessGroup | None) -> list[int]:
    """Global rank of every member of `group` (None: the default group), in group order."""
    return [dist.get_global_rank(group, r) if group is not None else r for r in range(dist.get_world_size(group))]
