"""Varlen attention in plain PyTorch: tiled, vectorised, bounded memory, CPU or GPU.

The query rows of a call are cut into tiles of block_q rows and the key rows
into tiles of block_k rows, by default regardless of segment boundaries, so a
batch of thousands of one-token documents costs a handful of tiles rather than
a Python loop over documents. Tile sizes are powers of two from 16 to 128, near
the length of the segment an average token belongs to: short documents get
small tiles, which wastes less work on masked scores. Where those tiles would
still compute over 1/8 more scores than the rows see (segments of a few hundred
rows, which tiles of 128 straddle), those sizes and smaller equal ones are
weighed, each with the rows one after another or with every segment starting a
tile of its own (padding slots at each segment's end, as flash kernels tile
segments), and the layout that computes the call fastest by a per-tile overhead
is taken.

Query row i of segment s may see the key interval [lo_i, hi_i): the keys of
segment s, cut by the bottom-right causal bound when causal. Both ends are
non-decreasing in i, which makes a tile's keys one contiguous span and lets the
non-empty (q tile, k tile) pairs be found with searchsorted. Pairs are
processed in chunks of bounded size (never a score matrix bigger than
CHUNK_SCORES elements), with masking by the per-row key interval and
online-softmax accumulation per q tile. The pair metadata of a call is kept in
a small LRU cache: every layer repeats the same boundaries.

Heads stay grouped for GQA: a q tile is laid out [Hkv, G * block_q, D] so one
matmul against a k tile [Hkv, block_k, D] serves all G query heads of a
key/value head without repeating K or V.

Arithmetic is float32 (float64 for float64 inputs, exact to ~1e-12). On the
CPU the backward is deterministic (index_add_ runs sequentially there).

Non-finite inputs stay inside their document, as with the flash kernels. Tiles
span documents and a hidden key gets probability 0, but 0 * NaN is NaN, so a
NaN or Inf in one document's q, k or v (or the backward's dout, out, lse) would
reach every row sharing a tile. Each call therefore first sums its inputs (one
cheap reduction per tensor); only when the total is not finite does it take the
exact path: compute on copies with NaN/Inf replaced by 0, which leaves every
result that does not depend on a bad value bitwise as it would be with any
finite value there, then set to NaN the results that do depend on one (found
from the per-row key intervals with prefix sums): in the forward, the out and
lse of rows that hold a bad q or see a bad key, and out[:, d] of rows that see
a bad v[:, d]; in the backward, likewise through dS and P (_backward_poison).
That is where flash gives NaN or Inf, except that a row whose score with an
Inf key is -inf, which flash treats as a hidden key, is marked NaN too. Finite
inputs never take that path and give the same results, bitwise, as without it.
Finite inputs so large that a score overflows to +-Inf keep it inside their
document too: a hidden score is -inf whatever the product was. So do a dout and
v so large that dout . v could overflow in the backward: a hidden pair's dS is
then set to 0 (which a visible pair whose probability underflowed to 0 gets too,
where flash would give NaN if its dout . v overflowed).

On a GPU that check is a host sync, like the plan lookup (which reads
cu_seqlens on the host): this backend is a fallback there, the flash backends
are the fast path.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .merge import accumulation_dtype

MIN_BLOCK, MAX_BLOCK = 16, 128
BLOCK_CHOICES = (32, 64)  # smaller equal tile sizes weighed beside the typical-segment ones (`_choose_blocks`)
# What a kept tile pair costs beyond its scores, in scores: fitted on this backend on the CPU (one
# thread, 8 query / 4 KV heads, head dim 32): 32-, 64- and 128-row tiles took about 25, 21 and 19 ns
# per score, forward and backward, on causal calls that mask almost nothing.
TILE_OVERHEAD_SCORES = 512
CHUNK_SCORES = 1 << 22  # score elements (pairs * Hq * block_q * block_k) per chunk
PLAN_CACHE_SIZE = 32


def check_cu_seqlens(cu: Tensor, total: int, name: str) -> int:
    """Raise ValueError unless `cu` (on the CPU) starts at 0, never decreases and ends at
    `total`; return its longest segment."""
    if cu.numel() == 0:
        raise ValueError(f"{name} must hold at least one entry (0), got an empty tensor")
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    steps = torch.diff(cu.long())
    if bool((steps < 0).any()):
        at = int(torch.nonzero(steps < 0)[0, 0])
        raise ValueError(f"{name} must be non-decreasing, but {name}[{at}]={int(cu[at])} > {name}[{at + 1}]={int(cu[at + 1])}")
    if int(cu[-1]) != total:
        raise ValueError(f"{name} must end at the number of tokens {total}, got {int(cu[-1])}")
    return int(steps.max()) if len(steps) else 0


@dataclass(frozen=True)
class _TilePlan:
    """Which (q tile, k tile) pairs to compute, in what order, and each query row's visible keys.

    q tiles are handled in "compute order": by decreasing number of k tiles.
    table[i, s] is the s-th k tile of the q tile at compute position i, so the
    q tiles that have an s-th k tile form a prefix of the compute order and a
    chunk of work is a rectangle of the table: accumulators are updated through
    slices, not scatters. Entries past a tile's count hold the dummy tile
    n_k_tiles, whose keys lie beyond every row's visible interval.

    Rows lie in their tiles one after another (row i at slot i), or, where each
    segment starts a tile of its own (`q_slots`, `k_slots`: the slot of every row),
    with padding slots at each segment's end; row_lo and row_hi are in key slots.
    """

    block_q: int
    block_k: int
    n_q_tiles: int
    n_k_tiles: int
    q_slots: Tensor | None  # [total_q] int64: the slot of each query row; None: row i at slot i
    k_slots: Tensor | None  # [total_k] int64: likewise for the keys
    order: Tensor  # [n_q_tiles] int64: q tile at each compute position
    inverse: Tensor  # [n_q_tiles] int64: compute position of each q tile
    lo: Tensor  # [total_q] int64: first key row each query row sees
    hi: Tensor  # [total_q] int64: end (exclusive) of that key interval
    row_lo: Tensor  # [n_q_tiles, block_q] int64, compute order: first key row each query row sees
    row_hi: Tensor  # [n_q_tiles, block_q] int64, compute order: end (exclusive) of that key interval
    table: Tensor  # [n_q_tiles, n_steps] int64, compute order: k tiles of each q tile
    active: list[int]  # active[s]: how many q tiles have an s-th k tile


def _block_size(lengths: Tensor) -> int:
    """Power of two in [MIN_BLOCK, MAX_BLOCK] near the length of the segment of an average token."""
    typical = float((lengths.double() ** 2).sum() / lengths.sum().clamp_min(1))
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << max(0, int(typical) - 1).bit_length()))


def _tile_pairs(lo: Tensor, hi: Tensor, n_q_tiles: int, block_q: int, block_k: int) -> tuple[Tensor, Tensor]:
    """(q tile, k tile) of every pair where some query row sees some key; `lo` and `hi`
    are the rows' key intervals, padded to n_q_tiles * block_q rows."""
    # Candidate pairs: every k tile overlapping the key span of the q tile.
    span_lo, span_hi = lo.view(n_q_tiles, block_q)[:, 0], hi.view(n_q_tiles, block_q)[:, -1]
    first_k = span_lo // block_k
    count = torch.where(span_hi > span_lo, (span_hi - 1) // block_k - first_k + 1, 0)
    pair_q = torch.repeat_interleave(torch.arange(n_q_tiles), count)
    pair_k = first_k[pair_q] + torch.arange(pair_q.numel()) - (torch.cumsum(count, 0) - count)[pair_q]

    # Keep a pair only if some row of the q tile sees some key of the k tile:
    # rows in [first_row, end_row) have hi > tile start and lo < tile end.
    first_row = torch.searchsorted(hi, pair_k * block_k, right=True)
    end_row = torch.searchsorted(lo, (pair_k + 1) * block_k)
    keep = torch.maximum(first_row, pair_q * block_q) < torch.minimum(end_row, (pair_q + 1) * block_q)
    return pair_q[keep], pair_k[keep]


def _segment_slots(cu: Tensor, block: int) -> tuple[int, Tensor]:
    """(tiles, slot of each row) when every segment starts a tile of its own."""
    lengths = torch.diff(cu)
    tiles = -(-lengths // block)
    first_tile = torch.cumsum(tiles, 0) - tiles
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    rows = torch.arange(int(cu[-1]))
    return int(tiles.sum()), first_tile[seg] * block + rows - cu[seg]


def _slot_intervals(lo: Tensor, hi: Tensor, q_slots: Tensor | None, k_slots: Tensor | None, n_q_tiles: int,
                    block_q: int, total_k: int) -> tuple[Tensor, Tensor]:
    """Each query slot's key interval in key slots; a padding slot sees nothing (an empty
    interval where the row before it ends, so that both ends stay non-decreasing)."""
    if k_slots is not None:
        end = torch.cat([k_slots + 1, k_slots.new_tensor([int(k_slots[-1]) + 1 if total_k else 0])])
        start = torch.cat([k_slots, end[-1:]])
        lo, hi = start[lo], torch.where(hi > lo, end[hi - 1], start[lo])
    slots = n_q_tiles * block_q
    if q_slots is None:
        padding = torch.full((slots - lo.numel(),), total_k, dtype=torch.int64)
        return torch.cat([lo, padding]), torch.cat([hi, padding])
    slot_hi = torch.full((slots,), -1, dtype=torch.int64).index_copy_(0, q_slots, hi)
    slot_hi = torch.cummax(slot_hi.clamp_min(0), 0).values  # padding: the hi of the row before it
    slot_lo = slot_hi.clone().index_copy_(0, q_slots, lo)
    return slot_lo, slot_hi


def _choose_blocks(lo: Tensor, hi: Tensor, cu_q: Tensor, cu_k: Tensor) -> tuple:
    """The tile layout for a call: tiles near each side's typical segment (`_block_size`),
    rows one after another, unless those tiles compute over 1/8 more scores than the rows
    see; then, of those sizes and the smaller equal ones of BLOCK_CHOICES, each with rows one
    after another or each segment starting a tile of its own, the layout that computes the
    call fastest, each kept (q tile, k tile) pair costing its block_q * block_k scores plus
    TILE_OVERHEAD_SCORES. Tiles over segment boundaries compute masked scores, so a call of
    many short segments (a rank's pieces of several documents) runs fastest on smaller or
    segment-aligned tiles. Returns (block_q, block_k, n_q_tiles, n_k_tiles, q_slots, k_slots,
    slot_lo, slot_hi, pair_q, pair_k)."""
    typical = (_block_size(torch.diff(cu_q)), _block_size(torch.diff(cu_k)))
    visible = int((hi - lo).sum())
    sizes = [typical] + [(b, b) for b in BLOCK_CHOICES if b < max(typical)]
    best, best_cost = None, None
    for (block_q, block_k), aligned in [(size, False) for size in sizes] + [(size, True) for size in sizes]:
        layout = _tile_layout(lo, hi, cu_q, cu_k, block_q, block_k, aligned)
        pairs = layout[-1].numel()
        cost = pairs * (block_q * block_k + TILE_OVERHEAD_SCORES)
        if best is None or cost < best_cost:
            best, best_cost = layout, cost
        if (block_q, block_k) == typical and not aligned and 8 * pairs * block_q * block_k <= 9 * visible:
            break  # little masked: keep them
    return best


def _tile_layout(lo: Tensor, hi: Tensor, cu_q: Tensor, cu_k: Tensor, block_q: int, block_k: int, aligned: bool) -> tuple:
    """`_choose_blocks`'s result for these tile sizes, rows one after another or (`aligned`)
    each segment starting a tile of its own."""
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    if aligned:
        (n_q_tiles, q_slots), (n_k_tiles, k_slots) = _segment_slots(cu_q, block_q), _segment_slots(cu_k, block_k)
    else:
        n_q_tiles, n_k_tiles, q_slots, k_slots = -(-total_q // block_q), -(-total_k // block_k), None, None
    slot_lo, slot_hi = _slot_intervals(lo, hi, q_slots, k_slots, n_q_tiles, block_q, total_k)
    pair_q, pair_k = _tile_pairs(slot_lo, slot_hi, n_q_tiles, block_q, block_k)
    return block_q, block_k, n_q_tiles, n_k_tiles, q_slots, k_slots, slot_lo, slot_hi, pair_q, pair_k


def _build_plan(cu_q: Tensor, cu_k: Tensor, causal: bool, total_q: int, total_k: int, device: torch.device) -> _TilePlan:
    check_cu_seqlens(cu_q, total_q, "cu_seqlens_q")
    check_cu_seqlens(cu_k, total_k, "cu_seqlens_k")
    len_q, len_k = torch.diff(cu_q), torch.diff(cu_k)
    seg = torch.repeat_interleave(torch.arange(len_q.numel()), len_q)
    lo = cu_k[seg]
    hi = cu_k[seg + 1]
    if causal:
        pos = torch.arange(total_q) - cu_q[seg]
        hi = torch.maximum(torch.minimum(hi, lo + pos + (len_k - len_q)[seg] + 1), lo)
    rows_lo, rows_hi = lo, hi
    block_q, block_k, n_q_tiles, n_k_tiles, q_slots, k_slots, lo, hi, pair_q, pair_k = _choose_blocks(lo, hi, cu_q, cu_k)

    count = torch.bincount(pair_q, minlength=n_q_tiles)
    order = torch.argsort(count, descending=True, stable=True)
    inverse = torch.argsort(order)
    n_steps = int(count.max())
    table = torch.full((n_q_tiles, n_steps), n_k_tiles, dtype=torch.int64)
    table[inverse[pair_q], torch.arange(pair_q.numel()) - (torch.cumsum(count, 0) - count)[pair_q]] = pair_k
    active = n_q_tiles - torch.cumsum(torch.bincount(count, minlength=n_steps + 1), 0)[:n_steps]

    return _TilePlan(
        block_q=block_q,
        block_k=block_k,
        n_q_tiles=n_q_tiles,
        n_k_tiles=n_k_tiles,
        q_slots=None if q_slots is None else q_slots.to(device),
        k_slots=None if k_slots is None else k_slots.to(device),
        order=order.to(device),
        inverse=inverse.to(device),
        lo=rows_lo.to(device),
        hi=rows_hi.to(device),
        row_lo=lo.view(n_q_tiles, block_q)[order].to(device),
        row_hi=hi.view(n_q_tiles, block_q)[order].to(device),
        table=table.to(device),
        active=active.tolist(),
    )


_plans: OrderedDict[tuple, _TilePlan] = OrderedDict()


def _plan(cu_q: Tensor, cu_k: Tensor, causal: bool, total_q: int, total_k: int, device: torch.device) -> _TilePlan:
    """The tile plan for these boundaries, from a small LRU cache (layers repeat the same shapes)."""
    cu_q, cu_k = cu_q.detach().to("cpu", torch.int64), cu_k.detach().to("cpu", torch.int64)
    key = (cu_q.numpy().tobytes(), cu_k.numpy().tobytes(), causal, total_q, total_k, str(device))
    plan = _plans.get(key)
    if plan is None:
        plan = _build_plan(cu_q, cu_k, causal, total_q, total_k, device)
        _plans[key] = plan
        if len(_plans) > PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    return plan


def _chunks(plan: _TilePlan, heads_q: int) -> Iterator[tuple[int, int, Tensor]]:
    """Yield (start, end, k tiles [end - start, W]): rectangles of the table of at most a chunk's pairs.

    Where few q tiles are active, a chunk takes W > 1 steps at once, as long as
    at least 3/4 of its rows are still active at its last step (bounded padding).
    """
    per_chunk = max(1, CHUNK_SCORES // (heads_q * plan.block_q * plan.block_k))
    active, n_steps = plan.active, len(plan.active)
    step = 0
    while step < n_steps:
        n_active = active[step]
        width = 1
        while (
            step + width < n_steps
            and n_active * (width + 1) <= per_chunk
            and 4 * active[step + width] >= 3 * n_active
        ):
            width += 1
        for start in range(0, n_active, per_chunk):
            end = min(n_active, start + per_chunk)
            yield start, end, plan.table[start:end, step : step + width]
        step += width


def _q_tiles(x: Tensor, plan: _TilePlan, heads_kv: int, dtype: torch.dtype, fill: float = 0.0) -> Tensor:
    """[Tq, Hq, *rest] -> [n_q_tiles, Hkv, G * block_q, *rest] in compute order.

    Row g * block_q + r of a tile is query row r for head g of the key/value head's group.
    """
    total, heads_q, *rest = x.shape
    groups = heads_q // heads_kv
    padded = x.new_full((plan.n_q_tiles * plan.block_q, heads_q, *rest), fill, dtype=dtype)
    if plan.q_slots is None:
        padded[:total] = x
    else:
        padded.index_copy_(0, plan.q_slots, x.to(dtype))
    tiles = padded.view(plan.n_q_tiles, plan.block_q, heads_kv, groups, *rest).movedim(1, 3)
    return tiles.reshape(plan.n_q_tiles, heads_kv, groups * plan.block_q, *rest).index_select(0, plan.order)


def _q_rows(tiles: Tensor, plan: _TilePlan, total: int, heads_q: int) -> Tensor:
    """Inverse of _q_tiles: [n_q_tiles, Hkv, G * block_q, *rest] in compute order -> [total, Hq, *rest]."""
    n_tiles, heads_kv, _, *rest = tiles.shape
    tiles = tiles.index_select(0, plan.inverse).view(n_tiles, heads_kv, heads_q // heads_kv, plan.block_q, *rest)
    rows = tiles.movedim(3, 1).reshape(n_tiles * plan.block_q, heads_q, *rest)
    return rows[:total] if plan.q_slots is None else rows.index_select(0, plan.q_slots)


def _k_tiles(x: Tensor, plan: _TilePlan, dtype: torch.dtype) -> Tensor:
    """[Tk, Hkv, D] -> [n_k_tiles + 1, Hkv, block_k, D], zero padded; the last tile is the dummy."""
    total, heads_kv, dim = x.shape
    padded = x.new_zeros(((plan.n_k_tiles + 1) * plan.block_k, heads_kv, dim), dtype=dtype)
    if plan.k_slots is None:
        padded[:total] = x
    else:
        padded.index_copy_(0, plan.k_slots, x.to(dtype))
    return padded.view(plan.n_k_tiles + 1, plan.block_k, heads_kv, dim).transpose(1, 2).contiguous()


def _k_rows(tiles: Tensor, plan: _TilePlan, total: int) -> Tensor:
    """Inverse of _k_tiles."""
    n_tiles, heads_kv, block_k, dim = tiles.shape
    rows = tiles.transpose(1, 2).reshape(n_tiles * block_k, heads_kv, dim)
    return rows[:total] if plan.k_slots is None else rows.index_select(0, plan.k_slots)


def _gather_keys(tiles: Tensor, k_idx: Tensor) -> Tensor:
    """k tiles [n, W] -> keys [n, Hkv, W * block_k, D] (a view, no copy, when W == 1)."""
    n, width = k_idx.shape
    _, heads_kv, block_k, dim = tiles.shape
    gathered = tiles.index_select(0, k_idx.reshape(-1))
    if width == 1:
        return gathered
    return gathered.view(n, width, heads_kv, block_k, dim).transpose(1, 2).reshape(n, heads_kv, width * block_k, dim)


def _scatter_keys(tiles: Tensor, k_idx: Tensor, grads: Tensor) -> None:
    """Add grads [n, Hkv, W * block_k, D] into tiles [n_k_tiles + 1, Hkv, block_k, D] at k_idx [n, W]."""
    n, width = k_idx.shape
    _, heads_kv, block_k, dim = tiles.shape
    if width > 1:
        grads = grads.view(n, heads_kv, width, block_k, dim).transpose(1, 2).reshape(n * width, heads_kv, block_k, dim)
    tiles.index_add_(0, k_idx.reshape(-1), grads)


def _masked_scores(plan: _TilePlan, start: int, end: int, q_c: Tensor, k_c: Tensor, k_idx: Tensor,
                   overflow: bool) -> Tensor:
    """Scores [n, Hkv, G * block_q, W * block_k] of compute positions [start, end), -inf where a
    key is hidden; `overflow`: a score may overflow (`_could_overflow` of the call's q and k)."""
    n, heads_kv, rows, _ = q_c.shape
    scores = torch.matmul(q_c, k_c.transpose(-1, -2))
    key = (k_idx[:, :, None] * plan.block_k + torch.arange(plan.block_k, device=k_idx.device)).view(n, 1, -1)
    lo, hi = plan.row_lo[start:end, :, None], plan.row_hi[start:end, :, None]  # [n, block_q, 1]
    bias = torch.where((key < lo) | (key >= hi), float("-inf"), 0.0).to(scores.dtype)
    # Adding a 0/-inf bias is several times faster than masked_fill_ on the CPU. A score that
    # overflowed to +inf (finite but huge q and k) gives NaN where hidden: hidden it stays. Where
    # no score can overflow there is no NaN, and that pass is left out (4% of a forward and
    # backward on the CPU: 543 against 565 ms, a 4,096-token row, 8 query heads of 32).
    scores.view(n, heads_kv, rows // plan.block_q, plan.block_q, -1).add_(bias[:, None, None])
    if not overflow:
        return scores
    return scores.nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def _any_nonfinite(dtype: torch.dtype, *tensors: Tensor) -> Tensor:
    """0-dim bool: whether the tensors hold a NaN or Inf, from their sums (a finite total may
    overflow only if the values are huge; the exact path then runs needlessly, still correct)."""
    return ~torch.isfinite(torch.stack([t.sum(dtype=dtype) for t in tensors]).sum())


def _sanitise_(*tensors: Tensor) -> None:
    """Replace NaN and +-Inf by 0 in place (the exact path's operand copies)."""
    for t in tensors:
        t.nan_to_num_(0.0, 0.0, 0.0)


def _could_overflow(dout: Tensor, v: Tensor, dtype: torch.dtype) -> bool:
    """Whether some dout . v (or delta = dout . out, out an average of v's rows; or a score
    q . k) could reach the largest float of `dtype`: 2 * head_dim * max|dout| * max|v|
    (finite inputs)."""
    if dout.numel() == 0 or v.numel() == 0:
        return False
    bound = 2.0 * dout.shape[-1] * dout.abs().amax().double() * v.abs().amax().double()
    return bool(bound >= torch.finfo(dtype).max)


def _nonfinite_rows(x: Tensor) -> Tensor:
    """[T, H, D] -> [T, H] bool: the row holds a NaN or Inf."""
    return ~torch.isfinite(x).all(-1)


def _sees(plan: _TilePlan, keys: Tensor, heads_q: int) -> Tensor:
    """Flags per key [Tk, Hkv, *rest] -> [Tq, Hq, *rest]: the query row sees a flagged key of its head."""
    counts = torch.cat([keys.new_zeros((1, *keys.shape[1:]), dtype=torch.int64), keys.cumsum(0)])
    seen = counts[plan.hi] > counts[plan.lo]
    return seen.repeat_interleave(heads_q // keys.shape[1], dim=1)


def _seen_by(plan: _TilePlan, rows: Tensor, total_k: int, heads_kv: int) -> Tensor:
    """Flags per query row [Tq, Hq, *rest] -> [Tk, Hkv, *rest]: a flagged row of the head's group sees the key."""
    total_q, heads_q, *rest = rows.shape
    flags = rows.reshape(total_q, heads_kv, heads_q // heads_kv, *rest).any(2).long()
    edges = flags.new_zeros((total_k + 1, heads_kv, *rest))
    edges.index_add_(0, plan.lo, flags).index_add_(0, plan.hi, -flags)
    return edges.cumsum(0)[:total_k] > 0


def _forward_poison(plan: _TilePlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Which forward results depend on a NaN or Inf: (rows [Tq, Hq] for out and lse, elements [Tq, Hq, D] of out).

    A bad q row or a bad key spoils the row's scores, hence its whole output and
    lse (a row without keys computes nothing); a bad v element only that column.
    """
    heads_q = q.shape[1]
    rows = (_nonfinite_rows(q) & (plan.hi > plan.lo)[:, None]) | _sees(plan, _nonfinite_rows(k), heads_q)
    return rows, rows[..., None] | _sees(plan, ~torch.isfinite(v), heads_q)


def _backward_poison(
    plan: _TilePlan, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, delta: Tensor, lse_nan: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Which gradients depend on a NaN or Inf: dq rows [Tq, Hq], dk rows [Tk, Hkv], dv elements [Tk, Hkv, D].

    With P = exp(S - lse), dS = P * (dout @ V^T - delta) over the visible pairs:
    P[i, j] is bad where row i's q or lse is, or key j is; dS[i, j] also where
    row i's dout or delta is, or v row j is. dq[i] sums dS[i, :] @ K, dk[j] sums
    dS[:, j] @ Q (a bad element of either makes its dS bad anyway), and
    dv[j, d] sums P[:, j] * dout[:, d].
    """
    total_k, heads_kv, _ = k.shape
    heads_q = q.shape[1]
    bad_k, bad_v, bad_dout = _nonfinite_rows(k), _nonfinite_rows(v), ~torch.isfinite(dout)
    sees_keys = (plan.hi > plan.lo)[:, None]
    rows_p = (_nonfinite_rows(q) | lse_nan) & sees_keys
    rows_ds = rows_p | ((bad_dout.any(-1) | ~torch.isfinite(delta)) & sees_keys)
    seen = _seen_by(plan, sees_keys, total_k, 1)  # [Tk, 1]: some query row sees the key
    dq = rows_ds | _sees(plan, bad_k | bad_v, heads_q)
    dk = _seen_by(plan, rows_ds, total_k, heads_kv) | (seen & (bad_k | bad_v))
    dv = (_seen_by(plan, rows_p, total_k, heads_kv) | (seen & bad_k))[..., None]
    return dq, dk, dv | _seen_by(plan, bad_dout, total_k, heads_kv)


def forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *, causal: bool, softmax_scale: float
) -> tuple[Tensor, Tensor]:
    """Varlen attention forward; returns (out [Tq, Hq, D] in q.dtype, lse [Hq, Tq] in the compute dtype)."""
    total_q, heads_q, _ = q.shape
    heads_kv = k.shape[1]
    dtype = accumulation_dtype(q)
    plan = _plan(cu_seqlens_q, cu_seqlens_k, causal, total_q, k.shape[0], q.device)
    exact = bool(_any_nonfinite(dtype, q, k, v))

    q_t = _q_tiles(q, plan, heads_kv, dtype).mul_(softmax_scale)
    k_t, v_t = _k_tiles(k, plan, dtype), _k_tiles(v, plan, dtype)
    if exact:
        _sanitise_(q_t, k_t, v_t)
    overflow = _could_overflow(q_t, k_t, dtype)
    row_max = torch.full(q_t.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
    row_sum = torch.zeros_like(row_max)
    acc = torch.zeros_like(q_t)

    for start, end, k_idx in _chunks(plan, heads_q):
        scores = _masked_scores(plan, start, end, q_t[start:end], _gather_keys(k_t, k_idx), k_idx, overflow)
        old_max = row_max[start:end]
        new_max = torch.maximum(old_max, scores.amax(-1))
        ref_max = torch.where(new_max == float("-inf"), 0.0, new_max)  # rows that have seen nothing yet
        probs = torch.exp_(scores.sub_(ref_max.unsqueeze(-1)))
        rescale = torch.exp(old_max - ref_max)
        row_sum[start:end].mul_(rescale).add_(probs.sum(-1))
        acc[start:end].mul_(rescale.unsqueeze(-1)).add_(torch.matmul(probs, _gather_keys(v_t, k_idx)))
        old_max.copy_(new_max)

    seen = row_sum > 0
    lse = torch.where(seen, row_max + torch.log(row_sum), float("-inf"))
    out = acc.div_(torch.where(seen, row_sum, 1.0).unsqueeze(-1))
    out, lse = _q_rows(out, plan, total_q, heads_q).to(q.dtype), _q_rows(lse, plan, total_q, heads_q).T.contiguous()
    if exact:
        bad_rows, bad_out = _forward_poison(plan, q, k, v)
        out.masked_fill_(bad_out, float("nan"))
        lse.masked_fill_(bad_rows.T, float("nan"))
    return out, lse


def backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    softmax_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Varlen attention backward against the given (possibly merged) out and lse; returns dq, dk, dv."""
    total_q, heads_q, _ = q.shape
    total_k, heads_kv, _ = k.shape
    dtype = accumulation_dtype(q)
    plan = _plan(cu_seqlens_q, cu_seqlens_k, causal, total_q, total_k, q.device)

    delta = (dout.to(dtype) * out.to(dtype)).sum(-1)  # not finite wherever dout or out is not
    lse_nan = torch.isnan(lse.T)
    exact = bool(_any_nonfinite(dtype, q, k, v, delta) | lse_nan.any())
    if exact:
        poison = _backward_poison(plan, q, k, v, dout, delta, lse_nan)
        delta = torch.where(torch.isfinite(delta), delta, 0.0)

    q_t = _q_tiles(q, plan, heads_kv, dtype).mul_(softmax_scale)  # scaled q also gives dk its scale
    dout_t = _q_tiles(dout, plan, heads_kv, dtype)
    delta_t = _q_tiles(delta, plan, heads_kv, dtype)
    # A row that saw no keys has lse = -inf; +inf makes its probabilities exp(s - inf) = 0. So does a NaN lse
    # (exact path only), whose row's gradients are set to NaN at the end.
    lse = torch.where((lse == float("-inf")) | torch.isnan(lse), float("inf"), lse.to(dtype))
    lse_t = _q_tiles(lse.T, plan, heads_kv, dtype, fill=float("inf"))
    k_t, v_t = _k_tiles(k, plan, dtype), _k_tiles(v, plan, dtype)
    if exact:
        _sanitise_(q_t, dout_t, k_t, v_t)
    # dS = P * (dout . v - delta) is 0 for a hidden pair, unless dout . v overflows there (finite
    # but huge dout or v in another document): 0 * inf is NaN, which would reach the other
    # document's dq and dk. Where |dout . v| and |delta| (out is an average of v) could reach
    # the largest float, hidden pairs' dS is set to 0 (`_could_overflow`).
    guard = _could_overflow(dout_t, v_t, dtype)
    overflow = _could_overflow(q_t, k_t, dtype)
    dq_t, dk_t, dv_t = torch.zeros_like(q_t), torch.zeros_like(k_t), torch.zeros_like(v_t)

    for start, end, k_idx in _chunks(plan, heads_q):
        q_c, dout_c = q_t[start:end], dout_t[start:end]
        k_c, v_c = _gather_keys(k_t, k_idx), _gather_keys(v_t, k_idx)
        scores = _masked_scores(plan, start, end, q_c, k_c, k_idx, overflow)
        probs = torch.exp_(scores.sub_(lse_t[start:end].unsqueeze(-1)))
        _scatter_keys(dv_t, k_idx, torch.matmul(probs.transpose(-1, -2), dout_c))
        dscores = torch.matmul(dout_c, v_c.transpose(-1, -2))
        dscores.sub_(delta_t[start:end].unsqueeze(-1)).mul_(probs)
        if guard:
            dscores.masked_fill_(probs == 0, 0.0)
        dq_t[start:end].add_(torch.matmul(dscores, k_c))
        _scatter_keys(dk_t, k_idx, torch.matmul(dscores.transpose(-1, -2), q_c))

    dq = _q_rows(dq_t.mul_(softmax_scale), plan, total_q, heads_q).to(q.dtype)
    dk, dv = _k_rows(dk_t, plan, total_k).to(k.dtype), _k_rows(dv_t, plan, total_k).to(v.dtype)
    if exact:
        for grad, bad in zip((dq, dk, dv), poison):
            grad.masked_fill_(bad if bad.dim() == 3 else bad[..., None], float("nan"))
    return dq, dk, dv
