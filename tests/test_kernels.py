"""Varlen attention kernels against the dense float64 reference, on random packed batches."""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from megatron_sap.kernels import (
    add_rows,
    available_backends,
    merge_into,
    merge_partials,
    resolve_backend,
    take_rows,
    torch_backend,
    varlen_backward,
    varlen_forward,
    write_rows,
)
from megatron_sap.reference import dense_attention

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}

# Document lengths of the packed test batches (zeros are empty documents).
LENGTHS = {
    "tiny_docs": [1, 0, 2, 1, 1, 3, 0, 1] * 150,
    "mixed": [5, 0, 130, 1, 300, 0, 0, 64, 2, 257, 1, 40],
    "long": [3, 1500, 0, 7],
}


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _random(total: int, heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(total, heads, dim, generator=gen, dtype=torch.float64).to(dtype)


def _reference(q, k, v, cu, dout, *, causal, scale):
    """Dense float64 (out, lse, dq, dk, dv) for q, k, v sharing the boundaries cu."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = dense_attention(*leaves, cu, causal=causal, softmax_scale=scale)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return (out.detach(), lse.detach(), *grads)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize(
    "case, dtype, causal, heads, scale",
    [
        ("tiny_docs", torch.float64, True, (4, 2), None),
        ("mixed", torch.float64, True, (4, 1), 0.3),
        ("mixed", torch.float64, False, (3, 3), None),
        ("long", torch.float64, True, (2, 2), None),
        ("long", torch.float64, False, (4, 2), 1.1),
        ("tiny_docs", torch.float32, False, (2, 2), None),
        ("mixed", torch.float32, True, (4, 2), None),
        ("long", torch.float32, True, (4, 2), 0.05),
        ("mixed", torch.bfloat16, True, (4, 2), None),
    ],
)
def test_matches_dense_reference(case, dtype, causal, heads, scale):
    lengths = LENGTHS[case]
    heads_q, heads_kv = heads
    cu, total, dim = _cu(lengths), sum(lengths), 16
    gen = torch.Generator().manual_seed(len(lengths) * 31 + heads_q)
    q, k, v = (_random(total, h, dim, dtype, gen) for h in (heads_q, heads_kv, heads_kv))
    dout = _random(total, heads_q, dim, dtype, gen)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _reference(q, k, v, cu, dout, causal=causal, scale=scale)

    out, lse = varlen_forward(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal, softmax_scale=scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.shape == (heads_q, total) and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _close(out, ref_out, dtype, "out")
    _close(lse, ref_lse, dtype, "lse")

    # The backward is given the reference's out and lse, as the executor gives it merged ones.
    grads = varlen_backward(
        dout, q, k, v, ref_out.to(dtype), ref_lse, cu, cu, max(lengths), max(lengths), causal=causal, softmax_scale=scale
    )
    for name, got, want, like in zip(("dq", "dk", "dv"), grads, (ref_dq, ref_dk, ref_dv), (q, k, v)):
        assert got.dtype == dtype and got.shape == like.shape
        _close(got, want, dtype, name)


@pytest.mark.parametrize("case", ["long", "mixed"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_results_are_rounded_once(case, causal, dtype):
    """The torch backend computes and sums in float32 and rounds each result once: out, dq,
    dk and dv (its own out and lse fed back) are within one rounding step of the float64
    reference at their largest magnitude (measured: up to 0.75 of a step; summing the
    backward in the input dtype gave up to 3.6 steps), lse (float32) within 1e-5."""
    lengths = LENGTHS[case]
    cu, total, longest = _cu(lengths), sum(lengths), max(lengths)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (_random(total, h, 16, dtype, gen) for h in (4, 2, 2))
    dout = _random(total, 4, 16, dtype, gen)
    out, lse = varlen_forward(q, k, v, cu, cu, longest, longest, causal=causal, backend="torch")
    grads = varlen_backward(dout, q, k, v, out, lse, cu, cu, longest, longest, causal=causal, backend="torch")
    expected = _reference(q, k, v, cu, dout, causal=causal, scale=None)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), expected):
        largest = want.abs().max().item()
        error = (got.double() - want).abs().max().item() / largest
        step = 1e-5 if name == "lse" else 2.0 ** math.floor(math.log2(largest)) * torch.finfo(dtype).eps / largest
        assert error <= step, (name, error, step)


def rounding_ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    """The RMS error of `got` against the float64 `want` over that of `want` rounded once to
    `got`'s dtype: 1 for a result rounded once, more for one rounded along the way."""
    once = want.to(got.dtype).double() - want
    return ((got.double() - want).norm() / once.norm()).item()


def test_long_rows_are_summed_in_float32_over_the_chunks():
    """A 3,000-token bf16 document runs in dozens of chunks of tile pairs: the gradients
    summed over them in float32 and rounded once come within 1.1x the RMS error of the float64
    reference rounded once (measured: out and dv 1.000, dk 1.05, dq 1.09); rounding dq's
    accumulator to bf16 after each chunk gave 1.44, which the test's 1.25 catches (the
    largest error in steps, as above, did not move)."""
    cu, total = _cu([3000]), 3000
    gen = torch.Generator().manual_seed(7)
    q, k, v = (_random(total, h, 16, torch.bfloat16, gen) for h in (4, 2, 2))
    dout = _random(total, 4, 16, torch.bfloat16, gen)
    out, lse = varlen_forward(q, k, v, cu, cu, total, total, causal=True, backend="torch")
    grads = varlen_backward(dout, q, k, v, out, lse, cu, cu, total, total, causal=True, backend="torch")
    expected = _reference(q, k, v, cu, dout, causal=True, scale=None)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (expected[0], *expected[2:])):
        assert rounding_ratio(got, want) <= 1.25, (name, rounding_ratio(got, want))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forward_on_inputs_that_require_grad_is_differentiable(causal, dtype):
    """q, k, v that require grad: out.backward gives the dense reference's gradients (by
    varlen_backward), lse carries none; under no_grad nothing is recorded."""
    lengths = LENGTHS["mixed"]
    cu, total, dim = _cu(lengths), sum(lengths), 16
    gen = torch.Generator().manual_seed(7)
    q, k, v = (_random(total, h, dim, dtype, gen).requires_grad_() for h in (4, 2, 2))
    dout = _random(total, 4, dim, dtype, gen)
    ref_out, _, *ref_grads = _reference(q, k, v, cu, dout, causal=causal, scale=None)

    out, lse = varlen_forward(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)
    assert out.requires_grad and not lse.requires_grad
    out.backward(dout)
    _close(out.detach(), ref_out, dtype, "out")
    for name, leaf, want in zip(("dq", "dk", "dv"), (q, k, v), ref_grads):
        _close(leaf.grad, want, dtype, name)
    with torch.no_grad():
        out, lse = varlen_forward(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)
    assert not out.requires_grad and out.grad_fn is None


def _split_documents(lengths, gen):
    """Cut each document into key parts [0, a), [a, s) and a query tail [s, L) (any part may be empty)."""
    parts = []
    for length in lengths:
        s = int(torch.randint(0, length + 1, (), generator=gen))
        a = int(torch.randint(0, s + 1, (), generator=gen))
        parts.append((a, s, length))
    return parts


def _rows(cu: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Packed row indices of span [lo, hi) of every document."""
    return torch.cat([torch.arange(int(cu[i]) + lo, int(cu[i]) + hi) for i, (lo, hi) in enumerate(spans)])


@pytest.mark.parametrize("dtype, heads", [(torch.float64, (4, 2)), (torch.float32, (2, 2))])
def test_key_blocks_merge_to_the_whole(dtype, heads):
    """Tail queries of each document against its keys split in three blocks (two full, one diagonal).

    Merging the partial (out, lse) must give the dense result, and each block's
    backward run with the merged out/lse must give exactly its share of the gradients.
    """
    heads_q, heads_kv = heads
    gen = torch.Generator().manual_seed(7)
    lengths = [1, 0, 90, 3, 600, 17, 0, 250, 1, 2]
    parts = _split_documents(lengths, gen)
    cu, total, dim, scale = _cu(lengths), sum(lengths), 8, 0.4
    q, k, v = (_random(total, h, dim, dtype, gen) for h in (heads_q, heads_kv, heads_kv))
    tail = _rows(cu, [(s, n) for _, s, n in parts])
    dout = torch.zeros(total, heads_q, dim, dtype=dtype)
    dout[tail] = _random(len(tail), heads_q, dim, dtype, gen)  # only tail queries feed the loss
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _reference(q, k, v, cu, dout, causal=True, scale=scale)

    cu_tail = _cu([n - s for _, s, n in parts])
    blocks = [  # (key spans per document, causal)
        ([(0, a) for a, _, _ in parts], False),
        ([(a, s) for a, s, _ in parts], False),
        ([(s, n) for _, s, n in parts], True),
    ]
    qt, dout_t = q[tail], dout[tail]
    results = []
    for spans, causal in blocks:
        keys = _rows(cu, spans)
        cu_k = _cu([hi - lo for lo, hi in spans])
        out, lse = varlen_forward(qt, k[keys], v[keys], cu_tail, cu_k, total, total, causal=causal, softmax_scale=scale)
        results.append((keys, cu_k, causal, out, lse))

    out, lse = results[0][3], results[0][4]
    for *_, out_b, lse_b in results[1:]:
        out, lse = merge_partials(out, lse, out_b, lse_b)
    _close(out, ref_out[tail], dtype, "merged out")
    _close(lse, ref_lse[:, tail], dtype, "merged lse")

    dq = torch.zeros_like(qt, dtype=torch.float64)
    dk, dv = torch.zeros(total, heads_kv, dim, dtype=torch.float64), torch.zeros(total, heads_kv, dim, dtype=torch.float64)
    for keys, cu_k, causal, _, _ in results:
        dq_b, dk_b, dv_b = varlen_backward(
            dout_t, qt, k[keys], v[keys], out, lse, cu_tail, cu_k, total, total, causal=causal, softmax_scale=scale
        )
        dq += dq_b.double()
        dk[keys] += dk_b.double()
        dv[keys] += dv_b.double()
    _close(dq, ref_dq[tail], dtype, "summed dq")
    _close(dk, ref_dk, dtype, "dk")
    _close(dv, ref_dv, dtype, "dv")


def test_arguments_take_flash_attns_order_and_causal_defaults_to_false():
    """(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale) positionally, as
    flash_attn_varlen_func takes them; without `causal` the blocks are full."""
    gen = torch.Generator().manual_seed(5)
    cu = _cu([5, 9])
    q, k, v = (_random(14, 2, 8, torch.float64, gen) for _ in range(3))
    out, lse = varlen_forward(q, k, v, cu, cu, 9, 9, True, 0.3)
    ref_out, ref_lse = dense_attention(q, k, v, cu, causal=True, softmax_scale=0.3)
    _close(out, ref_out, torch.float64, "positional out")
    _close(lse, ref_lse, torch.float64, "positional lse")
    full, _ = varlen_forward(q, k, v, cu, cu, 9, 9)
    _close(full, dense_attention(q, k, v, cu, causal=False)[0], torch.float64, "default full")
    grads = varlen_backward(torch.ones_like(out), q, k, v, out, lse, cu, cu, 9, 9, True, 0.3)
    keyword = varlen_backward(torch.ones_like(out), q, k, v, out, lse, cu, cu, 9, 9, causal=True, softmax_scale=0.3)
    for a, b in zip(grads, keyword):
        assert torch.equal(a, b)


def test_bottom_right_causal_alignment():
    """causal with len_q < len_k: the queries are the document's tail; len_q > len_k: leading rows see nothing."""
    gen = torch.Generator().manual_seed(3)
    lengths, tails = [40, 7, 300, 1, 0], [10, 7, 129, 0, 0]
    cu, total = _cu(lengths), sum(lengths)
    q, k, v = (_random(total, 2, 8, torch.float64, gen) for _ in range(3))
    ref_out, ref_lse = dense_attention(q, k, v, cu, causal=True)
    rows = _rows(cu, [(n - t, n) for n, t in zip(lengths, tails)])
    out, lse = varlen_forward(q[rows], k, v, _cu(tails), cu, 300, 300, causal=True)
    _close(out, ref_out[rows], torch.float64, "tail out")
    _close(lse, ref_lse[:, rows], torch.float64, "tail lse")

    # Swap roles: queries of whole documents against keys of their tails only.
    # Query i sees key j iff j <= i - (len_q - len_k): the first len_q - len_k rows see nothing.
    out, lse = varlen_forward(q, k[rows], v[rows], cu, _cu(tails), 300, 300, causal=True)
    blind = _rows(cu, [(0, n - t) for n, t in zip(lengths, tails)])
    assert torch.all(out[blind] == 0) and torch.all(lse[:, blind] == float("-inf"))
    sighted = _rows(cu, [(n - t, n) for n, t in zip(lengths, tails)])
    ref_out, ref_lse = dense_attention(q[sighted], k[rows], v[rows], _cu(tails), causal=True)
    _close(out[sighted], ref_out, torch.float64, "sighted out")
    _close(lse[:, sighted], ref_lse, torch.float64, "sighted lse")
    grads = varlen_backward(torch.ones_like(out), q, k[rows], v[rows], out, lse, cu, _cu(tails), 300, 300, causal=True)
    assert not any(torch.isnan(g).any() for g in grads)
    assert torch.all(grads[0][blind] == 0)


def test_rows_without_keys_are_zero_and_never_nan():
    gen = torch.Generator().manual_seed(5)
    cu_q, cu_k = _cu([3, 2, 4]), _cu([0, 5, 0])  # documents 0 and 2 have queries but no keys
    q = _random(9, 4, 8, torch.float32, gen)
    k, v = _random(5, 2, 8, torch.float32, gen), _random(5, 2, 8, torch.float32, gen)
    out, lse = varlen_forward(q, k, v, cu_q, cu_k, 4, 5, causal=False)
    blind = torch.tensor([0, 1, 2, 5, 6, 7, 8])
    assert torch.all(out[blind] == 0) and torch.all(lse[:, blind] == float("-inf"))

    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    merged_out, merged_lse = merge_partials(out, lse, empty_out, empty_lse)
    assert torch.equal(merged_out, out) and torch.equal(merged_lse, lse)
    both_out, both_lse = merge_partials(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.all(both_out == 0) and torch.all(both_lse == float("-inf"))

    dq, dk, dv = varlen_backward(torch.ones_like(out), q, k, v, out, lse, cu_q, cu_k, 4, 5, causal=False)
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))
    assert torch.all(dq[blind] == 0)

    # A NaN query in a row that sees no key computes nothing: still 0 and -inf, as the
    # rows that see keys stay those of the clean run. Causal too, where the first rows of a
    # document with fewer keys than queries see none (bottom-right alignment).
    poisoned = q.clone()
    poisoned[0, 0, 0] = poisoned[6, 3, 5] = float("nan")
    bad_out, bad_lse = varlen_forward(poisoned, k, v, cu_q, cu_k, 4, 5, causal=False)
    assert torch.all(bad_out[blind] == 0) and torch.all(bad_lse[:, blind] == float("-inf"))
    assert torch.equal(bad_out[3:5], out[3:5]) and torch.equal(bad_lse[:, 3:5], lse[:, 3:5])
    bad_out, bad_lse = varlen_forward(poisoned[:5], k[:2], v[:2], _cu([5]), _cu([2]), 5, 2, causal=True)
    assert torch.all(bad_out[:3] == 0) and torch.all(bad_lse[:, :3] == float("-inf"))
    assert torch.isfinite(bad_out[3:]).all() and torch.isfinite(bad_lse[:, 3:]).all()

    # No keys at all, and no queries at all.
    out, lse = varlen_forward(q, k[:0], v[:0], cu_q, _cu([0, 0, 0]), 4, 0, causal=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    out, lse = varlen_forward(q[:0], k, v, _cu([0, 0, 0]), cu_k, 0, 5, causal=True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)


def test_merge_into_accumulates_like_merge_partials():
    gen = torch.Generator().manual_seed(11)
    total, heads, dim = 50, 3, 4
    parts = [(_random(total, heads, dim, torch.float32, gen), torch.randn(heads, total, generator=gen)) for _ in range(3)]
    parts[1][1][:, :10] = float("-inf")
    expected_out, expected_lse = parts[0]
    for out_b, lse_b in parts[1:]:
        expected_out, expected_lse = merge_partials(expected_out, expected_lse, out_b, lse_b)

    acc_out = torch.zeros(total, heads, dim)
    acc_lse = torch.full((heads, total), float("-inf"))
    for out_b, lse_b in parts:
        rows = torch.randperm(total, generator=gen)
        merge_into(acc_out, acc_lse, rows, out_b[rows], lse_b[:, rows])
    torch.testing.assert_close(acc_out, expected_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(acc_lse, expected_lse, atol=1e-6, rtol=1e-6)


def test_rows_as_a_slice_act_like_their_index_tensor():
    """`take_rows`, `write_rows`, `add_rows` and `merge_into` give the same results for rows as a
    slice (a view, nothing gathered) as for the same rows as an index tensor, and change no other row."""
    gen = torch.Generator().manual_seed(5)
    total, heads, dim = 20, 3, 4
    part = slice(6, 13)
    index = torch.arange(part.start, part.stop)
    base_out, base_lse = _random(total, heads, dim, torch.float32, gen), torch.randn(heads, total, generator=gen)
    out_b, lse_b = _random(7, heads, dim, torch.float32, gen), torch.randn(heads, 7, generator=gen)
    lse_b[:, :2] = float("-inf")
    assert torch.equal(take_rows(base_out, part), base_out.index_select(0, index))
    assert torch.equal(take_rows(base_lse, part, dim=1), base_lse.index_select(1, index))
    assert take_rows(base_out, part).data_ptr() == base_out[part.start].data_ptr()  # a view
    assert torch.equal(take_rows(base_out, slice(-3, None)), base_out[-3:])  # any slice, as Python reads it
    results = []
    for rows in (part, index):
        out, lse = base_out.clone(), base_lse.clone()
        merge_into(out, lse, rows, out_b, lse_b)
        grads, written = torch.zeros(total, heads, dim, dtype=torch.float64), torch.zeros(heads, total)
        add_rows(grads, rows, out_b)
        add_rows(grads, rows, out_b)
        write_rows(written, rows, lse_b, dim=1)
        results.append((out, lse, grads, written))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    out, lse, grads, written = results[0]
    outside = torch.ones(total, dtype=torch.bool)
    outside[part] = False
    assert torch.equal(out[outside], base_out[outside]) and torch.equal(lse[:, outside], base_lse[:, outside])
    assert torch.all(grads[outside] == 0) and torch.all(written[:, outside] == 0)
    torch.testing.assert_close(grads[part], 2 * out_b.double())


def test_long_segment_memory_is_bounded():
    """The tail of a 64K-token document against all its keys, without a [Tq, Tk] score matrix.

    A dense implementation would allocate 512 x 65536 floats per head (128 MiB); the
    tiled one must stay within its chunk budget. The profiler reports the memory each
    op allocates.
    """
    length, n_queries, dim = 65536, 512, 16
    gen = torch.Generator().manual_seed(13)
    q = _random(n_queries, 2, dim, torch.float32, gen)
    k, v = _random(length, 1, dim, torch.float32, gen), _random(length, 1, dim, torch.float32, gen)
    cu_q, cu_k = _cu([n_queries]), _cu([length])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out, lse = varlen_forward(q, k, v, cu_q, cu_k, n_queries, length, causal=True)
        dq, dk, dv = varlen_backward(torch.ones_like(out), q, k, v, out, lse, cu_q, cu_k, n_queries, length, causal=True)
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert largest < 32 * 2**20, f"an op allocated {largest / 2**20:.0f} MiB"

    # Spot-check the last query (sees every key) and the first (sees all but the last 511).
    for row, visible in ((n_queries - 1, length), (0, length - n_queries + 1)):
        scores = torch.einsum("hd,td->ht", q[row].double(), k[:visible, 0].double()) / math.sqrt(dim)
        expected = torch.softmax(scores, -1) @ v[:visible, 0].double()
        torch.testing.assert_close(out[row].double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, row].double(), torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))


def _exact_reference(q, k, v, cu, dout, *, causal, scale):
    """Float64 (out, lse, dq, dk, dv), row by row over exactly the keys each row sees.

    No product with a hidden key is ever formed (as in the flash kernels), so a NaN
    or Inf reaches exactly the results that depend on it. Shared boundaries cu.
    """
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for doc in range(cu.numel() - 1):
        start, end = int(cu[doc]), int(cu[doc + 1])
        for row in range(start, end):
            stop = row + 1 if causal else end
            keys, values = (t[start:stop].repeat_interleave(groups, 1) for t in (k64, v64))
            scores = torch.einsum("hd,nhd->hn", q64[row], keys) * scale
            outs.append(torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), values))
            lses.append(torch.logsumexp(scores, -1))
    out, lse = torch.stack(outs), torch.stack(lses, 1)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return (out.detach(), lse.detach(), *grads)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("aligned", [False, True], ids=["chosen_tiles", "segments_aligned"])
def test_nonfinite_values_stay_in_their_document(monkeypatch, causal, where, value, aligned):
    """A NaN/Inf in one document: other documents' out, lse, dq, dk, dv are bitwise those of a clean run.

    Tiles span documents and 0 * NaN is NaN, so without care one bad token would
    spoil every row sharing a tile. Inside the bad document, results are
    non-finite at least where the row-by-row float64 reference is, and every
    finite one is bitwise the clean run's. Forward rows go non-finite exactly
    when they see the bad key (or hold the bad query). Also with every document
    starting a tile of its own (padding slots between them).
    """
    if aligned:
        monkeypatch.setattr(torch_backend, "_choose_blocks",
                            lambda lo, hi, cu_q, cu_k: torch_backend._tile_layout(lo, hi, cu_q, cu_k, 16, 16, True))
    torch_backend._plans.clear()
    heads_q, heads_kv, dim, scale = 4, 2, 8, 0.3
    for batch, dtype in enumerate((torch.float32, torch.float64)):
        gen = torch.Generator().manual_seed(1000 * batch + 100 * causal + 10 * "qkvd".index(where[0]) + int(value > 0))
        lengths = torch.randint(0, 30, (9,), generator=gen)
        lengths[torch.randint(0, 9, (2,), generator=gen)] = 0  # a few empty documents
        lengths[0] = max(int(lengths[0]), 1)
        cu, total = _cu(lengths.tolist()), int(lengths.sum())
        clean = {
            "q": _random(total, heads_q, dim, dtype, gen),
            "k": _random(total, heads_kv, dim, dtype, gen),
            "v": _random(total, heads_kv, dim, dtype, gen),
            "dout": _random(total, heads_q, dim, dtype, gen),
        }
        nonempty = torch.nonzero(lengths).flatten()
        doc = int(nonempty[torch.randint(0, len(nonempty), (), generator=gen)])
        row = int(cu[doc]) + int(torch.randint(0, int(lengths[doc]), (), generator=gen))
        head = int(torch.randint(0, clean[where].shape[1], (), generator=gen))
        col = int(torch.randint(0, dim, (), generator=gen))
        bad = dict(clean, **{where: clean[where].clone()})
        bad[where][row, head, col] = value

        def run(t):
            out, lse = varlen_forward(t["q"], t["k"], t["v"], cu, cu, 30, 30, causal=causal, softmax_scale=scale)
            grads = varlen_backward(
                t["dout"], t["q"], t["k"], t["v"], out, lse, cu, cu, 30, 30, causal=causal, softmax_scale=scale
            )
            return {"out": out, "lse": lse.T, "dq": grads[0], "dk": grads[1], "dv": grads[2]}

        want, got = run(clean), run(bad)
        ref = dict(zip(("out", "lse", "dq", "dk", "dv"), _exact_reference(**bad, cu=cu, causal=causal, scale=scale)))
        ref["lse"] = ref["lse"].T
        inside = torch.zeros(total, dtype=torch.bool)
        inside[int(cu[doc]) : int(cu[doc + 1])] = True
        for name, result in got.items():  # every tensor is [tokens, heads(, dim)]; q and k share cu
            what = f"{dtype} batch {batch}: {name}"
            assert torch.equal(result[~inside], want[name][~inside]), f"{what} changed outside the bad document"
            finite = torch.isfinite(result)
            assert torch.equal(result[finite], want[name][finite]), f"{what}: finite results differ from the clean run"
            assert not (finite & ~torch.isfinite(ref[name])).any(), f"{what}: finite where the reference is not"

        # Forward rows that are non-finite: those that see the bad key, or the bad query row itself.
        position = torch.arange(total)
        sees = inside & (position >= row if causal else inside)
        expected = {"q": position == row, "k": sees, "v": sees, "dout": torch.zeros(total, dtype=torch.bool)}[where]
        assert torch.equal(~torch.isfinite(got["out"]).all(-1).all(-1), expected), f"{dtype} batch {batch}: out rows"
        lse_expected = expected if where in ("q", "k") else torch.zeros(total, dtype=torch.bool)
        assert torch.equal(~torch.isfinite(got["lse"]).all(-1), lse_expected), f"{dtype} batch {batch}: lse rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("where", ["k", "v", "dout"])
def test_products_that_overflow_stay_in_their_document(where, causal, dtype):
    """Finite inputs so large that a product overflows to +-Inf: a score (huge k), or the
    backward's dout . v (huge v, or huge dout) for pairs across documents. The documents
    sharing its tiles are bitwise as with a modest value there (+Inf plus the hidden key's
    -Inf, or a hidden pair's probability 0 times Inf, would be NaN)."""
    gen = torch.Generator().manual_seed(23 + causal)
    cu = _cu([5, 6, 3])
    clean = dict(zip(("q", "k", "v", "dout"), (_random(14, heads, 16, torch.float32, gen).to(dtype) for heads in (4, 2, 2, 4))))
    clean["q"] = clean["q"].abs()
    huge = dict(clean, **{where: clean[where].clone()})
    huge[where][2] = 3e38 if where != "k" else 1e38  # in document 0
    runs = []
    for t in (clean, huge):
        out, lse = varlen_forward(t["q"], t["k"], t["v"], cu, cu, 6, 6, causal=causal)
        runs.append((out, lse.T, *varlen_backward(t["dout"], t["q"], t["k"], t["v"], out, lse, cu, cu, 6, 6, causal=causal)))
    for name, want, got in zip(("out", "lse", "dq", "dk", "dv"), *runs):
        assert torch.equal(got[5:], want[5:]), f"{name} changed outside document 0"
    if where == "k":
        assert not torch.isfinite(runs[1][0][2:5]).all()  # inside, rows that see the key overflow


def test_backward_is_deterministic_on_cpu():
    gen = torch.Generator().manual_seed(17)
    lengths = [200, 3, 1, 90]
    cu, total = _cu(lengths), sum(lengths)
    q, k, v, dout = (_random(total, 2, 8, torch.float32, gen) for _ in range(4))
    out, lse = varlen_forward(q, k, v, cu, cu, 200, 200, causal=True)
    first = varlen_backward(dout, q, k, v, out, lse, cu, cu, 200, 200, causal=True)
    second = varlen_backward(dout, q, k, v, out, lse, cu, cu, 200, 200, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def _computed_scores(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool) -> tuple[int, int, tuple[int, int]]:
    """(scores the torch backend's tiles compute, scores the rows see, tile sizes) of one call."""
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    plan = torch_backend._build_plan(cu_q.long(), cu_k.long(), causal, total_q, total_k, torch.device("cpu"))
    return sum(plan.active) * plan.block_q * plan.block_k, int((plan.hi - plan.lo).sum()), (plan.block_q, plan.block_k)


def test_segments_that_tiles_straddle_get_smaller_or_aligned_tiles():
    """Segments of a few hundred rows (a rank's pieces of several documents) straddle tiles
    of 128, their typical size, which then compute 2.3x (causal) and 1.5x (full blocks) the
    scores the rows see: smaller tiles, each segment starting one of its own, compute far
    fewer. Long segments keep large tiles over rows one after another."""
    pieces = _cu([200, 300, 150, 400, 250, 180, 320, 248])
    computed, visible, blocks = _computed_scores(pieces, pieces, causal=True)
    assert computed < 1.5 * visible
    keys = _cu([700, 1000, 450, 1200, 900, 500, 1100, 800])  # full blocks: each piece over its earlier keys
    computed, visible, blocks = _computed_scores(pieces, keys, causal=False)
    assert computed < 1.2 * visible
    long = _cu([3000, 5000])
    assert _computed_scores(long, long, causal=True)[2] == (128, 128)
    assert torch_backend._build_plan(long.long(), long.long(), True, 8000, 8000, torch.device("cpu")).q_slots is None


@pytest.mark.parametrize("aligned", [False, True], ids=["rows_in_a_row", "segments_aligned"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("blocks", [(16, 16), (32, 32), (64, 64), (128, 128), (16, 128), (128, 32)])
def test_every_tile_layout_matches_the_dense_reference(monkeypatch, causal, blocks, aligned):
    """The result does not depend on the tile layout a call is computed in: each tile size,
    rows one after another or each segment starting a tile, on query boundaries that differ
    from the key ones (each segment's queries the last rows of its document, bottom-right
    causal), against the float64 reference of the whole documents."""
    monkeypatch.setattr(torch_backend, "_choose_blocks",
                        lambda lo, hi, cu_q, cu_k: torch_backend._tile_layout(lo, hi, cu_q, cu_k, *blocks, aligned))
    torch_backend._plans.clear()
    gen = torch.Generator().manual_seed(sum(blocks) + causal)
    len_q, len_k = [37, 0, 150, 1, 90, 64, 0], [80, 3, 150, 9, 200, 64, 5]
    cu_q, cu_k = _cu(len_q), _cu(len_k)
    rows = torch.cat([torch.arange(int(end) - n, int(end)) for n, end in zip(len_q, cu_k[1:])])
    q_all = _random(sum(len_k), 4, 8, torch.float64, gen)
    k, v = (_random(sum(len_k), 2, 8, torch.float64, gen) for _ in range(2))
    dout = _random(sum(len_q), 4, 8, torch.float64, gen)
    leaves = [t.clone().requires_grad_() for t in (q_all, k, v)]
    ref_out, ref_lse = dense_attention(*leaves, cu_k, causal=causal)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref_out[rows], leaves, dout)
    q = q_all[rows]
    out, lse = varlen_forward(q, k, v, cu_q, cu_k, max(len_q), max(len_k), causal=causal)
    plan = next(reversed(torch_backend._plans.values()))
    assert (plan.block_q, plan.block_k, plan.q_slots is not None) == (*blocks, aligned)
    grads = varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(len_q), max(len_k), causal=causal)
    wanted = (ref_out[rows], ref_lse[:, rows], ref_dq[rows], ref_dk, ref_dv)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), wanted):
        _close(got, want.detach(), torch.float64, name)
    torch_backend._plans.clear()


def test_plan_cache_is_bounded():
    """More distinct batches than the cache holds: it keeps the most recent ones, evicting
    the oldest first, and a hit moves a plan to the back."""
    torch_backend._plans.clear()
    size = torch_backend.PLAN_CACHE_SIZE
    tokens = size + 8
    q = torch.randn(tokens, 1, 4)

    def run(n: int) -> None:
        cu = torch.tensor([0, n + 1, tokens], dtype=torch.int32)
        varlen_forward(q, q, q, cu, cu, tokens, tokens, causal=True)

    for n in range(size):
        run(n)
    assert len(torch_backend._plans) == size
    oldest = next(iter(torch_backend._plans))
    run(0)  # a hit: the first batch's plan is now the most recent
    assert next(iter(torch_backend._plans)) != oldest
    for n in range(size, size + 5):
        run(n)
    assert len(torch_backend._plans) == size
    keys = list(torch_backend._plans)
    run(0)  # still held after five evictions, thanks to the hit: nothing planned anew
    assert set(torch_backend._plans) == set(keys)
    run(1)  # evicted (the oldest once the first batch was hit): planned again, at the back
    assert len(torch_backend._plans) == size and list(torch_backend._plans)[-1] not in keys
    torch_backend._plans.clear()


def test_backend_resolution():
    assert available_backends("cpu") == ["torch"]
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "torch"
    assert resolve_backend("torch", "cpu", torch.float64) == "torch"
    with pytest.raises(ValueError, match="'flash-attn' is not available on cpu; available: \\['torch'\\]"):
        resolve_backend("flash-attn", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'.*'torch'"):
        resolve_backend("xformers", "cpu", torch.float32)
    if torch.cuda.is_available():
        assert "aten-flash" in available_backends("cuda")
        assert resolve_backend("auto", "cuda", torch.bfloat16) in ("flash-attn", "aten-flash")
        assert resolve_backend("auto", "cuda", torch.float32) == "torch"


def test_backend_resolution_weighs_the_head_dim(monkeypatch):
    """Where a flash backend is available, "auto" takes it only for head dims the flash
    kernels run (a multiple of 8, at most 256), and an explicit flash backend refuses
    the others before any kernel runs."""
    import megatron_sap.kernels as kernels

    monkeypatch.setattr(kernels, "available_backends", lambda device=None: ["aten-flash", "torch"])
    assert resolve_backend("auto", "cpu", torch.bfloat16, head_dim=128) == "aten-flash"
    assert resolve_backend("auto", "cpu", torch.bfloat16, head_dim=100) == "torch"
    assert resolve_backend("auto", "cpu", torch.bfloat16, head_dim=512) == "torch"
    with pytest.raises(ValueError, match=r"head_dim % 8 == 0 and head_dim <= 256, got 100"):
        resolve_backend("aten-flash", "cpu", torch.bfloat16, head_dim=100)


@pytest.mark.parametrize("capability, wide_heads", [((8, 0), True), ((9, 0), True), ((8, 6), False), ((8, 9), False),
                                                    ((10, 0), False)])
def test_flash_backends_refuse_head_dims_their_backward_refuses_on_the_gpu(monkeypatch, capability, wide_heads):
    """The flash kernels' backward takes head dims 200-224 on sm80 and sm90 GPUs only (it
    raises elsewhere, after the forward ran): "auto" takes the torch backend there, and a
    named flash backend refuses at once; 192 and 256 (without dropout) run everywhere."""
    import megatron_sap.kernels as kernels

    monkeypatch.setattr(kernels, "available_backends", lambda device=None: ["flash-attn", "aten-flash", "torch"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    for head_dim in (192, 256):
        assert resolve_backend("auto", "cuda", torch.bfloat16, head_dim=head_dim) == "flash-attn"
    for head_dim in (200, 224):
        assert resolve_backend("auto", "cuda", torch.bfloat16, head_dim=head_dim) == ("flash-attn" if wide_heads else "torch")
        if wide_heads:
            assert resolve_backend("aten-flash", "cuda", torch.bfloat16, head_dim=head_dim) == "aten-flash"
        else:
            with pytest.raises(ValueError, match=rf"head_dim 200..224 on sm80/sm90 GPUs only, got {head_dim} on "
                                                 rf"sm{capability[0]}{capability[1]}"):
                resolve_backend("aten-flash", "cuda", torch.bfloat16, head_dim=head_dim)


@pytest.mark.parametrize("hip", [None, "6.2.41133"])
def test_flash_backends_are_offered_on_nvidia_gpus_only(monkeypatch, hip):
    """ROCm builds run other kernels behind the same calls, unchecked against this
    package's conventions (rows without keys, causal alignment): only "torch" there."""
    import megatron_sap.kernels as kernels

    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4) if hip else (9, 0))
    monkeypatch.setattr(kernels.aten_flash, "built", lambda device: True)
    monkeypatch.setattr(kernels, "_flash_attn_importable", lambda: True)
    assert available_backends("cuda") == (["torch"] if hip else ["flash-attn", "aten-flash", "torch"])


def test_flash_kernels_are_probed_where_torch_has_no_query(monkeypatch):
    """torch 2.4 has no torch.backends.cuda.is_flash_attention_available: a tiny call tells
    whether the kernels run on the device (on the CPU, which has none, they do not)."""
    from megatron_sap.kernels import aten_flash

    monkeypatch.delattr(torch.backends.cuda, "is_flash_attention_available", raising=False)
    aten_flash._runs_on.cache_clear()
    assert aten_flash.built(torch.device("cpu")) is False
    monkeypatch.setattr(aten_flash, "_kernel_forward", lambda *args: None)  # a build whose kernels run
    aten_flash._runs_on.cache_clear()
    assert aten_flash.built(torch.device("cpu")) is True
    aten_flash._runs_on.cache_clear()


def _bad_inputs():
    q, kv = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    cu = _cu([2, 4])
    yield "multiple of key/value heads", dict(k=torch.randn(6, 3, 8), v=torch.randn(6, 3, 8))
    yield "must share a dtype", dict(q=q.double())
    yield "same head_dim", dict(k=torch.randn(6, 2, 4), v=torch.randn(6, 2, 4))
    yield "k and v must have the same shape", dict(v=torch.randn(5, 2, 8))
    yield "tokens, heads, head_dim", dict(q=q[0])
    yield "1-D int32/int64", dict(cu_q=cu.float())
    yield "1-D int32/int64", dict(cu_q=cu[None])
    yield "must start at 0", dict(cu_q=torch.tensor([1, 2, 6], dtype=torch.int32))
    yield "non-decreasing", dict(cu_k=torch.tensor([0, 4, 3, 6], dtype=torch.int32), cu_q=_cu([2, 2, 2]))
    yield "end at the number of tokens 6, got 5", dict(cu_k=torch.tensor([0, 2, 5], dtype=torch.int32))
    yield "same number of segments, got 2 and 3", dict(cu_k=_cu([2, 2, 2]))
    yield "must be on one device, got \\['cpu', 'meta'\\]", dict(k=kv.to("meta"), v=kv.to("meta"))


@pytest.mark.parametrize("message, change", list(_bad_inputs()), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs_raise_clear_errors(message, change):
    args = dict(q=torch.randn(6, 4, 8), k=torch.randn(6, 2, 8), v=torch.randn(6, 2, 8), cu_q=_cu([2, 4]), cu_k=_cu([2, 4]))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        varlen_forward(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"], 4, 4, causal=True)


def test_backward_checks_out_and_lse_shapes():
    q, kv, cu = torch.randn(6, 4, 8), torch.randn(6, 2, 8), _cu([2, 4])
    with pytest.raises(ValueError, match="lse must be \\[Hq, Tq\\] = \\(4, 6\\), got \\(6, 4\\)"):
        varlen_backward(q, q, kv, kv, q, torch.zeros(6, 4), cu, cu, 4, 4, causal=True)
    with pytest.raises(ValueError, match="must have q's shape"):
        varlen_backward(q[:5], q, kv, kv, q, torch.zeros(4, 6), cu, cu, 4, 4, causal=True)


def test_flash_lse_layout_round_trip():
    """The flash backends' lse conversions (pure tensor ops, so checked here on the CPU)."""
    from megatron_sap.kernels.aten_flash import lse_for_kernel, lse_rows

    cu = _cu([3, 0, 1, 4])
    lse = torch.randn(2, 8)
    lse[1, 3] = float("-inf")  # a row without keys
    padded = lse_for_kernel(lse, cu, 5, padded=True)
    assert padded.shape == (4, 2, 5)
    assert padded[0, 0, 2] == lse[0, 2] and padded[3, 1, 3] == lse[1, 7] and padded[2, 1, 0] == float("inf")
    assert torch.all(padded[0, :, 3:] == float("inf")) and torch.all(padded[1] == float("inf"))
    assert torch.equal(lse_rows(padded, cu, 8), lse)
    flat = lse_for_kernel(lse, cu, 5, padded=False)
    assert flat.shape == (2, 8) and flat[1, 3] == float("inf")
    assert torch.equal(lse_rows(flat, cu, 8), lse)


class _CustomOp:
    """Stands in for torch.library.custom_op's wrapper (flash-attn >= 2.7), whose signature is (*args, **kwargs)."""

    def __init__(self, fn):
        self._init_fn = fn

    def __call__(self, *args, **kwargs):
        return self._init_fn(*args, **kwargs)


def _fake_flash_attn(new_api: bool):
    """A flash_attn.flash_attn_interface computing with the torch backend, in flash-attn 2.3 or 2.7 calling style."""
    from megatron_sap.kernels.aten_flash import lse_for_kernel, lse_rows

    def kernel_forward(q, k, v, cu_q, cu_k, max_q, causal, scale):
        assert max_q >= 2 and cu_q.dtype == torch.int32
        out, lse = torch_backend.forward(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale)
        return out, lse_for_kernel(lse, cu_q, max_q, padded=not new_api)

    def kernel_backward(dout, q, k, v, out, lse, grads, cu_q, cu_k, causal, scale):
        lse = lse_rows(lse, cu_q, q.shape[0])
        for buffer, grad in zip(grads, torch_backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, softmax_scale=scale)):
            buffer.copy_(grad)

    def forward_2_3(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                    window_size, alibi_slopes, return_softmax):
        assert dropout_p == 0.0 and window_size == (-1, -1) and alibi_slopes is None and not return_softmax
        out, lse = kernel_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale)
        return out, q, k, v, out, lse, None, None

    def backward_2_3(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, rng_state=None):
        kernel_backward(dout, q, k, v, out, softmax_lse, (dq, dk, dv), cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
        return dq, dk, dv, None

    def forward_2_7(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                    window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
                    block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):
        assert (window_size_left, window_size_right, softcap) == (-1, -1, 0.0)
        out, lse = kernel_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale)
        return out, lse, None, None

    def backward_2_7(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                     alibi_slopes, deterministic, rng_state=None, zero_tensors=False):
        kernel_backward(dout, q, k, v, out, softmax_lse, (dq, dk, dv), cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
        return torch.empty(0)

    interface = types.ModuleType("flash_attn.flash_attn_interface")
    if new_api:
        interface._flash_attn_varlen_forward = _CustomOp(forward_2_7)
        interface._flash_attn_varlen_backward = _CustomOp(backward_2_7)
    else:
        interface._flash_attn_varlen_forward = forward_2_3
        interface._flash_attn_varlen_backward = backward_2_3
    package = types.ModuleType("flash_attn")
    package.flash_attn_interface = interface
    return package, interface


@pytest.mark.parametrize("version, interface_loads, usable", [
    ("2.7.4.post1", True, True), ("2.3.4", True, True), ("2.3.3", True, False), ("2.1.0", True, False),
    ("2.0.9", True, False), (None, True, False), ("2.7.4", False, False),
])
def test_flash_attn_counts_only_when_it_imports_and_is_2_3_4_or_newer(monkeypatch, version, interface_loads, usable):
    """A flash_attn older than 2.3.4 (before 2.1 top-left causal masks; before 2.3.4 a
    segment without keys or queries left out/lse or dk/dv unwritten, where this package's
    calls have such segments) or one whose compiled kernels fail to load (built against
    another torch) is not offered."""
    from megatron_sap import kernels

    package, interface = _fake_flash_attn(new_api=True)
    if version is not None:
        package.__version__ = version
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    if interface_loads:
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    else:  # its compiled extension does not load (undefined symbol): importing the interface raises OSError
        del package.flash_attn_interface
        monkeypatch.delitem(sys.modules, "flash_attn.flash_attn_interface", raising=False)

        def missing_symbol(name: str):
            raise OSError(f"flash_attn_2_cuda.so: undefined symbol (loading {name})")

        package.__getattr__ = missing_symbol
    kernels._flash_attn_importable.cache_clear()
    try:
        assert kernels._flash_attn_importable() is usable
    finally:
        kernels._flash_attn_importable.cache_clear()


@pytest.mark.parametrize("new_api", [False, True], ids=["flash-attn-2.3", "flash-attn-2.7"])
def test_flash_attn_adapter_across_versions(monkeypatch, new_api):
    """The flash-attn backend's calling conventions, against a stand-in package (the real one needs CUDA)."""
    from megatron_sap.kernels import flash_attn_backend

    package, interface = _fake_flash_attn(new_api)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    flash_attn_backend.varlen.padded_lse.cache_clear()

    gen = torch.Generator().manual_seed(19)
    # One query per segment (max_seqlen_q = 1, the kernels' decoding case), a zero-length segment, one without keys.
    cu_q, cu_k = _cu([1, 0, 1, 1]), _cu([1, 4, 0, 3])
    q, dout = _random(3, 4, 16, torch.float16, gen), _random(3, 4, 16, torch.float16, gen)
    k, v = _random(8, 2, 16, torch.float16, gen), _random(8, 2, 16, torch.float16, gen)
    out, lse = flash_attn_backend.forward(q, k, v, cu_q, cu_k, 1, 4, causal=True, softmax_scale=0.25)
    want_out, want_lse = torch_backend.forward(q, k, v, cu_q, cu_k, causal=True, softmax_scale=0.25)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and lse[0, 1] == float("-inf")

    grads = flash_attn_backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, 1, 4, causal=True, softmax_scale=0.25)
    wanted = torch_backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, softmax_scale=0.25)
    assert all(torch.equal(got, want) for got, want in zip(grads, wanted))
    flash_attn_backend.varlen.padded_lse.cache_clear()


def _bind_to_schema(op, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call to the aten op `op`, by name, checked against this torch's
    schema of it: as many positional arguments as it takes, keywords it knows, and each
    value of the type the schema declares (None only where it is optional)."""
    schema = op.default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    assert len(args) <= len(positional), f"{schema.name} takes {len(positional)} positional arguments, got {len(args)}"
    bound = dict(zip((a.name for a in positional), args))
    names = {a.name for a in schema.arguments}
    assert set(kwargs) <= names, f"{schema.name} has no argument {sorted(set(kwargs) - names)}"
    bound.update(kwargs)
    python_types = {"Tensor": torch.Tensor, "int": int, "SymInt": int, "float": float, "bool": bool}
    for arg in schema.arguments:
        if arg.name not in bound:
            assert arg.has_default_value(), f"{schema.name}: required argument {arg.name} not passed"
            continue
        value, type_name = bound[arg.name], str(arg.type)
        optional = type_name.startswith("Optional[")
        type_name = type_name.removeprefix("Optional[").removesuffix("]")
        if value is None:
            assert optional, f"{schema.name}: {arg.name} is not optional"
            continue
        want = python_types[type_name]
        assert isinstance(value, want) and not (want is not bool and isinstance(value, bool)), (
            f"{schema.name}: {arg.name} should be {type_name}, got {type(value).__name__}")
    return bound


def test_aten_flash_calls_bind_to_torchs_op_schemas(monkeypatch):
    """The aten-flash backend's calls to torch.ops.aten._flash_attention_forward/_backward,
    checked against the schemas of the torch installed here (the kernels need CUDA), with
    stand-ins that compute through the torch backend in the kernels' conventions (lse
    [Hq, Tq], +inf for rows without keys)."""
    from megatron_sap.kernels import aten_flash

    real_forward, real_backward = torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward
    calls = []

    def forward(*args, **kwargs):
        a = _bind_to_schema(real_forward, args, kwargs)
        calls.append("forward")
        assert a["dropout_p"] == 0.0 and not a["return_debug_mask"] and a["cum_seq_q"].dtype == torch.int32
        out, lse = torch_backend.forward(a["query"], a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"],
                                         causal=a["is_causal"], softmax_scale=a["scale"])
        return out, aten_flash.lse_for_kernel(lse, a["cum_seq_q"], a["max_q"], padded=False), None, None, None

    def backward(*args, **kwargs):
        a = _bind_to_schema(real_backward, args, kwargs)
        calls.append("backward")
        assert a["dropout_p"] == 0.0 and a["logsumexp"].dtype == torch.float32
        lse = aten_flash.lse_rows(a["logsumexp"], a["cum_seq_q"], a["query"].shape[0])
        return torch_backend.backward(a["grad_out"], a["query"], a["key"], a["value"], a["out"], lse, a["cum_seq_q"],
                                      a["cum_seq_k"], causal=a["is_causal"], softmax_scale=a["scale"])

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", backward)
    aten_flash.varlen.padded_lse.cache_clear()
    try:
        gen = torch.Generator().manual_seed(23)
        cu_q, cu_k = _cu([1, 0, 2, 3]), _cu([1, 4, 0, 3])  # a zero-length segment, one without keys
        q, dout = _random(6, 4, 16, torch.float16, gen), _random(6, 4, 16, torch.float16, gen)
        k, v = _random(8, 2, 16, torch.float16, gen), _random(8, 2, 16, torch.float16, gen)
        out, lse = aten_flash.forward(q, k, v, cu_q, cu_k, 3, 4, causal=False, softmax_scale=0.25)
        want_out, want_lse = torch_backend.forward(q, k, v, cu_q, cu_k, causal=False, softmax_scale=0.25)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and torch.all(lse[:, 1:3] == float("-inf"))
        grads = aten_flash.backward(dout, q, k, v, out, lse, cu_q, cu_k, 3, 4, causal=False, softmax_scale=0.25)
        wanted = torch_backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=False, softmax_scale=0.25)
        assert all(torch.equal(got, want) for got, want in zip(grads, wanted))
        assert calls == ["forward", "forward", "backward"]  # the layout probe, then the calls
    finally:
        aten_flash.varlen.padded_lse.cache_clear()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dense_reference_equals_the_row_by_row_reference(causal):
    """The dense float64 reference every other test trusts, against the row-by-row one built
    here without masks (GQA, several documents, an empty one): out, lse and gradients."""
    gen = torch.Generator().manual_seed(17)
    cu = _cu([7, 0, 12, 1, 9])
    q = _random(29, 6, 8, torch.float64, gen).requires_grad_()
    k, v = (_random(29, 2, 8, torch.float64, gen).requires_grad_() for _ in range(2))
    dout = _random(29, 6, 8, torch.float64, gen)
    out, lse = dense_attention(q, k, v, cu, causal=causal, softmax_scale=0.4)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = _exact_reference(q, k, v, cu, dout, causal=causal, scale=0.4)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)


def test_flash_backends_take_stacked_kv_views_without_copies(monkeypatch):
    """The executors pass K and V as views into one stacked [n, 2, Hkv, D] buffer: the flash
    kernels take any row stride, so those views reach the op as they are (no copy per call),
    and a tensor whose last dim is strided is made contiguous. Checked with stand-ins for
    PyTorch's flash ops that compute through the torch backend."""
    from megatron_sap.kernels import aten_flash

    seen = []

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, return_debug_mask, scale=None):
        seen.append((k.data_ptr(), k.stride(), v.data_ptr(), k.stride(-1), q.stride(-1)))
        out, lse = torch_backend.forward(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale)
        return out, aten_flash.lse_for_kernel(lse, cu_q, max_q, padded=False), None, None, None

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, rng, offset, scale=None):
        seen.append((k.data_ptr(), k.stride(), v.data_ptr(), k.stride(-1), q.stride(-1)))
        rows = aten_flash.lse_rows(lse, cu_q, q.shape[0])
        return torch_backend.backward(dout, q, k, v, out, rows, cu_q, cu_k, causal=causal, softmax_scale=scale)

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", backward)
    aten_flash.varlen.padded_lse.cache_clear()
    try:
        aten_flash.varlen.padded_lse(torch.device("cpu"))  # the layout probe, before the calls
        seen.clear()
        gen = torch.Generator().manual_seed(5)
        cu = _cu([3, 0, 5])
        q, dout = _random(8, 4, 16, torch.float16, gen), _random(8, 4, 16, torch.float16, gen)
        kv = _random(8, 4, 16, torch.float16, gen).view(8, 2, 2, 16)  # [n, 2, Hkv, D]
        k, v = kv[:, 0], kv[:, 1]
        out, lse = aten_flash.forward(q, k, v, cu, cu, 5, 5, causal=True, softmax_scale=0.3)
        grads = aten_flash.backward(dout, q, k, v, out, lse, cu, cu, 5, 5, causal=True, softmax_scale=0.3)
        want_out, want_lse = torch_backend.forward(q, k.contiguous(), v.contiguous(), cu, cu, causal=True,
                                                   softmax_scale=0.3)
        wanted = torch_backend.backward(dout, q, k.contiguous(), v.contiguous(), want_out, want_lse, cu, cu,
                                        causal=True, softmax_scale=0.3)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
        assert all(torch.equal(got, want) for got, want in zip(grads, wanted))
        assert len(seen) == 2 and all(c[:3] == (k.data_ptr(), k.stride(), v.data_ptr()) for c in seen)
        strided_q = q.transpose(1, 2).contiguous().transpose(1, 2)  # last dim strided: copied
        aten_flash.forward(strided_q, k, v, cu, cu, 5, 5, causal=True, softmax_scale=0.3)
        assert seen[-1][3:] == (1, 1)
    finally:
        aten_flash.varlen.padded_lse.cache_clear()


def test_double_backward_through_the_kernel_interface_is_refused():
    """`varlen_forward`'s backward is `varlen_backward`, which is not differentiable itself:
    second-order gradients raise (they ran and came out wrong, by up to 2.5x the largest),
    also from a loss linear in the output (where once_differentiable alone returns dq as a
    constant and a gradient penalty lost its term without an error)."""
    cu = torch.tensor([0, 5, 20, 33], dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(33, 2, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    weights = torch.randn(33, 2, 8, generator=gen, dtype=torch.float64)
    for loss in (lambda out: out.pow(2).sum(), lambda out: (out * weights).sum()):  # the latter: dout needs no grad
        out, _ = varlen_forward(q, k, v, cu, cu, 15, 15, causal=True, backend="torch")
        (dq,) = torch.autograd.grad(loss(out), q, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            (q.pow(2).sum() + dq.pow(2).sum()).backward()  # a gradient penalty
