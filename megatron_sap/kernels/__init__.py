"""Varlen attention kernels for packed sequences: one thin interface over several backends.

Tensors are packed: q [Tq, Hq, D], k and v [Tk, Hkv, D], with segment
boundaries in cu_seqlens_q / cu_seqlens_k (int, 1-D, same number of segments).
Segment i of q attends only to segment i of k, which keeps documents apart.
causal=True applies a bottom-right aligned causal mask inside each segment
(key j visible to query i iff j <= i + len_k - len_q, as flash-attn >= 2.1 and
PyTorch's FlashAttention-2); the pipelined schedule uses it for diagonal blocks, the
gathered one for a query piece over all keys of its document up to its end. causal=False is full attention inside the
segment. GQA is native: Hq must be a multiple of Hkv and query head h reads
key/value head h // (Hq // Hkv).

Conventions shared by every backend:
  * lse is [Hq, Tq], float32 (float64 for float64 inputs), natural log, of the
    scaled scores;
  * a query row that sees no key gets out = 0 and lse = -inf;
  * the backward takes out and lse as given, so called once per key block with
    the final, merged out/lse it returns that block's exact share of the
    gradients (D_i = rowsum(dout * out), P = exp(S * scale - lse)).

Backends: "torch" (pure PyTorch, any device and float dtype), "aten-flash"
(PyTorch's built-in flash kernels, CUDA fp16/bf16), "flash-attn" (the
flash_attn package, CUDA fp16/bf16). "auto" picks the fastest available.
"""
from __future__ import annotations

import functools
import importlib
import math
import numbers
import re
from typing import Any, Callable

import torch
from torch import Tensor

from ..validation import check_bool, check_has_data
from . import aten_flash, torch_backend  # aten_flash imports only torch; flash_attn_backend stays lazy
from .merge import accumulation_dtype, add_rows, merge_into, merge_partials, take_rows, write_rows
from .torch_backend import check_cu_seqlens

__all__ = [
    "accumulation_dtype",
    "add_rows",
    "available_backends",
    "first_order_only",
    "merge_into",
    "merge_partials",
    "resolve_backend",
    "resolve_softmax_scale",
    "take_rows",
    "varlen_backward",
    "varlen_forward",
    "write_rows",
]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# Bottom-right causal alignment (2.1), and zeros written for a segment without queries or
# keys (2.3.4; before, such rows' out/lse and such keys' dk/dv were left unwritten).
_MIN_FLASH_ATTN = (2, 3, 4)


@functools.cache
def _flash_attn_importable() -> bool:
    """Whether the flash_attn package imports (a build compiled against another torch
    fails here, not at the first call) and is at least 2.3.4."""
    try:
        import flash_attn

        importlib.import_module("flash_attn.flash_attn_interface")  # loads the compiled kernels
    except (ImportError, OSError, RuntimeError):
        return False
    version = tuple(int(part) for part in re.findall(r"\d+", getattr(flash_attn, "__version__", "0"))[:3])
    return version >= _MIN_FLASH_ATTN


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends usable on `device` (default: CUDA if present, else CPU), fastest first.

    The flash kernels need an NVIDIA Ampere or newer GPU; aten-flash also needs a
    PyTorch build that includes them. On ROCm builds of PyTorch only "torch" is offered:
    their flash kernels (other implementations behind the same calls) have not been
    checked against this package's conventions.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    names = []
    if (device.type == "cuda" and torch.cuda.is_available() and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 8):
        if _flash_attn_importable():
            names.append("flash-attn")
        if aten_flash.built(device):
            names.append("aten-flash")
    names.append("torch")
    return names


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None) -> str:
    """Map "auto" to the fastest backend for (device, dtype, head_dim); check an explicit
    name is usable there (the head dim too, when given)."""
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {list(_FLOAT_DTYPES)}")
    available = available_backends(device)
    on_gpu = available[0] != "torch" and torch.device(device).type == "cuda"
    capability = torch.cuda.get_device_capability(device) if on_gpu else None
    flash_head_dim = head_dim is None or aten_flash.head_dim_supported(head_dim, capability)
    if name == "auto":
        if dtype in _FLASH_DTYPES and available[0] != "torch" and flash_head_dim:
            return available[0]
        return "torch"
    if name not in ("flash-attn", "aten-flash", "torch"):
        raise ValueError(f"unknown attention backend {name!r}; available on {device}: {available}")
    if name not in available:
        raise ValueError(f"attention backend {name!r} is not available on {device}; available: {available}")
    if name != "torch" and dtype not in _FLASH_DTYPES:
        raise ValueError(f"attention backend {name!r} needs float16 or bfloat16 inputs, got {dtype}; use 'torch'")
    if name != "torch" and head_dim is not None:
        aten_flash.check_head_dim(head_dim, capability)
    return name


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                  max_seqlen_q: int, max_seqlen_k: int) -> None:
    """Validate shapes, dtypes and devices; cu_seqlens values and the max lengths too when
    the boundaries live on the CPU (no device sync)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}; expected one of {list(_FLOAT_DTYPES)}")
    devices = {t.device for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, cu_seqlens_q, cu_seqlens_k must be on one device, got {sorted(map(str, devices))}")
    check_has_data(q)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k/v must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    if q.shape[2] == 0:
        raise ValueError(f"head_dim must be positive, got shape {tuple(q.shape)}")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_q == 0 or heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"query heads ({heads_q}) must be a positive multiple of key/value heads ({heads_kv})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got shape {tuple(cu.shape)} dtype {cu.dtype}")
        if cu.numel() == 0:
            raise ValueError(f"{name} must hold at least one entry (0), got an empty tensor")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer on the host (the flash kernels size their grids with it), "
                            f"got {type(value).__name__}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of segments, "
            f"got {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
        )
    if cu_seqlens_q.device.type == "cpu":
        for name, cu, tokens, max_seqlen in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                             ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
            longest = check_cu_seqlens(cu, tokens, name)
            if max_seqlen < longest:  # the flash kernels would silently skip the rest
                raise ValueError(f"max_seqlen for {name} is {max_seqlen}, below its longest segment ({longest})")


def resolve_softmax_scale(head_dim: int, softmax_scale: float | None, dtype: torch.dtype = torch.float32) -> float:
    """The scale of the scores: `softmax_scale`, default head_dim ** -0.5; checked a finite
    real number (a NaN or infinite scale would make every output NaN; a string or a bool is
    a mistake that `float` would accept) that is finite in the dtype the kernels compute the
    scores of `dtype` inputs in (float32, float64 for float64: beyond it every output would
    be NaN or 0)."""
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)):
        raise TypeError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    score_dtype = accumulation_dtype(dtype)
    if abs(scale) > torch.finfo(score_dtype).max:
        raise ValueError(f"softmax_scale {softmax_scale!r} overflows {score_dtype}, the dtype the scores of {dtype} "
                         "inputs are computed in")
    return scale


def _call_scale(q: Tensor, causal: bool, softmax_scale: float | None) -> float:
    """`resolve_softmax_scale` for a kernel call, with `causal` checked a bool."""
    check_bool(causal, "causal")
    return resolve_softmax_scale(q.shape[2], softmax_scale, q.dtype)


def _flash_module(backend: str):
    if backend == "aten-flash":
        return aten_flash
    from . import flash_attn_backend

    return flash_attn_backend


def varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Attention of each q segment over its k segment.

    Arguments in flash-attn's order (`flash_attn_varlen_func`), `causal` False unless
    given. Returns (out [Tq, Hq, D] in q.dtype, lse [Hq, Tq] float32, float64 for float64
    inputs). max_seqlen_* must be at least the longest segment (Python ints: the
    flash kernels size their grids with them). softmax_scale defaults to D ** -0.5.
    cu_seqlens values are validated when they live on the CPU; on a GPU that
    would cost a host sync, so the flash backends trust them. Where q, k or v
    require grad (and grad mode is on), out is differentiable: its backward is
    `varlen_backward` (lse is not differentiable), once: a second-order gradient
    raises, as it does through `sap_attention` and the baselines.
    """
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    scale = _call_scale(q, causal, softmax_scale)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    name = resolve_backend(backend, q.device, q.dtype, q.shape[2])
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, name)
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, name)


def _forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
             max_seqlen_k: int, causal: bool, scale: float, name: str) -> tuple[Tensor, Tensor]:
    """`varlen_forward` on checked inputs, with the backend resolved."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=accumulation_dtype(q), device=q.device)
        return torch.zeros_like(q), lse
    if name == "torch":
        return torch_backend.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=scale)
    return _flash_module(name).forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, softmax_scale=scale
    )


def first_order_only(backward: Callable) -> Callable:
    """`once_differentiable` for an attention backward, also where the incoming gradient
    does not require grad (a loss linear in the output): there `once_differentiable`
    returns the gradients as constants, though dq, dk and dv depend on q, k and v, and a
    gradient penalty would lose that term without an error. Under `create_graph` (grad
    mode on in the backward) the gradients are always marked, so differentiating them
    raises."""
    once = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def run(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():
            grads = tuple(g.detach().requires_grad_() if isinstance(g, Tensor) and g.is_floating_point()
                          and not g.requires_grad else g for g in grads)
        return once(ctx, *grads)

    return run


class _VarlenAttention(torch.autograd.Function):
    """`varlen_forward` for inputs that require grad: out's gradient by `varlen_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, name):
        out, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, name)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.call = (max_seqlen_q, max_seqlen_k, causal, scale, name)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @first_order_only  # the kernels' backward is not differentiable itself
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        max_seqlen_q, max_seqlen_k, causal, scale, name = ctx.call
        grads = varlen_backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, causal=causal, softmax_scale=scale, backend=name)
        return (*grads, None, None, None, None, None, None, None)


def varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv), in the input dtypes, of this call's attention given dout.

    out and lse may be the final results merged over several key blocks: the
    gradients are then this block's exact contribution (sum them over blocks).
    """
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(
            f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have q's shape {tuple(q.shape)}"
        )
    if dout.dtype != q.dtype or out.dtype != q.dtype:
        raise ValueError(f"dout and out must have q's dtype {q.dtype} (as the forward returns out), got {dout.dtype} and {out.dtype}")
    if lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse must be [Hq, Tq] = {(q.shape[1], q.shape[0])}, got {tuple(lse.shape)}")
    if lse.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"lse must be float32 or float64 (as the forward returns it), got {lse.dtype}")
    if not (dout.device == out.device == lse.device == q.device):
        raise ValueError(f"dout, out, lse must be on q's device {q.device}, got {dout.device}, {out.device}, {lse.device}")
    scale = _call_scale(q, causal, softmax_scale)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    name = resolve_backend(backend, q.device, q.dtype, q.shape[2])
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if name == "torch":
        return torch_backend.backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=scale
        )
    return _flash_module(name).backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal=causal, softmax_scale=scale,
    )
