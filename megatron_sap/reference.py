"""Dense reference attention for packed sequences, used to check the kernels.

It is deliberately the obvious implementation: one T x T mask over the whole
packed batch, float64, plain differentiable torch ops. It shares no code with
the tiled kernels so that agreement between the two means something. It
allocates O(T^2 * H) memory: use it for small T only (a few thousand tokens).
"""
from __future__ import annotations

import torch
from torch import Tensor


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of packed documents, each query seeing only keys of its own document.

    q: [T, Hq, D]; k, v: [T, Hkv, D] with Hq a multiple of Hkv (GQA: query head h
    reads key/value head h // (Hq // Hkv)). cu_seqlens: document boundaries,
    shared by queries and keys. causal=True lets position i see positions <= i.
    Returns (out [T, Hq, D], lse [Hq, T]), both float64; rows without keys get
    out = 0 and lse = -inf. Differentiable with respect to q, k and v.
    """
    total, heads_q, dim = q.shape
    groups = heads_q // k.shape[1]
    scale = dim**-0.5 if softmax_scale is None else softmax_scale

    doc = torch.repeat_interleave(
        torch.arange(cu_seqlens.numel() - 1), torch.diff(cu_seqlens.long().cpu())
    ).to(q.device)
    mask = doc[:, None] == doc[None, :]
    if causal:
        pos = torch.arange(total, device=q.device)
        mask &= pos[None, :] <= pos[:, None]

    q64 = q.double().transpose(0, 1)  # [Hq, T, D]
    k64 = k.double().repeat_interleave(groups, dim=1).transpose(0, 1)
    v64 = v.double().repeat_interleave(groups, dim=1).transpose(0, 1)
    scores = (q64 @ k64.transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, T]
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite_lse[..., None])
    out = (probs @ v64).transpose(0, 1)
    return out, lse
