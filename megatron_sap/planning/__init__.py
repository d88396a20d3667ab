"""Planning: per-batch placement, the compiled per-rank program and the plan cache.

Pure Python/torch; nothing here touches process groups.
"""
from .cost_model import CostModel, PRESETS

__all__ = ["CostModel", "PRESETS"]
