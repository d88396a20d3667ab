"""What differs between the megatron-core and Megatron-LM releases SAP supports (0.13 to 0.19) and SAP must know."""
from __future__ import annotations

from types import ModuleType

import megatron.core
import megatron.core.utils as core_utils


def megatron_core_version() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core."""
    major, minor = megatron.core.__version__.split(".")[:2]
    return int(major), int(minor)


def packed_get_batch() -> bool:
    """Whether Megatron-LM's `pretrain_gpt.get_batch` has a packed (THD) path (core_v0.16, core_v0.17), found
    by the split it calls there; before, the SAP hooks split every row themselves."""
    return hasattr(core_utils, "get_thd_batch_on_this_cp_rank")


def batch_functions_in_core() -> bool:
    """Whether megatron-core holds the training batch functions (`get_batch_on_this_tp_rank`,
    `get_batch_on_this_cp_rank`), as Megatron-LM's `pretrain_gpt.get_batch` calls them from
    core_v0.18 on; before, they were Megatron-LM's `megatron.training.utils`."""
    return hasattr(core_utils, "get_batch_on_this_tp_rank")


def sft_split_on_every_stage() -> bool:
    """Whether Megatron-LM's `pretrain_gpt.get_batch` reads and splits SFT rows on every pipeline
    stage, each stage by its own copy (core_v0.17): the hooks' hand-over of each micro-batch's
    documents from the first stage to the chunks that read no data does not follow that."""
    return packed_get_batch() and megatron_core_version() >= (0, 17)


def mtp_takes_packed_rows() -> bool:
    """Whether multi-token prediction layers accept the packed rows the SAP hooks make at every CP
    size (core_v0.16 on)."""
    return packed_get_batch() or batch_functions_in_core()


def mla_keeps_packed_rope_table() -> bool:
    """Whether multi-latent attention keeps the whole rotary table for packed rows under CP
    (0.14 on). megatron-core 0.13 cuts it to the local token count (and its YaRN table to its own
    CP layout), which SAP's per-document positions overrun."""
    return megatron_core_version() >= (0, 14)


def gpt_yarn_keeps_packed_rope_table() -> bool:
    """Whether GPTModel keeps the whole YaRN rotary table (position_embedding_type "yarn",
    without multi-latent attention) for packed rows under CP (0.16 on). 0.15 builds it without
    `packed_seq`, cut to Megatron's own CP layout: SAP's per-document positions overrun it or
    read the wrong rows."""
    return megatron_core_version() >= (0, 16)


def chunk_aware_get_batch() -> bool:
    """Whether Megatron-LM's `pretrain_gpt.get_batch` gives a virtual pipeline's batch to the first
    stage's first model chunk and the last stage's last only (core_v0.15 on, with `vp_stage`);
    before, every chunk on those stages reads its own, which the documents' hand-over (one
    message per micro-batch) does not follow."""
    return megatron_core_version() >= (0, 15)


MLA_ROPE_TABLE_REFUSED = (
    "SAP with context parallelism needs megatron-core 0.14 or later for multi-latent attention: 0.13 cuts the "
    "rotary table to Megatron's own CP layout, which SAP's per-document positions overrun"
)

GPT_YARN_REFUSED = (
    "SAP with context parallelism needs megatron-core 0.16 or later for YaRN rotary embeddings without multi-latent "
    "attention (--position-embedding-type yarn): 0.15's GPTModel cuts the YaRN table to Megatron's own CP layout, "
    "which SAP's per-document positions overrun"
)


def packed_rope_refusal(multi_latent_attention: bool, yarn: bool) -> str | None:
    """Why this release's rotary table cannot serve SAP's per-document positions under CP
    (MLA before 0.14, GPTModel's YaRN without MLA before 0.16), or None where it can."""
    if multi_latent_attention:
        return None if mla_keeps_packed_rope_table() else MLA_ROPE_TABLE_REFUSED
    return GPT_YARN_REFUSED if yarn and not gpt_yarn_keeps_packed_rope_table() else None


TRAINING_LAYOUT_REFUSED = (
    "SAP's hooks for Megatron-LM's pretrain_gpt.py follow core_v0.13 to core_v0.19: this checkout has the batch "
    "functions neither in megatron.training.utils (core_v0.13 to core_v0.17) nor, with pretrain_gpt.forward_step "
    "building the packed-sequence parameters, in megatron.core.utils (core_v0.18 on). Use a checkout of a supported "
    "release, or build the batch with sap_split_batch in your own script (docs/megatron.md)"
)


def training_layout(training_utils: ModuleType) -> str | None:
    """Where Megatron-LM keeps the batch functions the hooks wrap: "training-utils" (core_v0.13
    to core_v0.17: `megatron.training.utils`), "core-utils" (core_v0.18 on: `megatron.core.utils`,
    with `pretrain` taking a config container and the args parsed by the script), else None."""
    if hasattr(training_utils, "get_batch_on_this_tp_rank"):
        return "training-utils"
    if batch_functions_in_core() and hasattr(core_utils, "get_batch_on_this_cp_rank"):
        return "core-utils"
    return None
