"""Compiled programs realise exactly the planned work: every outer rank's program is simulated
in one process with index bookkeeping (no process groups, no kernels)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megatron_sap as sap
from megatron_sap.bench.data import document_lengths
from megatron_sap.bench.packing import pack
from megatron_sap.planning import CostModel, KernelCall, RankProgram, compile_all
from megatron_sap.planning.evaluate import evaluate
from megatron_sap.planning.candidates import FILL_MIN_RANKS, candidates
from megatron_sap.planning.placement import build_all
from megatron_sap.planning.plan import DEFAULT_SLACKS
from megatron_sap.planning.program import exchange_round
from megatron_sap.planning.timeline import joint_schedule
from sap_cases import force_ring_exchanges
from test_planner import cu_seqlens_for, expected_mask

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def outer_batches(draw: st.DrawFn, max_outer: int = 16, max_tokens: int = 640) -> tuple[list[int], int]:
    """(cu_seqlens, R) with T divisible by R."""
    outer = draw(st.one_of(st.integers(1, max_outer), st.just(max_outer)))
    per_rank = draw(st.integers(1, max_tokens // outer))
    return draw(cu_seqlens_for(outer * per_rank)), outer


def row_array(rows, count: int) -> np.ndarray:
    """The row numbers a program's `Rows` (None, a slice or an index tensor) select of `count` rows."""
    if rows is None:
        return np.arange(count)
    if isinstance(rows, slice):
        assert rows.step is None and 0 <= rows.start < rows.stop <= count
        return np.arange(rows.start, rows.stop)
    return rows.numpy()


def segments(call: KernelCall, num_q: int, num_k: int):
    """(q_rows, k_rows, causal) of every segment of a call, rows as numpy arrays."""
    q_rows, k_rows = row_array(call.q_rows, num_q), row_array(call.k_rows, num_k)
    cu_q, cu_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
    assert call.cu_seqlens_q.dtype == call.cu_seqlens_k.dtype == torch.int32
    assert len(cu_q) == len(cu_k) and cu_q[0] == cu_k[0] == 0
    assert cu_q[-1] == len(q_rows) and cu_k[-1] == len(k_rows)
    assert call.max_seqlen_q == max(np.diff(cu_q), default=0)
    assert call.max_seqlen_k == max(np.diff(cu_k), default=0)
    for i in range(len(cu_q) - 1):
        yield q_rows[cu_q[i] : cu_q[i + 1]], k_rows[cu_k[i] : cu_k[i + 1]]


def add_call(count: np.ndarray, call: KernelCall, q_global: np.ndarray, k_global: np.ndarray) -> None:
    """Add the (q, k) pairs of one call to `count`; rows map to global positions through
    `q_global` (the rank's local rows) and `k_global` (the key source's rows)."""
    q_rows, k_rows = row_array(call.q_rows, len(q_global)), row_array(call.k_rows, len(k_global))
    assert len(np.unique(q_rows)) == len(q_rows), "a query row appears twice in one call"
    assert len(np.unique(k_rows)) == len(k_rows), "a key row appears twice in one call"
    for q, k in segments(call, len(q_global), len(k_global)):
        mask = np.ones((len(q), len(k)), dtype=bool)
        if call.causal:  # bottom-right aligned
            mask = np.tril(mask, k=len(k) - len(q))
        qi, ki = np.nonzero(mask)
        np.add.at(count, (q_global[q[qi]], k_global[k[ki]]), 1)


def transfer_at(program: RankProgram, round_: int):
    found = [t for t in program.transfers if t.round == round_]
    assert len(found) <= 1, f"rank {program.rank} has two transfers in round {round_}"
    return found[0] if found else None


def simulate(plan: sap.Plan, schedule: str = "pipelined") -> list[np.ndarray]:
    """Per outer rank, the [T, T] count of (q, k) pairs its program computes."""
    R, total = plan.outer_size, plan.total_tokens
    programs = [plan.program(r, schedule=schedule) for r in range(R)]
    rows = [plan.group_indices(r).numpy() for r in range(R)]
    counts = []
    for r, program in enumerate(programs):
        assert program.rank == r and program.num_tokens == plan.capacity == len(rows[r])
        count = np.zeros((total, total), dtype=np.int64)
        for call in program.local_calls:
            add_call(count, call, rows[r], rows[r])
        assert program.schedule == schedule
        source = [rows[r]]  # the gathered calls' key rows: local, then each step's received rows
        rounds = [t.round for t in program.transfers]
        assert len(set(rounds)) == len(rounds) and all(0 <= s < R for s in rounds)
        if plan.ring_exchanges:  # shift d: send to r + d, receive from r - d, in shift order
            assert rounds == sorted(rounds) and 0 not in rounds and not plan.exchange_order()
        else:  # steps follow the plan's one order of rank pairs, which every rank runs
            order = plan.exchange_order()
            positions = [order[min(r, (d - r) % R), max(r, (d - r) % R)] for d in rounds]
            assert positions == sorted(positions)
        for transfer in program.transfers:
            d = transfer.round
            # the peers: a shift's two, or the round's partner both ways
            dst, src = ((r + d) % R, (r - d) % R) if plan.ring_exchanges else ((d - r) % R,) * 2
            assert src != r and dst != r
            # The send side matches the peer's receive in the same round.
            if transfer.send_rows is None:
                assert transfer.send_peer is None
            else:
                sent = row_array(transfer.send_rows, len(rows[r]))
                assert transfer.send_peer == dst and len(sent) == transfer.send_tokens > 0
                peer = transfer_at(programs[dst], d)
                assert peer is not None and peer.recv_peer == r and peer.recv_tokens == len(sent)
            # The receive side: the rows are what the sender sends at this offset, in order.
            if transfer.recv_peer is None:
                assert transfer.recv_tokens == 0 and not transfer.calls
                continue
            assert transfer.recv_peer == src and transfer.recv_tokens > 0
            sender = transfer_at(programs[src], d)
            assert sender is not None and sender.send_peer == r and sender.send_rows is not None
            received = rows[src][row_array(sender.send_rows, len(rows[src]))]
            assert len(received) == transfer.recv_tokens
            source.append(received)
            for call in transfer.calls:
                if schedule == "gathered":  # keys in the rows there so far: the local ones, then each step's
                    assert call.causal and call.k_rows is not None
                    assert row_array(call.k_rows, sum(map(len, source))).max() < sum(map(len, source))
                    add_call(count, call, rows[r], np.concatenate(source))
                else:
                    add_call(count, call, rows[r], received)
        if schedule == "gathered":
            # Every query row gets its whole result from one call: nothing to merge.
            calls = program.local_calls + tuple(c for t in program.transfers for c in t.calls)
            used = np.concatenate([row_array(c.q_rows, len(rows[r])) for c in calls])
            np.testing.assert_array_equal(np.sort(used), np.arange(len(rows[r])))
        counts.append(count)
    return counts


def check_programs(plan: sap.Plan) -> None:
    """Each rank's program, in both schedules, covers the causal same-document pairs of its
    queries exactly once."""
    expected = expected_mask(list(plan.cu_seqlens)).astype(np.int64)
    stats = plan.stats()
    for schedule in ("pipelined", "gathered"):
        for r, count in enumerate(simulate(plan, schedule)):
            mine = np.zeros(plan.total_tokens, dtype=bool)
            mine[plan.group_indices(r).numpy()] = True
            np.testing.assert_array_equal(count[mine], expected[mine], err_msg=f"rank {r} misses or repeats pairs ({schedule})")
            assert not count[~mine].any(), f"rank {r} computes queries it does not hold ({schedule})"
        programs = [plan.program(r, schedule=schedule) for r in range(plan.outer_size)]
        joint_schedule(programs, plan.inner_size, plan.capacity, plan.cost_model)  # raises if they would wait forever
        sent = [plan.program(r, schedule=schedule).sent_tokens for r in range(plan.outer_size)]
        received = [plan.program(r, schedule=schedule).recv_tokens for r in range(plan.outer_size)]
        assert sent == stats["sent_tokens_per_outer_rank"]
        assert received == stats["recv_tokens_per_outer_rank"]


@SETTINGS
@given(outer_batches())
def test_programs_realise_the_work(batch):
    cu, outer = batch
    check_programs(sap.plan_sequences(cu, outer_size=outer, cache=None))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outer_batches(), st.sampled_from([1, 2]))
def test_ring_exchanges_realise_the_work(batch, inner):
    """Exchanges as ring shifts (which plans weigh at odd outer sizes), forced on plans of
    any outer size: every message meets its peer's in the same shift, the work is done
    exactly once, and the ranks' programs run together without waiting forever."""
    cu, outer = batch
    total = cu[-1]
    if total % (outer * inner):
        cu = [*cu[:-1], total + (-total) % (outer * inner)]
    check_programs(force_ring_exchanges(sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cache=None)))


def test_ring_shifts_take_one_step_fewer_than_pairwise_rounds_at_odd_sizes():
    """Where every rank needs K/V from every other (one document over an odd number of
    ranks, zigzag), pairwise exchanges need R rounds (no perfect matching: one rank idles
    in each), ring shifts R - 1 steps; with the exchanges longer than the kernels the ring
    is faster all ranks together by about one exchange, and the plan takes it."""
    model = replace(CostModel.preset("h100"), inter_node_gbps=2.0, intra_node_gbps=2.0)
    for R in (3, 5):
        cu = [0, 2048 * R]
        plan = sap.plan_sequences(cu, outer_size=R, cost_model=model, cache=None)
        pairs = compile_all(plan.placement, "pipelined", tile=model.tile)
        ring = compile_all(plan.placement, "pipelined", tile=model.tile, ring=True)
        assert all(len(p.transfers) == R - 1 for p in pairs + ring)
        assert sorted({t.round for p in pairs for t in p.transfers}) == list(range(R))
        assert sorted({t.round for p in ring for t in p.transfers}) == list(range(1, R))
        pair_s, ring_s = (max(t.forward_s for t in joint_schedule(p, 1, plan.capacity, model)) for p in (pairs, ring))
        assert ring_s < pair_s * (R - 0.5) / R
        assert plan.ring_exchanges
        even = sap.plan_sequences([0, 2048 * (R + 1)], outer_size=R + 1, cost_model=model, cache=None)
        assert not even.ring_exchanges  # weighed at odd outer sizes only


@settings(max_examples=30, deadline=None)
@given(outer_batches(max_outer=4, max_tokens=256), st.sampled_from([2, 4]))
def test_programs_with_inner_groups(batch, inner):
    cu, outer = batch
    total = cu[-1]
    if total % (outer * inner):
        cu = [*cu[:-1], total + (-total) % (outer * inner)]
    check_programs(sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cache=None))


@pytest.mark.parametrize("seed", range(4))
def test_every_candidate_compiles_correctly(seed):
    """Not only the winner: every candidate placement compiles to a correct program."""
    rng = np.random.default_rng(seed)
    outer, total = 8, 512
    cu = [0, *np.sort(rng.integers(0, total, size=12)).tolist(), total]
    model = CostModel.preset("h100")
    placements = list(build_all(candidates(cu[:-1], np.diff(cu).tolist(), outer, total // outer, model, DEFAULT_SLACKS)).values())
    assert {p.strategy for p in placements} >= {"zigzag", "contiguous"}
    for placement in placements:
        evaluation = evaluate(placement, 1, model)
        check_programs(sap.Plan(tuple(cu), outer, 1, model, placement, evaluation, {}))
        assert [p.rank for p in compile_all(placement)] == list(range(outer))


def test_a_rank_s_consecutive_pieces_of_one_document_are_one_local_segment():
    """The zigzag layout gives each rank a head and a tail chunk of every document, side by
    side: one causal segment over both computes their local pairs (each chunk's diagonal,
    the tail over the head) with one tile rounding, as the ring's diagonal step does, where
    three segments (two diagonals and a full block) each rounded to tiles."""
    model = CostModel.preset("h100")
    cu = [0, 80, 240, 512]  # zigzag over 4 ranks: 8 chunks of 10, 20 and 34 tokens, two of each on a rank
    placement = build_all(candidates(cu[:-1], np.diff(cu).tolist(), 4, 128, model, DEFAULT_SLACKS))["zigzag"]
    plan = sap.Plan(tuple(cu), 4, 1, model, placement, evaluate(placement, 1, model), {})
    check_programs(plan)
    for r in range(4):
        program = plan.program(r, schedule="pipelined")
        (local,) = program.local_calls  # no full blocks among a rank's own pieces
        assert local.causal and local.q_ranges is None and local.k_ranges is None
        assert [q for q, _ in local.seqlens] == [2 * (n // 8) for n in np.diff(cu)]


@pytest.mark.parametrize("seed", range(2))
def test_fill_candidates_compile_correctly(seed):
    """The fill passes' placements (weighed from FILL_MIN_RANKS outer ranks), whose last
    documents are cut through the rooms left, compile to correct programs too."""
    rng = np.random.default_rng(seed)
    outer = FILL_MIN_RANKS
    total = 48 * outer
    cu = [0, *np.sort(rng.integers(0, total, size=40)).tolist(), total]
    model = CostModel.preset("h100")
    placements = build_all(candidates(cu[:-1], np.diff(cu).tolist(), outer, total // outer, model, DEFAULT_SLACKS))
    filled = [p for name, p in placements.items() if name.endswith(", fill)")]
    assert any(p.ranks != placements[p.strategy.replace(", fill", "")].ranks for p in filled)  # fills happened
    for placement in filled:
        check_programs(sap.Plan(tuple(cu), outer, 1, model, placement, evaluate(placement, 1, model), {}))


@pytest.mark.parametrize("R", range(1, 10))
def test_exchange_rounds_pair_every_two_ranks_once(R):
    """Two ranks meet in one round, the same seen from either, and in each round a rank
    meets at most one other: the partner relation of a round is a matching."""
    for r in range(R):
        rounds = [exchange_round(r, p, R) for p in range(R) if p != r]
        assert len(set(rounds)) == len(rounds) and all(0 <= s < R for s in rounds)
        assert all(exchange_round(p, r, R) == exchange_round(r, p, R) for p in range(R))


def test_program_is_cached_and_moves_to_device():
    plan = sap.plan_sequences([0, 40, 100, 128], outer_size=4, cache=None)
    program = plan.program(1)
    assert plan.program(1) is program
    assert plan.program(1, device="cpu") is program
    moved = program.to(torch.device("cpu"))
    assert moved.sent_tokens == program.sent_tokens and moved.recv_tokens == program.recv_tokens


def _index_tensors(program: RankProgram) -> list:
    """Every `Rows` and `cu_seqlens` of a program, in order (None where a call takes all rows)."""
    out = []
    for call in (*program.local_calls, *(c for step in program.transfers for c in step.calls)):
        out += [call.q_rows, call.k_rows, call.cu_seqlens_q, call.cu_seqlens_k]
    return out + [step.send_rows for step in program.transfers]


def _expected_tensors(program: RankProgram) -> list:
    """`_index_tensors` spelled out from the ranges and segment lengths, one row at a time: a
    slice where the rows are one run of consecutive rows, else an index tensor."""
    def rows(ranges):
        if ranges is None:
            return None
        numbers = [i for rg in ranges for i in rg]
        if numbers and numbers == list(range(numbers[0], numbers[-1] + 1)):
            return slice(numbers[0], numbers[-1] + 1)
        return torch.tensor(numbers, dtype=torch.int64)

    def offsets(lengths):
        return torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)

    out = []
    for call in (*program.local_calls, *(c for step in program.transfers for c in step.calls)):
        out += [rows(call.q_ranges), rows(call.k_ranges), offsets([q for q, _ in call.seqlens]),
                offsets([k for _, k in call.seqlens])]
    return out + [rows(step.send_ranges) for step in program.transfers]


@SETTINGS
@given(outer_batches(), st.sampled_from(["pipelined", "gathered"]))
def test_a_moved_program_holds_the_tensors_its_calls_would_make(batch, schedule):
    """`RankProgram.to` makes every index tensor at once, as views of two buffers: each
    equals, in dtype and values, what the call or step makes from its ranges when first
    used (rows that are one run of consecutive rows: the same slice, no tensor); the
    cu_seqlens start 16-byte aligned and every tensor is contiguous."""
    cu, outer = batch
    plan = sap.plan_sequences(cu, outer_size=outer, cache=None)
    for r in range(outer):
        compiled = plan.program(r, schedule=schedule)
        moved = compiled.to("cpu")
        made, lazy = _index_tensors(moved), _index_tensors(compiled)  # the compiled calls make theirs here
        expected = _expected_tensors(compiled)
        assert len(made) == len(lazy) == len(expected)
        for want, got_lazy, got in zip(expected, lazy, made):
            assert (want is None) == (got is None) == (got_lazy is None)
            if isinstance(want, slice):
                assert got == got_lazy == want
            elif got is not None:
                for tensor in (got, got_lazy):
                    assert tensor.dtype == want.dtype and tensor.is_contiguous() and torch.equal(tensor, want)
        for call in (*moved.local_calls, *(c for step in moved.transfers for c in step.calls)):
            for offsets in (call.cu_seqlens_q, call.cu_seqlens_k):
                assert offsets.dtype == torch.int32 and offsets.data_ptr() % 16 == 0


def test_q_moving_bound_counts_the_programs_transfers(load_script):
    """scripts/q_moving_bound.py weighs one K/V message per (source, destination) pair of the plan."""
    script = load_script("q_moving_bound")
    model = CostModel.preset("h100")
    cu = [0, 5000, 5100, 9000, 9001, 12000, 16384]
    result = script.busiest_rank_bytes(cu, 2, 4, model, query_factor=5)
    plan = sap.plan_sequences(cu, outer_size=4, inner_size=2, cost_model=model, cache=None)
    messages = sum(t.recv_peer is not None for r in range(4) for t in plan.program(r).transfers)
    assert result["pairs"] == messages > 0
    assert 0 < result["cheaper"] <= result["kv_only"]
    sent = plan.stats()["sent_tokens_per_outer_rank"]
    kv_bytes = 2 * model.inner_kv_bytes_per_token(2)
    assert result["kv_only"] >= max(sent) * kv_bytes


# ---- the order of a pass's events ------------------------------------------------------------


def run_posted_in_order(plan, programs, events, windowed=None) -> None:
    """Run every outer rank's `events` as the executor does, with each rank's exchanges done one
    after another in the order it posts them (NCCL runs a group's batched calls so), and waits
    that block the rank: a step's calls wait for its fetch, a collect for its return. Fails if
    the ranks get stuck, or runs a step's events out of order, or if a rank r with
    `windowed[r]` ever holds more fetched or returning steps than the window allows."""
    from megatron_sap.planning.program import COLLECT, COMPUTE, FETCH, LOCAL, RECOMPUTE_KV_AHEAD, RETURN

    R = plan.outer_size
    at = [0] * R
    queue: list[list[tuple[str, int, int]]] = [[] for _ in range(R)]  # posted, not done: (kind, round, step)
    moved: set[tuple[str, int, int, int]] = set()  # (kind, round, rank, peer): their message is done
    done: list[set[tuple[str, int]]] = [set() for _ in range(R)]
    seen: list[list[tuple[str, int]]] = [[] for _ in range(R)]
    peers = [[{q for q in (t.send_peer, t.recv_peer) if q is not None} for t in p.transfers] for p in programs]
    windowed = windowed or [False] * R
    progress = True
    while progress:
        progress = False
        for a in range(R):  # post and compute until a wait blocks
            while at[a] < len(events[a]):
                kind, i = events[a][at[a]]
                if kind in (FETCH, RETURN):
                    queue[a].append((kind, programs[a].transfers[i].round, i))
                elif kind == COMPUTE and any(e == (FETCH, i) for e in seen[a]) and (FETCH, i) not in done[a]:
                    break
                elif kind == COLLECT and (RETURN, i) not in done[a]:
                    break
                seen[a].append((kind, i))
                at[a] += 1
                progress = True
        # a message goes once the step is at the head of both its ranks' queues (a ring
        # shift's step has two, with two peers); a step is done with all its messages
        for a in range(R):
            if queue[a]:
                kind, round_, i = queue[a][0]
                for b in peers[a][i]:
                    if queue[b] and queue[b][0][:2] == (kind, round_):
                        moved |= {(kind, round_, a, b), (kind, round_, b, a)}
        for a in range(R):
            while queue[a]:
                kind, round_, i = queue[a][0]
                if any((kind, round_, a, b) not in moved for b in peers[a][i]):
                    break
                queue[a].pop(0)
                done[a].add((kind, i))
                progress = True
    stuck = [a for a in range(R) if at[a] < len(events[a]) or queue[a]]
    assert not stuck, f"outer ranks {stuck} wait for each other"
    for a in range(R):
        n = len(programs[a].transfers)
        assert sorted(i for kind, i in seen[a] if kind == COMPUTE) == list(range(n))
        assert sum(kind == LOCAL for kind, _ in seen[a]) == 1
        for i in range(n):
            kinds = [kind for kind, j in seen[a] if j == i]
            assert kinds == [k for k in (FETCH, COMPUTE, RETURN, COLLECT) if k in kinds] and len(set(kinds)) == len(kinds)
        if windowed[a]:
            fetched = returning = 0
            for kind, _ in seen[a]:
                fetched += {FETCH: 1, COMPUTE: -1}.get(kind, 0)
                returning += {RETURN: 1, COLLECT: -1}.get(kind, 0)
                assert fetched <= RECOMPUTE_KV_AHEAD + 1 and returning <= RECOMPUTE_KV_AHEAD + 1


@pytest.mark.parametrize("seed", range(12))
def test_every_pass_posts_its_exchanges_in_one_order_all_ranks_follow(seed):
    """Forward and backward, with and without recompute_kv, each rank in its own schedule: run
    as NCCL runs a group's batches (in each rank's posting order), every rank gets through
    its events, and with recompute_kv none holds more than the window's fetched K/V and
    returning gradients, however many peers it meets."""
    rng = np.random.default_rng(seed)
    for _ in range(8):
        inner = int(rng.choice([1, 1, 2]))
        outer = int(rng.choice([2, 3, 5, 6, 8, 12, 16, 32, 64]))
        per_rank = int(rng.choice([16, 64, 256]))
        total = inner * outer * per_rank
        cuts = sorted(set(rng.integers(1, total, int(rng.integers(0, 8))).tolist()))
        plan = sap.plan_sequences([0, *cuts, total], outer_size=outer, inner_size=inner, cache=None)
        schedules = [str(rng.choice(["pipelined", "gathered", "auto"])) for _ in range(outer)]
        for recompute_kv in (False, True):
            forward = [plan.program(r, schedule=s, recompute_kv=recompute_kv) for r, s in enumerate(schedules)]
            run_posted_in_order(plan, forward, [p.forward_events() for p in forward],
                                [p.schedule == "pipelined" for p in forward])
            backward = [plan.backward_program(r, schedule=s, recompute_kv=recompute_kv) for r, s in enumerate(schedules)]
            run_posted_in_order(plan, backward, [p.backward_events(recompute_kv) for p in backward], [recompute_kv] * outer)


@pytest.mark.parametrize("schedule", ["pipelined", "gathered"])
def test_the_forward_posts_its_exchanges_as_its_schedule_needs(schedule):
    """Pipelined: the first exchange goes before the local calls (which run while it
    travels), then each step's calls follow the posting of the next step's exchange, never
    of a later one: a GPU with one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) would hold
    a kernel queued behind two exchanges until the first was done. Gathered (whose steps
    mostly run no call): every exchange first, so that none waits for a kernel."""
    from megatron_sap.planning.program import COMPUTE, FETCH, FETCH_AHEAD, LOCAL

    assert FETCH_AHEAD == 1
    rows = [([0, 4096], 8), ([0, 700, 1500, 4096], 8), ([0, 3, 9000, 16384], 16), ([0, 256], 2)]
    multi_step = 0
    for cu, outer in rows:
        plan = sap.plan_sequences(cu, outer_size=outer, cache=None)
        for rank in range(outer):
            program = plan.program(rank, schedule=schedule)
            n = len(program.transfers)
            if schedule == "gathered":
                expected = [(FETCH, i) for i in range(n)] + [(LOCAL, -1)] + [(COMPUTE, i) for i in range(n)]
            else:
                expected = [(FETCH, 0)] * (n > 0) + [(LOCAL, -1)]
                for i in range(n):
                    expected += [(FETCH, i + 1)] * (i + 1 < n) + [(COMPUTE, i)]
            assert list(program.forward_events()) == expected
            in_flight, most = 0, 0
            for kind, _ in expected:
                in_flight += {FETCH: 1, COMPUTE: -1}.get(kind, 0)
                most = max(most, in_flight)
            assert most == (n if schedule == "gathered" else min(n, FETCH_AHEAD + 1))
            multi_step += n > 2
    assert multi_step


def test_the_gathered_backward_runs_its_local_calls_under_its_first_return():
    """Keeping the K/V, the gathered backward runs every step's calls (by backward level),
    posts the first return, runs the local calls, posts the other returns, then collects:
    with one hardware queue the local calls queued after the last return would wait for
    all the others to be done. The pipelined one runs each step's calls and its return in
    turn, the local calls last."""
    from megatron_sap.planning.program import COLLECT, COMPUTE, LOCAL, RETURN

    plan = sap.plan_sequences([0, 700, 1500, 4096], outer_size=8, cache=None)
    seen = 0
    for rank in range(8):
        for schedule in ("gathered", "pipelined"):
            program = plan.backward_program(rank, schedule=schedule)
            steps = sorted(range(len(program.transfers)), key=lambda i: program.transfers[i].backward_level)
            if schedule == "gathered":
                returns = [(RETURN, i) for i in steps]
                expected = [(COMPUTE, i) for i in steps] + returns[:1] + [(LOCAL, -1)] + returns[1:]
            else:
                expected = [e for i in steps for e in ((COMPUTE, i), (RETURN, i))] + [(LOCAL, -1)]
            assert list(program.backward_events()) == expected + [(COLLECT, i) for i in steps]
            seen += len(steps) > 1
    assert seen


def test_timing_the_slowest_rank_leaves_no_program_of_it_in_another_ranks_plan(monkeypatch):
    """Under `auto`, beyond JOINT_SCHEDULE_RANKS outer ranks, every rank times the plan's
    slowest rank in both schedules; a rank that is not it keeps only its own program (the
    plan, pickled from a loader's worker, carries the programs it holds)."""
    import numpy as np

    from megatron_sap.planning import plan as plan_module

    monkeypatch.setattr(plan_module, "JOINT_SCHEDULE_RANKS", 3)

    plan = sap.plan_sequences([0, 700, 1500, 4096], outer_size=4, cache=None)
    slowest = int(np.argmax(plan.evaluation.rank_time_s))
    other = (slowest + 1) % 4
    plan.program(other)
    assert {rank for rank, _, _ in plan._programs} == {other}
    plan.program(slowest)
    assert {rank for rank, _, _ in plan._programs} == {other, slowest}


def test_backward_in_its_own_order_is_posted_in_one_order_all_ranks_follow():
    """Plans whose backward runs the reverse of the forward's exchange order: run as NCCL
    runs a group's batches, every rank gets through its backward events, in every schedule,
    with and without recompute_kv (and its window)."""
    rows = [([0, 421, 496], 8), ([0, 13, 22, 216], 6), ([0, 116, 165, 167, 176], 4), ([0, 60, 96], 6),
            ([0, 50, 400, 420, 990], 6)]
    rows += [(cu, 32) for cu in pack(document_lengths("stdlib"), 32 * 1024, 2, seed=4)]
    reversed_plans = 0
    for cu, outer in rows:
        plan = sap.plan_sequences(cu, outer_size=outer, cache=None)
        reversed_plans += plan.backward_exchange_order() != plan.exchange_order()
        for recompute_kv in (False, True):
            for schedules in (["pipelined"] * outer, ["gathered", "pipelined"] * (outer // 2)):
                backward = [plan.backward_program(r, schedule=s, recompute_kv=recompute_kv) for r, s in enumerate(schedules)]
                run_posted_in_order(plan, backward, [p.backward_events(recompute_kv) for p in backward], [recompute_kv] * outer)
    assert reversed_plans >= 4


def test_backward_posted_by_each_rank_s_own_step_count_would_wait_in_a_cycle():
    """The check above catches the order that fails on NCCL: refetches and returns interleaved
    by each rank's own step count (one 98-token document over seven ranks, exchanging pairwise
    in the order paced by the kernels; the plan itself runs ring shifts, whose steps every
    rank counts alike)."""
    from megatron_sap.planning.plan import step_seconds
    from megatron_sap.planning.program import COLLECT, COMPUTE, FETCH, LOCAL, RETURN

    plan = sap.plan_sequences([0, 98], outer_size=7, cache=None)
    paced = step_seconds(plan.placement, plan.evaluation, plan.cost_model, 1).paced
    programs = compile_all(plan.placement, "pipelined", paced, tile=plan.cost_model.tile)

    def own_count(program):
        n, ahead = len(program.transfers), 2
        events = [(FETCH, i) for i in range(min(ahead, n))] + [(LOCAL, -1)]
        for i in range(n):
            events += [(FETCH, i + ahead)] if i + ahead < n else []
            events += [(COMPUTE, i), (RETURN, i)]
        return events + [(COLLECT, i) for i in range(n)]

    with pytest.raises(AssertionError, match="wait for each other"):
        run_posted_in_order(plan, programs, [own_count(p) for p in programs])
    run_posted_in_order(plan, programs, [p.backward_events(True) for p in programs], [True] * 7)


def test_recompute_kv_backward_refetches_and_waits_a_window_of_levels_away():
    """With recompute_kv each step's K/V is fetched again RECOMPUTE_KV_AHEAD levels before its
    calls and its return is waited for that many levels after: the returns of the levels up to
    there are posted before the wait (they overlap it), none later (a bounded window)."""
    from megatron_sap.planning.program import COLLECT, COMPUTE, FETCH, RECOMPUTE_KV_AHEAD, RETURN

    plan = sap.plan_sequences([0, 40000, 40100, 65536], outer_size=8, cache=None)
    ahead, windows = RECOMPUTE_KV_AHEAD, 0
    for rank in range(plan.outer_size):
        program = plan.backward_program(rank, schedule="pipelined", recompute_kv=True)
        at = {event: n for n, event in enumerate(program.backward_events(recompute_kv=True))}
        levels = [step.level for step in program.transfers]
        for i, level in enumerate(levels):
            for j, other in enumerate(levels):
                assert (at[(COLLECT, i)] > at[(RETURN, j)]) == (other <= level + ahead), (rank, i, j)
                assert (at[(FETCH, i)] < at[(COMPUTE, j)]) == (other >= level - ahead), (rank, i, j)
        windows += len(levels) > ahead + 1
    assert windows  # ranks with more steps than one window


def check_chunked(program: RankProgram, events, chunks: int) -> None:
    """`RankProgram.chunked` keeps the events' order, runs the first and last kernel events
    with calls (the local one always counts) chunk by chunk and the others on every head,
    brings every chunk's inputs once before its first unit and takes its outputs once after
    its last (the first chunk's inputs and the last chunk's outputs go with the pass)."""
    from megatron_sap.planning.program import ALL_HEADS, LOCAL, NO_CHUNK, POST

    units = program.chunked(events, chunks)
    if chunks == 1:
        assert units == tuple((kind, i, ALL_HEADS) for kind, i in events)
        return
    assert [(kind, i) for kind, i, c in units if kind != POST and c in (ALL_HEADS, 0)] == list(events)
    calls = [n for n, (kind, i) in enumerate(events) if kind == LOCAL or (kind == "compute" and program.transfers[i].calls)]
    chunked = {events[calls[0]], events[calls[-1]]}
    per_chunk = [u for u in units if u[0] != POST and u[2] != ALL_HEADS]
    assert len(set(per_chunk)) == len(per_chunk) == chunks * len(chunked)
    brought, taken, used = {0}, set(), {}
    for n, (kind, i, c) in enumerate(units):
        if kind == POST:
            assert i != NO_CHUNK or c != NO_CHUNK
            if i != NO_CHUNK:
                assert i not in brought
                brought.add(i)
            if c != NO_CHUNK:
                assert c not in taken and c in used  # after its units, none of which come later
                taken.add(c)
            continue
        assert (c != ALL_HEADS) == ((kind, i) in chunked)
        needs = range(chunks) if c == ALL_HEADS else [c]
        if kind == LOCAL or (kind == "compute" and program.transfers[i].calls):
            assert all(x in brought and x not in taken for x in needs)
            for x in needs:
                used.setdefault(x, []).append(n)
    assert brought == set(range(chunks)) and taken == set(range(chunks - 1))


@settings(max_examples=60, deadline=None)
@given(outer_batches(max_outer=8, max_tokens=320), st.sampled_from(["pipelined", "gathered"]),
       st.integers(1, 4))
def test_head_chunked_units_keep_the_program(batch, schedule, chunks):
    cu, outer = batch
    plan = sap.plan_sequences(cu, outer_size=outer, cache=None)
    for r in range(outer):
        program = plan.program(r, schedule=schedule)
        check_chunked(program, program.forward_events(), chunks)
        check_chunked(program, program.backward_events(), chunks)


def test_head_chunks_split_heads_by_kv_groups():
    """Each chunk's query heads read the KV heads of its slice (query head i reads KV head
    i // group); counts that would split a chunk across part of a group are refused."""
    from megatron_sap.planning.program import head_chunks

    for heads, kv, inner in [(32, 8, 8), (32, 8, 4), (16, 4, 2), (8, 1, 4), (12, 4, 2), (24, 8, 8), (8, 8, 2)]:
        per_rank, kv_per_rank = heads // inner, max(kv, inner) // inner
        group = per_rank // kv_per_rank
        for chunks in range(1, per_rank + 2):
            split = head_chunks(heads, kv, inner, chunks)
            fits = per_rank % chunks == 0 and ((per_rank // chunks) % group == 0 or group % (per_rank // chunks) == 0)
            assert (split is not None) == fits, (heads, kv, inner, chunks)
            if split is None:
                continue
            assert [q for q, _ in split] == [slice(c * per_rank // chunks, (c + 1) * per_rank // chunks)
                                             for c in range(chunks)]
            for q, kv_slice in split:
                read = sorted({h // group for h in range(q.start, q.stop)})
                assert list(range(kv_slice.start, kv_slice.stop)) == read
    # Query heads that do not divide over the inner ranks (fewer than U of them, too) split into no chunks.
    for heads, kv, inner in [(32, 8, 64), (4, 4, 8), (12, 4, 8)]:
        assert all(head_chunks(heads, kv, inner, chunks) is None for chunks in (1, 2, 3))


def test_stats_where_the_cost_models_heads_do_not_split_over_the_inner_size():
    """A plan's layout need not split the cost model's heads (it plans tokens): its stats and
    memory then count one head chunk (they raised ZeroDivisionError where U > the heads)."""
    for cost_model, inner in [("h100", 64), (CostModel.preset("h100", num_heads=4, num_kv_heads=4), 8)]:
        plan = sap.plan_sequences([0, 64 * inner], outer_size=1, inner_size=inner, cost_model=cost_model, cache=None)
        stats = plan.stats()
        assert stats["inner_chunks"] == 1 and stats["tokens_per_rank"] == [64] * inner
        assert plan.memory_bytes(0)["forward"] > 0
