"""One place that turns a global `cu_seqlens` into the SAP plan for the current groups.

The batch split and every layer call `plan_for` with the same `cu_seqlens`; the planner's cache
makes every call after the first a dictionary lookup.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

import megatron_sap as sap

from .options import get_sap_options


def plan_for(cu_seqlens: torch.Tensor | list[int], groups: Optional["sap.SAPGroups"]) -> Any:
    """The plan of this packed row for `groups` (None: one rank)."""
    inner, outer = (1, 1) if groups is None else (groups.inner_size, groups.outer_size)
    options = get_sap_options()
    kwargs: dict[str, Any] = {}
    if options.cost_preset is not None:
        kwargs["cost_model"] = sap.CostModel.preset(options.cost_preset)
    elif options.calibration_file is not None:
        kwargs["cost_model"] = sap.CostModel.from_calibration(options.calibration_file)
    return sap.plan_sequences(cu_seqlens, outer_size=outer, inner_size=inner, **kwargs)
