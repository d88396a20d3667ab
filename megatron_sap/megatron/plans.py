"""One place that turns a global `cu_seqlens` into the SAP plan for the current groups.

The batch split and every layer call `plan_for` with the same `cu_seqlens` tensor. The split's
plan is remembered against that tensor, so layers find it without reading `cu_seqlens` back to
the host (no device sync per layer); other tensors go through the planner's cache.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch
from torch.utils.weak import WeakTensorKeyDictionary

import megatron_sap as sap
from megatron_sap.planning import PlanCache
from megatron_sap.planning.plan import DEFAULT_CACHE, DEFAULT_COST_MODEL, DEFAULT_SLACKS

from .options import get_sap_options


_SIZED_CACHE: Optional[PlanCache] = None
_PLANS_BY_TENSOR: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _cache(size: Optional[int]) -> Optional[PlanCache]:
    """A plan cache of `size` entries shared by the batch split and the layers (None: planner default)."""
    global _SIZED_CACHE
    if size is None:
        return None
    if _SIZED_CACHE is None or _SIZED_CACHE.maxsize != size:
        _SIZED_CACHE = PlanCache(maxsize=size)
    return _SIZED_CACHE


@functools.lru_cache(maxsize=8)
def _cost_model(
    preset: Optional[str],
    calibration_file: Optional[str],
    model_shape: Optional[tuple[int, int, int, int]] = None,
    gpus_per_node: Optional[int] = None,
    tensor_parallel_size: int = 1,
) -> Optional["sap.CostModel"]:
    """The cost model the options name (a calibration file read once), with the model's shape
    and CP ranks per node (GPUs per node over TP) when known; None for the planner's default."""
    if preset is not None:
        model = sap.CostModel.preset(preset)
    elif calibration_file is not None:
        model = sap.CostModel.from_calibration(calibration_file)
    elif model_shape is None and gpus_per_node is None and tensor_parallel_size == 1:
        return None
    else:
        model = DEFAULT_COST_MODEL
    if model_shape is not None:
        model = model.with_shape(*model_shape)
    per_node = max((gpus_per_node or model.gpus_per_node) // tensor_parallel_size, 1)
    return dataclasses.replace(model, gpus_per_node=per_node)


def plan_for(cu_seqlens: torch.Tensor | list[int], groups: Optional["sap.SAPGroups"],
             values: Optional[list[int]] = None) -> "sap.Plan":
    """The plan of this packed row for `groups` (None: one rank). `values`: the tensor's values,
    where the caller has them on the host (planned from them, the tensor is not read back)."""
    inner, outer = sap_levels(groups)
    if isinstance(cu_seqlens, torch.Tensor):
        known = split_plan(cu_seqlens)
        if known is not None:
            if (known.inner_size, known.outer_size) != (inner, outer):
                raise ValueError(
                    f"this batch was split for SAP levels {known.inner_size} x {known.outer_size}, but a layer runs "
                    f"with {inner} x {outer}: build the layers with the same CP groups as the batch split (a "
                    "pg_collection with `hcp` when CP is hierarchical, or none to use parallel_state)"
                )
            return known
    kwargs: dict[str, Any] = {"choose_by": get_sap_options().choose_by}
    cache, model = _planning()
    if cache is not None:
        kwargs["cache"] = cache
    if model is not None:
        kwargs["cost_model"] = model
    plan = sap.plan_sequences(cu_seqlens if values is None else values, outer_size=outer, inner_size=inner, **kwargs)
    if isinstance(cu_seqlens, torch.Tensor):
        _PLANS_BY_TENSOR[cu_seqlens] = plan
    return plan


def sap_levels(groups: Optional["sap.SAPGroups"]) -> tuple[int, int]:
    """(inner_size, outer_size) of `groups`; (1, 1) for None (one rank)."""
    return (1, 1) if groups is None else (groups.inner_size, groups.outer_size)


def split_plan(cu_seqlens: torch.Tensor) -> Optional["sap.Plan"]:
    """The plan a batch split (`sap_split_batch`, `sap_packed_seq_params`) made for this very
    `cu_seqlens` tensor, or None for a tensor no split made (a copy, or one built by hand)."""
    return _PLANS_BY_TENSOR.get(cu_seqlens)


def _planning() -> tuple[Optional[PlanCache], Optional["sap.CostModel"]]:
    """The plan cache and cost model the options name (None: the planner's defaults)."""
    options = get_sap_options()
    model = _cost_model(options.cost_preset, options.calibration_file, options.model_shape, options.gpus_per_node,
                        options.tensor_parallel_size)
    return _cache(options.plan_cache_size), model


def planning_cache() -> PlanCache:
    """The plan cache `plan_for` looks plans up in."""
    cache = _planning()[0]
    return cache if cache is not None else DEFAULT_CACHE  # an empty cache is falsy (it has a length)


def planning_cost_model() -> "sap.CostModel":
    """The cost model `plan_for` plans with."""
    return _planning()[1] or DEFAULT_COST_MODEL


def adopt_plan(plan: "sap.Plan") -> bool:
    """Put a plan made elsewhere (a data loader's worker) into the cache `plan_for` reads, if it
    was made with the cost model, load slacks and choice (`choose_by`) `plan_for` plans with."""
    if (plan.cost_model != planning_cost_model() or plan.slacks != DEFAULT_SLACKS
            or plan.choose_by != get_sap_options().choose_by):
        return False
    planning_cache().add(plan)
    return True
