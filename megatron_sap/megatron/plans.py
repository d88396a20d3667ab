"""One place that turns a global `cu_seqlens` into the SAP plan for the current groups.

The batch split and every layer call `plan_for` with the same `cu_seqlens`; the planner's cache
makes every call after the first a dictionary lookup.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

import megatron_sap as sap
from megatron_sap.planning import PlanCache

from .options import get_sap_options


_SIZED_CACHE: Optional[PlanCache] = None


def _cache(size: Optional[int]) -> Optional[PlanCache]:
    """A plan cache of `size` entries shared by the batch split and the layers (None: planner default)."""
    global _SIZED_CACHE
    if size is None:
        return None
    if _SIZED_CACHE is None or _SIZED_CACHE.maxsize != size:
        _SIZED_CACHE = PlanCache(maxsize=size)
    return _SIZED_CACHE


def plan_for(cu_seqlens: torch.Tensor | list[int], groups: Optional["sap.SAPGroups"]) -> "sap.Plan":
    """The plan of this packed row for `groups` (None: one rank)."""
    inner, outer = (1, 1) if groups is None else (groups.inner_size, groups.outer_size)
    options = get_sap_options()
    kwargs: dict[str, Any] = {}
    cache = _cache(options.plan_cache_size)
    if cache is not None:
        kwargs["cache"] = cache
    if options.cost_preset is not None:
        kwargs["cost_model"] = sap.CostModel.preset(options.cost_preset)
    elif options.calibration_file is not None:
        kwargs["cost_model"] = sap.CostModel.from_calibration(options.calibration_file)
    return sap.plan_sequences(cu_seqlens, outer_size=outer, inner_size=inner, **kwargs)
