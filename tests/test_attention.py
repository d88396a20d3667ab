"""Distributed SAP attention on gloo against the dense float64 reference."""
from __future__ import annotations

import random
import zlib

import pytest
import torch

import megatron_sap as sap
from dist_pool import make_pool_fixture
from megatron_sap.planning import CostModel
from megatron_sap.planning.cost_model import LINK_INTER, LINK_INTRA
from megatron_sap.reference import dense_attention
from sap_cases import collective_order, host_reads, host_reads_recorded, make_inputs, random_cu_seqlens, run_rank

pool2 = make_pool_fixture(2, timeout=120)
pool3 = make_pool_fixture(3, timeout=120)
pool4 = make_pool_fixture(4, timeout=180)
pool6 = make_pool_fixture(6, timeout=240)
pool8 = make_pool_fixture(8, timeout=240)

TOL = {"float64": 1e-10, "float32": 1e-5}


def reference(cu: list[int], heads: int, kv_heads: int, dim: int, seed: int, scale: float | None, perturb_doc=None):
    q, k, v, dout = make_inputs(cu, heads, kv_heads, dim, seed)
    if perturb_doc is not None:
        lo, hi = cu[perturb_doc], cu[perturb_doc + 1]
        for t in (q, k, v):
            t[lo:hi] += 1.0
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = dense_attention(q, k, v, torch.tensor(cu), causal=True, softmax_scale=scale)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def assemble(results: list[dict], total: int) -> dict[str, torch.Tensor]:
    """Scatter every rank's local rows back to global packed positions."""
    full = {}
    for name in ("out", "dq", "dk", "dv"):
        shape = (total, *results[0][name].shape[1:])
        t = torch.full(shape, float("nan"), dtype=torch.float64)
        for r in results:
            t[r["indices"]] = r[name].to(torch.float64)
        full[name] = t
    return full


def check_against_reference(pool, cu, inner, heads, kv_heads, dim, dtype, seed, scale=None, **kw) -> dict:
    results = pool.run(run_rank, cu, inner, heads, kv_heads, dim, dtype, seed, scale, **kw)
    chunks = kw.get("inner_chunks", "auto")
    if isinstance(chunks, int):  # an explicit count: every rank ran it (one op, unchunked at 1)
        assert all(r["chunks_run"] == ([chunks] if chunks > 1 else []) for r in results), (chunks, results[0]["chunks_run"])
    got = assemble(results, cu[-1])
    ref = reference(cu, heads, kv_heads, dim, seed, scale)
    for name, value in got.items():
        err = (value - ref[name]).abs().max().item()
        assert err <= TOL[dtype] * max(1.0, ref[name].abs().max().item()), (name, err, cu)
    return got


KINDS = ["one", "tiny", "long", "zeros", "mixture"]


@pytest.mark.parametrize("kind", KINDS)
def test_world2_float64(pool2, kind):
    rng = random.Random(zlib.crc32(kind.encode()) % 1000)  # not hash(): it changes with PYTHONHASHSEED
    for case in range(3):
        cu = random_cu_seqlens(rng, 2 * rng.randint(20, 120), kind)
        heads, kv = rng.choice([(4, 4), (4, 2), (6, 1)])
        check_against_reference(pool2, cu, 1, heads, kv, 8, "float64", seed=case, scale=rng.choice([None, 0.3]))


@pytest.mark.parametrize("kind", KINDS)
def test_world3_float64(pool3, kind):
    rng = random.Random(7 + len(kind))
    for case in range(2):
        cu = random_cu_seqlens(rng, 3 * rng.randint(20, 100), kind)
        check_against_reference(pool3, cu, 1, 4, 2, 8, "float64", seed=case)


@pytest.mark.parametrize("inner", [1, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_world4_float64(pool4, inner, kind):
    rng = random.Random(31 * inner + len(kind))
    cu = random_cu_seqlens(rng, 4 * rng.randint(32, 128), kind)
    heads, kv = rng.choice([(4, 4), (8, 2), (4, 1)])  # includes KV heads fewer than the inner size
    check_against_reference(pool4, cu, inner, heads, kv, 8, "float64", seed=inner)


@pytest.mark.parametrize("inner", [1, 2, 4])
def test_world8_float64(pool8, inner):
    rng = random.Random(inner)
    for kind in ("mixture", "long"):
        cu = random_cu_seqlens(rng, 8 * rng.randint(24, 64), kind)
        check_against_reference(pool8, cu, inner, 8, 2, 8, "float64", seed=3)


@pytest.mark.parametrize("inner", [1, 2, 3, 6])
def test_world6_mixed_layouts(pool6, inner):
    """Six ranks as 1 x 6, 2 x 3, 3 x 2 and 6 x 1 (neither side a power of two), each
    case drawn at random from a fixed seed: batch kind, query and KV heads (KV heads
    replicated where fewer than the inner size), kernel tile, schedule (per outer rank
    too) and recomputed K/V."""
    rng = random.Random(600 + inner)
    for _ in range(4):
        kv = rng.choice([1, inner, 2 * inner])
        heads = rng.choice([1, 2]) * max(kv, inner) * (2 if kv < inner else 1)
        cu = random_cu_seqlens(rng, 6 * rng.randint(8, 64), rng.choice(KINDS))
        check_against_reference(pool6, cu, inner, heads, kv, rng.choice([4, 8]), "float64", seed=rng.randint(0, 99),
                                fresh_plan=True, tile=rng.choice([None, 4, 16]),
                                schedule=rng.choice(["pipelined", "gathered", "mixed"]), recompute_kv=rng.random() < 0.3)


def test_odd_outer_sizes_exchange_as_the_plan_chooses(pool3):
    """Three outer ranks: plans choose pairwise rounds or ring shifts (each rank sending to
    one peer and receiving from another in a step); both kinds occur here and match the
    reference."""
    rng = random.Random(33)
    chosen = set()
    for case in range(8):
        cu = random_cu_seqlens(rng, 3 * rng.randint(40, 200), rng.choice(["one", "long", "mixture"]))
        results = pool3.run(run_rank, cu, 1, 4, 2, 8, "float64", case, None, tile=rng.choice([None, 16]))
        chosen |= {r["ring_exchanges"] for r in results}
        got, ref = assemble(results, cu[-1]), reference(cu, 4, 2, 8, case, None)
        for name, value in got.items():
            assert (value - ref[name]).abs().max().item() <= TOL["float64"] * max(1.0, ref[name].abs().max().item())
    assert chosen == {False, True}


@pytest.mark.parametrize("recompute_kv", [False, True])
@pytest.mark.parametrize("schedule", ["pipelined", "gathered", "mixed"])
def test_ring_exchanges_match_reference(pool6, schedule, recompute_kv):
    """Ring shifts forced at 1 x 6, 2 x 3 and 3 x 2 (inner x outer: outer sizes 6, 3 and 2),
    in every schedule, with and without recomputed K/V: outputs and gradients are the
    reference's."""
    rng = random.Random(60 + len(schedule) + recompute_kv)
    for inner in (1, 2, 3):
        cu = random_cu_seqlens(rng, 6 * rng.randint(8, 48), rng.choice(KINDS))
        check_against_reference(pool6, cu, inner, 6, 3 if inner == 3 else 2, 8, "float64", seed=inner,
                                ring=True, tile=rng.choice([None, 4, 16]), schedule=schedule,
                                recompute_kv=recompute_kv)


@pytest.mark.parametrize("inner", [1, 2])
def test_world4_whole_tile_chunks(pool4, inner):
    """With an 8-token tile the planner splits even these short documents into chunks of
    whole tiles (the last one short); the result is still exact."""
    rng = random.Random(40 + inner)
    # The first row's 900-token document is split head-to-tail in 112- and 120-token chunks.
    rows = [[0, 900, 950, 1000, 1024]] + [random_cu_seqlens(rng, 4 * rng.randint(64, 160), kind) for kind in ("long", "mixture")]
    for cu in rows:
        check_against_reference(pool4, cu, inner, 4, 2, 8, "float64", seed=inner, tile=8)


def test_float32_and_recompute(pool4):
    rng = random.Random(5)
    cu = random_cu_seqlens(rng, 4 * 96, "mixture")
    check_against_reference(pool4, cu, 1, 4, 2, 16, "float32", seed=1)
    check_against_reference(pool4, cu, 2, 4, 2, 16, "float64", seed=1, recompute_kv=True)


@pytest.mark.parametrize("inner", [1, 2, 4])
def test_gathered_schedule(pool4, inner):
    """The gathered schedule (each query piece once all its keys are in, as one causal
    segment over all of them) is exact too: float64 over every kind of batch, with GQA,
    whole-tile chunks, recomputed K/V and float32."""
    rng = random.Random(90 + inner)
    for kind in KINDS:
        cu = random_cu_seqlens(rng, 4 * rng.randint(32, 128), kind)
        heads, kv = rng.choice([(4, 4), (8, 2), (4, 1)])
        check_against_reference(pool4, cu, inner, heads, kv, 8, "float64", seed=inner, schedule="gathered")
    cu = random_cu_seqlens(rng, 4 * rng.randint(64, 160), "long")
    check_against_reference(pool4, cu, inner, 4, 2, 8, "float64", seed=2, tile=8, schedule="gathered")
    check_against_reference(pool4, cu, inner, 4, 2, 8, "float64", seed=3, recompute_kv=True, schedule="gathered")
    check_against_reference(pool4, cu, inner, 4, 2, 16, "float32", seed=4, schedule="gathered")


def test_gathered_schedule_world8(pool8):
    rng = random.Random(8)
    for inner, kind in ((1, "mixture"), (2, "long"), (1, "zeros")):
        cu = random_cu_seqlens(rng, 8 * rng.randint(24, 64), kind)
        check_against_reference(pool8, cu, inner, 8, 2, 8, "float64", seed=5, schedule="gathered")


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_ranks_may_run_different_schedules(pool8, recompute_kv):
    """Ranks may be given different schedules: pipelined and gathered ranks exchange the same
    rows in the same order, forward and backward, so a mix is exact and does not deadlock."""
    rng = random.Random(12)
    for inner, kind in ((1, "long"), (2, "mixture")):
        cu = random_cu_seqlens(rng, 8 * rng.randint(24, 64), kind)
        check_against_reference(pool8, cu, inner, 8, 2, 8, "float64", seed=6, schedule="mixed", recompute_kv=recompute_kv)


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_backward_in_the_reverse_of_the_forward_order(pool8, recompute_kv):
    """Rows whose plans run the backward's exchanges in the reverse of the forward's order
    (`Plan.backward_exchange_order`): exact in every schedule, with and without recompute_kv,
    and no rank waits for another forever."""
    for cu, inner in (([0, 87, 185, 384], 1), ([0, 266, 640], 2)):
        plan = sap.plan_sequences(cu, outer_size=8 // inner, inner_size=inner, cost_model="h100", cache=None)
        forward = plan.exchange_order()
        assert len(forward) > 2 and plan.backward_exchange_order() == {p: len(forward) - 1 - i for p, i in forward.items()}
        for schedule in ("pipelined", "gathered", "mixed"):
            check_against_reference(pool8, cu, inner, 8, 2, 8, "float64", seed=7, schedule=schedule, recompute_kv=recompute_kv)


def test_world1_is_plain_varlen():
    """P = 1 runs in-process without groups or communication."""
    import megatron_sap as sap

    rng = random.Random(11)
    for kind in KINDS:
        cu = random_cu_seqlens(rng, rng.randint(50, 300), kind)
        plan = sap.plan_sequences(cu)
        assert torch.equal(plan.local_indices(0), torch.arange(cu[-1]))
        q, k, v, dout = make_inputs(cu, 4, 2, 8, seed=2)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = sap.sap_attention(q, k, v, plan)
        out.backward(dout)
        ref = reference(cu, 4, 2, 8, 2, None)
        for name, value in (("out", out.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            assert (value - ref[name]).abs().max().item() < 1e-10, (name, kind)


def test_output_owns_its_storage():
    """The op's output is a fresh tensor (the kernels may return views of padded buffers), so
    in-place changes to it fail only where autograd needs it, as for any op's output."""
    import megatron_sap as sap

    cu = [0, 5, 40, 41, 96]
    q, k, v, _ = make_inputs(cu, 4, 2, 8, seed=4)
    for dtype in (torch.float32, torch.float64):
        out = sap.sap_attention(q.to(dtype), k.to(dtype), v.to(dtype), sap.plan_sequences(cu))
        assert out._base is None and out.is_contiguous()


def test_deterministic_across_runs_and_cache(pool4):
    rng = random.Random(9)
    cu = random_cu_seqlens(rng, 4 * 80, "long")
    first = pool4.run(run_rank, cu, 2, 4, 2, 8, "float32", 4)
    again = pool4.run(run_rank, cu, 2, 4, 2, 8, "float32", 4)
    fresh = pool4.run(run_rank, cu, 2, 4, 2, 8, "float32", 4, fresh_plan=True)
    for a, b, c in zip(first, again, fresh):
        for name in ("out", "dq", "dk", "dv"):
            assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name]), name


SHARED_CALLS = [0, 59, 129, 256]  # at 1 x 4 some kernel calls hold rows of two documents


@pytest.mark.parametrize("inner, dtype, schedule, recompute_kv, inner_chunks, kind", [
    (1, "float32", "pipelined", False, "auto", "mixture"),
    (1, "float32", "pipelined", False, "auto", "shared calls"),
    (1, "float32", "gathered", False, "auto", "shared calls"),
    (2, "float32", "pipelined", False, 2, "shared calls"),
    (1, "float32", "gathered", False, "auto", "mixture"),
    (2, "bfloat16", "pipelined", True, "auto", "long"),
    (2, "float32", "gathered", False, 2, "long"),
    (4, "bfloat16", "pipelined", False, "auto", "mixture"),
])
def test_no_contamination(pool4, inner, dtype, schedule, recompute_kv, inner_chunks, kind):
    """Changing one document (a few spread over the row, and the longest, split over ranks)
    changes no other document's outputs or gradients, bitwise: flat and two-level, in both
    schedules, with recompute_kv and head chunks, in float32 and bfloat16, and on a row
    whose kernel calls hold rows of two documents (which a leak across a call's rows, in
    the kernels or the merge, would show)."""
    cu = SHARED_CALLS if kind == "shared calls" else random_cu_seqlens(random.Random(21), 4 * 64, kind)
    docs = [d for d in range(len(cu) - 1) if cu[d + 1] > cu[d]]
    options = dict(schedule=schedule, recompute_kv=recompute_kv, inner_chunks=inner_chunks)
    base = assemble(pool4.run(run_rank, cu, inner, 4, 2, 8, dtype, 6, **options), cu[-1])
    for target in set(docs[:: max(1, len(docs) // 4)]) | {max(docs, key=lambda d: cu[d + 1] - cu[d])}:
        moved = assemble(pool4.run(run_rank, cu, inner, 4, 2, 8, dtype, 6, perturb_doc=target, **options), cu[-1])
        inside = torch.zeros(cu[-1], dtype=torch.bool)
        inside[cu[target] : cu[target + 1]] = True
        for name in ("out", "dq", "dk", "dv"):
            assert torch.equal(base[name][~inside], moved[name][~inside]), (name, target)
            assert not torch.equal(base[name][inside], moved[name][inside]), (name, target)


@pytest.mark.parametrize("inner, kv, schedule, recompute_kv", [
    (1, 2, "pipelined", False), (2, 2, "pipelined", False), (4, 2, "pipelined", False), (4, 1, "pipelined", False),
    (1, 2, "gathered", False), (2, 2, "gathered", False), (1, 2, "auto", True), (2, 2, "auto", True)])
def test_bytes_sent_match_plan(pool4, inner, kv, schedule, recompute_kv):
    """Each rank's bytes counted at its sends are the plan's `stats` (with `recompute_kv`,
    the backward's second K/V exchange: every rank sends its K/V twice)."""
    rng = random.Random(13)
    cu = random_cu_seqlens(rng, 4 * 100, "long")
    heads, dim = 4, 8
    results = pool4.run(run_rank, cu, inner, heads, kv, dim, "float64", 1, count_bytes=True, schedule=schedule,
                        recompute_kv=recompute_kv)
    stats = results[0]["stats"]
    per_token = 2 * max(kv, inner) * dim * 8 / inner  # K and V rows of this rank's heads (replicated), float64
    fetches = 2 if recompute_kv else 1
    for r in results:
        outer_rank = r["cp_rank"] // inner
        expected = (fetches * stats["sent_tokens_per_outer_rank"][outer_rank]
                    + stats["recv_tokens_per_outer_rank"][outer_rank]) * per_token
        assert r["p2p_bytes"] == expected
        assert sum(stats["sent_bytes_per_rank"]) == pytest.approx(sum(stats["recv_bytes_per_rank"]))
        # the inner all-to-all and the P2P steps together: what the plan reports per rank
        assert r["p2p_bytes"] + r["a2a_bytes"] == pytest.approx(stats["sent_bytes_per_rank"][r["cp_rank"]])
    assert any(r["p2p_bytes"] for r in results) == (inner < 4)
    assert all(r["a2a_bytes"] for r in results) == (inner > 1)


@pytest.mark.parametrize("inner, gpus_per_node", [(2, 1), (4, 2), (4, 4)])
def test_bytes_by_link_match_plan_where_inner_groups_span_nodes(pool4, inner, gpus_per_node):
    """Each rank's bytes to peers on its node and on other nodes, counted at the sends
    (the inner all-to-alls too, whose groups here span nodes but at (4, 4)), are the plan's."""
    import dataclasses

    cu = random_cu_seqlens(random.Random(14), 4 * 100, "long")
    results = pool4.run(run_rank, cu, inner, 4, 2, 8, "float64", 1, count_bytes=True, gpus_per_node=gpus_per_node)
    stats = results[0]["stats"]
    model = dataclasses.replace(CostModel.preset("h100"), gpus_per_node=gpus_per_node)
    for r in results:
        rank = r["cp_rank"]
        by_link = {LINK_INTRA: 0, LINK_INTER: 0}
        for peer, nbytes in r["bytes_by_peer"].items():
            by_link[model.link_between(rank, peer)] += nbytes
        assert by_link[LINK_INTRA] == pytest.approx(stats["sent_bytes_intra_per_rank"][rank])
        assert by_link[LINK_INTER] == pytest.approx(stats["sent_bytes_inter_per_rank"][rank])
    assert any(stats["sent_bytes_inter_per_rank"]) == (gpus_per_node < inner)


@pytest.mark.parametrize("inner", [1, 2])
def test_outer_group_runs_a_collective_before_its_first_exchange(pool4, inner):
    """NCCL builds a group's communicator on its first call, which every rank of the group
    must make; a rank whose program moves nothing would leave the others waiting in their
    first batched P2P. So each outer group runs one all-reduce first, once per group."""
    cu = random_cu_seqlens(random.Random(3), 4 * 64, "mixture")
    for log in pool4.run(collective_order, cu, inner):
        exchanges = [ranks for kind, ranks in log if kind == "p2p"]
        assert exchanges, "the plan moves nothing: pick a batch with transfers"
        outer = exchanges[0]
        assert all(ranks == outer for ranks in exchanges)
        first_exchange = log.index(("p2p", outer))
        assert log[:first_exchange].count(("all_reduce", outer)) == 1
        assert log.count(("all_reduce", outer)) == 1


def test_double_backward_is_refused():
    """The gradients exchanged in backward are not differentiable: asking for second-order
    gradients raises instead of returning wrong ones, also from a loss linear in the output
    (where dq came back a constant, and a gradient penalty lost its term silently)."""
    cu = [0, 5, 16]
    plan = sap.plan_sequences(cu, cache=None)
    q, k, v, dout = (t.requires_grad_() if i < 3 else t for i, t in enumerate(make_inputs(cu, 4, 2, 8, 0)))
    for loss in (lambda out: out.pow(2).sum(), lambda out: (out * dout).sum()):  # the latter: dout needs no grad
        out = sap.sap_attention(q, k, v, plan, None)
        (dq,) = torch.autograd.grad(loss(out), q, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            (q.pow(2).sum() + dq.pow(2).sum()).backward()  # a gradient penalty


@pytest.mark.parametrize("schedule", ["pipelined", "gathered"])
def test_forward_posts_its_exchanges_as_its_schedule_needs(monkeypatch, schedule):
    """The executor posts a rank's forward exchanges in its program's order. Pipelined: the
    first before the local kernel calls, each next one before the calls of the step before
    it (`FETCH_AHEAD`: with one hardware queue a kernel queued behind two exchanges would
    wait for the first to be done); gathered: all of them before any kernel (what
    `timeline` models). One rank of a 4-rank plan, its exchanges made local."""
    from types import SimpleNamespace

    from megatron_sap import attention
    from megatron_sap.comm.p2p import local_exchanges

    cu = [0, 700, 1500, 4096]
    plan = sap.plan_sequences(cu, outer_size=4, cache=None)
    rank = max(range(4), key=lambda r: len(plan.program(r, schedule=schedule).transfers))
    program = plan.program(rank, schedule=schedule)
    assert len(program.transfers) >= 2
    events = []
    post, forward = attention.post_exchange, attention.varlen_forward
    monkeypatch.setattr(attention, "post_exchange", lambda *a, **k: events.append(("post", a[5])) or post(*a, **k))
    monkeypatch.setattr(attention, "varlen_forward", lambda *a, **k: events.append(("kernel", None)) or forward(*a, **k))
    groups = SimpleNamespace(world_size=4, inner_size=1, outer_rank=rank, cp_rank=rank, outer_group=None,
                             outer_peer=lambda r: r)
    q, k, v = (torch.randn(plan.local_tokens, h, 16) for h in (4, 2, 2))
    with local_exchanges():
        sap.sap_attention(q, k, v, plan, groups, schedule=schedule, check_agreement=False)
    steps = program.transfers
    if schedule == "gathered":
        expected = [("post", step.round) for step in steps] + [("kernel", None)] * len(program.local_calls)
        expected += [("kernel", None)] * sum(len(step.calls) for step in steps)
    else:
        expected = [("post", steps[0].round)] + [("kernel", None)] * len(program.local_calls)
        for i, step in enumerate(steps):
            expected += [("post", steps[i + 1].round)] if i + 1 < len(steps) else []
            expected += [("kernel", None)] * len(step.calls)
    assert events == expected


@pytest.mark.parametrize("inner", [1, 2, 4])
@pytest.mark.parametrize("schedule, recompute_kv", [("pipelined", False), ("pipelined", True), ("gathered", False),
                                                    ("gathered", True)])
def test_executor_reads_no_tensor_values_on_the_host(pool4, inner, schedule, recompute_kv):
    """No host sync in the hot loop: once a rank's program is compiled and the plan checked,
    forward and backward read no tensor's values on the host outside the kernels (each such
    read would wait for the GPU; `host_reads_recorded`). Documents split over every rank
    and short ones kept whole."""
    cu = [0, 3, 40, 41, 300, 1500, 1600, 4096]
    results = pool4.run(host_reads, cu, inner, schedule, recompute_kv)
    assert results == [[]] * 4


def test_the_host_read_check_sees_a_read_in_sap_attention():
    """The check above can fail: `check_finite=True` reads every rank's NaN/Inf count on the
    host (documented as a host sync), and the check records where."""
    cu = [0, 5, 16]
    plan = sap.plan_sequences(cu, cache=None)
    q, k, v, dout = make_inputs(cu, 4, 2, 8, 0)
    found = {}
    for check_finite in (False, True):
        calls: list[str] = []
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        with host_reads_recorded(calls):
            sap.sap_attention(ql, kl, vl, plan, check_finite=check_finite).backward(dout)
            q.sum().item()  # a read outside megatron_sap is not the check's business
        found[check_finite] = calls
    assert found[False] == []
    assert found[True] and all(c.startswith("Tensor.__bool__ at attention.py:") for c in found[True]), found


@pytest.mark.parametrize("inner", [2, 4])
@pytest.mark.parametrize("schedule", ["pipelined", "gathered"])
def test_inner_all_to_alls_in_head_chunks(pool4, inner, schedule):
    """The Ulysses all-to-alls in head chunks under the kernels (`inner_chunks`): every
    batch kind, head shapes whose chunks read one KV head, a whole group or part of one,
    against the dense float64 reference, outputs and gradients."""
    rng = random.Random(101 * inner + len(schedule))
    shapes = [(8, 8, 2), (8, 2, 2), (8, 2, 4), (16, 4, 4), (8, 1, 2), (12, 4, 3)]
    for kind in KINDS:
        cu = random_cu_seqlens(rng, 4 * rng.randint(24, 96), kind)
        heads, kv, chunks = rng.choice([s for s in shapes if s[0] // inner % s[2] == 0
                                        and sap.planning.program.head_chunks(s[0], s[1], inner, s[2])])
        check_against_reference(pool4, cu, inner, heads, kv, 8, "float64", seed=len(kind), schedule=schedule,
                                inner_chunks=chunks, scale=rng.choice([None, 0.4]))


@pytest.mark.parametrize("inner", [2, 4])
def test_head_chunks_the_plan_chooses(pool4, inner):
    """Under a cost model whose all-to-alls are slow and free of latency, with the inner
    groups the nodes, the plan runs them in head chunks by default ("auto"): the result is
    the dense float64 reference's, and every rank sends the bytes the plan reports (the
    all-to-alls move the same rows, in more messages)."""
    rng = random.Random(77 + inner)
    slow = {"message_latency_us": 0.0, "intra_node_gbps": 1.0}
    for kind in ("mixture", "long"):
        cu = random_cu_seqlens(rng, 4 * rng.randint(40, 90), kind)
        got = check_against_reference(pool4, cu, inner, 16, 4, 8, "float64", seed=5, gpus_per_node=inner,
                                      cost_overrides=slow)
        results = pool4.run(run_rank, cu, inner, 16, 4, 8, "float64", 5, count_bytes=True, gpus_per_node=inner,
                            cost_overrides=slow)
        assert {r["plan_inner_chunks"] for r in results} == {results[0]["stats"]["inner_chunks"]}
        assert results[0]["stats"]["inner_chunks"] > 1
        stats = results[0]["stats"]
        for r in results:
            assert r["p2p_bytes"] + r["a2a_bytes"] == pytest.approx(stats["sent_bytes_per_rank"][r["cp_rank"]])
            assert torch.equal(r["out"], got["out"][r["indices"]].to(r["out"].dtype))


@pytest.mark.parametrize("schedule", ["pipelined", "gathered"])
def test_head_chunks_with_several_outer_steps(pool8, schedule):
    """Head chunks at `2 x 4`: programs of several outer steps, whose kernel events between
    the first and the last run once per chunk, against the dense float64 reference."""
    rng = random.Random(11 + len(schedule))
    for kind in ("mixture", "long"):
        cu = random_cu_seqlens(rng, 8 * rng.randint(24, 48), kind)
        check_against_reference(pool8, cu, 2, 8, 2, 8, "float64", seed=7, schedule=schedule, inner_chunks=2)
