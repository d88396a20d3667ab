"""One place that turns a global `cu_seqlens` into the SAP plan for the current groups.

The batch split and every layer call `plan_for` with the same `cu_seqlens` tensor. The split's
plan is remembered against that tensor, so layers find it without reading `cu_seqlens` back to
the host (no device sync per layer); other tensors go through the planner's cache.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch.utils.weak import WeakTensorKeyDictionary

import megatron_sap as sap
from megatron_sap.planning import PlanCache

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
def _cost_model(preset: Optional[str], calibration_file: Optional[str]) -> Optional["sap.CostModel"]:
    """The cost model the options name (read once per file), or None for the planner's default."""
    if preset is not None:
        return sap.CostModel.preset(preset)
    if calibration_file is not None:
        return sap.CostModel.from_calibration(calibration_file)
    return None


def plan_for(cu_seqlens: torch.Tensor | list[int], groups: Optional["sap.SAPGroups"]) -> "sap.Plan":
    """The plan of this packed row for `groups` (None: one rank)."""
    inner, outer = (1, 1) if groups is None else (groups.inner_size, groups.outer_size)
    if isinstance(cu_seqlens, torch.Tensor):
        known = _PLANS_BY_TENSOR.get(cu_seqlens)
        if known is not None and (known.inner_size, known.outer_size) == (inner, outer):
            return known
    options = get_sap_options()
    kwargs: dict[str, Any] = {}
    cache = _cache(options.plan_cache_size)
    if cache is not None:
        kwargs["cache"] = cache
    model = _cost_model(options.cost_preset, options.calibration_file)
    if model is not None:
        kwargs["cost_model"] = model
    plan = sap.plan_sequences(cu_seqlens, outer_size=outer, inner_size=inner, **kwargs)
    if isinstance(cu_seqlens, torch.Tensor):
        _PLANS_BY_TENSOR[cu_seqlens] = plan
    return plan
