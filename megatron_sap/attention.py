"""`sap_attention`: causal attention over packed documents split across a CP group.

The op only executes a plan (see `megatron_sap.planning`): at the inner level an
all-to-all turns token shards into head shards; at the outer level the compiled
program moves the K/V each rank needs and runs the kernel calls on what has arrived:
pipelined, a call per step whose partial results merge by log-sum-exp in fp32; gathered,
each query piece once all its keys are in, written without a merge (`planning.program`).

Saved for backward (per rank): q, k, v, the output and its lse (fp32, [H, T/R]) and,
unless `recompute_kv=True`, the K/V rows received from other ranks (gathered: the one
buffer that holds them after the local K/V). With `recompute_kv=True` those rows are
fetched again during backward (one more forward-sized exchange), and each pass holds the
rows of a few steps at a time, not all it receives (the gathered forward excepted): a
window of exchanges in flight (`FETCH_AHEAD`, `RECOMPUTE_KV_AHEAD`; `Plan.memory_bytes`).
Each pass runs the events compiled with the program (`RankProgram.forward_events`,
`backward_events`), whose exchanges come in one order that all ranks share; the forward
posts each exchange one step ahead of the kernels that need it.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import weakref
from typing import Sequence

import torch
import torch.distributed as dist

from .comm.groups import SAPGroups
from .comm.p2p import PendingExchange, collective_device, mark_ready, post_exchange, ready_for_batched_p2p
from .comm.ulysses import GatherHeads, ScatterHeads, check_heads, replicate_kv_heads
from .kernels import (accumulation_dtype, add_rows, first_order_only, merge_into, resolve_backend, resolve_softmax_scale,
                      take_rows, varlen_backward, varlen_forward, write_rows)
from .planning import Plan, RankProgram
from .planning.program import COMPUTE, FETCH, LOCAL, RETURN, check_schedule
from .validation import check_bool, check_qkv

_BACKWARD_TAG = 1 << 20
_REFETCH_TAG = 2 << 20
INNER_STEP = "SAP inner all-to-all"  # names the collective when a peer fails


class _Outer:
    """What the outer-level executor needs from the groups: ranks and the group."""

    def __init__(self, groups: SAPGroups | None):
        self.rank = 0 if groups is None else groups.outer_rank
        self.group = None if groups is None else groups.outer_group
        self.peer = (lambda r: r) if groups is None else groups.outer_peer


def _post_step(program: RankProgram, index: int, send: torch.Tensor | None, recv: torch.Tensor | None,
               outer: _Outer, tag: int, reverse: bool = False) -> PendingExchange:
    """Post transfer `index` of the program: `send` to its send peer and `recv` from its
    receive peer, or (`reverse`, backward's gradients) the other way round."""
    step = program.transfers[index]
    to, source = (step.recv_peer, step.send_peer) if reverse else (step.send_peer, step.recv_peer)
    return post_exchange(
        send,
        None if to is None else outer.peer(to),
        recv,
        None if source is None else outer.peer(source),
        outer.group,
        tag + step.round,
        f"SAP {'backward ' if reverse else ''}step {index + 1} of {len(program.transfers)} (round {step.round}) "
        f"on outer rank {outer.rank}",
    )


def _post_kv(program: RankProgram, index: int, kv: torch.Tensor, outer: _Outer, tag: int,
             recv: torch.Tensor | None = None) -> tuple[PendingExchange, torch.Tensor]:
    """Post transfer `index` of the forward program, receiving into `recv` (default: a new
    buffer); return its handle and receive buffer."""
    step = program.transfers[index]
    if recv is None:
        recv = kv.new_empty((step.recv_tokens, *kv.shape[1:]))
    send = None if step.send_rows is None else take_rows(kv, step.send_rows)
    return _post_step(program, index, send, recv, outer, tag), recv


def _forward_calls(calls, q, kv_source, acc_out, acc_lse, scale, backend) -> None:
    """Run kernel calls on `kv_source` rows ([n, 2, Hkv, D]) and merge their (out, lse) into the accumulators."""
    for call in calls:
        out, lse = _run_forward_call(call, q, kv_source, scale, backend)
        merge_into(acc_out, acc_lse, call.q_rows, out, lse)


def _run_forward_call(call, q, kv_source, scale, backend):
    """One kernel call's (out, lse) for its query rows of `q` over its rows of `kv_source`."""
    q_part, kv = take_rows(q, call.q_rows), take_rows(kv_source, call.k_rows)
    return varlen_forward(
        q_part, kv[:, 0], kv[:, 1], call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k,
        causal=call.causal, softmax_scale=scale, backend=backend,
    )


def _local_forward(program: RankProgram, q, kv, scale, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """The local calls' merged (out, lse), in the accumulation dtype. The first call (the causal
    diagonal of every local row) starts the accumulators: a copy, where a merge into zeros would
    take two passes over them."""
    acc_dtype = accumulation_dtype(q)
    calls = program.local_calls
    if calls and calls[0].q_rows is None:
        out, lse = _run_forward_call(calls[0], q, kv, scale, backend)
        # Copies: the kernels may return views of their padded buffers, and the op's output must own its storage.
        acc_out, acc_lse, calls = out.to(acc_dtype, copy=True), lse.to(acc_dtype, copy=True), calls[1:]
    else:
        acc_out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        acc_lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc_dtype, device=q.device)
    _forward_calls(calls, q, kv, acc_out, acc_lse, scale, backend)
    return acc_out, acc_lse


def _write_forward(calls, q, kv_source, out, lse, scale, backend) -> None:
    """Run kernel calls whose query rows each get their whole result from one call (the
    gathered schedule) and write their (out, lse) into those rows."""
    for call in calls:
        part_out, part_lse = _run_forward_call(call, q, kv_source, scale, backend)
        write_rows(out, call.q_rows, part_out)
        write_rows(lse, call.q_rows, part_lse, dim=1)


def _gathered_source(program: RankProgram, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The gathered schedule's key/value rows: the local ones, then room for every step's
    received rows in step order; returns the buffer and each step's slice of it."""
    sizes = [step.recv_tokens for step in program.transfers]
    source = k.new_empty((len(k) + sum(sizes), 2, *k.shape[1:]))
    source[: len(k), 0] = k
    source[: len(k), 1] = v
    return source, list(torch.split(source[len(k):], sizes))


def _backward_calls(calls, dout, q, out, lse, kv_source, dq, dkv, scale, backend, dq_written_once=False) -> None:
    """Gradients of kernel calls against the final out/lse: into dq, and into dkv at the source
    rows. With `dq_written_once` (the gathered schedule, where each query row is in one call)
    a call's dQ is written into its rows, not added."""
    for call in calls:
        rows = call.q_rows
        kv = take_rows(kv_source, call.k_rows)
        g_q, g_k, g_v = varlen_backward(
            take_rows(dout, rows), take_rows(q, rows), kv[:, 0], kv[:, 1], take_rows(out, rows),
            take_rows(lse, rows, dim=1), call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q,
            call.max_seqlen_k, causal=call.causal, softmax_scale=scale, backend=backend,
        )
        if dq_written_once:
            write_rows(dq, rows, g_q)
        else:
            add_rows(dq, rows, g_q)
        add_rows(dkv[:, 0], call.k_rows, g_k)
        add_rows(dkv[:, 1], call.k_rows, g_v)


class _SAPOuterAttention(torch.autograd.Function):
    """The outer-level program as one autograd op on [T/R, H, D] tensors."""

    @staticmethod
    def forward(ctx, q, k, v, plan: Plan, outer: _Outer, scale: float, backend: str, recompute_kv: bool, schedule: str):
        program = plan.program(outer.rank, q.device, schedule, recompute_kv)
        ctx.plan, ctx.outer, ctx.scale, ctx.backend, ctx.recompute_kv = plan, outer, scale, backend, recompute_kv
        ctx.schedule = program.schedule
        run = _gathered_forward if program.schedule == "gathered" else _pipelined_forward
        out, lse, kept = run(program, q, k, v, outer, scale, backend, recompute_kv)
        ctx.save_for_backward(q, k, v, out, lse, *([] if recompute_kv else kept))
        return out

    @staticmethod
    @first_order_only  # the exchanged gradients are not differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        program = ctx.plan.backward_program(ctx.outer.rank, q.device, ctx.schedule, ctx.recompute_kv)
        dq, dkv = _backward(ctx, program, dout.contiguous(), q, k, v, out, lse, saved)
        return dq.to(q.dtype), dkv[:, 0].to(k.dtype), dkv[:, 1].to(v.dtype), None, None, None, None, None, None


def _pipelined_forward(program: RankProgram, q, k, v, outer: _Outer, scale, backend, recompute_kv: bool):
    """The pipelined schedule's forward (`RankProgram.forward_events`): (out, lse, the
    received rows of every step). Each step's calls merge into fp32 accumulators; a step's
    send copy goes once its exchange is done, its received rows once used unless kept."""
    kv = torch.stack([k, v], 1)  # [T/R, 2, Hkv, D]: one message per step
    posted: dict[int, tuple[PendingExchange, torch.Tensor]] = {}
    received: list[torch.Tensor] = []
    for kind, i in program.forward_events():
        if kind == FETCH:
            posted[i] = _post_kv(program, i, kv, outer, 0)
        elif kind == LOCAL:
            acc_out, acc_lse = _local_forward(program, q, kv, scale, backend)
        else:  # COMPUTE
            handle, recv = posted.pop(i)
            handle.wait()
            del handle
            _forward_calls(program.transfers[i].calls, q, recv, acc_out, acc_lse, scale, backend)
            if not recompute_kv:
                received.append(recv)
            del recv
    return acc_out.to(q.dtype), acc_lse, received


def _gathered_forward(program: RankProgram, q, k, v, outer: _Outer, scale, backend, recompute_kv: bool):
    """The gathered schedule's forward: (out, lse, [source]). Every step is received into its
    slice of the source buffer; each call runs once the step that brings its last keys is
    in, and writes its rows of the output (nothing is merged)."""
    source, slices = _gathered_source(program, k, v)
    kv = source[: len(k)]
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=accumulation_dtype(q), device=q.device)
    posted: dict[int, PendingExchange] = {}
    for kind, i in program.forward_events():
        if kind == FETCH:
            posted[i] = _post_kv(program, i, kv, outer, 0, slices[i])[0]
        elif kind == LOCAL:
            _write_forward(program.local_calls, q, kv, out, lse, scale, backend)
        else:  # COMPUTE
            posted.pop(i).wait()
            _write_forward(program.transfers[i].calls, q, source, out, lse, scale, backend)
    return out, lse, [source]


def _backward(ctx, program: RankProgram, dout, q, k, v, out, lse, saved) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dK/dV stacked), accumulated, running `RankProgram.backward_events`. Pipelined,
    each step's calls add into an fp32 gradient of its received rows (the K/V saved in
    forward, or fetched again with `recompute_kv`); gathered, into one buffer of every
    step's, the saved source's. A return sends those gradients back to their owner and
    receives those of the rows the step sent, which its collect adds into dK/dV."""
    outer, scale, backend = ctx.outer, ctx.scale, ctx.backend
    acc_dtype = accumulation_dtype(q)
    gathered = program.schedule == "gathered"
    # Gathered, every query row's dQ comes from the one call that has the row (as its
    # output did in forward): written there, in q's dtype, nothing to start from or add.
    dq = torch.empty_like(q) if gathered else torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    steps = program.transfers
    if gathered:
        (source,) = saved
        kv = source[: len(k)]
        grad_source = torch.zeros(source.shape, dtype=acc_dtype, device=q.device)
        dkv = grad_source[: len(k)]
        grads = dict(enumerate(torch.split(grad_source[len(k):], [step.recv_tokens for step in steps])))
    else:
        kv = torch.stack([k, v], 1)
        dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)
        grads = {}
    fetched: dict[int, tuple[PendingExchange, torch.Tensor]] = {}
    returns: dict[int, tuple[PendingExchange, torch.Tensor | None]] = {}
    for kind, i in program.backward_events(ctx.recompute_kv):
        if kind == LOCAL:
            _backward_calls(program.local_calls, dout, q, out, lse, kv, dq, dkv, scale, backend, gathered)
            continue
        step = steps[i]
        if kind == FETCH:
            fetched[i] = _post_kv(program, i, kv, outer, _REFETCH_TAG)
        elif kind == COMPUTE and gathered:
            _backward_calls(step.calls, dout, q, out, lse, source, dq, grad_source, scale, backend, True)
        elif kind == COMPUTE:
            if ctx.recompute_kv:
                handle, recv = fetched.pop(i)
                handle.wait()
                del handle
            else:
                recv = saved[i]
            grads[i] = torch.zeros(recv.shape, dtype=acc_dtype, device=q.device)
            _backward_calls(step.calls, dout, q, out, lse, recv, dq, grads[i], scale, backend)
            del recv
        elif kind == RETURN:
            returns[i] = _post_gradients(program, i, grads.pop(i), kv, outer)
        else:  # COLLECT
            handle, grad_in = returns.pop(i)
            handle.wait()
            if grad_in is not None:
                add_rows(dkv, step.send_rows, grad_in)
    return dq, dkv


def _post_gradients(program: RankProgram, index: int, grad_recv: torch.Tensor, kv: torch.Tensor,
                    outer: _Outer) -> tuple[PendingExchange, torch.Tensor | None]:
    """Post step `index` in reverse: the gradients of the rows it received go back to their
    owner, those of the rows it sent come back (into a new buffer, returned with the handle)."""
    step = program.transfers[index]
    grad_in = None if step.send_rows is None else kv.new_empty((step.send_tokens, *kv.shape[1:]))
    send = grad_recv.to(kv.dtype) if step.recv_tokens else None
    return _post_step(program, index, send, grad_in, outer, _BACKWARD_TAG, reverse=True), grad_in


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, groups: SAPGroups | None) -> None:
    check_qkv(q, k, v)
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a megatron_sap Plan from plan_sequences, got {type(plan).__name__}")
    if groups is not None and not all(hasattr(groups, a) for a in ("world_size", "inner_size", "cp_rank")):
        raise TypeError(f"groups must be SAPGroups (from init_sap_groups) or None, got {type(groups).__name__}")
    world = 1 if groups is None else groups.world_size
    inner = 1 if groups is None else groups.inner_size
    if plan.world_size != world or plan.inner_size != inner:
        raise ValueError(
            f"plan was built for inner x outer = {plan.inner_size} x {plan.outer_size} ranks, "
            f"but the groups are {inner} x {world // inner}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != plan.local_tokens:
            raise ValueError(
                f"{name} has {t.shape[0]} tokens but the plan gives each rank T/P = "
                f"{plan.total_tokens}/{plan.world_size} = {plan.local_tokens}"
            )
    check_heads(q.shape[1], k.shape[1], inner)


def _check_finite(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: SAPGroups | None) -> None:
    """Raise on every rank of the CP group when any rank's q, k or v holds NaN or Inf: one
    all-reduce of each rank's count (and a host sync), so that the ranks without them do not
    go on into exchanges that their peer has left. Every rank must check alike."""
    problem = None
    for name, t in (("q", q), ("k", k), ("v", v)):
        bad = ~torch.isfinite(t)
        if bad.any():
            token, head, _ = (int(i) for i in torch.nonzero(bad)[0])
            problem = (f"{name} contains {int(bad.sum())} NaN or Inf values, the first at local token {token}, "
                       f"head {head}")
            break
    others: list[int] = []
    if groups is not None and groups.world_size > 1:
        counts = torch.zeros(groups.world_size, dtype=torch.int64, device=collective_device(groups.cp_group))
        counts[groups.cp_rank] = problem is not None
        _all_reduce(counts, groups.cp_group, dist.ReduceOp.SUM, groups, "finite check", "NaN/Inf findings",
                    "not every rank checks (check_finite / MEGATRON_SAP_CHECK_FINITE must be alike on all CP ranks)")
        others = [r for r, c in enumerate(counts.tolist()) if c and r != groups.cp_rank]
    if problem is not None:
        also = f"; cp_ranks {others} have some too" if others else ""
        raise ValueError(f"{problem}{also} (MEGATRON_SAP_CHECK_FINITE / check_finite is on)")
    if others:
        raise ValueError(
            f"q, k or v of cp_ranks {others} contain NaN or Inf values (this rank's are finite; "
            f"MEGATRON_SAP_CHECK_FINITE / check_finite is on)"
        )


def _all_reduce(values: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp, groups: SAPGroups, check: str,
                of: str, cause: str) -> None:
    """All-reduce `values` (`of` what) for one of the op's checks over the CP ranks; on failure a
    RuntimeError that names the check, the ranks and, besides a dead or stuck rank, the likely `cause`."""
    try:
        dist.all_reduce(values, op=op, group=group)
    except Exception as exc:  # a dead or stuck rank: the backend's error type varies (gloo, NCCL)
        raise RuntimeError(
            f"SAP {check} (all-reduce of {of} over CP ranks {list(groups.cp_ranks)}, from cp_rank {groups.cp_rank}) "
            f"failed: {exc}. A rank died or is stuck, or {cause}"
        ) from exc


def attention_shape(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, str]:
    """(query heads, key/value heads, head dim, dtype name) of one rank's attention: what
    the ranks' exchanges must agree on besides the plan. The dtype, not only its size:
    fp16 and bf16 buffers are the same size, and one read as the other is garbage."""
    return q.shape[1], k.shape[1], q.shape[2], dtype_name(q.dtype)


def dtype_name(dtype: torch.dtype | str) -> str:
    """'bfloat16' for torch.bfloat16 (a name stays as it is)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _shape_key(shape: Sequence) -> tuple:
    """An attention shape as the agreement check hashes it: sizes as ints, a dtype (or an
    element size, as earlier callers gave it) as its name or int."""
    *sizes, kind = shape
    return (*(int(x) for x in sizes), dtype_name(kind) if isinstance(kind, (str, torch.dtype)) else int(kind))


# CP group (weakly: a destroyed group leaves) -> what was last checked on it: the plan's
# signature, `recompute_kv`, the attention shape and the softmax scale (None: the default).
# The signature, not the plan object: ranks holding equal plans as different objects (one
# planned afresh, the other's from its cache) skip the check alike.
_LAST_CHECKED: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[str, bool, tuple | None, float | None]] = (
    weakref.WeakKeyDictionary())
# CP group -> the softmax scale (`_scale_key`) of the last `sap_attention` call on it.
_LAST_SCALE: weakref.WeakKeyDictionary[dist.ProcessGroup, float | None] = weakref.WeakKeyDictionary()


def last_softmax_scale(groups: SAPGroups) -> float | None:
    """The softmax scale of the last `sap_attention` call on these groups' CP group as the
    agreement check counts it (None: the default, or no call yet). A batch split checks
    with it, so that the layers of a model with a scale of its own need no check of their
    own after the first micro-batch."""
    return _LAST_SCALE.get(groups.cp_group)


def _check_agreement(plan: Plan, groups: SAPGroups, recompute_kv: bool, shape: tuple[int, int, int, str],
                     softmax_scale: float | None) -> None:
    """`verify_plan_agreement` unless it was last run on this CP group for this plan (an
    equal one: `Plan.signature`), `recompute_kv`, attention shape and softmax scale (a batch
    split's check, or an earlier layer's).

    Checking whenever a rank's call differs from the last one checked, not only on a
    plan's or shape's first use, is what keeps ranks that agreed from parting silently: a
    rank that goes back to a plan or shape it checked before, while the others stay on
    theirs, enters the all-reduce alone and fails at the group's timeout instead of
    exchanging messages of the right sizes for another batch (peers waiting for its
    messages fail too). A model whose layers alternate shapes checks at every change."""
    if _LAST_CHECKED.get(groups.cp_group) != (plan.signature(), bool(recompute_kv), shape, softmax_scale):
        verify_plan_agreement(plan, groups, recompute_kv, shape, softmax_scale=softmax_scale)


def _scale_key(scale: float, head_dim: int | None) -> float | None:
    """The softmax scale as the agreement check counts it: None for the default where the
    head dim is known (also as 1 / sqrt(head_dim), Megatron's form, which can differ from
    head_dim ** -0.5 in the last bit), else rounded to 9 significant digits (the same scale
    computed two ways agrees)."""
    if head_dim is not None and math.isclose(scale, head_dim ** -0.5, rel_tol=1e-9):
        return None
    return float(f"{scale:.9g}")


def verify_plan_agreement(plan: Plan, groups: SAPGroups, recompute_kv: bool = False,
                          shape: Sequence | None = None, over: dist.ProcessGroup | None = None,
                          softmax_scale: float | None = None) -> None:
    """Check now that every rank of the CP group planned the same batch and layout, and
    runs it with the same `recompute_kv` (which decides whether the backward exchanges K/V
    again: ranks that differ would wait for each other), attention `shape` ((query heads,
    KV heads, head dim, dtype) as `attention_shape` gives it, which size and type the
    exchanged buffers; None: not checked here) and `softmax_scale` (None: the default
    head_dim ** -0.5; ranks that scale their scores differently merge partial results that
    do not fit together).

    One all-reduce of a 62-bit hash over the CP group (and one host sync), or over `over`, a
    gloo group of the same ranks (host to host, no wait for the GPU). Raises on every rank, with both
    hashes, instead of deadlocking in P2P or computing garbage. A batch splitter calls it
    once per micro-batch (with the model's shape where it knows it), which also catches a
    rank that reuses a cached plan while another plans a new batch; `sap_attention` calls
    it when the plan, `recompute_kv`, shape or scale differs from what was last checked on the
    group. (Ranks may run different schedules: both exchange the same rows in the same
    order.)
    """
    recompute_kv = bool(recompute_kv)
    shape = None if shape is None else _shape_key(shape)
    if softmax_scale is not None:  # as `sap_attention` counts it
        softmax_scale = _scale_key(float(softmax_scale), None if shape is None else shape[2])
    scale = "" if softmax_scale is None else f"|scale {softmax_scale!r}"
    digest = hashlib.sha1(f"{plan.signature()}|{recompute_kv}|{shape}{scale}".encode()).hexdigest()
    mine = int(digest[:16], 16) & ((1 << 62) - 1)
    high, low, failed = _exchange_hashes(mine, groups, over)
    described = (f"this rank (cp_rank {groups.cp_rank}) planned hash {mine:x} ({plan.total_tokens} tokens, "
                 f"{len(plan.cu_seqlens) - 1} documents, layout {plan.inner_size}x{plan.outer_size}, cost model "
                 f"{plan.cost_model.name!r}, attention shape (heads, kv heads, head dim, dtype) {shape}, "
                 f"recompute_kv={recompute_kv}, softmax_scale "
                 f"{'default' if softmax_scale is None else softmax_scale})")
    if failed:
        raise RuntimeError(
            f"CP rank {failed - 1} of {list(groups.cp_ranks)} (the highest that failed) could not prepare this "
            f"micro-batch; its own error names the problem; {described}"
        )
    if high != low:
        raise RuntimeError(
            f"CP ranks disagree on the batch, the layout, the cost model, the attention shape, the softmax scale or "
            f"recompute_kv: {described}, the group has hashes from {low:x} to {high:x}"
        )
    _LAST_CHECKED[groups.cp_group] = (plan.signature(), recompute_kv, shape, softmax_scale)
    mark_ready(groups.cp_group if over is None else over)  # the CP group (and the outer group at U = 1), or the host group


def announce_failure(groups: SAPGroups, over: dist.ProcessGroup | None = None) -> None:
    """Take part in the agreement check the other CP ranks are running as a rank that could
    not prepare its micro-batch (bad input, a plan it could not make): they raise at once,
    naming this rank, instead of waiting for its hash until the group's timeout. The caller
    raises its own error after this returns; `over` as in `verify_plan_agreement`."""
    _exchange_hashes(None, groups, over)


# What a failed rank adds to the hashes' maximum: below any hash (hashes are >= 0).
_NO_HASH = -(1 << 62)


def _exchange_hashes(mine: int | None, groups: SAPGroups, over: dist.ProcessGroup | None) -> tuple[int, int, int]:
    """(highest hash, lowest hash, 1 + the highest failed cp_rank or 0) over the CP group, or
    over `over`; `mine` None for a rank that failed."""
    failed = mine is None
    values = [_NO_HASH, _NO_HASH, groups.cp_rank + 1] if failed else [mine, -mine, 0]
    group = groups.cp_group if over is None else over
    values = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    _all_reduce(values, group, dist.ReduceOp.MAX, groups, "agreement check", "plan hashes",
                "the ranks built their SAP groups differently (every rank must create them alike, e.g. the same "
                "init_sap_groups sizes)")
    return int(values[0]), -int(values[1]), int(values[2])


def sap_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    groups: SAPGroups | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    recompute_kv: bool = False,
    schedule: str = "auto",
    check_agreement: bool = True,
    check_finite: bool | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's tokens over the packed batch described by `plan`.

    q [T/P, Hq, D], k/v [T/P, Hkv, D] hold the rank's tokens in `plan.local_indices(cp_rank)`
    order; returns [T/P, Hq, D]. `groups` is the SAPGroups of the CP group (None: one rank).
    `schedule`: "pipelined" (each exchange's kernel calls overlap the next exchange, partial
    results merged by lse), "gathered" (each query piece once all its keys are in, as one
    kernel segment over all of them, nothing merged; see `planning.program`) or "auto"
    (`plan.schedule(outer_rank, recompute_kv)`: one for every rank, what the cost model
    times faster for all ranks together, or beyond 16 outer ranks for the plan's slowest
    rank).
    `check_agreement`: when the plan, `recompute_kv`, attention shape or softmax scale differs from what
    was last checked on these groups, all-reduce a hash of them (`verify_plan_agreement`)
    so that ranks that planned different batches fail together; the layers of one
    micro-batch check once (where they share a shape). A rank that keeps its plan while
    another changes does not enter the all-reduce: the changed rank fails at the group's
    timeout, and so does the other wherever it waits for that rank's messages (one whose
    program exchanges nothing returns its result for the plan it kept), so a caller that
    can hand one rank a cached plan while another plans a new batch (without Megatron's
    batch split, which checks every micro-batch) should call `verify_plan_agreement` per
    micro-batch for a clear message on every rank.
    `check_finite` (default: the MEGATRON_SAP_CHECK_FINITE variable, "1" for on): raise on
    every rank when q, k or v of any rank holds NaN or Inf (one all-reduce and a host sync;
    on alike on every rank).
    """
    if not check_bool(causal, "causal"):
        raise ValueError("sap_attention computes causal attention only (causal=False is not supported)")
    _check_inputs(q, k, v, plan, groups)
    check_schedule(schedule, allow_auto=True)
    check_bool(recompute_kv, "recompute_kv")
    check_bool(check_agreement, "check_agreement")
    if check_finite is not None and not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be True, False or None (MEGATRON_SAP_CHECK_FINITE), got {check_finite!r}")
    scale = resolve_softmax_scale(q.shape[2], softmax_scale, q.dtype)
    # The backend and dtype are checked here, before any exchange is posted: an error
    # raised between posting and waiting would leave the peers' transfers pending.
    backend = resolve_backend(backend, q.device, q.dtype, q.shape[2])
    outer = _Outer(groups)
    # The checks' collectives go where q is (NCCL's on the current GPU: `collective_device`),
    # not to another GPU that happens to be current.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        if check_finite if check_finite is not None else os.environ.get("MEGATRON_SAP_CHECK_FINITE") == "1":
            _check_finite(q, k, v, groups)
        if groups is not None and groups.world_size > 1 and check_agreement:
            scale_key = _LAST_SCALE[groups.cp_group] = _scale_key(scale, q.shape[2])
            _check_agreement(plan, groups, recompute_kv, attention_shape(q, k), scale_key)
        if outer.group is not None:
            ready_for_batched_p2p(outer.group, f"outer group (cp_rank {groups.cp_rank})")
    U = 1 if groups is None else groups.inner_size
    if U == 1:
        return _SAPOuterAttention.apply(q, k, v, plan, outer, scale, backend, recompute_kv, schedule)
    k, v = replicate_kv_heads(k, v, U)  # heads checked by _check_inputs
    q_h, k_h, v_h = ScatterHeads.apply(groups.inner_group, INNER_STEP, q, k, v)
    out_h = _SAPOuterAttention.apply(q_h, k_h, v_h, plan, outer, scale, backend, recompute_kv, schedule)
    (out,) = GatherHeads.apply(groups.inner_group, INNER_STEP, out_h)
    return out
