"""PyTorch's built-in FlashAttention-2 varlen kernels (CUDA, fp16/bf16).

Thin wrappers over torch.ops.aten._flash_attention_forward/_backward with
cum_seq_q/cum_seq_k, adapted to this package's conventions by `FlashVarlen`.
Nothing here syncs the host with the device. `FlashVarlen`, the lse layout
helpers and the head-dim check are shared with the flash-attn backend, whose
kernels are the same.

Flash kernel conventions that differ from ours:
  * lse is [Hq, Tq] in recent kernels but [batch, Hq, max_seqlen_q] (padded)
    in older ones; the layout is probed once per device;
  * a row that sees no key gets lse = +inf (so the backward's exp(S - lse) is 0);
    we return -inf and convert back for the backward;
  * max_seqlen_q == 1 with GQA takes a decoding shortcut that assumes one query
    per segment (wrong with zero-length segments), so we pass at least 2.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

_MAX_HEAD_DIM = 256
_WIDE_HEADS = (192, 224)  # head dims in (192, 224]: the backward runs on sm80 and sm90 GPUs only
_WIDE_HEAD_GPUS = ((8, 0), (9, 0))  # A100/A800, H100/H800/H200


def built(device: torch.device) -> bool:
    """Whether this PyTorch build has the flash kernels for `device` (a CUDA GPU of sm80
    or newer). torch 2.4 has no query for it: there a tiny forward call tells, once per device."""
    query = getattr(torch.backends.cuda, "is_flash_attention_available", None)  # torch 2.5 on
    return query() if query is not None else _runs_on(torch.device(device))


@functools.cache
def _runs_on(device: torch.device) -> bool:
    x = torch.zeros(1, 1, 8, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    try:
        _kernel_forward(x, x, x, cu, cu, 2, 1, False, 1.0)
    except RuntimeError:  # not compiled in, or no kernel for this device (NotImplementedError)
        return False
    return True


def head_dim_supported(dim: int, capability: tuple[int, int] | None = None) -> bool:
    """The flash kernels need a head dim that is a multiple of 8 and at most 256; their
    backward refuses 192 < dim <= 224 on GPUs other than sm80 and sm90 (`capability`,
    the GPU's compute capability, where known)."""
    if dim % 8 or dim > _MAX_HEAD_DIM:
        return False
    return not (_WIDE_HEADS[0] < dim <= _WIDE_HEADS[1] and capability is not None
                and tuple(capability) not in _WIDE_HEAD_GPUS)


def check_head_dim(dim: int, capability: tuple[int, int] | None = None) -> None:
    """ValueError unless `head_dim_supported(dim, capability)`."""
    if not head_dim_supported(dim):
        raise ValueError(f"flash kernels need head_dim % 8 == 0 and head_dim <= {_MAX_HEAD_DIM}, got {dim}; use backend='torch'")
    if not head_dim_supported(dim, capability):
        raise ValueError(f"flash kernels' backward takes head_dim {_WIDE_HEADS[0] + 8}..{_WIDE_HEADS[1]} on sm80/sm90 "
                         f"GPUs only, got {dim} on sm{capability[0]}{capability[1]}; use backend='torch'")


def rows_of(t: Tensor) -> Tensor:
    """`t` as the kernels take it: any row and head strides, the last dim contiguous. The
    executors pass K and V as views into one stacked [n, 2, Hkv, D] buffer, which need no copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def kernel_max_seqlen_q(max_seqlen_q: int) -> int:
    """max_seqlen_q to pass to the kernels: at least 2, avoiding the single-query GQA shortcut."""
    return max(int(max_seqlen_q), 2)


def _row_segments(cu_seqlens_q: Tensor, total_q: int) -> tuple[Tensor, Tensor]:
    """(segment, position in segment) of every query row, computed on the device."""
    cu = cu_seqlens_q.long()
    rows = torch.arange(total_q, device=cu.device)
    segment = torch.searchsorted(cu[1:], rows, right=True)
    return segment, rows - cu[segment]


def lse_rows(lse: Tensor, cu_seqlens_q: Tensor, total_q: int) -> Tensor:
    """A kernel's lse (either layout, +inf for rows without keys) -> [Hq, Tq] float32 with -inf there."""
    if lse.dim() == 3:
        segment, position = _row_segments(cu_seqlens_q, total_q)
        lse = lse[segment, :, position].T
    lse = lse.float()
    return torch.where(lse == float("inf"), float("-inf"), lse).contiguous()


def lse_for_kernel(lse: Tensor, cu_seqlens_q: Tensor, max_seqlen_q: int, padded: bool) -> Tensor:
    """Our lse [Hq, Tq] -> the kernel's layout, float32, +inf for rows without keys."""
    lse = lse.float()
    lse = torch.where(lse == float("-inf"), float("inf"), lse)
    if not padded:
        return lse.contiguous()
    heads, total_q = lse.shape
    segment, position = _row_segments(cu_seqlens_q, total_q)
    out = torch.full((cu_seqlens_q.numel() - 1, heads, max_seqlen_q), float("inf"), dtype=torch.float32, device=lse.device)
    out[segment, :, position] = lse.T
    return out


def _kernel_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return out, lse


def _kernel_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
                     cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float):
    unused_rng = torch.zeros(2, dtype=torch.int64, device=q.device)  # read only with dropout
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, unused_rng, unused_rng, scale=scale
    )
    return dq, dk, dv


class FlashVarlen:
    """A flash varlen kernel pair behind this package's forward/backward interface.

    `kernel_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale) -> (out, kernel lse)` and
    `kernel_backward(dout, q, k, v, out, kernel lse, cu_q, cu_k, max_q, max_k, causal, scale)
    -> (dq, dk, dv)` take the kernels' own conventions; the lse layout they use is probed once
    per device. The head dim was checked by `resolve_backend`.
    """

    def __init__(self, kernel_forward: Callable[..., tuple[Tensor, Tensor]],
                 kernel_backward: Callable[..., tuple[Tensor, Tensor, Tensor]]) -> None:
        self._kernel_forward = kernel_forward
        self._kernel_backward = kernel_backward
        self.padded_lse = functools.cache(self._probe_padded_lse)

    def _probe_padded_lse(self, device: torch.device) -> bool:
        """Whether the kernels use the padded [batch, H, max_seqlen_q] lse layout."""
        x = torch.zeros(1, 1, 8, dtype=torch.float16, device=device)
        cu = torch.arange(2, dtype=torch.int32, device=device)
        return self._kernel_forward(x, x, x, cu, cu, 2, 1, False, 1.0)[1].dim() == 3

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, *, causal: bool, softmax_scale: float) -> tuple[Tensor, Tensor]:
        """Returns (out [Tq, Hq, D] in q.dtype, lse [Hq, Tq] float32)."""
        cu_q, cu_k = cu_seqlens_q.to(torch.int32).contiguous(), cu_seqlens_k.to(torch.int32).contiguous()
        out, lse = self._kernel_forward(
            rows_of(q), rows_of(k), rows_of(v), cu_q, cu_k,
            kernel_max_seqlen_q(max_seqlen_q), int(max_seqlen_k), causal, softmax_scale,
        )
        return out, lse_rows(lse, cu_q, q.shape[0])

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                 cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool,
                 softmax_scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients against the given out/lse (the kernel recomputes D = rowsum(dout * out) from them)."""
        cu_q, cu_k = cu_seqlens_q.to(torch.int32).contiguous(), cu_seqlens_k.to(torch.int32).contiguous()
        max_q = kernel_max_seqlen_q(max_seqlen_q)
        return self._kernel_backward(
            rows_of(dout.to(q.dtype)), rows_of(q), rows_of(k), rows_of(v), rows_of(out.to(q.dtype)),
            lse_for_kernel(lse, cu_q, max_q, self.padded_lse(q.device)), cu_q, cu_k, max_q, int(max_seqlen_k), causal,
            softmax_scale,
        )


varlen = FlashVarlen(_kernel_forward, _kernel_backward)
forward = varlen.forward
backward = varlen.backward
