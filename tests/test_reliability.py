"""Distributed failure modes on gloo: ranks that disagree, dead and stuck ranks, and a fuzz test.

A failure must raise on every rank it concerns, quickly and with a message naming the SAP step,
never hang or compute garbage.
"""
from __future__ import annotations

import math
import os
import random
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_pool import WorkerError, WorkerPool, make_pool_fixture
from megatron_sap.reference import dense_attention
from sap_cases import groups_for, make_inputs, random_cu_seqlens

pool2 = make_pool_fixture(2, timeout=60)
pool4 = make_pool_fixture(4, timeout=60)

# Timeout of the SAP groups in the dead/stuck rank tests: survivors must raise within it.
SHORT_TIMEOUT_S = 5.0
# Bound on a whole failed job: the timeout plus time to report, kill and start the next workers.
FAILED_JOB_BOUND_S = 25.0


def _local_inputs(plan, cp_rank: int, cu: list[int], heads: int, kv_heads: int, seed: int) -> tuple[torch.Tensor, ...]:
    q, k, v, dout = make_inputs(cu, heads, kv_heads, 8, seed)
    idx = plan.local_indices(cp_rank)
    return tuple(t[idx].requires_grad_() for t in (q, k, v)) + (dout[idx],)


# ---- ranks that disagree ------------------------------------------------------------------------


def disagree_job(rank: int, world: int, inner: int, cu: list[int], other_cu: list[int], odd_rank: int,
                 odd_recompute: bool = False, odd_shape: tuple[int, int, str] | None = None,
                 shape: tuple[int, int, str] = (4, 2, "float64"), scales: tuple = (None, None),
                 chunks: tuple = ("auto", "auto")) -> str:
    """Every rank attends with a fresh plan in `shape` (query heads, KV heads, dtype) and
    softmax scale `scales[0]`; `odd_rank` plans `other_cu` (and, with `odd_recompute`, alone
    recomputes the K/V; with `odd_shape` alone attends in that shape; with its scale
    `scales[1]`; its head chunks `chunks[1]`, the others' `chunks[0]`). Returns 'ok' or the error."""
    import megatron_sap as sap
    from megatron_sap.planning import PlanCache

    from megatron_sap import attention

    attention._LAST_CHECKED.clear()  # every rank checks: none skips a call it checked in an earlier job
    groups = groups_for(inner, world // inner)
    mine = other_cu if rank == odd_rank else cu
    plan = sap.plan_sequences(mine, outer_size=world // inner, inner_size=inner, cache=PlanCache())
    heads, kv_heads, dtype = odd_shape if odd_shape and rank == odd_rank else shape
    q, k, v, dout = (t.to(getattr(torch, dtype)) for t in _local_inputs(plan, groups.cp_rank, mine, heads, kv_heads, seed=0))
    try:
        sap.sap_attention(q, k, v, plan, groups, recompute_kv=odd_recompute and rank == odd_rank,
                          softmax_scale=scales[rank == odd_rank], inner_chunks=chunks[rank == odd_rank]).backward(dout)
    except RuntimeError as exc:
        return str(exc)
    return "ok"


@pytest.mark.parametrize(("world", "inner"), [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
def test_disagreeing_rank_raises_on_every_rank(request: pytest.FixtureRequest, world: int, inner: int) -> None:
    pool: WorkerPool = request.getfixturevalue(f"pool{world}")
    cu = [0, 10, 24, 40, 64]
    other = [0, 10, 25, 40, 64]  # same T, one boundary moved
    odd_rank = world - 1
    messages = pool.run(disagree_job, inner, cu, other, odd_rank)
    hashes = []
    for rank, message in enumerate(messages):
        found = re.search(r"CP ranks disagree on the batch, the layout, the cost model, the attention shape, the "
                          r"softmax scale or recompute_kv: this rank \(cp_rank (\d+)\) planned hash ([0-9a-f]+) \(64 tokens, 4 documents, "
                          r"layout .*\), the group has hashes from ([0-9a-f]+) to ([0-9a-f]+)", message)
        assert found, (rank, message)
        cp_rank, mine, low, high = found.groups()
        assert int(cp_rank) == rank and low != high and mine in (low, high), message
        hashes.append((mine, low, high))
    assert len({(low, high) for _, low, high in hashes}) == 1, "every rank must report the same pair"
    assert hashes[odd_rank][0] != hashes[0][0]


@pytest.mark.parametrize("chunks", [(1, 2), ("auto", 2), (2, 4)])
def test_rank_asking_for_other_head_chunks_raises_on_every_rank(pool4: WorkerPool, chunks) -> None:
    """The head chunks decide how many all-to-alls the inner ranks run and how large: a
    rank asking for another count than its peers fails the agreement check with them."""
    cu = [0, 10, 24, 40, 64]
    messages = pool4.run(disagree_job, 4, cu, cu, 1, False, None, (16, 4, "float64"), (None, None), chunks)
    assert all("disagree" in m for m in messages), messages
    assert f"inner_chunks {chunks[1]})" in messages[1]
    assert pool4.run(disagree_job, 4, cu, cu, 1, False, None, (16, 4, "float64"), (None, None),
                     ("auto", 1)) == ["ok"] * 4  # "auto" runs one chunk here: the same, and checked alike


def test_rank_recomputing_kv_alone_raises_on_every_rank(pool4: WorkerPool) -> None:
    """recompute_kv decides whether the backward fetches K/V again: a rank that differs
    would leave its peers waiting, so the agreement check counts it."""
    cu = [0, 10, 24, 40, 64]
    messages = pool4.run(disagree_job, 1, cu, cu, 2, True)
    assert all("recompute_kv=" in m and "disagree" in m for m in messages), messages
    assert "recompute_kv=True" in messages[2] and "recompute_kv=False" in messages[0]


@pytest.mark.parametrize(("shape", "odd_shape"), [
    ((4, 2, "float64"), (8, 2, "float64")),
    ((4, 2, "float64"), (4, 4, "float64")),
    ((4, 2, "float64"), (4, 2, "float32")),
    ((4, 2, "bfloat16"), (4, 2, "float16")),
], ids=["query-heads", "kv-heads", "dtype-size", "dtype-same-size"])
def test_rank_attending_in_another_shape_raises_on_every_rank(pool4: WorkerPool, shape, odd_shape) -> None:
    """Heads and dtype size and type the exchanged buffers: a rank that differs would make
    its peers read garbage (fp16 read as bf16: same bytes, other numbers) or abort inside
    the backend, so the agreement check counts them."""
    cu = [0, 10, 24, 40, 64]
    messages = pool4.run(disagree_job, 2, cu, cu, 1, False, odd_shape, shape)
    assert all("disagree" in m and "attention shape" in m for m in messages), messages
    heads, kv_heads, dtype = odd_shape
    assert f"(heads, kv heads, head dim, dtype) ({heads}, {kv_heads}, 8, '{dtype}')" in messages[1]
    assert f"'{shape[2]}')" in messages[0]


@pytest.mark.parametrize("first, scales", [(11, (None, 0.5)), (12, (0.25, 0.5)), (13, (0.5, None))])
def test_rank_scaling_its_scores_otherwise_raises_on_every_rank(pool4: WorkerPool, first, scales) -> None:
    """Partial results scaled differently do not merge (a wrong answer, no error, before
    the scale entered the check); the default scale (head_dim ** -0.5) and the same scale
    given explicitly (also as 1 / sqrt(head_dim)) agree. (A batch no earlier case checked: a rank going back to the
    key last checked skips the check, and the others wait for it until the timeout.)"""
    cu = [0, first, 24, 40, 64]
    messages = pool4.run(disagree_job, 2, cu, cu, 1, False, None, (4, 2, "float64"), scales)
    assert all("disagree" in m and "softmax scale" in m for m in messages), messages
    assert f"softmax_scale {scales[1] or 'default'})" in messages[1]
    assert f"softmax_scale {scales[0] or 'default'})" in messages[0]
    assert pool4.run(disagree_job, 2, cu, cu, 1, False, None, (4, 2, "float64"), (None, 8 ** -0.5)) == ["ok"] * 4
    assert 1 / math.sqrt(8) != 8 ** -0.5  # Megatron's form of the default, one bit off
    cu[1] += 10
    assert pool4.run(disagree_job, 2, cu, cu, 1, False, None, (4, 2, "float64"), (None, 1 / math.sqrt(8))) == ["ok"] * 4


def test_agreeing_ranks_in_half_precision_pass(pool4: WorkerPool) -> None:
    """bf16 on every rank: the dtype in the check does not fire where all agree."""
    cu = [0, 10, 24, 40, 64]
    assert pool4.run(disagree_job, 2, cu, cu, 0, False, None, (4, 2, "bfloat16")) == ["ok"] * 4


def test_agreeing_ranks_pass(pool4: WorkerPool) -> None:
    """The check does not fire on a batch every rank planned alike (same inputs as above)."""
    cu = [0, 10, 24, 40, 64]
    assert pool4.run(disagree_job, 2, cu, cu, 0) == ["ok"] * 4


def changing_calls_job(rank: int, world: int, calls: list[tuple], last: list[tuple]) -> list[str]:
    """One plan, attended by every rank in each of `calls` in turn ((query heads, KV heads,
    head dim, dtype, recompute_kv), forward and backward), then by each rank in its own
    entry of `last`. Returns 'ok' or the error of each call."""
    import megatron_sap as sap
    from megatron_sap.planning import PlanCache

    groups = groups_for(1, world)
    cu = [0, 48, 64]  # the document spans both ranks: the K/V are exchanged
    plan = sap.plan_sequences(cu, outer_size=world, cache=PlanCache())
    idx = plan.local_indices(groups.cp_rank)
    results = []
    for heads, kv_heads, dim, dtype, recompute in [*calls, last[rank]]:
        q, k, v, dout = (t[idx].to(getattr(torch, dtype)) for t in make_inputs(cu, heads, kv_heads, dim, seed=2))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        try:
            sap.sap_attention(q, k, v, plan, groups, recompute_kv=recompute).backward(dout)
            results.append("ok")
        except RuntimeError as exc:
            results.append(str(exc))
    return results


# Three keys with K/V rows of one size (32 elements), so that ranks exchanging in different
# ones would read each other's buffers without a size error.
_SAME_SIZE_SHAPES = [(8, 4, 8, "float64", False), (8, 2, 16, "float64", False), (8, 1, 32, "float64", False)]


@pytest.mark.parametrize(("calls", "last"), [
    (_SAME_SIZE_SHAPES, _SAME_SIZE_SHAPES[:2]),
    ([(4, 2, 8, "bfloat16", False), (4, 2, 8, "float16", False), (4, 2, 8, "float32", False)],
     [(4, 2, 8, "bfloat16", False), (4, 2, 8, "float16", False)]),
    ([(4, 2, 8, "float64", False), (4, 2, 8, "float64", True), (4, 1, 16, "float64", False)],
     [(4, 2, 8, "float64", False), (4, 2, 8, "float64", True)]),
], ids=["shape", "dtype", "recompute_kv"])
def test_ranks_parting_to_keys_checked_before_raise_on_every_rank(pool2: WorkerPool, calls, last) -> None:
    """Both ranks attended in every key of `calls` (each checked once), then each goes back to
    a different earlier one: neither is the last key checked, so both check again and fail
    with the disagreement, where a check skipped for any key checked before with the plan let
    them exchange in different shapes or dtypes (a wrong answer, no error) or wait for each
    other's K/V (a timeout)."""
    results = pool2.run(changing_calls_job, calls, last)
    for rank, result in enumerate(results):
        assert result[:-1] == ["ok"] * len(calls), (rank, result)
        assert "CP ranks disagree" in result[-1], (rank, result[-1])


def nan_rank_job(rank: int, world: int, inner: int, odd_rank: int) -> list[str]:
    """Two forwards of one plan with check_finite on every rank: the first clean, the second
    with a NaN in `odd_rank`'s k. Returns 'ok' or the error of each."""
    import megatron_sap as sap
    from megatron_sap.planning import PlanCache

    groups = groups_for(inner, world // inner)
    cu = [0, 10, 24, 40, 64]
    plan = sap.plan_sequences(cu, outer_size=world // inner, inner_size=inner, cache=PlanCache())
    q, k, v, _ = _local_inputs(plan, groups.cp_rank, cu, 4, 2, seed=0)
    results = []
    for poisoned in (False, True):
        k_in = k.detach().clone()
        if poisoned and rank == odd_rank:
            k_in[3, 1, 0] = float("nan")
        try:
            sap.sap_attention(q, k_in, v, plan, groups, check_finite=True)
            results.append("ok")
        except ValueError as exc:
            results.append(str(exc))
    return results


@pytest.mark.parametrize("inner", [1, 2])
def test_a_nan_on_one_rank_raises_on_every_rank(pool4: WorkerPool, inner: int) -> None:
    """With check_finite, a NaN on one rank, after the plan's agreement check has run, stops
    every rank before any exchange (none is left waiting for a peer that raised)."""
    results = pool4.run(nan_rank_job, inner, 2, timeout=30)
    assert [first for first, _ in results] == ["ok"] * 4
    assert re.match(r"k contains 1 NaN or Inf values, the first at local token 3, head 1 \(", results[2][1]), results[2]
    for rank in (0, 1, 3):
        assert re.match(r"q, k or v of cp_ranks \[2\] contain NaN or Inf values", results[rank][1]), results[rank]


def count_agreement_job(rank: int, world: int, check: bool) -> list[int]:
    """all_reduce calls per forward: a fresh plan, the same plan again, another batch's plan, the
    first again, then the first batch planned afresh (an equal plan, another object)."""
    import torch.distributed as dist

    import megatron_sap as sap
    from megatron_sap.planning import PlanCache

    from megatron_sap.comm import p2p

    # U = 1: the forward's only collectives are the agreement check and, before the group's
    # first batched P2P, one all-reduce that the agreement check makes unneeded.
    groups = groups_for(1, world)
    p2p._ready_groups.clear()
    calls = 0
    real = dist.all_reduce

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    counts = []
    cu, other_cu = [0, 3, 20, 32], [0, 9, 32]
    first = sap.plan_sequences(cu, outer_size=world, cache=PlanCache())
    second = sap.plan_sequences(other_cu, outer_size=world, cache=PlanCache())
    again = sap.plan_sequences(cu, outer_size=world, cache=PlanCache())
    dist.all_reduce = counting
    try:
        for plan in (first, first, second, first, again):
            before = calls
            q, k, v, _ = _local_inputs(plan, groups.cp_rank, list(plan.cu_seqlens), 2, 1, seed=1)
            sap.sap_attention(q, k, v, plan, groups, check_agreement=check)
            counts.append(calls - before)
    finally:
        dist.all_reduce = real
    return counts


def test_agreement_check_runs_when_the_plan_changes_and_can_be_switched_off(pool2: WorkerPool) -> None:
    assert pool2.run(count_agreement_job, True) == [[1, 0, 1, 1, 0]] * 2
    assert pool2.run(count_agreement_job, False) == [[1, 0, 0, 0, 0]] * 2


def switch_back_job(rank: int, world: int) -> tuple[float, str]:
    """Every rank runs batches A and B (both checked), then A again (error against the
    reference); then rank 0 stays on A while the others go back to B. The two rows
    exchange messages of the same sizes, so only the check can tell them apart."""
    import megatron_sap as sap
    from megatron_sap.planning import PlanCache

    groups = sap.init_sap_groups(inner_size=1, outer_size=world, timeout=timedelta(seconds=SHORT_TIMEOUT_S))
    dist.barrier()
    rows = {"A": [0, 16 * world], "B": [0, 16 * world - 1, 16 * world]}
    cache = PlanCache()
    plans = {name: sap.plan_sequences(cu, outer_size=world, cache=cache) for name, cu in rows.items()}

    def attend(name: str) -> float:
        q, k, v, _ = make_inputs(rows[name], 4, 2, 8, 5)
        idx = plans[name].local_indices(groups.cp_rank)
        out = sap.sap_attention(q[idx], k[idx], v[idx], plans[name], groups)
        return (out - dense_attention(q, k, v, torch.tensor(rows[name]))[0][idx]).abs().max().item()

    attend("A"), attend("B")
    error = attend("A")
    try:
        attend("A" if rank == 0 else "B")
    except RuntimeError as exc:
        return error, str(exc)
    return error, "ok"


def test_ranks_going_back_to_a_checked_plan_fail_instead_of_computing_garbage(pool4: WorkerPool) -> None:
    """Checking only a plan's first use let ranks 1-3 run batch B's plan against rank 0's A
    without an error (both checked before), with wrong outputs on every rank. Now the ranks
    that change plan check it and rank 0, which does not, fails in its first step: all at
    the group's timeout."""
    start = time.monotonic()
    results = pool4.run(switch_back_job, timeout=60)
    assert time.monotonic() - start < FAILED_JOB_BOUND_S
    assert all(error < 1e-10 for error, _ in results), results  # all going back together is checked and right
    # Rank 0's step fails: at the group's timeout, or sooner where gloo sees the peers'
    # side of the pair closed first (under load); either way an error, not an output.
    assert results[0][1].startswith("SAP step") and " failed: " in results[0][1], results[0]
    for _, message in results[1:]:
        assert "SAP agreement check" in message, results
    assert pool4.run(healthy_job) == pytest.approx([0.0] * 4, abs=1e-10)


def equal_plan_job(rank: int, world: int) -> tuple[float, int]:
    """Both ranks attend with one plan (checked); then rank 1 plans the same row afresh (an
    equal plan, another object, as after a cache miss) and both attend again: (error against
    the reference, all-reduces of the second step)."""
    import megatron_sap as sap

    groups = sap.init_sap_groups(inner_size=1, outer_size=world, timeout=timedelta(seconds=SHORT_TIMEOUT_S))
    cu = [0, 99, 123, 145, 238, 256]
    plan = sap.plan_sequences(cu, outer_size=world, cache=None)
    q, k, v, _ = make_inputs(cu, 4, 2, 8, 7)
    idx = plan.local_indices(groups.cp_rank)
    sap.sap_attention(q[idx], k[idx], v[idx], plan, groups)
    if rank == 1:
        plan = sap.plan_sequences(cu, outer_size=world, cache=None)
    calls, real = 0, dist.all_reduce

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        out = sap.sap_attention(q[idx], k[idx], v[idx], plan, groups)
    finally:
        dist.all_reduce = real
    return (out - dense_attention(q, k, v, torch.tensor(cu))[0][idx]).abs().max().item(), calls


def test_ranks_holding_equal_plans_as_other_objects_skip_the_check_alike(pool2: WorkerPool) -> None:
    """The last plan checked on a group is remembered by its signature: a rank whose equal
    plan is another object (planned afresh) skips the check as its peer does, where keyed
    by the object it alone entered the all-reduce and both waited out the group's timeout."""
    results = pool2.run(equal_plan_job, timeout=30)
    assert all(error < 1e-10 and calls == 0 for error, calls in results), results


def split_agreement_job(rank: int, world: int, model_shape, attention_dtype=None, softmax_scale=None) -> list[int]:
    """all_reduce calls of a batch split and a layer's forward, two micro-batches, with the
    model's shape and attention dtype known to the options or not, the layer attending
    with `softmax_scale`."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    import megatron_sap as sap
    from megatron_sap.megatron import sap_split_batch, set_sap_options
    from megatron_sap.megatron.options import reset_sap_options
    from megatron_sap.megatron.plans import plan_for

    from megatron_sap.planning.plan import DEFAULT_CACHE

    from megatron_sap import attention

    groups = groups_for(1, world)
    DEFAULT_CACHE.clear()  # the split plans afresh, as for rows it has not seen
    attention._LAST_SCALE.clear()  # as in a fresh process: no layer has attended
    set_sap_options(model_shape=model_shape, attention_dtype=attention_dtype)
    calls, real = 0, dist.all_reduce

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    counts = []
    dist.all_reduce = counting
    try:
        for cu in ([0, 3, 20, 32], [0, 7, 30, 32]):
            before = calls
            _, params = sap_split_batch({"tokens": torch.arange(32)[None]}, cu, groups)
            plan = plan_for(params.cu_seqlens_q, groups)  # the split's plan, as the layers get it
            q, k, v, _ = _local_inputs(plan, groups.cp_rank, cu, 2, 1, seed=1)
            sap.sap_attention(q, k, v, plan, groups, softmax_scale=softmax_scale)
            counts.append(calls - before)
    finally:
        dist.all_reduce = real
        reset_sap_options()
    return counts


def test_a_split_that_knows_the_model_shape_covers_the_layers(pool2: WorkerPool) -> None:
    """One agreement all-reduce per micro-batch when the options know the layers' shape
    and dtype (as the flags set them), a second one in the first layer when they do not,
    or name another dtype than the layers attend in."""
    assert pool2.run(split_agreement_job, (2, 1, 8, 8), "float64") == [[1, 1]] * 2
    assert pool2.run(split_agreement_job, (2, 1, 8, 8), torch.float64) == [[1, 1]] * 2
    assert pool2.run(split_agreement_job, None) == [[2, 2]] * 2
    assert pool2.run(split_agreement_job, (2, 1, 8, 8)) == [[2, 2]] * 2
    assert pool2.run(split_agreement_job, (2, 1, 8, 8), "float32") == [[2, 2]] * 2
    # a scale of the model's own: the layer checks in the first micro-batch only, the split
    # then checks with the scale the layers use (Megatron's 1 / sqrt(d) is the default)
    assert pool2.run(split_agreement_job, (2, 1, 8, 8), "float64", 0.3) == [[2, 1]] * 2
    assert pool2.run(split_agreement_job, (2, 1, 8, 8), "float64", 1 / math.sqrt(8)) == [[1, 1]] * 2


def unchecked_disagreement_job(rank: int, world: int) -> float:
    """Pure Ulysses (no P2P) with different cu_seqlens on rank 1 and the check off: max error vs the truth."""
    import megatron_sap as sap
    from megatron_sap.planning import PlanCache

    groups = groups_for(world, 1)
    cu = [0, 10, 24, 40, 64]
    mine = [0, 10, 25, 40, 64] if rank == 1 else cu
    plan = sap.plan_sequences(mine, inner_size=world, cache=PlanCache())
    q, k, v, _ = make_inputs(cu, 4, 2, 8, 3)
    idx = plan.local_indices(groups.cp_rank)
    out = sap.sap_attention(q[idx], k[idx], v[idx], plan, groups, check_agreement=False)
    ref, _ = dense_attention(q, k, v, torch.tensor(cu))
    return (out - ref[idx]).abs().max().item()


def test_unchecked_disagreement_is_silently_wrong(pool2: WorkerPool) -> None:
    """Why the check is on by default: without it this layout completes with a wrong answer."""
    errors = pool2.run(unchecked_disagreement_job)
    assert max(errors) > 1e-3, errors


# ---- dead and stuck ranks -----------------------------------------------------------------------


def failing_rank_job(rank: int, world: int, inner: int, fate: str, check: bool) -> None:
    """Rank 1 dies (os._exit) or hangs after planning; the others run forward and backward."""
    import megatron_sap as sap
    from megatron_sap.planning import PlanCache

    groups = sap.init_sap_groups(inner_size=inner, outer_size=world // inner, timeout=timedelta(seconds=SHORT_TIMEOUT_S))
    dist.barrier()  # every rank has connected its groups: what fails next is the SAP step
    cu = random_cu_seqlens(random.Random(3), world * 48, "long")
    plan = sap.plan_sequences(cu, outer_size=world // inner, inner_size=inner, cache=PlanCache())
    q, k, v, dout = _local_inputs(plan, groups.cp_rank, cu, 4, 2, seed=2)
    if rank == 1:
        if fate == "dies":
            os._exit(17)
        time.sleep(10 * SHORT_TIMEOUT_S)  # stuck: the pool kills it once the others have failed
    sap.sap_attention(q, k, v, plan, groups, check_agreement=check).backward(dout)


def healthy_job(rank: int, world: int) -> float:
    """A normal forward on the (restarted) pool: max error against the reference."""
    import megatron_sap as sap

    groups = groups_for(2, world // 2)
    cu = [0, 7, 30, 64]
    plan = sap.plan_sequences(cu, outer_size=world // 2, inner_size=2)
    q, k, v, _ = make_inputs(cu, 4, 2, 8, 4)
    idx = plan.local_indices(groups.cp_rank)
    out = sap.sap_attention(q[idx], k[idx], v[idx], plan, groups)
    ref, _ = dense_attention(q, k, v, torch.tensor(cu))
    return (out - ref[idx]).abs().max().item()


SAP_STEP_PHRASES = ("SAP step", "SAP backward step", "SAP inner all-to-all", "SAP agreement check", "SAP first collective")


def _run_failing(pool: WorkerPool, inner: int, fate: str, check: bool) -> tuple[WorkerError, float]:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.run(failing_rank_job, inner, fate, check, timeout=60)
    return info.value, time.monotonic() - start


@pytest.mark.parametrize(("inner", "check"), [(1, True), (1, False), (2, False)])
def test_stuck_rank_makes_the_others_raise_within_the_timeout(pool4: WorkerPool, inner: int, check: bool) -> None:
    """A hung rank 1: every rank that needs it raises a timeout naming the SAP step, not hang.

    With the check on, everyone waits in the agreement all-reduce; off, in P2P steps (U = 1) or the
    inner all-to-all and the P2P steps that depend on it (U = 2).
    """
    error, elapsed = _run_failing(pool4, inner, "hangs", check)
    assert elapsed < FAILED_JOB_BOUND_S, elapsed
    survivors = {rank: line for rank, line in error.failures.items() if rank != 1}
    assert survivors, str(error)
    for rank, line in survivors.items():  # a timeout, or the connection of a survivor the pool killed
        assert any(p in line for p in SAP_STEP_PHRASES), (rank, line)
    assert any("Timed out" in line for line in survivors.values()), str(error)
    if check:
        assert set(survivors) == {0, 2, 3} and all("agreement check" in line for line in survivors.values())
    assert pool4.run(healthy_job) == pytest.approx([0.0] * 4, abs=1e-10)


@pytest.mark.parametrize("inner", [1, 2])
def test_dead_rank_fails_the_job_promptly(pool4: WorkerPool, inner: int) -> None:
    """Rank 1 exits mid-job: the job fails fast; survivors that report name the SAP step; the pool recovers."""
    error, elapsed = _run_failing(pool4, inner, "dies", False)
    assert elapsed < FAILED_JOB_BOUND_S, elapsed
    assert error.failures[1] == "exited with code 17"
    for rank, line in error.failures.items():
        if rank != 1:
            assert any(p in line for p in SAP_STEP_PHRASES), (rank, line)
    assert pool4.run(healthy_job) == pytest.approx([0.0] * 4, abs=1e-10)


# ---- fuzz ---------------------------------------------------------------------------------------


def fuzz_job(
    rank: int, world: int, cu: list[int], inner: int, heads: int, kv_heads: int, recompute_kv: bool
) -> dict[str, torch.Tensor]:
    """One rank's forward and backward in float64 with a fresh plan; its rows, output and grads."""
    import megatron_sap as sap
    from megatron_sap.planning import PlanCache

    groups = groups_for(inner, world // inner)
    plan = sap.plan_sequences(cu, outer_size=world // inner, inner_size=inner, cache=PlanCache())
    q, k, v, dout = _local_inputs(plan, groups.cp_rank, cu, heads, kv_heads, seed=len(cu))
    out = sap.sap_attention(q, k, v, plan, groups, recompute_kv=recompute_kv)
    out.backward(dout)
    return {"idx": plan.local_indices(groups.cp_rank), "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[int], int, int, int, bool]:
    """(cu_seqlens with T a multiple of 4, inner size, query heads, KV heads, recompute_kv)."""
    lengths = draw(st.lists(st.integers(0, 60), min_size=1, max_size=16))
    lengths.append(-sum(lengths) % 4 + draw(st.sampled_from([0, 4])))
    if sum(lengths) == 0:
        lengths.append(4)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    inner = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = math.lcm(kv_heads, inner) * draw(st.sampled_from([1, 2]))
    return cu, inner, heads, kv_heads, draw(st.booleans())


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts())
def test_fuzz_matches_dense_reference(pool4: WorkerPool, layout: tuple[list[int], int, int, int, bool]) -> None:
    cu, inner, heads, kv_heads, recompute_kv = layout
    results = pool4.run(fuzz_job, cu, inner, heads, kv_heads, recompute_kv, timeout=30)
    q, k, v, dout = make_inputs(cu, heads, kv_heads, 8, seed=len(cu))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref, _ = dense_attention(q, k, v, torch.tensor(cu))
    ref.backward(dout)
    expected = {"out": ref.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    covered = torch.cat([r["idx"] for r in results]).sort().values
    assert torch.equal(covered, torch.arange(cu[-1])), "ranks must hold every token exactly once"
    for r in results:
        for name, want in expected.items():
            assert torch.allclose(r[name], want[r["idx"]], atol=1e-10, rtol=0), (name, r["idx"][:8])


def stale_plan_job(rank: int, world: int) -> str:
    """Both ranks split batch A; then rank 0 splits A again (a cached, already-checked plan)
    while rank 1 splits a new batch B. The splitter checks every micro-batch."""
    import megatron_sap as sap
    from megatron_sap.megatron import sap_split_batch

    groups = sap.init_sap_groups(inner_size=1, outer_size=world)
    row = torch.arange(16).unsqueeze(0)
    batch_a, batch_b = [0, 5, 16], [0, 9, 16]
    sap_split_batch({"tokens": row}, batch_a, groups)
    try:
        sap_split_batch({"tokens": row}, batch_a if rank == 0 else batch_b, groups)
    except RuntimeError as exc:
        return str(exc)
    return "ok"


def released_groups_job(rank: int, world: int, inner: int) -> list[bool]:
    """SAP groups that attended (the agreement check, the outer group's first collective)
    then destroyed: whether each CP group object was freed."""
    import gc
    import weakref

    import megatron_sap as sap

    freed = []
    for cycle in range(3):
        groups = sap.init_sap_groups(inner_size=inner, outer_size=world // inner)
        cu = [0, 10 + cycle, 100, 128]
        plan = sap.plan_sequences(cu, outer_size=world // inner, inner_size=inner, cache=None)
        q, k, v, dout = _local_inputs(plan, groups.cp_rank, cu, 2, 2, seed=cycle)
        sap.sap_attention(q, k, v, plan, groups).backward(dout)
        ref = weakref.ref(groups.cp_group)
        made = {id(g): g for g in (groups.cp_group, groups.inner_group, groups.outer_group) if g is not None}
        for group in made.values():
            dist.destroy_process_group(group)
        del groups, group, made
        gc.collect()
        freed.append(ref() is None)
    return freed


@pytest.mark.parametrize("inner", [1, 2])
def test_destroyed_groups_are_let_go(pool2: WorkerPool, inner: int) -> None:
    """The state kept per CP group (the first-collective mark, the last agreement check, the
    layers' scale) holds it weakly: groups destroyed and made again (an in-process restart)
    kept every old group, its connections and threads, alive."""
    assert pool2.run(released_groups_job, inner) == [[True] * 3] * 2


def test_batch_splitter_catches_a_stale_cached_plan(pool2: WorkerPool) -> None:
    messages = pool2.run(stale_plan_job)
    assert all("CP ranks disagree" in m for m in messages), messages


def one_bad_batch_job(rank: int, world: int, bad: str) -> dict:
    """Rank 1 splits an invalid micro-batch (`bad` says how) while the others split a valid
    one, over groups whose timeout (120 s) outlasts the job's; then every rank splits a
    valid one again."""
    import datetime

    import megatron_sap as sap
    from megatron_sap.megatron import sap_packed_seq_params, sap_split_batch

    groups = sap.init_sap_groups(inner_size=1, outer_size=world, timeout=datetime.timedelta(seconds=120))
    row, cu = torch.arange(16)[None], [0, 5, 16]
    if rank == 1:
        row, cu = {"cu_seqlens": (row, [0, 9, 5, 16]), "cu_seqlens_end": (row, [0, 5, 15]),
                   "shape": (torch.arange(32).reshape(2, 16), cu), "length": (torch.arange(15)[None], [0, 5, 15]),
                   "middle_stage": (None, [0, 5, 15])}[bad]
    try:
        if row is None:
            sap_packed_seq_params(cu, torch.device("cpu"), groups)
        else:
            sap_split_batch({"tokens": row}, cu, groups)
        outcome = "ok"
    except (ValueError, RuntimeError) as error:
        outcome = f"{type(error).__name__}: {error}"
    local, _ = sap_split_batch({"tokens": torch.arange(16)[None]}, [0, 7, 16], groups)
    return {"outcome": outcome, "then": local["tokens"][0].tolist()}


@pytest.mark.parametrize("bad", ["cu_seqlens", "cu_seqlens_end", "shape", "length", "middle_stage"])
def test_a_rank_with_a_bad_batch_makes_the_others_raise_at_once(pool4: WorkerPool, bad: str) -> None:
    """The splitting rank raises its own error, and the others, in the agreement check,
    name it at once (they waited for its hash until the group's timeout before); the
    group stays usable."""
    results = pool4.run(one_bad_batch_job, bad, timeout=30)
    assert results[1]["outcome"].startswith("ValueError"), results[1]
    for rank in (0, 2, 3):
        assert "CP rank 1 of [0, 1, 2, 3] (the highest that failed) could not prepare this micro-batch" in \
            results[rank]["outcome"], results[rank]
    assert sorted(sum((r["then"] for r in results), [])) == list(range(16))


def one_bad_attention_job(rank: int, world: int, inner: int, bad: str, check_finite: bool = False) -> dict:
    """Every rank attends with a fresh plan, rank 1 with inputs that fail `sap_attention`'s
    own checks (`bad` says which), over groups whose timeout (120 s) outlasts the job's;
    then every rank attends again with valid ones. `check_finite`: on every call, and the
    bad call on the plan every rank checked already (the finite check runs on every call)."""
    import datetime

    import megatron_sap as sap

    groups = sap.init_sap_groups(inner_size=inner, outer_size=world // inner, timeout=datetime.timedelta(seconds=120))
    cu = [0, 10, 24, 40, 64]
    plan = sap.plan_sequences(cu, outer_size=world // inner, inner_size=inner, cache=None)
    q, k, v, dout = _local_inputs(plan, groups.cp_rank, cu, 4, 2, seed=3)
    if check_finite:
        sap.sap_attention(q, k, v, plan, groups, check_finite=True).backward(dout)
    kwargs: dict = {"check_finite": check_finite}
    if rank == 1:
        if bad == "rows":
            q = q[:-1]
        elif bad == "heads":
            q = q[:, :3]
        elif bad == "layout":
            plan = sap.plan_sequences(cu, outer_size=world, inner_size=1, cache=None) if inner > 1 else \
                sap.plan_sequences(cu, outer_size=world // 2, inner_size=2, cache=None)
        else:
            kwargs["softmax_scale"] = float("nan")
    try:
        sap.sap_attention(q, k, v, plan, groups, **kwargs).backward(dout)
        outcome = "ok"
    except (ValueError, RuntimeError) as error:
        outcome = f"{type(error).__name__}: {error}"
    plan = sap.plan_sequences([0, 7, 64], outer_size=world // inner, inner_size=inner, cache=None)
    q, k, v, dout = _local_inputs(plan, groups.cp_rank, [0, 7, 64], 4, 2, seed=4)
    sap.sap_attention(q, k, v, plan, groups, check_finite=check_finite).backward(dout)
    return {"outcome": outcome, "then": "ok"}


@pytest.mark.parametrize("bad", ["rows", "heads", "layout", "scale"])
@pytest.mark.parametrize("inner", [1, 2])
def test_a_rank_whose_attention_inputs_fail_makes_the_others_raise_at_once(pool4: WorkerPool, bad: str,
                                                                            inner: int) -> None:
    """A rank whose q, k, v, plan or options fail `sap_attention`'s checks on a plan the group
    has not checked raises its own error, and its peers, about to check that plan, name it at
    once (before, they waited in the agreement check until the group's timeout); the group
    stays usable."""
    results = pool4.run(one_bad_attention_job, inner, bad, timeout=30)
    assert results[1]["outcome"].startswith("ValueError"), results[1]
    for rank in (0, 2, 3):
        assert "CP rank 1 of [0, 1, 2, 3] (the highest that failed) could not prepare this micro-batch" in \
            results[rank]["outcome"], results[rank]
    assert [r["then"] for r in results] == ["ok"] * 4


@pytest.mark.parametrize("bad", ["rows", "layout"])
def test_with_the_finite_check_a_rank_whose_inputs_fail_makes_the_others_raise_at_once(pool4: WorkerPool,
                                                                                        bad: str) -> None:
    """With `check_finite` on, every rank runs the finite check on every call: a rank whose
    inputs fail takes part in it as a failed rank, even on a plan the group checked before,
    and its peers name it at once."""
    results = pool4.run(one_bad_attention_job, 2, bad, True, timeout=30)
    assert results[1]["outcome"].startswith("ValueError"), results[1]
    for rank in (0, 2, 3):
        assert "cp_ranks [1] of [0, 1, 2, 3] could not prepare their attention inputs" in results[rank]["outcome"], \
            results[rank]
    assert [r["then"] for r in results] == ["ok"] * 4


def bad_inputs_on_a_checked_plan_job(rank: int, world: int) -> str:
    """Every rank attends with a plan (checked), then rank 1 alone calls again with the same
    plan and a q of the wrong size, over groups whose timeout (120 s) outlasts the job's."""
    import datetime

    import megatron_sap as sap

    groups = sap.init_sap_groups(inner_size=1, outer_size=world, timeout=datetime.timedelta(seconds=120))
    cu = [0, 10, 24, 40, 60]
    plan = sap.plan_sequences(cu, outer_size=world, inner_size=1, cache=None)
    q, k, v, dout = _local_inputs(plan, groups.cp_rank, cu, 4, 2, seed=5)
    sap.sap_attention(q, k, v, plan, groups).backward(dout)
    if rank != 1:
        return "skipped"
    try:
        sap.sap_attention(q[:-1], k, v, plan, groups)
    except ValueError as error:
        return f"ValueError: {error}"
    return "ok"


def test_a_rank_failing_its_inputs_on_a_checked_plan_raises_alone(pool4: WorkerPool) -> None:
    """Where the group checked the plan already, its peers do not enter the agreement check
    again (a later layer): the rank raises its own error at once rather than wait there for
    them until the group's timeout."""
    results = pool4.run(bad_inputs_on_a_checked_plan_job, timeout=30)
    assert results[1].startswith("ValueError: q has 14 tokens"), results[1]
    assert results[0] == results[2] == results[3] == "skipped"


# ---- NCCL's order: each group's batched P2P calls run one after another -------------------------


def in_order_p2p(stuck_after_s: float):
    """Make `dist.batch_isend_irecv` run each process group's batches one after another, in the
    order they are posted, each done only when its sends and receives are (as NCCL runs a
    group's batches on one stream); a batch not done within `stuck_after_s` raises when waited
    for. Returns a function that undoes it."""
    import queue
    import threading

    real = dist.batch_isend_irecv
    lanes: dict[int, queue.Queue] = {}

    class Batch:
        def __init__(self) -> None:
            self.done, self.error = threading.Event(), None

        def wait(self, timeout=None) -> bool:
            if not self.done.wait(stuck_after_s):
                raise RuntimeError(f"batched P2P not done after {stuck_after_s} s: the group's batches wait for each other")
            if self.error is not None:
                raise self.error
            return True

    def run_in_order(lane: queue.Queue) -> None:
        while True:
            ops, batch = lane.get()
            try:
                for work in real(ops):
                    work.wait()
            except Exception as exc:  # the backend's error type varies
                batch.error = RuntimeError(str(exc))
            batch.done.set()

    def posted(ops):
        group = id(ops[0].group)
        if group not in lanes:
            lanes[group] = queue.Queue()
            threading.Thread(target=run_in_order, args=(lanes[group],), daemon=True).start()
        batch = Batch()
        lanes[group].put((ops, batch))
        return [batch]

    dist.batch_isend_irecv = posted

    def undo() -> None:
        dist.batch_isend_irecv = real

    return undo


def in_order_job(rank: int, world: int, cu: list[int], recompute_kv: bool,
                 schedules: list[str]) -> dict[str, torch.Tensor]:
    """Forward and backward on one outer group of `world` ranks with batched P2P run in order per
    group, this rank in `schedules[rank]`: its rows' positions, output and input gradients."""
    import megatron_sap as sap
    from megatron_sap.planning import PlanCache

    groups = groups_for(1, world)
    plan = sap.plan_sequences(cu, outer_size=world, cache=PlanCache())
    q, k, v, dout = make_inputs(cu, 4, 2, 8, seed=len(cu))
    idx = plan.local_indices(groups.cp_rank)
    local = [t[idx].requires_grad_() for t in (q, k, v)]
    undo = in_order_p2p(stuck_after_s=20.0)
    try:
        out = sap.sap_attention(*local, plan, groups, recompute_kv=recompute_kv, schedule=schedules[rank])
        out.backward(dout[idx])
    finally:
        undo()
    return {"indices": idx, "out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}


def in_order_reference(cu: list[int]) -> dict[str, torch.Tensor]:
    """`in_order_job`'s inputs through the dense reference: the output and input gradients."""
    q, k, v, dout = make_inputs(cu, 4, 2, 8, seed=len(cu))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = dense_attention(q, k, v, torch.tensor(cu))[0]
    return dict(zip(("out", "dq", "dk", "dv"), (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))))


pool6 = make_pool_fixture(6, timeout=120)


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_exchanges_complete_when_each_group_runs_its_batches_in_order(pool6: WorkerPool, recompute_kv: bool) -> None:
    """NCCL runs a group's batched P2P calls one after another in the order each rank posts
    them, so every rank must post its exchanges in one order that all ranks share (gloo lets
    them progress in any order, which hides a mistake). One document over six ranks (whose
    steps interleave so that a backward posting refetches and returns by each rank's own step
    count waits in a cycle), and random rows, in every mix of schedules."""
    rng = random.Random(66)
    rows = [[0, 96], [0, 3072]] + [random_cu_seqlens(rng, 6 * rng.randint(16, 96), kind) for kind in ("long", "mixture")]
    for cu in rows:
        ref = in_order_reference(cu)
        for schedules in (["pipelined"] * 6, ["gathered"] * 6, ["pipelined", "gathered", "auto"] * 2):
            results = pool6.run(in_order_job, cu, recompute_kv, schedules, timeout=180)
            for r in results:
                for name in ("out", "dq", "dk", "dv"):
                    error = (r[name] - ref[name][r["indices"]]).abs().max().item()
                    assert error < 1e-10, (cu, schedules, name, error)
