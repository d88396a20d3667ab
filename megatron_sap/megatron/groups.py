"""SAP process groups from Megatron's parallel state.

SAP reuses Megatron's own context-parallel groups: the CP group, and with
`--hierarchical-context-parallel-sizes U R` Megatron's [inner, outer] groups (inner = U
consecutive CP ranks, outer strided by U, cp_rank = outer_rank * U + inner_rank, exactly SAP's
convention). Every Megatron consumer of those groups (gradient reduction over data-parallel-with-CP,
loss reduction, pipeline shapes) therefore stays consistent without rewriting any globals.
"""
from __future__ import annotations

import inspect
import math
import numbers
import weakref
from typing import Any, Optional, Sequence

import torch.distributed as dist

import megatron_sap as sap
from megatron.core import parallel_state
from megatron_sap.comm.groups import check_every_rank_asks_alike, group_timeout
from megatron_sap.comm.p2p import collective_device

from .options import get_sap_options


def _current_hcp(cp_group: dist.ProcessGroup, hcp: Optional[Sequence[Any]]) -> Optional[Sequence[Any]]:
    """`hcp` if it belongs to this CP group, else None.

    megatron-core 0.16.1's `destroy_model_parallel` does not reset the hierarchical CP groups and a
    later `initialize_model_parallel` without hierarchical sizes leaves them in place, so stale
    groups of an earlier initialization can still be returned. Groups whose ranks are not all in
    the CP group, or whose sizes do not multiply to its size, are such leftovers, and so are
    groups torch no longer knows (destroyed since).
    """
    if not hcp:
        return None
    cp_ranks = set(dist.get_process_group_ranks(cp_group))
    sizes = [group.size() for group in hcp]
    try:
        members = [set(dist.get_process_group_ranks(group)) for group in hcp]
    except KeyError:  # torch forgets a group once it is destroyed
        return None
    if math.prod(sizes) != len(cp_ranks) or any(not ranks <= cp_ranks for ranks in members):
        return None
    return hcp


def _sap_groups(cp_group: Optional[dist.ProcessGroup], hcp: Optional[Sequence[Any]]) -> Optional["sap.SAPGroups"]:
    """SAPGroups over `cp_group` ([inner, outer] from `hcp` when given); None when CP size is 1."""
    if cp_group is None or cp_group.size() == 1:
        return None
    hcp = _current_hcp(cp_group, hcp)
    # GPUs per node, for the warning when an inner group leaves its node: LOCAL_WORLD_SIZE when
    # the launcher set it (the SAP options take it from there), else SAPGroups' default.
    per_node = get_sap_options().gpus_per_node
    node = {} if per_node is None else {"gpus_per_node": per_node}
    if hcp is None:
        return sap.SAPGroups.from_process_groups(cp_group, **node)
    if len(hcp) != 2:
        raise ValueError(
            f"SAP uses two context-parallel levels [inner, outer]; got {len(hcp)} hierarchical groups "
            "(--hierarchical-context-parallel-sizes must have two entries)"
        )
    inner, outer = hcp
    return sap.SAPGroups.from_process_groups(cp_group, inner_group=inner, outer_group=outer, **node)


def sap_groups_from_pg_collection(pg_collection: Any = None) -> Optional["sap.SAPGroups"]:
    """SAPGroups for a layer built with Megatron's `pg_collection` (or parallel_state without one)."""
    if pg_collection is None:
        return sap_groups_from_parallel_state()
    # ProcessGroupCollection fields are declared init=False: unset ones are absent, not None.
    cp_group = getattr(pg_collection, "cp", None)
    if cp_group is None:
        return sap_groups_from_parallel_state()
    return _sap_groups(cp_group, getattr(pg_collection, "hcp", None))


def sap_groups_from_parallel_state() -> Optional["sap.SAPGroups"]:
    """SAPGroups over the CP (and hierarchical CP) groups `parallel_state` holds; None when CP size is 1."""
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError("Megatron's parallel state is not initialized; call initialize_sap_parallel first")
    return _sap_groups(
        parallel_state.get_context_parallel_group(),
        parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False),
    )


def initialize_sap_parallel(
    *,
    inner_size: int,
    outer_size: int = 1,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    **kwargs: Any,
) -> Optional["sap.SAPGroups"]:
    """Initialize Megatron's model parallelism with CP = inner_size * outer_size laid out for SAP.

    For scripts that call Megatron-Core directly. Wraps `parallel_state.initialize_model_parallel`
    (extra keywords pass through) with `context_parallel_size=U*R` and, at CP > 1,
    `hierarchical_context_parallel_sizes=[U, R]` so the SAP levels are Megatron's own groups (a level
    of size 1 included). Returns the groups (None at CP 1). Every rank's sizes are compared
    first (one all-reduce over the world, on the current GPU under NCCL: set the device
    before, as Megatron-LM does), so ranks that ask for different ones all raise.
    """
    if dist.is_initialized():  # first, so that ranks whose sizes differ hear it rather than wait for each other
        check_every_rank_asks_alike(inner_size, outer_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                                    None, caller="initialize_sap_parallel")
    for name, size in (("inner_size", inner_size), ("outer_size", outer_size)):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {size!r}")
    if inner_size < 1 or outer_size < 1:
        raise ValueError(f"inner_size and outer_size must be >= 1, got {inner_size} and {outer_size}")
    for name in ("context_parallel_size", "hierarchical_context_parallel_sizes"):
        if name in kwargs:
            raise ValueError(f"{name} is derived from inner_size and outer_size; do not pass it")
    cp_size = inner_size * outer_size
    model_ranks = tensor_model_parallel_size * cp_size * pipeline_model_parallel_size
    if dist.is_initialized() and dist.get_world_size() % model_ranks:
        raise ValueError(
            f"world_size={dist.get_world_size()} is not divisible by tensor_model_parallel_size * inner_size * "
            f"outer_size * pipeline_model_parallel_size = {tensor_model_parallel_size} * {inner_size} * "
            f"{outer_size} * {pipeline_model_parallel_size} = {model_ranks}"
        )
    hierarchical = [inner_size, outer_size] if cp_size > 1 else None
    if not parallel_state.model_parallel_is_initialized():
        # Drop hierarchical groups a previous initialization left behind (see _current_hcp).
        parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=cp_size,
        hierarchical_context_parallel_sizes=hierarchical,
        **kwargs,
    )
    prepare_pipeline_host_group()
    return sap_groups_from_parallel_state()


# group -> its gloo twin; weakly, so a group destroyed and collected takes its twin along.
_HOST_TWINS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = weakref.WeakKeyDictionary()
# Whether this torch makes a group with its members only (the others need not call new_group).
_LOCAL_GROUPS = "use_local_synchronization" in inspect.signature(dist.new_group).parameters


def host_twin(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group of `group`'s ranks, for small collectives of host values that should not
    wait for the GPU (`group` itself where its collectives run on the CPU already, or where
    torch cannot make a group of some ranks only), with its timeout. Made at first use, by the
    group's ranks together, and again for a group rebuilt since. Torch names a group its ranks
    make alone after how many groups each has made: this holds for the TP and CP groups, whose
    ranks share a pipeline stage and so have made the same groups (not for a pipeline's ranks:
    `prepare_pipeline_host_group`)."""
    if collective_device(group).type == "cpu" or not _LOCAL_GROUPS:
        return group
    twin = _HOST_TWINS.get(group)
    if twin is None:
        twin = _HOST_TWINS[group] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                                   timeout=group_timeout(group), use_local_synchronization=True)
    return twin


def tensor_parallel_host_group() -> Optional[tuple[dist.ProcessGroup, int]]:
    """The `host_twin` of this rank's TP group and the global rank of its data source (TP rank
    0): how the TP ranks share a row's documents without a round trip through the GPU. None at
    TP 1 or before Megatron's groups exist."""
    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return host_twin(parallel_state.get_tensor_model_parallel_group()), parallel_state.get_tensor_model_parallel_src_rank()


# PP group -> its host group (weakly, as `_HOST_TWINS`).
_PIPELINE_TWINS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def _pipeline_ranks() -> tuple[dist.ProcessGroup, int, list[int]]:
    """This rank's pipeline group, the global rank of its first stage and those of the stages
    that receive documents from it: the middle ones, and with a virtual pipeline the last too
    (its chunks but the last read no data)."""
    group = parallel_state.get_pipeline_model_parallel_group()
    first, last = parallel_state.get_pipeline_model_parallel_first_rank(), parallel_state.get_pipeline_model_parallel_last_rank()
    virtual = (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) > 1
    return group, first, [r for r in dist.get_process_group_ranks(group) if r != first and (virtual or r != last)]


def documents_cross_stages() -> bool:
    """Whether some rank's model chunk is given no batch by `pretrain_gpt.get_batch`, and so
    needs the first stage's documents: with more than two pipeline stages (the middle ones),
    or a virtual pipeline (every chunk but the first stage's first and the last stage's last)."""
    return parallel_state.model_parallel_is_initialized() and (
        parallel_state.get_pipeline_model_parallel_world_size() > 2
        or (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) > 1
    )


def pipeline_host_group() -> Optional[tuple[dist.ProcessGroup, int, list[int]]]:
    """A group of this rank's pipeline, its first stage's global rank, and the global ranks of
    the stages that receive documents from it (the middle ones; with a virtual pipeline, all
    but the first): how the first stage hands each micro-batch's documents to the model chunks
    that read no data. The group is a gloo one of those ranks made by
    `prepare_pipeline_host_group` (host to host, and apart from the pipeline group, whose
    point-to-point messages of activations on gloo would otherwise meet these). None where no
    documents cross stages (`documents_cross_stages`) or before Megatron's groups exist;
    RuntimeError where the gloo group was not made (made at the first micro-batch instead, the
    first stage would wait in it for stages that wait for its activations)."""
    if not documents_cross_stages():
        return None
    group, first, receivers = _pipeline_ranks()
    twin = _PIPELINE_TWINS.get(group)
    if twin is None:
        raise RuntimeError(
            "SAP's pipeline host group was not made after initialize_model_parallel: call "
            "megatron_sap.megatron.groups.prepare_pipeline_host_group() on every rank right after it (the launcher, "
            "the fork patch and initialize_sap_parallel do)"
        )
    return twin, first, receivers


def prepare_pipeline_host_group() -> None:
    """Make the gloo groups `pipeline_host_group` returns, one per pipeline: on every rank of
    the job together, right after `initialize_model_parallel` (a collective of all ranks: every
    rank makes every group, in one order, as Megatron makes its own; a group made by its
    members alone would be named after how many groups each has, which differs between
    stages). Nothing where no documents cross stages, or where they are made for these groups
    already (a patched `pretrain_gpt.py` run through the launcher calls this twice)."""
    if not documents_cross_stages():
        return
    group, first, receivers = _pipeline_ranks()
    if group in _PIPELINE_TWINS:  # on every rank alike: all were made in one call
        return
    mine = tuple(sorted([first, *receivers]))
    pipelines: list[Optional[tuple[int, ...]]] = [None] * dist.get_world_size()
    dist.all_gather_object(pipelines, mine)
    for members in sorted(set(pipelines)):
        twin = dist.new_group(list(members), backend="gloo", timeout=group_timeout(group))
        if members == mine:
            _PIPELINE_TWINS[group] = twin
