"""Input checks shared by the public entry points.

Every check raises ValueError naming the problem and the offending values (TypeError where
attention's inputs are not tensors), so that bad input fails loudly at the entry point instead of
producing a wrong answer or a hang.
"""
from __future__ import annotations

import numbers
import operator
from typing import Sequence

import numpy as np
import torch

INT32_MAX = 2**31 - 1


def cu_seqlens_to_list(cu_seqlens: Sequence[int] | torch.Tensor, name: str = "cu_seqlens") -> list[int]:
    """Validate cumulative sequence lengths and return them as a Python list.

    Valid: 1-D, integer, at least one entry, starts at 0, non-decreasing (zero-length
    documents are allowed), last entry below 2**31 (the kernels use int32 offsets).
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.is_nested or cu_seqlens.layout != torch.strided:
            layout = "nested" if cu_seqlens.is_nested else str(cu_seqlens.layout).removeprefix("torch.")
            raise ValueError(f"{name} must be a dense 1-D tensor, got a {layout} tensor")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"{name} must have an integer dtype, got {cu_seqlens.dtype}")
        if cu_seqlens.is_meta:
            raise ValueError(f"{name} is a meta tensor: it has no values to plan from")
        values = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, np.ndarray) and cu_seqlens.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {cu_seqlens.shape}")
    elif isinstance(cu_seqlens, np.ndarray) and cu_seqlens.dtype.kind not in "iu":
        raise ValueError(f"{name} must have an integer dtype, got {cu_seqlens.dtype}")
    else:
        if not isinstance(cu_seqlens, (Sequence, np.ndarray)) or isinstance(cu_seqlens, (str, bytes)):
            raise ValueError(f"{name} must be a 1-D sequence of integers, got {type(cu_seqlens).__name__}")
        if isinstance(cu_seqlens, (list, tuple)) and all(type(v) is int for v in cu_seqlens):
            values = list(cu_seqlens)  # plain ints (the common case): nothing to convert
        else:
            values = [_integer(v, name) for v in cu_seqlens]
    if not values:
        raise ValueError(f"{name} is empty; it needs at least [0]")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if any(map(operator.lt, values[1:], values)):
        i = next(i for i in range(1, len(values)) if values[i] < values[i - 1])
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{i}]={values[i]} < {name}[{i - 1}]={values[i - 1]}"
        )
    if values[-1] > INT32_MAX:
        raise ValueError(f"{name} total {values[-1]} is too large for int32 kernel offsets (max {INT32_MAX})")
    return values


def _integer(value: object, name: str) -> int:
    """An entry of `name` as an int: integers only (Python, numpy, 0-d integer tensors), no
    bools or floats (which `int()` would truncate), no arrays or tensors of one element."""
    dtype = getattr(value, "dtype", None)
    if getattr(value, "ndim", 0) != 0:
        raise ValueError(f"{name} must hold integers, got an entry of shape {tuple(value.shape)}")
    if isinstance(value, (bool, np.bool_)) or dtype in (torch.bool, np.bool_):
        raise ValueError(f"{name} must hold integers, got {value!r} ({type(value).__name__})")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must hold integers, got {value!r} ({type(value).__name__})") from None


def is_positive_int(value: object) -> bool:
    """Whether `value` is a positive integer (numpy's too; no bools or floats, which would
    read as 1 or truncate)."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, numbers.Integral) and value >= 1


def _zero_dim_integer(value: object) -> object:
    """A 0-d integer (not bool) numpy array or tensor as a Python int; anything else as it is."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        return value.item()
    if (isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_meta
            and not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)):
        return int(value.item())
    return value


def positive_int(value: object, name: str) -> int:
    """`value` as an int, checked by `is_positive_int` (a 0-d integer array or tensor taken
    as its value, as `Plan`'s methods take ranks)."""
    number = _zero_dim_integer(value)
    if not is_positive_int(number):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(number)


def check_inner_chunks(value: object, recompute_kv: bool = False, name: str = "inner_chunks") -> int | str:
    """An `inner_chunks` value (`name` in errors, such as its flag): "auto", or a positive int
    (as an int) that, above 1, does not go with `recompute_kv` (each chunk would fetch the K/V again)."""
    if value == "auto":
        return "auto"
    if not is_positive_int(value):
        raise ValueError(f"{name} must be 'auto' or a positive int, got {value!r}")
    if value > 1 and recompute_kv:
        raise ValueError(f"inner_chunks={value} needs recompute_kv off (every chunk would fetch the K/V again)")
    return int(value)


def check_divisible(total: int, parts: int, what: str, by: str) -> None:
    """Raise, naming both sizes, unless `parts` (positive) divides `total`."""
    if total % parts:
        raise ValueError(f"{what} ({total}) must be divisible by {by} ({parts})")


def check_has_data(q: torch.Tensor) -> None:
    """q (and k, v, on its device, checked before) hold data: a meta tensor has a shape only."""
    if q.device.type == "meta":
        raise ValueError("q, k, v are meta tensors (shapes without data); attention needs real ones")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q [tokens, Hq, D] and k/v [tokens, Hkv, D]: one dtype and device, k and v alike, a
    positive head_dim shared by all, query heads a multiple of key/value heads."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [tokens, heads, head_dim], got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_has_data(q)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k/v must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    if q.shape[2] == 0:
        raise ValueError(f"head_dim must be positive, got shape {tuple(q.shape)}")
    if q.shape[1] == 0 or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


def check_bool(value: object, name: str) -> bool:
    """`value`, checked to be True or False: a flag such as the string "no" would read as True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value
