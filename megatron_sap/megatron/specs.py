"""Layer specs whose core attention is `SAPDotProductAttention`.

Two ways in: rewrite a spec you already have (`swap_core_attention`: dense, MoE, MLA, MTP and
heterogeneous specs alike, since it walks the whole ModuleSpec tree), or make Megatron's backend
providers hand out SAP attention while specs are built (`use_sap_core_attention`), which is what
the launcher does for `--cp-comm-type sap`.
"""
from __future__ import annotations

import importlib.util

import copy
import dataclasses
from typing import Any, Callable

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import SAPDotProductAttention


def _swap(node: Any, seen: set[int]) -> int:
    """Replace every `core_attention` entry below `node` in place; return how many were replaced."""
    if id(node) in seen:
        return 0
    seen.add(id(node))
    if isinstance(node, (list, tuple)):
        return sum(_swap(item, seen) for item in node)
    if isinstance(node, ModuleSpec):
        return _swap(node.submodules, seen)
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return 0
    count = 0
    for field in dataclasses.fields(node):
        value = getattr(node, field.name, None)
        if field.name == "core_attention" and value is not None:
            _check_dense(value)
            setattr(node, field.name, SAPDotProductAttention)
            count += 1
        else:
            count += _swap(value, seen)
    return count


def _check_dense(core_attention: Any) -> None:
    """Refuse a core attention SAP cannot stand in for: SAP is dense causal attention, as
    Megatron's DotProductAttention and its Transformer Engine (or other backends') kin are,
    plain modules; a sparse one (DeepSeek's DSAttention, a spec with its indexer as a
    submodule) would silently become dense."""
    module = core_attention.module if isinstance(core_attention, ModuleSpec) else core_attention
    name = getattr(module, "__name__", repr(module))
    with_submodules = isinstance(core_attention, ModuleSpec) and core_attention.submodules is not None
    if with_submodules or name.startswith("DSA") or "Sparse" in name:
        raise ValueError(f"spec's core_attention is {name}{' with submodules' if with_submodules else ''}, which SAP "
                         "(dense causal attention) cannot replace: only plain dense core attention (e.g. "
                         "DotProductAttention, TEDotProductAttention)")


def swap_core_attention(spec: Any) -> Any:
    """A copy of `spec` (ModuleSpec, block submodules, or a list of layer specs) with SAP core attention.

    Raises ValueError when the spec has no core attention to replace (e.g. a Mamba-only spec).
    """
    swapped = copy.deepcopy(spec)
    if _swap(swapped, set()) == 0:
        raise ValueError("spec contains no core_attention submodule to replace with SAP attention")
    return swapped


def get_gpt_layer_sap_spec(use_transformer_engine: bool = False, **kwargs: Any) -> ModuleSpec:
    """Megatron's GPT layer spec (local, or Transformer Engine linears/norms) with SAP core attention.

    `kwargs` go to `get_gpt_layer_local_spec` / `get_gpt_layer_with_transformer_engine_spec`
    (num_experts, qk_layernorm, multi_latent_attention, ...).
    """
    if use_transformer_engine:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        if importlib.util.find_spec("transformer_engine") is None:  # Megatron's builder fails with a NameError
            raise ImportError("get_gpt_layer_sap_spec(use_transformer_engine=True) needs Transformer Engine, which is "
                              "not installed: use the local spec (use_transformer_engine=False) or install it")

        return swap_core_attention(get_gpt_layer_with_transformer_engine_spec(**kwargs))
    return swap_core_attention(get_gpt_layer_local_spec(**kwargs))


def _provider_classes() -> list[type]:
    """Megatron's backend providers whose `core_attention()` the GPT/MoE/MTP spec builders call."""
    providers: list[type] = [LocalSpecProvider]
    try:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    except ImportError:  # Transformer Engine is not installed
        return providers
    return providers + [TESpecProvider]


def use_sap_core_attention() -> Callable[[], None]:
    """Make every spec built from now on use SAP core attention; returns a function that undoes it."""
    originals = {cls: cls.__dict__["core_attention"] for cls in _provider_classes()}

    def core_attention(self) -> type:
        """SAP context-parallel core attention (installed by megatron_sap)."""
        return SAPDotProductAttention

    for cls in originals:
        cls.core_attention = core_attention

    def undo() -> None:
        for cls, original in originals.items():
            cls.core_attention = original

    return undo
