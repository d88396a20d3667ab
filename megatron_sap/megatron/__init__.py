"""Megatron-Core integration of SAP (the only package that imports Megatron).

    from megatron_sap.megatron import (
        SAPDotProductAttention, get_gpt_layer_sap_spec, swap_core_attention,
        sap_split_batch, sap_loss, initialize_sap_parallel,
    )

See docs/megatron.md for the training flags, the launcher and the patch for forks.
"""
from .arguments import add_sap_args, chain_args_providers
from .attention import SAPDotProductAttention
from .batch import cu_seqlens_from_position_ids, resolve_groups, sap_loss, sap_packed_seq_params, sap_split_batch
from .groups import (
    initialize_sap_parallel,
    prepare_pipeline_host_group,
    sap_groups_from_parallel_state,
    sap_groups_from_pg_collection,
)
from .loader import PlannedDataset, adopt_loader_plan, loader_plan_bytes, loader_planning
from .options import SAPOptions, get_sap_options, set_sap_options
from .rope import install_sap_rope, make_rotary_cpu_safe, rotate_by_positions
from .specs import get_gpt_layer_sap_spec, swap_core_attention, use_sap_core_attention

__all__ = [
    "PlannedDataset",
    "SAPDotProductAttention",
    "SAPOptions",
    "add_sap_args",
    "adopt_loader_plan",
    "chain_args_providers",
    "cu_seqlens_from_position_ids",
    "get_gpt_layer_sap_spec",
    "get_sap_options",
    "initialize_sap_parallel",
    "install_sap_rope",
    "loader_plan_bytes",
    "loader_planning",
    "make_rotary_cpu_safe",
    "prepare_pipeline_host_group",
    "resolve_groups",
    "rotate_by_positions",
    "sap_groups_from_parallel_state",
    "sap_groups_from_pg_collection",
    "sap_loss",
    "sap_packed_seq_params",
    "sap_split_batch",
    "set_sap_options",
    "swap_core_attention",
    "use_sap_core_attention",
]
