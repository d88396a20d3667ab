"""Input checks shared by the public entry points.

Every check raises ValueError naming the problem and the offending values, so that bad
input fails loudly at the entry point instead of producing a wrong answer or a hang.
"""
from __future__ import annotations

from typing import Sequence

import torch

INT32_MAX = 2**31 - 1


def cu_seqlens_to_list(cu_seqlens: Sequence[int] | torch.Tensor, name: str = "cu_seqlens") -> list[int]:
    """Validate cumulative sequence lengths and return them as a Python list.

    Valid: 1-D, integer, at least one entry, starts at 0, non-decreasing (zero-length
    documents are allowed), last entry below 2**31 (the kernels use int32 offsets).
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"{name} must have an integer dtype, got {cu_seqlens.dtype}")
        values = cu_seqlens.tolist()
    else:
        try:
            values = list(cu_seqlens)
        except TypeError:
            raise ValueError(f"{name} must be a 1-D sequence of integers, got {type(cu_seqlens).__name__}") from None
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) and not (hasattr(v, "__index__") and not isinstance(v, float)):
                raise ValueError(f"{name} must hold integers, got {v!r} ({type(v).__name__})")
        values = [int(v) for v in values]
    if not values:
        raise ValueError(f"{name} is empty; it needs at least [0]")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing, but {name}[{i}]={values[i]} < {name}[{i - 1}]={values[i - 1]}"
            )
    if values[-1] > INT32_MAX:
        raise ValueError(f"{name} total {values[-1]} is too large for int32 kernel offsets (max {INT32_MAX})")
    return values


def check_divisible(total: int, parts: int, what: str, by: str) -> int:
    """Return total // parts, or raise naming both sizes."""
    if parts <= 0:
        raise ValueError(f"{by} must be a positive integer, got {parts}")
    if total % parts:
        raise ValueError(f"{what} ({total}) must be divisible by {by} ({parts})")
    return total // parts
