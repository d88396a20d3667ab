"""megatron-sap: Sequence-Aware Parallelism for packed sequences.

Public API::

    import megatron_sap as sap
    plan = sap.plan_sequences(cu_seqlens, outer_size=R, inner_size=U)
    groups = sap.init_sap_groups(inner_size=U, outer_size=R)
    out = sap.sap_attention(q, k, v, plan, groups)
"""
from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "plan_sequences": "megatron_sap.planning",
    "Plan": "megatron_sap.planning",
    "PlanCache": "megatron_sap.planning",
    "DEFAULT_CACHE": "megatron_sap.planning",
    "CostModel": "megatron_sap.planning",
    "sap_attention": "megatron_sap.attention",
    "init_sap_groups": "megatron_sap.comm.groups",
    "SAPGroups": "megatron_sap.comm.groups",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the public names lazily so `import megatron_sap` stays cheap."""
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron_sap' has no attribute {name!r}")
