"""Baseline CP methods against the dense float64 reference, and their traffic against the model."""
from __future__ import annotations

import dataclasses
import pytest
import torch
import torch.distributed as dist

from megatron_sap.baselines import METHODS, get, shard, unshard
from megatron_sap.baselines.hybrid import outer_order
from megatron_sap.baselines.ulysses import kv_heads_per_rank
from megatron_sap.comm.traffic import count_traffic
from megatron_sap.planning.cost_model import CostModel
from megatron_sap.reference import dense_attention

HEAD_DIM = 8
TOL = 1e-10


def _random_lengths(seed: int, count: int) -> list[int]:
    """A packed row of random documents: a third of them one token long, the rest 2..40, then one of 64."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 41, (count,), generator=gen)
    ones = torch.rand(count, generator=gen) < 1 / 3
    return [*torch.where(ones, 1, lengths).tolist(), 64]


# 1-token documents, and documents longer than T / P for P = 2 and 4.
DOCS = {
    "mixed": [1, 37, 1, 5, 70, 1, 13, 2],
    "random": _random_lengths(seed=7, count=9),
    "one_long": [97],
    "tiny": [1, 1, 0, 2, 1, 3],  # with an empty document
}


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _cost_model(heads: tuple[int, int], bytes_per_element: int) -> CostModel:
    """The test shape, two CP ranks per node so both link classes appear at P = 4."""
    return CostModel.preset("cpu", gpus_per_node=2).with_shape(heads[0], heads[1], HEAD_DIM, bytes_per_element)


def _groups(name: str, inner_size: int):
    """The group argument of `attention`: the world, or (inner, outer) groups for a2a+p2p
    (outer None where the inner group is the world)."""
    if name != "a2a+p2p":
        return dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    inner = outer = None
    for g in range(world // inner_size):  # every rank creates every group, in one order
        members = list(range(g * inner_size, (g + 1) * inner_size))
        group = dist.new_group(members)
        inner = group if rank in members else inner
    for u in range(inner_size):
        members = list(range(u, world, inner_size))
        group = dist.new_group(members)
        outer = group if rank in members else outer
    # One outer rank: no outer group, as `SAPGroups.outer_group` is then.
    return inner, (outer if world > inner_size else None)


def _layout_kwargs(name: str, inner_size: int) -> dict:
    return {"inner_size": inner_size} if name == "a2a+p2p" else {}


def run_method(rank: int, world_size: int, name: str, inner_size: int, cu: torch.Tensor,
               q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> dict:
    """One rank's forward and backward; padding rows are filled with noise to show they never matter."""
    method = get(name)
    layout = method.layout(cu, world_size, **_layout_kwargs(name, inner_size))
    group = _groups(name, inner_size)
    pad = layout.positions[rank] < 0
    gen = torch.Generator().manual_seed(1000 + rank)
    local = []
    for x in (q, k, v):
        part = shard(x, layout, rank)
        part[pad] = torch.randn(part[pad].shape, generator=gen, dtype=part.dtype)
        local.append(part.requires_grad_())
    with count_traffic() as log:
        out = method.attention(*local, layout, group)
        out.backward(shard(dout, layout, rank))
    return {
        "out": out.detach(),
        "grads": [x.grad for x in local],
        "sent": dict(log.sent_bytes),
    }


def _inputs(lengths: list[int], heads: tuple[int, int], seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    shapes = [(total, heads[0], HEAD_DIM), (total, heads[1], HEAD_DIM), (total, heads[1], HEAD_DIM),
              (total, heads[0], HEAD_DIM)]
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for shape in shapes]


CASES = [
    (name, inner, heads, docs)
    for name, inner in (("p2p", 1), ("all_gather", 1), ("a2a", 1), ("a2a+p2p", 2))
    for heads in ((4, 4), (4, 2), (4, 1))
    for docs in DOCS
]


def _check(dist_pool, name: str, inner_size: int, heads: tuple[int, int], docs: str,
           dtype: torch.dtype = torch.float64) -> None:
    """Outputs and gradients against the dense reference; measured bytes against model_stats."""
    world_size = dist_pool.world_size
    lengths = DOCS[docs]
    cu = _cu(lengths)
    q, k, v, dout = _inputs(lengths, heads, len(lengths) + heads[1], dtype)
    results = dist_pool.run(run_method, name, inner_size, cu, q, k, v, dout)

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, _ = dense_attention(*leaves, cu)
    ref_out.backward(dout.double())
    tol = TOL if dtype == torch.float64 else 1e-5

    layout = get(name).layout(cu, world_size, **_layout_kwargs(name, inner_size))
    out = unshard([r["out"] for r in results], layout)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=tol, rtol=0)
    for i, leaf in enumerate(leaves):
        grad = unshard([r["grads"][i] for r in results], layout)
        torch.testing.assert_close(grad.double(), leaf.grad, atol=tol, rtol=0, msg=lambda m: f"grad {'qkv'[i]}: {m}")
    for rank, r in enumerate(results):
        pad = layout.positions[rank] < 0
        assert not r["out"][pad].any() and not any(g[pad].any() for g in r["grads"])

    cost_model = _cost_model(heads, torch.finfo(dtype).bits // 8)
    stats = get(name).model_stats(cu, world_size, cost_model, inner_size=inner_size)
    for rank, r in enumerate(results):
        intra = sum(b for (_, peer), b in r["sent"].items() if cost_model.link_between(rank, peer) == "intra")
        assert sum(r["sent"].values()) == stats["sent_bytes_per_rank"][rank]
        assert intra == stats["sent_bytes_intra_per_rank"][rank]
    assert stats["tokens_per_rank"] == [layout.local_tokens] * world_size


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
@pytest.mark.parametrize("name,inner_size,heads,docs", [c for c in CASES if c[0] != "a2a+p2p"])
def test_matches_reference_world2(dist_pool, name, inner_size, heads, docs):
    _check(dist_pool, name, inner_size, heads, docs)


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
@pytest.mark.parametrize("name,inner_size,heads,docs", CASES + [
    ("a2a+p2p", 1, (4, 2), "mixed"),  # pure ring
    ("a2a+p2p", 4, (4, 2), "mixed"),  # pure Ulysses, KV heads replicated
])
def test_matches_reference_world4(dist_pool, name, inner_size, heads, docs):
    _check(dist_pool, name, inner_size, heads, docs)


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
@pytest.mark.parametrize("name,inner_size", [("p2p", 1), ("all_gather", 1), ("a2a", 1), ("a2a+p2p", 2)])
def test_float32_world4(dist_pool, name, inner_size):
    _check(dist_pool, name, inner_size, (4, 2), "mixed", torch.float32)


def ulysses_error(rank: int, world_size: int, heads_q: int, heads_kv: int) -> str:
    """The ValueError of `a2a` attention for a head shape that cannot be split."""
    layout = get("a2a").layout(_cu([8]), world_size)
    q = torch.zeros(layout.local_tokens, heads_q, HEAD_DIM, dtype=torch.float64)
    kv = torch.zeros(layout.local_tokens, heads_kv, HEAD_DIM, dtype=torch.float64)
    with pytest.raises(ValueError) as err:
        get("a2a").attention(q, kv, kv, layout, dist.group.WORLD)
    return str(err.value)


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
@pytest.mark.parametrize("heads_q,heads_kv,match", [
    (6, 6, "query heads (6) must be divisible by the inner (Ulysses) size (4)"),
    (12, 6, "key/value heads (6) must be divisible by the inner size (4)"),
    (12, 3, "key/value heads (3) fewer than the inner size (4) must divide it"),
])
def test_ulysses_head_errors(dist_pool, heads_q, heads_kv, match):
    assert all(match in message for message in dist_pool.run(ulysses_error, heads_q, heads_kv))


def layout_errors(rank: int, world_size: int) -> list[str]:
    """Every method's ValueError for a layout made for another world size or another method,
    or rows of another rank count; a2a+p2p's for its groups given as (outer, inner)."""
    cu = _cu([37, 50])
    messages = []
    for name in METHODS:
        module, group = get(name), _groups(name, 2)
        other = "all_gather" if name != "all_gather" else "p2p"
        for layout, rows in ((module.layout(cu, 2 * world_size, **_layout_kwargs(name, 2)), None),
                             (get(other).layout(cu, world_size), None),
                             (module.layout(cu, world_size, **_layout_kwargs(name, 2)), 5)):
            n = layout.local_tokens if rows is None else rows
            q = torch.zeros(n, 4, HEAD_DIM, dtype=torch.float64)
            with pytest.raises(ValueError) as err:
                module.attention(q, q[:, :2], q[:, :2], layout, group)
            messages.append(str(err.value))
        if name == "a2a+p2p":
            layout = module.layout(cu, world_size, inner_size=2)
            q = torch.zeros(layout.local_tokens, 4, HEAD_DIM, dtype=torch.float64)
            with pytest.raises(ValueError) as err:
                module.attention(q, q[:, :2], q[:, :2], layout, group[::-1])
            messages.append(str(err.value))
    return messages


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
def test_layouts_of_another_size_or_method_are_refused(dist_pool):
    """A layout made for another world size or method, or the wrong rows, would run and give
    a wrong answer (tokens never computed, rows read as another layout's): each is refused."""
    for messages in dist_pool.run(layout_errors):
        assert len(messages) == 13
        for i, name in enumerate(METHODS):
            size, method, rows = messages[3 * i: 3 * i + 3]
            assert "the layout was made for 8 ranks, but the group has 4" in size
            assert f"{name} attention got a layout made for" in method
            assert "q holds 5 rows, but the layout gives each rank" in rows
        assert "group must be (inner, outer): inner 2 consecutive ranks" in messages[-1]


def bad_inputs_then_a_good_call(rank: int, world_size: int) -> list[str]:
    """Every method with inputs its kernels would refuse (a head ratio, k/v rows, a backend
    or scale): the ValueError of each, then one good call on the same group, whose output
    is returned against the reference's as the last entry ('ok' or the error)."""
    cu = _cu([37, 50])
    q_all, k_all, v_all = (torch.randn(int(cu[-1]), h, HEAD_DIM, dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(i)) for i, h in enumerate((4, 2, 2)))
    messages = []
    for name in METHODS:
        module, group = get(name), _groups(name, 2)
        layout = module.layout(cu, world_size, **_layout_kwargs(name, 2))
        q, k, v = (shard(x, layout, rank) for x in (q_all, k_all, v_all))
        extra = torch.cat([k, k[:1]])
        for args, kwargs in (((q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1)), {}),
                             ((q, extra, torch.cat([v, v[:1]])), {}),
                             ((q, k, v), {"backend": "no-such-backend"}),
                             ((q, k, v), {"softmax_scale": float("nan")})):
            with pytest.raises(ValueError) as err:
                module.attention(*args, layout, group, **kwargs)
            messages.append(str(err.value))
        out = unshard(_all_gather(module.attention(q, k, v, layout, group)), layout)
        ref, _ = dense_attention(q_all, k_all, v_all, cu)
        messages.append("ok" if torch.allclose(out, ref, atol=1e-10, rtol=0) else f"{name}: wrong output")
    return messages


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


@pytest.mark.parametrize("dist_pool", [4], indirect=True)
def test_inputs_a_kernel_would_refuse_are_refused_before_any_exchange(dist_pool):
    """Each bad input raises on every rank before a message is posted: the p2p ring posted
    its first K/V before its first kernel call, so an error there left the message pending
    and the group's next operation waited until the timeout; all_gather read k/v rows
    past q's without a check (a wrong answer)."""
    for messages in dist_pool.run(bad_inputs_then_a_good_call):
        assert len(messages) == 5 * len(METHODS)
        for i, name in enumerate(METHODS):
            heads, rows, backend, scale, good = messages[5 * i: 5 * i + 5]
            assert "query heads (4) must be a multiple of key/value heads (3)" in heads, (name, heads)
            assert "k holds" in rows and "rows, but the layout gives each rank" in rows, (name, rows)
            assert "no-such-backend" in backend, (name, backend)
            assert "softmax_scale" in scale, (name, scale)
            assert good == "ok", (name, good)


@pytest.mark.parametrize("name", METHODS)
def test_an_empty_row_is_refused(name):
    with pytest.raises(ValueError, match=r"cu_seqlens describes an empty batch \(0 tokens\)"):
        get(name).layout(_cu([0]), 2, **_layout_kwargs(name, 2))


@pytest.mark.parametrize("name", sorted(METHODS))
@pytest.mark.parametrize(("cu_seqlens", "world_size", "inner_size", "message"), [
    ([0, 2.5, 5], 2, 1, r"cu_seqlens must hold integers, got 2.5"),  # would truncate to [0, 2, 5]
    ([[0, 2], [3, 5]], 2, 1, r"cu_seqlens must hold integers, got \[0, 2\]"),  # would flatten
    (torch.tensor([0.0, 4.0]), 2, 1, r"cu_seqlens must have an integer dtype"),
    ([0, 3, 2, 4], 2, 1, r"cu_seqlens must be non-decreasing"),
    ([0, 4], True, 1, r"world_size must be a positive integer, got True"),  # would read as 1
    ([0, 4], 2.0, 1, r"world_size must be a positive integer, got 2.0"),
    ([0, 4], 0, 1, r"world_size must be a positive integer, got 0"),
])
def test_model_stats_refuses_what_the_planner_refuses(name, cu_seqlens, world_size, inner_size, message):
    """The baselines' models take the planner's checks: no boundary truncated or
    flattened, no size that only reads as an integer."""
    with pytest.raises(ValueError, match=message):
        get(name).model_stats(cu_seqlens, world_size, CostModel(), inner_size=inner_size)


def test_hybrid_inner_size_must_be_a_positive_integer_dividing_the_world():
    for inner_size, message in ((2.0, "inner_size must be a positive integer, got 2.0"), (0, "positive integer, got 0"),
                                (3, r"inner_size \(3\) must divide world_size \(4\)")):
        with pytest.raises(ValueError, match=message):
            get("a2a+p2p").model_stats([0, 8], 4, CostModel(), inner_size=inner_size)


def test_kv_heads_per_rank():
    assert kv_heads_per_rank(8, 4, 2) == 2  # sharded
    assert kv_heads_per_rank(8, 2, 4) == 1  # replicated twice
    assert kv_heads_per_rank(8, 1, 8) == 1  # replicated to every rank
    with pytest.raises(ValueError, match=r"query heads \(6\) must be divisible by the inner \(Ulysses\) size \(4\)"):
        kv_heads_per_rank(6, 2, 4)
    with pytest.raises(ValueError, match=r"key/value heads \(6\) must be divisible by the inner size \(4\)"):
        kv_heads_per_rank(12, 6, 4)
    with pytest.raises(ValueError, match=r"must be a multiple of KV heads"):
        kv_heads_per_rank(8, 3, 2)
    with pytest.raises(ValueError, match=r"key/value heads \(6\) must be divisible by the inner size \(4\)"):
        get("a2a").model_stats(_cu([12]), 4, CostModel().with_shape(12, 6, 64))


@pytest.mark.parametrize("name", sorted(METHODS))
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_layout_places_every_token_once(name, world_size):
    inner = 2 if name == "a2a+p2p" and world_size % 2 == 0 else 1
    cu = _cu(DOCS["mixed"])
    layout = get(name).layout(cu, world_size, **_layout_kwargs(name, inner))
    held = torch.cat(layout.positions)
    assert sorted(held[held >= 0].tolist()) == list(range(int(cu[-1])))
    assert all(p.numel() == layout.local_tokens for p in layout.positions)
    assert layout.padding_tokens == int((held < 0).sum())


def test_zigzag_layout_chunks():
    layout = get("p2p").layout(_cu([16, 3]), 2)  # chunks of 4 and 1 (3 padded to 4)
    assert layout.positions[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, -1]
    assert layout.positions[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 17, 18]


def test_outer_order_matches_zigzag_of_outer_groups():
    """After the inner all-to-all, an inner group's reordered rows are its outer zigzag chunks."""
    lengths, world, inner = [16, 9, 1], 4, 2
    layout = get("a2a+p2p").layout(_cu(lengths), world, inner_size=inner)
    padded = [16, 16, 8]  # each document padded to a multiple of 2P
    outer = get("p2p").layout(_cu(padded), world // inner)
    for g in range(world // inner):
        stacked = torch.cat([layout.positions[g * inner + u] for u in range(inner)])
        reordered = stacked[outer_order(layout.chunk_sizes, inner, torch.device("cpu"))]
        pos = outer.positions[g]
        doc = torch.searchsorted(_cu(padded), pos, right=True) - 1
        offset = pos - _cu(padded)[doc]
        expected = torch.where(offset < torch.tensor(lengths)[doc], _cu(lengths)[doc] + offset, -1)
        assert torch.equal(reordered, expected)


def test_a2a_model_prices_one_all_to_all_per_tensor():
    """As Transformer Engine runs it: q, k, v, out, dout, dq, dk, dv each its own all-to-all,
    each paying (P - 1) message latencies: eight a layer."""
    base = CostModel().with_shape(8, 2, 64)
    cu = _cu([1024] * 4)
    slow = dataclasses.replace(base, message_latency_us=base.message_latency_us + 100.0)
    a, b = get("a2a").model_stats(cu, 4, base), get("a2a").model_stats(cu, 4, slow)
    assert b["modelled_time_s"] - a["modelled_time_s"] == pytest.approx(8 * 3 * 100e-6)
    assert b["sent_bytes_per_rank"] == a["sent_bytes_per_rank"]
    # The hybrid's inner all-to-alls too (one inner group of all 4 ranks: no ring messages).
    a, b = (get("a2a+p2p").model_stats(cu, 4, m, inner_size=4) for m in (base, slow))
    assert b["modelled_time_s"] - a["modelled_time_s"] == pytest.approx(8 * 3 * 100e-6)


def test_model_stats_shape_and_balance():
    cost_model = CostModel()
    cu = _cu([4096] * 4)
    p2p = get("p2p").model_stats(cu, 8, cost_model)
    gathered = get("all_gather").model_stats(cu, 8, cost_model)
    for stats in (p2p, gathered, get("a2a").model_stats(cu, 8, cost_model),
                  get("a2a+p2p").model_stats(cu, 16, cost_model, inner_size=8)):
        assert set(stats) >= {"tokens_per_rank", "padding_tokens", "pairs_per_rank", "imbalance",
                              "sent_bytes_per_rank", "recv_bytes_per_rank", "sent_bytes_intra_per_rank",
                              "sent_bytes_inter_per_rank", "modelled_time_s", "ideal_time_s"}
        assert stats["modelled_time_s"] >= stats["ideal_time_s"] > 0
        assert sum(stats["sent_bytes_per_rank"]) == sum(stats["recv_bytes_per_rank"])
    assert p2p["imbalance"] == pytest.approx(1.0, abs=1e-3)  # zigzag balances causal work
    assert gathered["imbalance"] > 1.4  # contiguous shards do not (3:1 within each document)


def test_hybrid_without_an_inner_group_points_to_the_ring():
    layout = get("a2a+p2p").layout(_cu([37, 27]), 2, inner_size=1)
    q = torch.zeros(layout.local_tokens, 4, HEAD_DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match="a2a\\+p2p needs its inner group .*use megatron_sap.baselines.ring_p2p"):
        get("a2a+p2p").attention(q, q, q, layout, (None, None))
    for group in (None, object(), (None,)):
        with pytest.raises(ValueError, match=r"a2a\+p2p takes its groups as the pair \(inner, outer\), got "):
            get("a2a+p2p").attention(q, q, q, layout, group)


def test_collective_and_exchange_times_pay_one_latency_per_message_on_each_link() -> None:
    """An all-to-all-style collective: each member sends one message to every other member;
    intra- and inter-node links run side by side, each paying its messages' latencies."""
    from megatron_sap.baselines.common import collective_seconds, exchange_seconds

    model = CostModel.preset("h100")  # 8 GPUs per node
    nbytes = 1 << 20
    assert collective_seconds(model, [0, 1, 2, 3], nbytes) == model.transfer_seconds(3 * nbytes, "intra", messages=3)
    # Rank 0 to ranks 1 and 2 (its node) and to 8, 9, 10 (the next): the slower of the two links.
    expected = max(model.transfer_seconds(2 * nbytes, "intra", messages=2),
                   model.transfer_seconds(3 * nbytes, "inter", messages=3))
    assert exchange_seconds(model, 0, {1: nbytes, 2: nbytes, 8: nbytes, 9: nbytes, 10: nbytes}) == expected
    assert exchange_seconds(model, 0, {}) == 0.0


def test_the_ring_model_overlaps_one_message_per_backward_step_and_no_trailing_hop() -> None:
    """As Transformer Engine runs it: forward, each step but the last overlaps the next KV;
    backward the other way round, the first step overlaps a KV message, the middle ones a
    KV + dKV message, the last (the own, diagonal block) the dKV coming home."""
    from megatron_sap.baselines.ring_p2p import ring_seconds, ring_sent

    model = CostModel.preset("h100")
    diagonal, off = 3 << 30, 1 << 30

    def f(pairs):
        return model.compute_seconds(pairs)

    def b(pairs):
        return model.compute_seconds(pairs, backward=True)

    # Computing only: every step's kernels.
    assert ring_seconds(model, 4, diagonal, off, 0.0, 0.0) == pytest.approx(f(diagonal) + 3 * f(off) + 3 * b(off) + b(diagonal))
    # Communication-bound: the messages.
    kv_s, bundle_s = 1.0, 1.5
    assert ring_seconds(model, 4, diagonal, off, kv_s, bundle_s) == pytest.approx(3 * kv_s + f(off) + 2 * kv_s + 2 * bundle_s)
    assert ring_seconds(model, 2, diagonal, off, kv_s, bundle_s) == pytest.approx(kv_s + f(off) + 2 * kv_s)
    assert ring_seconds(model, 1, diagonal, off, kv_s, bundle_s) == pytest.approx(f(diagonal) + b(diagonal))
    # Bytes: forward to the next rank, backward KV and dKV to the previous one.
    assert ring_sent(0, 4, 1, 10.0) == {1: 30.0, 3: 60.0}
    assert ring_sent(2, 8, 2, 10.0) == {4: 30.0, 0: 60.0}  # a ring of every second rank
    assert ring_sent(1, 4, 2, 10.0) == {3: 30.0} and ring_sent(0, 2, 2, 10.0) == {}


def test_summarize_counts_each_rank_s_bytes_received_from_what_the_others_send() -> None:
    """Uneven sends: the receiver's count is what was sent to it, split by link at the sender."""
    from megatron_sap.baselines.common import summarize

    model = CostModel.preset("h100")
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    stats = summarize(model, cu, [4, 4, 4], [10.0, 10.0, 10.0], [{1: 10, 2: 5}, {}, {1: 7}], 1e-3)
    assert stats["sent_bytes_per_rank"] == [15, 0, 7]
    assert stats["recv_bytes_per_rank"] == [0, 17, 5]
    assert stats["sent_bytes_intra_per_rank"] == [15, 0, 7] and stats["padding_tokens"] == 0


def test_device_copies_are_made_once_per_layout():
    """A method's index tensors and kernel boundaries go to the device once per layout (each
    copy from host memory waits for the GPU's queued work), kept with the layout."""
    from megatron_sap.baselines import ring_p2p
    from megatron_sap.baselines.common import zero_padding_rows

    layout = ring_p2p.layout([0, 5, 16], 2)
    made = []
    first = layout.on_device("x", "cpu", lambda d: made.append(d) or torch.ones(1))
    assert layout.on_device("x", torch.device("cpu"), lambda d: made.append(d) or torch.zeros(1)) is first
    assert made == [torch.device("cpu")]
    out = torch.ones(layout.local_tokens, 1, 1)
    for rank in (0, 1):
        zeroed = zero_padding_rows(out, layout, rank)
        assert torch.equal(zeroed[:, 0, 0], (layout.positions[rank] >= 0).to(out.dtype))
        mask = layout.on_device(f"real rows {rank}", "cpu", lambda d: pytest.fail("made again"))
        assert torch.equal(mask, layout.positions[rank] >= 0)



def second_order_job(rank: int, world_size: int) -> list[str]:
    """Per method: what asking for a second-order gradient through it raises."""
    cu = [0, 5, 20, 40]
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(40, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
    raised = []
    for name in METHODS:
        inner_size = 2 if name == "a2a+p2p" else 1
        layout = get(name).layout(cu, world_size, **_layout_kwargs(name, inner_size))
        for linear in (False, True):  # a loss linear in the output: dout needs no grad
            q, k, v = (shard(x, layout, rank).requires_grad_() for x in full)
            out = get(name).attention(q, k, v, layout, _groups(name, inner_size))
            loss = (out * torch.ones_like(out)).sum() if linear else out.pow(2).sum()
            (dq,) = torch.autograd.grad(loss, q, create_graph=True)
            try:
                (q.pow(2).sum() + dq.pow(2).sum()).backward()
                raised.append("nothing")
            except RuntimeError as error:
                raised.append(str(error))
    return raised


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_double_backward_is_refused(dist_pool):
    """The exchanged gradients and the kernels' backward are not differentiable: second-order
    gradients raise instead of coming out wrong (the ring's ran, off by up to 25%)."""
    for raised in dist_pool.run(second_order_job):
        assert len(raised) == 2 * len(METHODS)
        for name, message in zip([m for m in METHODS for _ in range(2)], raised):
            assert "once_differentiable" in message, (name, message)
