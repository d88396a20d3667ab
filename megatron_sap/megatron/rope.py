"""Rotary embeddings for the SAP token layout.

Megatron's THD RoPE (`apply_rotary_pos_emb(..., cu_seqlens=..., cp_group=...)`) assumes each
document is split into 2*CP zigzag chunks. Under SAP a rank holds whole documents or arbitrary
pieces of them, so each local token must be rotated by its true position inside its document.

`sap_split_batch` registers those per-token positions against the global `cu_seqlens` tensor
it puts into the `PackedSeqParams`; the replacement `apply_rotary_pos_emb` installed by
`install_sap_rope()` looks the positions up by that tensor and falls back to Megatron's function
for every other call, except packed `cu_seqlens` under CP > 1 that no split registered (a
copied tensor, or a batch split by Megatron's own THD split), which it refuses. Keying on the
tensor (not on a global "current batch") keeps activation recomputation and interleaved
pipeline micro-batches correct.
"""
from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

# Modules that bind `apply_rotary_pos_emb` by name at import time (megatron-core 0.13 on).
_ROPE_CALLERS = (
    "megatron.core.transformer.attention",
    "megatron.core.transformer.multi_latent_attention",
)

_TOKEN_POSITIONS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
_ORIGINALS: dict[str, Callable] = {}


def register_token_positions(cu_seqlens: Tensor, positions: Tensor) -> None:
    """Record the in-document position of every local token for the batch keyed by `cu_seqlens`."""
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D (one per local token), got shape {tuple(positions.shape)}")
    _TOKEN_POSITIONS[cu_seqlens] = positions


def token_positions(cu_seqlens: Optional[Tensor]) -> Optional[Tensor]:
    """Positions registered for this `cu_seqlens` tensor, or None for a batch SAP did not split."""
    if cu_seqlens is None:
        return None
    return _TOKEN_POSITIONS.get(cu_seqlens)


def _rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    """(x1, x2) -> (-x2, x1), on halves or on interleaved even/odd pairs."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_by_positions(
    t: Tensor,
    freqs: Tensor,
    positions: Tensor,
    *,
    interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
) -> Tensor:
    """Rotate `t` [tokens, heads, dim] token by token with `freqs[positions]`.

    `freqs` is Megatron's embedding table `[max_seqlen, 1, 1, rot_dim]` (angles, already laid out
    for the interleaved/non-interleaved convention); dimensions past `rot_dim` pass through.
    """
    if t.dim() != 3:
        raise ValueError(f"expected THD input [tokens, heads, dim], got shape {tuple(t.shape)}")
    if positions.numel() != t.size(0):
        raise ValueError(f"{positions.numel()} positions for {t.size(0)} tokens")
    angles = freqs.reshape(freqs.size(0), -1)[positions.to(freqs.device)].unsqueeze(1)  # [t, 1, rot]
    rot_dim = angles.size(-1)
    x, x_pass = t[..., :rot_dim], t[..., rot_dim:]
    if multi_latent_attention:  # MLA stores rotary pairs interleaved; RoPE works on halves.
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    cos = (torch.cos(angles) * mscale).to(t.dtype)
    sin = (torch.sin(angles) * mscale).to(t.dtype)
    x = x * cos + _rotate_half(x, interleaved) * sin
    return torch.cat((x, x_pass), dim=-1)


def _sap_apply_rotary_pos_emb(original: Callable) -> Callable:
    """Wrap Megatron's `apply_rotary_pos_emb`: per-token positions for SAP batches, else unchanged."""

    def apply_rotary_pos_emb(
        t: Tensor,
        freqs: Tensor,
        config,
        cu_seqlens: Optional[Tensor] = None,
        mscale: float = 1.0,
        cp_group=None,
        mla_rotary_interleaved: Optional[bool] = None,
        **others,
    ) -> Tensor:
        # `mla_rotary_interleaved` (megatron-core 0.19 on; multi-latent attention passes True)
        # replaced reading `config.multi_latent_attention`; releases before it never pass it.
        positions = token_positions(cu_seqlens)
        if positions is None:
            if cu_seqlens is not None and cp_group is not None and cp_group.size() > 1:
                # Megatron's THD RoPE would place these tokens by its own 2*CP-chunk layout,
                # which is not how SAP split them: the rotations would be silently wrong.
                raise ValueError(
                    "RoPE got packed cu_seqlens under context parallelism that no sap_split_batch call "
                    "registered: pass the PackedSeqParams sap_split_batch returns (the same cu_seqlens tensor, "
                    "not a copy), or split the batch with sap_split_batch"
                )
            if mla_rotary_interleaved is not None:
                others["mla_rotary_interleaved"] = mla_rotary_interleaved
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **others)
        if positions.numel() != t.size(0):
            raise ValueError(
                f"SAP's RoPE got {t.size(0)} tokens of a packed row whose batch split gave this rank "
                f"{positions.numel()}: run the model on the local batch sap_split_batch returns (not the whole row)"
            )
        if others:
            # An argument of a newer release whose meaning the per-token rotation does not know:
            # refused rather than ignored, which could rotate wrongly.
            raise TypeError(f"SAP's rotary embedding does not support the argument(s) {', '.join(sorted(others))} "
                            "of this megatron-core release")
        return rotate_by_positions(
            t,
            freqs,
            positions,
            interleaved=config.rotary_interleaved,
            multi_latent_attention=(config.multi_latent_attention if mla_rotary_interleaved is None
                                    else mla_rotary_interleaved),
            mscale=mscale,
        )

    apply_rotary_pos_emb.__doc__ = _sap_apply_rotary_pos_emb.__doc__
    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


def install_sap_rope() -> None:
    """Point every attention module's `apply_rotary_pos_emb` at the SAP-aware version (idempotent)."""
    for name in _ROPE_CALLERS:
        module = importlib.import_module(name)
        if name in _ORIGINALS:
            continue
        _ORIGINALS[name] = module.apply_rotary_pos_emb
        module.apply_rotary_pos_emb = _sap_apply_rotary_pos_emb(module.apply_rotary_pos_emb)


def uninstall_sap_rope() -> None:
    """Restore Megatron's `apply_rotary_pos_emb` where `install_sap_rope` replaced it."""
    for name, original in list(_ORIGINALS.items()):
        importlib.import_module(name).apply_rotary_pos_emb = original
        del _ORIGINALS[name]


def make_rotary_cpu_safe(rotary: torch.nn.Module) -> None:
    """Keep a Megatron `RotaryEmbedding` on its own device.

    Megatron moves `inv_freq` to the current CUDA device on first use, which fails on CPU-only
    machines (demo, tests). This builds the same table (angles duplicated for rotate-half, or
    pairwise for interleaved) on `inv_freq`'s device instead: as an instance-level `get_emb`
    where the class has one (megatron-core 0.16), else as an instance-level `forward` that also
    slices a non-packed table for its CP rank as Megatron's does (0.13-0.15).
    """

    def table(max_seq_len: int, offset: int = 0) -> Tensor:
        freqs = rotary.get_freqs_non_repeated(max_seq_len, offset)
        if rotary.rotary_interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    if hasattr(type(rotary), "get_emb"):
        rotary.get_emb = table
        return

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> Tensor:
        emb = table(max_seq_len, offset)
        group = cp_group if cp_group is not None else getattr(rotary, "cp_group", None)
        if group is not None and group.size() > 1 and not packed_seq:
            from megatron.core.models.common.embeddings.rotary_pos_embedding import get_pos_emb_on_this_cp_rank

            emb = get_pos_emb_on_this_cp_rank(emb, 0, group)
        return emb

    rotary.forward = forward
