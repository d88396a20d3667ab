"""Exact combination of attention results computed over disjoint key sets.

If (out_a, lse_a) is softmax attention over key set A and (out_b, lse_b) over a
disjoint set B, attention over A u B is

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

A row that saw no keys on one side has lse = -inf there and contributes
nothing; a row with no keys on either side stays out = 0, lse = -inf.

The weights are computed from the difference of the two lse, as sigmoid(lse_a - lse_b)
and sigmoid(lse_b - lse_a), not against the rounded merged lse: they then sum to 1
however large the lse (in float32, exp(lse_a - lse) + exp(lse_b - lse) is off by 2e-4
at |lse| = 1e4 and by a factor of 2 from about 2e7), as the kernels' own rescaling is.
"""
from __future__ import annotations

import torch
from torch import Tensor


def accumulation_dtype(*values: Tensor | torch.dtype) -> torch.dtype:
    """Dtype scores, lse and partial results are computed, merged and summed in: float64
    where any input (a tensor or a dtype) is, else float32."""
    dtypes = (v if isinstance(v, torch.dtype) else v.dtype for v in values)
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _weights(lse_a: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The two sides' weights [T, H, 1] for lse [H, T] (see the module docstring); 0 on
    rows with -inf on both sides (the difference is NaN there)."""
    diff = lse_a - lse_b
    return tuple(torch.sigmoid(d).nan_to_num_(0.0).transpose(0, 1).unsqueeze(-1) for d in (diff, -diff))


def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Merge in `dtype`; out [T, H, D], lse [H, T]. Returns (out, lse) in `dtype`."""
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    weight_a, weight_b = _weights(lse_a, lse_b)
    out = weight_a * out_a.to(dtype) + weight_b * out_b.to(dtype)
    return out, torch.logaddexp(lse_a, lse_b)


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial attention results over disjoint key sets.

    out_*: [T, H, D], lse_*: [H, T]. Computed in float32 (float64 when any input
    is float64). Returns out in out_a's dtype and lse in the computation dtype.
    Never produces NaN, also when lse is -inf on one or both sides.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(
            f"merge_partials: shapes differ: out {tuple(out_a.shape)} vs {tuple(out_b.shape)}, "
            f"lse {tuple(lse_a.shape)} vs {tuple(lse_b.shape)}"
        )
    if lse_a.shape != (out_a.shape[1], out_a.shape[0]):
        raise ValueError(
            f"merge_partials: lse must be [H, T] = {(out_a.shape[1], out_a.shape[0])} for out "
            f"{tuple(out_a.shape)}, got {tuple(lse_a.shape)}"
        )
    out, lse = _merge(out_a, lse_a, out_b, lse_b, accumulation_dtype(out_a, lse_a, out_b, lse_b))
    return out.to(out_a.dtype), lse


Rows = Tensor | slice | None  # all rows (None), one run of consecutive rows, or an index tensor


def take_rows(t: Tensor, rows: Rows, dim: int = 0) -> Tensor:
    """Rows `rows` of `t` along `dim`: all of them (None), a view (a slice of consecutive
    rows), or a gathered copy (an index tensor)."""
    if rows is None:
        return t
    if isinstance(rows, slice):
        return t[(slice(None),) * dim + (rows,)]
    return t.index_select(dim, rows)


def write_rows(t: Tensor, rows: Rows, values: Tensor, dim: int = 0) -> None:
    """Write `values` into rows `rows` of `t` along `dim`, in place (`take_rows`'s rows)."""
    if rows is None or isinstance(rows, slice):
        take_rows(t, rows, dim).copy_(values)
    else:
        t.index_copy_(dim, rows, values.to(t.dtype))


def add_rows(t: Tensor, rows: Rows, values: Tensor) -> None:
    """Add `values` to rows `rows` of `t` (dim 0), in place; the rows are distinct."""
    if rows is None or isinstance(rows, slice):
        take_rows(t, rows).add_(values)
    else:
        t.index_add_(0, rows, values.to(t.dtype))


def _num_rows(rows: Rows, total: int) -> int:
    if rows is None:
        return total
    if isinstance(rows, slice):
        return len(range(*rows.indices(total)))
    return rows.numel()


def merge_into(acc_out: Tensor, acc_lse: Tensor, rows: Rows, out_part: Tensor, lse_part: Tensor) -> None:
    """Merge a partial result for a subset of rows into running accumulators, in place.

    acc_out [T, H, D] and acc_lse [H, T] are floating accumulators (start them at
    0 and -inf); rows is a LongTensor of n distinct row indices, a slice of n
    consecutive rows or None for all T rows in order (those two merged in place,
    without gathering them); out_part is [n, H, D] and lse_part [H, n]. The merge
    runs in acc_out's dtype, so keeping the accumulators in float32 avoids rounding
    partial sums to bf16.
    """
    n = _num_rows(rows, acc_out.shape[0])
    if acc_out.dim() != 3 or acc_lse.shape != (acc_out.shape[1], acc_out.shape[0]):
        raise ValueError(f"merge_into: acc_lse must be [H, T] = {tuple(acc_out.shape[1::-1])} for acc_out "
                         f"{tuple(acc_out.shape)} [T, H, D], got {tuple(acc_lse.shape)}")
    bad_rows = (isinstance(rows, Tensor) and rows.dim() != 1) or (isinstance(rows, slice) and rows.step not in (None, 1))
    if bad_rows or out_part.shape != (n, *acc_out.shape[1:]) or lse_part.shape != (acc_lse.shape[0], n):
        shown = tuple(rows.shape) if isinstance(rows, Tensor) else rows
        raise ValueError(
            f"merge_into: rows {shown}, out_part {tuple(out_part.shape)} and "
            f"lse_part {tuple(lse_part.shape)} must describe the same n rows of acc_out {tuple(acc_out.shape)} "
            f"and acc_lse {tuple(acc_lse.shape)}"
        )
    if rows is None or isinstance(rows, slice):
        _merge_in_place(take_rows(acc_out, rows), take_rows(acc_lse, rows, dim=1), out_part, lse_part)
        return
    cur_out = acc_out.index_select(0, rows)
    cur_lse = acc_lse.index_select(1, rows)
    _merge_in_place(cur_out, cur_lse, out_part, lse_part)
    acc_out.index_copy_(0, rows, cur_out)
    acc_lse.index_copy_(1, rows, cur_lse)


def _merge_in_place(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """`_merge` into (out, lse) themselves, in their dtype: two passes over out (scale it, then
    add the weighted part), where building the merged tensor anew takes several."""
    lse_b = lse_b.to(lse.dtype)
    weight, weight_b = _weights(lse, lse_b)
    out.mul_(weight)
    out.addcmul_(out_b, weight_b)
    torch.logaddexp(lse, lse_b, out=lse)
