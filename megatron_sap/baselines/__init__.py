"""Existing context-parallel attention methods, for honest comparison with SAP.

Each method lives in one module exposing `NAME`, `layout(cu_seqlens, world_size, ...)`,
`attention(q, k, v, layout, group, *, softmax_scale=None, backend="auto")` and
`model_stats(cu_seqlens, world_size, cost_model, inner_size=1)`; all run on the same
varlen kernels and count their sends with `megatron_sap.comm.traffic`.

  p2p         zigzag ring, Megatron / Transformer Engine `p2p` for THD  (ring_p2p)
  all_gather  KV all-gather over contiguous shards, no load balancing  (all_gather)
  a2a         Ulysses head all-to-all                                    (ulysses)
  a2a+p2p     Ulysses in inner groups, zigzag ring across them           (hybrid)

`a2a+p2p` takes `inner_size` in `layout` and a (inner, outer) pair of groups in
`attention`; the others take one context-parallel group.
"""
from __future__ import annotations

from types import ModuleType

from megatron_sap.baselines import all_gather, hybrid, ring_p2p, ulysses
from megatron_sap.baselines.common import BaselineLayout, shard, unshard

METHODS: dict[str, ModuleType] = {m.NAME: m for m in (ring_p2p, all_gather, ulysses, hybrid)}


def get(name: str) -> ModuleType:
    """The module implementing baseline `name` (`p2p`, `all_gather`, `a2a`, `a2a+p2p`)."""
    if name not in METHODS:
        raise ValueError(f"unknown baseline {name!r}; known: {sorted(METHODS)}")
    return METHODS[name]


__all__ = ["METHODS", "BaselineLayout", "get", "shard", "unshard"]
