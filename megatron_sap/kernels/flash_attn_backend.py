"""The flash_attn package's varlen kernels (CUDA, fp16/bf16), imported lazily.

Calls flash_attn.flash_attn_interface._flash_attn_varlen_forward/_backward, the
functions under flash_attn_varlen_func. Their keyword arguments changed across
2.x releases (window_size became window_size_left/right, softcap, block_table,
leftpad_k, seqused_k, zero_tensors were added), so the leading positional
arguments, stable since 2.0, are passed by position and the rest by keyword,
keeping only the names the installed version accepts. The lse conventions are
the same as PyTorch's copy of these kernels (see aten_flash).
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

from .aten_flash import FlashVarlen


def _interface():
    from flash_attn import flash_attn_interface

    return flash_attn_interface


@functools.cache
def _parameter_names(fn) -> frozenset[str]:
    """Parameter names of fn, looking through torch.library.custom_op's (*args, **kwargs) wrapper."""
    return frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def _accepted(fn, **candidates) -> dict:
    """The keyword arguments among `candidates` that `fn` accepts."""
    names = _parameter_names(fn)
    return {name: value for name, value in candidates.items() if name in names}


def _kernel_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float):
    fn = _interface()._flash_attn_varlen_forward
    options = _accepted(
        fn, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(-1, -1), window_size_left=-1,
        window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None,
        leftpad_k=None, seqused_k=None,
    )
    result = fn(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    # <= 2.6: (out, q, k, v, out_padded, lse, S_dmask, rng_state); >= 2.7: (out, lse, S_dmask, rng_state)
    return result[0], result[5] if len(result) == 8 else result[1]


def _kernel_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
                     cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float):
    """The kernel writes dq, dk, dv into buffers we allocate."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fn = _interface()._flash_attn_varlen_backward
    options = _accepted(
        fn, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(-1, -1), window_size_left=-1,
        window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=True, rng_state=None,
    )
    fn(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, **options)
    return dq, dk, dv


varlen = FlashVarlen(_kernel_forward, _kernel_backward)
forward = varlen.forward
backward = varlen.backward
