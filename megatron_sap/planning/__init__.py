"""Planning: per-batch placement, the compiled per-rank program and the plan cache.

Pure Python/torch; nothing here touches process groups.
"""
from .cost_model import PRESETS, CostModel
from .plan import DEFAULT_CACHE, Plan, PlanCache, plan_sequences
from .program import KernelCall, RankProgram, Transfer, compile_all

__all__ = [
    "PRESETS",
    "CostModel",
    "DEFAULT_CACHE",
    "Plan",
    "PlanCache",
    "plan_sequences",
    "KernelCall",
    "RankProgram",
    "Transfer",
    "compile_all",
]
