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
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .comm.groups import SAPGroups
from .comm.p2p import PendingExchange, collective_device, mark_ready, post_exchange, ready_for_batched_p2p
from .comm.ulysses import (GatherHeads, PendingAllToAll, ScatterHeads, check_heads, from_gather_part, from_scatter_part,
                           gather_part, replicate_kv_heads, scatter_part)
from .kernels import (accumulation_dtype, add_rows, first_order_only, merge_into, resolve_backend, resolve_softmax_scale,
                      take_rows, varlen_backward, varlen_forward, write_rows)
from .planning import Plan, RankProgram
from .planning.program import (ALL_HEADS, COMPUTE, FETCH, LOCAL, NO_CHUNK, POST, RETURN, check_schedule,
                               head_chunks)
from .validation import check_bool, check_inner_chunks, check_qkv

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


class _HeadChunks:
    """A pass's head chunks (`RankProgram.chunked`): the inputs that arrive by chunk (queries
    forward, output gradients backward) and each chunk's slice of the KV heads. One chunk
    (no inner pipe): the tensors as they are."""

    def __init__(self, inputs: list[torch.Tensor | None], kv_heads: Sequence[slice], pipe: _InnerPipe | None = None):
        self.inputs, self.kv_heads, self.pipe = inputs, kv_heads, pipe

    @classmethod
    def single(cls, inputs: torch.Tensor) -> "_HeadChunks":
        return cls([inputs], [slice(None)])

    @property
    def count(self) -> int:
        return len(self.inputs)

    def each(self, chunk: int) -> range:
        """The chunks a unit runs: its own, or every one (ALL_HEADS)."""
        return range(self.count) if chunk == ALL_HEADS else range(chunk, chunk + 1)

    def input(self, chunk: int) -> torch.Tensor:
        """Chunk `chunk`'s inputs, waiting for the all-to-all that brings them."""
        if self.inputs[chunk] is None:
            self.pipe.arrive(chunk)
        return self.inputs[chunk]

    def kv(self, rows: torch.Tensor, chunk: int) -> torch.Tensor:
        """Chunk `chunk`'s KV heads of stacked [n, 2, Hkv, D] rows (a view)."""
        heads = self.kv_heads[chunk]
        return rows if heads == slice(None) else rows[:, :, heads]


class _InnerPipe:
    """The inner all-to-alls of one pass in head chunks (`RankProgram.chunked`): each brings
    a chunk's inputs (sequence-sharded, `source`) as head-sharded rows into
    `chunks.inputs`, takes a chunk's outputs (head-sharded, `output(c)`) to the token
    owners, or both; `finish` places every chunk's outputs, sequence-sharded, into one
    [n, H, D] tensor."""

    def __init__(self, group: dist.ProcessGroup, size: int, heads: Sequence[slice], source: torch.Tensor,
                 output, step: str):
        self.group, self.size, self.heads, self.source, self.output, self.step = group, size, heads, source, output, step
        self.pending: list[tuple[PendingAllToAll, int, int]] = []  # (all-to-all, brings, takes)
        self.chunks: _HeadChunks | None = None
        self.result = source.new_empty(source.shape)
        self.extras: list[torch.Tensor] = []

    def _input_part(self, chunk: int) -> torch.Tensor:
        return self.source.unflatten(1, (self.size, -1))[:, :, self.heads[chunk]].transpose(0, 1)

    def post(self, brings: int, takes: int, extras: Sequence[torch.Tensor] = ()) -> None:
        """Post an all-to-all (a POST unit) that brings chunk `brings`'s inputs, takes chunk
        `takes`'s outputs (either NO_CHUNK) and carries `extras` (parts as they are)."""
        parts = [self._input_part(brings)] if brings != NO_CHUNK else []
        if takes != NO_CHUNK:
            parts.append(gather_part(self.output(takes), self.size))
        parts += list(extras)
        self.pending.append((PendingAllToAll(parts, self.group, self.step), brings, takes))

    def _wait_next(self) -> None:
        pending, brings, takes = self.pending.pop(0)
        parts = pending.wait()
        if brings != NO_CHUNK:  # a copy where the buffer holds outputs too: the inputs may be kept for backward
            part = from_scatter_part(parts.pop(0))
            self.chunks.inputs[brings] = part.contiguous() if takes != NO_CHUNK else part
        if takes != NO_CHUNK:
            self.result.unflatten(1, (self.size, -1))[:, :, self.heads[takes]] = parts.pop(0).transpose(0, 1)
        self.extras = parts

    def start(self, chunks: _HeadChunks, extras: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """The first all-to-all: chunk 0's inputs and `extras` (scatter parts), waited for;
        returns the extras received (head-sharded)."""
        self.chunks = chunks
        self.post(0, NO_CHUNK, [scatter_part(t, self.size) for t in extras])
        self._wait_next()
        return [from_scatter_part(part) for part in self.extras]

    def arrive(self, chunk: int) -> None:
        """Wait for the all-to-alls up to the one that brings chunk `chunk`'s inputs."""
        while self.chunks.inputs[chunk] is None:
            self._wait_next()

    def finish(self, extras: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The last all-to-all (the last chunk's outputs and `extras`, head-sharded), then
        every all-to-all still in flight waited for: (the outputs [n, H, D], the extras
        sequence-sharded)."""
        self.post(NO_CHUNK, len(self.heads) - 1, [gather_part(t, self.size) for t in extras])
        while self.pending:
            self._wait_next()
        return self.result, [from_gather_part(part) for part in self.extras]


class _SAPOuterAttention(torch.autograd.Function):
    """The outer-level program as one autograd op on [T/R, H, D] tensors."""

    @staticmethod
    def forward(ctx, q, k, v, plan: Plan, outer: _Outer, scale: float, backend: str, recompute_kv: bool, schedule: str):
        program = plan.program(outer.rank, q.device, schedule, recompute_kv)
        ctx.plan, ctx.outer, ctx.scale, ctx.backend, ctx.recompute_kv = plan, outer, scale, backend, recompute_kv
        ctx.schedule = program.schedule
        run = _gathered_forward if program.schedule == "gathered" else _pipelined_forward
        units = program.chunked(program.forward_events(), 1)
        (out,), (lse,), kept = run(program, units, _HeadChunks.single(q), k, v, outer, scale, backend, recompute_kv)
        ctx.save_for_backward(q, k, v, out, lse, *([] if recompute_kv else kept))
        return out

    @staticmethod
    @first_order_only  # the exchanged gradients are not differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        program = ctx.plan.backward_program(ctx.outer.rank, q.device, ctx.schedule, ctx.recompute_kv)
        units = program.chunked(program.backward_events(ctx.recompute_kv), 1)
        (dq,), dkv = _backward(ctx, program, units, _HeadChunks.single(dout.contiguous()), [q], k, v, [out], [lse],
                               saved)
        return dq.to(q.dtype), dkv[:, 0].to(k.dtype), dkv[:, 1].to(v.dtype), None, None, None, None, None, None


class _SAPChunkedAttention(torch.autograd.Function):
    """The inner and outer levels as one autograd op on sequence-sharded [T/P, H, D]
    tensors (K/V heads as `replicate_kv_heads` gives them), with the Ulysses all-to-alls
    in head chunks under the kernels (`RankProgram.chunked`, `Plan.inner_chunks`)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: Plan, groups: SAPGroups, outer: _Outer, scale: float, backend: str,
                schedule: str, heads: tuple[tuple[slice, slice], ...]):
        program = plan.program(outer.rank, q.device, schedule)
        ctx.plan, ctx.groups, ctx.outer, ctx.scale, ctx.backend, ctx.heads = plan, groups, outer, scale, backend, heads
        ctx.schedule, ctx.recompute_kv = program.schedule, False
        U, C = groups.inner_size, len(heads)
        acc: dict[int, torch.Tensor] = {}  # a finished chunk's output, in q's dtype
        pipe = _InnerPipe(groups.inner_group, U, [h for h, _ in heads], q, acc.__getitem__, INNER_STEP)
        chunks = _HeadChunks([None] * C, [kv for _, kv in heads], pipe)
        k_h, v_h = pipe.start(chunks, (k, v))
        run = _gathered_forward if program.schedule == "gathered" else _pipelined_forward
        units = program.chunked(program.forward_events(), C)
        outs, lses, kept = run(program, units, chunks, k_h, v_h, outer, scale, backend, False, acc)
        out, _ = pipe.finish()
        ctx.save_for_backward(k_h, v_h, *chunks.inputs, *outs, *lses, *kept)
        return out

    @staticmethod
    @first_order_only  # the exchanged gradients are not differentiable
    def backward(ctx, dout):
        k_h, v_h, *saved = ctx.saved_tensors
        C, U = len(ctx.heads), ctx.groups.inner_size
        q, out, lse, kept = saved[:C], saved[C:2 * C], saved[2 * C:3 * C], saved[3 * C:]
        program = ctx.plan.backward_program(ctx.outer.rank, k_h.device, ctx.schedule)
        finished: dict[int, torch.Tensor] = {}  # a finished chunk's dQ, in q's dtype
        pipe = _InnerPipe(ctx.groups.inner_group, U, [h for h, _ in ctx.heads], dout.contiguous(),
                          finished.__getitem__, f"{INNER_STEP} (backward)")
        chunks = _HeadChunks([None] * C, [kv for _, kv in ctx.heads], pipe)
        pipe.start(chunks)
        units = program.chunked(program.backward_events(), C)
        dq, dkv = _backward(ctx, program, units, chunks, q, k_h, v_h, out, lse, kept, finished)
        dq, (dk, dv) = pipe.finish((dkv[:, 0].to(k_h.dtype), dkv[:, 1].to(v_h.dtype)))
        return dq.to(q[0].dtype), dk, dv, None, None, None, None, None, None, None


def _pipelined_forward(program: RankProgram, units, chunks: _HeadChunks, k, v, outer: _Outer, scale, backend,
                       recompute_kv: bool, finished: dict[int, torch.Tensor] | None = None):
    """The pipelined schedule's forward (`RankProgram.chunked` `units` of its forward
    events): (each chunk's out, its lse, the received rows of every step). Each step's calls
    merge into fp32 accumulators; a step's send copy goes once its exchange is done, its
    received rows once used unless kept. A chunk's output goes into `finished` (in the
    queries' dtype) before the all-to-all that takes it."""
    kv = torch.stack([k, v], 1)  # [T/R, 2, Hkv, D]: one message per step
    acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * chunks.count
    posted: dict[int, tuple[PendingExchange, torch.Tensor]] = {}
    received: dict[int, torch.Tensor] = {}
    for kind, i, chunk in units:
        if kind == POST:
            if chunk != NO_CHUNK:  # its output is whole: taken in the inputs' dtype, the fp32 accumulator let go
                out, lse = acc[chunk]
                finished[chunk], acc[chunk] = out.to(chunks.inputs[chunk].dtype), (None, lse)
                del out
            chunks.pipe.post(i, chunk)
        elif kind == FETCH:
            posted[i] = _post_kv(program, i, kv, outer, 0)
        elif kind == LOCAL:
            for c in chunks.each(chunk):
                acc[c] = _local_forward(program, chunks.input(c), chunks.kv(kv, c), scale, backend)
        else:  # COMPUTE
            if i in posted:
                handle, received[i] = posted.pop(i)
                handle.wait()
                del handle
            recv = received.pop(i) if recompute_kv else received[i]
            for c in chunks.each(chunk) if program.transfers[i].calls else ():  # none: no inputs needed
                _forward_calls(program.transfers[i].calls, chunks.input(c), chunks.kv(recv, c), *acc[c], scale, backend)
            del recv
    outs = [a.to(chunks.inputs[c].dtype) if a is not None else finished[c] for c, (a, _) in enumerate(acc)]
    if finished is not None:
        finished[chunks.count - 1] = outs[-1]
    return outs, [lse for _, lse in acc], [received[i] for i in sorted(received)]


def _gathered_forward(program: RankProgram, units, chunks: _HeadChunks, k, v, outer: _Outer, scale, backend,
                      recompute_kv: bool, finished: dict[int, torch.Tensor] | None = None):
    """The gathered schedule's forward: (each chunk's out, its lse, [source]). Every step is
    received into its slice of the source buffer; each call runs once the step that brings
    its last keys is in, and writes its rows of the output (nothing is merged)."""
    source, slices = _gathered_source(program, k, v)
    kv = source[: len(k)]
    outs: list[torch.Tensor | None] = [None] * chunks.count
    lses: list[torch.Tensor | None] = [None] * chunks.count
    posted: dict[int, PendingExchange] = {}
    for kind, i, chunk in units:
        if kind == POST:
            if chunk != NO_CHUNK:
                finished[chunk] = outs[chunk]
            chunks.pipe.post(i, chunk)
        elif kind == FETCH:
            posted[i] = _post_kv(program, i, kv, outer, 0, slices[i])[0]
        elif kind == LOCAL:
            for c in chunks.each(chunk):
                q = chunks.input(c)
                outs[c] = torch.empty_like(q)
                lses[c] = torch.empty((q.shape[1], q.shape[0]), dtype=accumulation_dtype(q), device=q.device)
                _write_forward(program.local_calls, q, chunks.kv(kv, c), outs[c], lses[c], scale, backend)
        else:  # COMPUTE
            if i in posted:
                posted.pop(i).wait()
            for c in chunks.each(chunk) if program.transfers[i].calls else ():  # none: no inputs needed
                _write_forward(program.transfers[i].calls, chunks.input(c), chunks.kv(source, c), outs[c], lses[c],
                               scale, backend)
    if finished is not None:
        finished[chunks.count - 1] = outs[-1]
    return outs, lses, [source]


def _backward(ctx, program: RankProgram, units, chunks: _HeadChunks, q, k, v, out, lse, saved,
              finished: dict[int, torch.Tensor] | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(each chunk's dq, dK/dV stacked), accumulated, running the `RankProgram.chunked`
    `units` of `backward_events` (`chunks`' inputs: the output gradients; q, out, lse: each
    chunk's). Pipelined, each step's calls add into an fp32 gradient of its received rows
    (the K/V saved in forward, or fetched again with `recompute_kv`); gathered, into one
    buffer of every step's, the saved source's. A return sends those gradients back to their
    owner and receives those of the rows the step sent, which its collect adds into dK/dV.
    A chunk's dQ goes into `finished` (in q's dtype) before the all-to-all that takes it."""
    outer, scale, backend = ctx.outer, ctx.scale, ctx.backend
    acc_dtype = accumulation_dtype(q[0])
    gathered = program.schedule == "gathered"
    # Gathered, every query row's dQ comes from the one call that has the row (as its
    # output did in forward): written there, in q's dtype, nothing to start from or add.
    dq = [torch.empty_like(x) if gathered else torch.zeros(x.shape, dtype=acc_dtype, device=x.device) for x in q]
    steps = program.transfers
    if gathered:
        (source,) = saved
        kv = source[: len(k)]
        grad_source = torch.zeros(source.shape, dtype=acc_dtype, device=source.device)
        dkv = grad_source[: len(k)]
        grads = dict(enumerate(torch.split(grad_source[len(k):], [step.recv_tokens for step in steps])))
    else:
        kv = torch.stack([k, v], 1)
        dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=kv.device)
        grads = {}
    fetched: dict[int, tuple[PendingExchange, torch.Tensor]] = {}
    returns: dict[int, tuple[PendingExchange, torch.Tensor | None]] = {}
    for kind, i, chunk in units:
        if kind == POST:
            if chunk != NO_CHUNK:  # its dQ is whole: taken in q's dtype, the fp32 accumulator let go
                finished[chunk] = dq[chunk] = dq[chunk].to(q[chunk].dtype)
            chunks.pipe.post(i, chunk)
            continue
        if kind == LOCAL:
            for c in chunks.each(chunk) if program.local_calls else ():
                _backward_calls(program.local_calls, chunks.input(c), q[c], out[c], lse[c], chunks.kv(kv, c), dq[c],
                                chunks.kv(dkv, c), scale, backend, gathered)
            continue
        step = steps[i]
        if kind == FETCH:
            fetched[i] = _post_kv(program, i, kv, outer, _REFETCH_TAG)
        elif kind == COMPUTE and gathered:
            for c in chunks.each(chunk) if step.calls else ():  # a unit without calls needs no inputs
                _backward_calls(step.calls, chunks.input(c), q[c], out[c], lse[c], chunks.kv(source, c), dq[c],
                                chunks.kv(grad_source, c), scale, backend, True)
        elif kind == COMPUTE:
            if ctx.recompute_kv:
                handle, recv = fetched.pop(i)
                handle.wait()
                del handle
            else:
                recv = saved[i]
            if i not in grads:
                grads[i] = torch.zeros(recv.shape, dtype=acc_dtype, device=recv.device)
            for c in chunks.each(chunk) if step.calls else ():
                _backward_calls(step.calls, chunks.input(c), q[c], out[c], lse[c], chunks.kv(recv, c), dq[c],
                                chunks.kv(grads[i], c), scale, backend)
            del recv
        elif kind == RETURN:
            returns[i] = _post_gradients(program, i, grads.pop(i), kv, outer)
        else:  # COLLECT
            handle, grad_in = returns.pop(i)
            handle.wait()
            if grad_in is not None:
                add_rows(dkv, step.send_rows, grad_in)
    if finished is not None:
        finished[chunks.count - 1] = dq[-1].to(q[-1].dtype)
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


# What a rank reports in the finite check's all-reduce: its inputs are finite, hold NaN or
# Inf, or failed `sap_attention`'s own checks (it takes part only to tell the others).
_FINITE, _NOT_FINITE, _FAILED_CHECKS = 0, 1, 2


def _check_finite(q: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None,
                  groups: SAPGroups | None) -> None:
    """Raise on every rank of the CP group when any rank's q, k or v holds NaN or Inf: one
    all-reduce of each rank's finding (and a host sync), so that the ranks without them do not
    go on into exchanges that their peer has left. Every rank must check alike. A rank whose
    inputs failed `sap_attention`'s own checks takes part with q, k, v None (`_FAILED_CHECKS`):
    the others raise, naming it, and it raises its own error."""
    problem = None
    for name, t in () if q is None else (("q", q), ("k", k), ("v", v)):
        bad = ~torch.isfinite(t)
        if bad.any():
            token, head, _ = (int(i) for i in torch.nonzero(bad)[0])
            problem = (f"{name} contains {int(bad.sum())} NaN or Inf values, the first at local token {token}, "
                       f"head {head}")
            break
    others: list[int] = []
    if groups is not None and groups.world_size > 1:
        counts = torch.zeros(groups.world_size, dtype=torch.int64, device=collective_device(groups.cp_group))
        counts[groups.cp_rank] = _FAILED_CHECKS if q is None else _NOT_FINITE if problem is not None else _FINITE
        _all_reduce(counts, groups.cp_group, dist.ReduceOp.SUM, groups, "finite check", "NaN/Inf findings",
                    "not every rank checks (check_finite / MEGATRON_SAP_CHECK_FINITE must be alike on all CP ranks)")
        found = counts.tolist()
        failed = [r for r, c in enumerate(found) if c == _FAILED_CHECKS and r != groups.cp_rank]
        if failed and q is not None:
            raise RuntimeError(f"cp_ranks {failed} of {list(groups.cp_ranks)} could not prepare their attention "
                               f"inputs (sap_attention's checks); their own errors name the problem")
        if q is None:  # a rank that failed its checks: its own error follows
            return
        others = [r for r, c in enumerate(found) if c == _NOT_FINITE and r != groups.cp_rank]
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
            f"failed: {exc}. A rank died or is stuck (or raised on its own inputs before this check: see its error), or {cause}"
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
# signature, `recompute_kv`, the attention shape, the softmax scale (None: the default) and
# the head chunks where they are not "auto"'s (None: those).
# The signature, not the plan object: ranks holding equal plans as different objects (one
# planned afresh, the other's from its cache) skip the check alike.
_LAST_CHECKED: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[str, bool, tuple | None, float | None, int | None]] = (
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
                     softmax_scale: float | None, inner_chunks: int | None = None) -> None:
    """`verify_plan_agreement` unless it was last run on this CP group for this plan (an
    equal one: `Plan.signature`), `recompute_kv`, attention shape, softmax scale and head
    chunks (`inner_chunks`: a count that is not "auto"'s, else None) (a batch split's
    check, or an earlier layer's).

    Checking whenever a rank's call differs from the last one checked, not only on a
    plan's or shape's first use, is what keeps ranks that agreed from parting silently: a
    rank that goes back to a plan or shape it checked before, while the others stay on
    theirs, enters the all-reduce alone and fails at the group's timeout instead of
    exchanging messages of the right sizes for another batch (peers waiting for its
    messages fail too). A model whose layers alternate shapes checks at every change."""
    if _LAST_CHECKED.get(groups.cp_group) != (plan.signature(), bool(recompute_kv), shape, softmax_scale, inner_chunks):
        verify_plan_agreement(plan, groups, recompute_kv, shape, softmax_scale=softmax_scale, inner_chunks=inner_chunks)


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
                          softmax_scale: float | None = None, inner_chunks: int | None = None) -> None:
    """Check now that every rank of the CP group planned the same batch and layout, and
    runs it with the same `recompute_kv` (which decides whether the backward exchanges K/V
    again: ranks that differ would wait for each other), attention `shape` ((query heads,
    KV heads, head dim, dtype) as `attention_shape` gives it, which size and type the
    exchanged buffers; None: not checked here) and `softmax_scale` (None: the default
    head_dim ** -0.5; ranks that scale their scores differently merge partial results that
    do not fit together) and `inner_chunks` (a count `sap_attention` runs that is not its
    "auto" one; None: that one, which the plan and shape decide alike on every rank).

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
    chunks = "" if inner_chunks is None else f"|inner chunks {int(inner_chunks)}"
    digest = hashlib.sha1(f"{plan.signature()}|{recompute_kv}|{shape}{scale}{chunks}".encode()).hexdigest()
    mine = int(digest[:16], 16) & ((1 << 62) - 1)
    high, low, failed = _exchange_hashes(mine, groups, over)
    described = (f"this rank (cp_rank {groups.cp_rank}) planned hash {mine:016x} ({plan.total_tokens} tokens, "
                 f"{len(plan.cu_seqlens) - 1} documents, layout {plan.inner_size}x{plan.outer_size}, cost model "
                 f"{plan.cost_model.name!r}, attention shape (heads, kv heads, head dim, dtype) {shape}, "
                 f"recompute_kv={recompute_kv}, softmax_scale "
                 f"{'default' if softmax_scale is None else softmax_scale}"
                 f"{'' if inner_chunks is None else f', inner_chunks {inner_chunks}'})")
    if failed:
        raise RuntimeError(
            f"CP rank {failed - 1} of {list(groups.cp_ranks)} (the highest that failed) could not prepare this "
            f"micro-batch; its own error names the problem; {described}"
        )
    if high != low:
        raise RuntimeError(
            f"CP ranks disagree on the batch, the layout, the cost model, the attention shape, the softmax scale or "
            f"recompute_kv: {described}, the group has hashes from {low:016x} to {high:016x} (head chunks count too, "
            f"where a rank asks for inner_chunks other than 'auto' gives)"
        )
    _LAST_CHECKED[groups.cp_group] = (plan.signature(), recompute_kv, shape, softmax_scale,
                                      None if inner_chunks is None else int(inner_chunks))
    mark_ready(groups.cp_group if over is None else over)  # the CP group (and the outer group at U = 1), or the host group


def _has_peers(groups: object) -> bool:
    """Whether `groups` are SAPGroups of several CP ranks with process groups to reach them."""
    return isinstance(groups, SAPGroups) and groups.world_size > 1 and groups.cp_group is not None


def _peers_check_this_plan(plan: object, groups: object) -> bool:
    """Whether the other CP ranks, called with `plan` as this rank was, are about to run the
    agreement check (`_check_agreement`): a plan of several ranks that this group has not
    checked yet (ranks that keep a checked plan skip the check, and one that announced its
    failure there would wait for them until the group's timeout)."""
    if not _has_peers(groups) or not isinstance(plan, Plan):
        return False
    last = _LAST_CHECKED.get(groups.cp_group)
    return last is None or last[0] != plan.signature()


def tell_peers_of_failure(error: BaseException, tell: Callable[[], None]) -> None:
    """Run `tell` (this rank's part in a check its peers are about to run, as a failed rank)
    for a rank about to raise `error`: where telling them fails too (they are gone), that is
    noted on `error`, which stays the one to see."""
    try:
        tell()
    except Exception as told:  # the backend's error type varies (gloo, NCCL)
        if hasattr(error, "add_note"):  # Python 3.11 on
            error.add_note(f"(telling the other CP ranks failed too: {told})")


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


def _head_chunks(inner_chunks: int | str, plan: Plan, outer_rank: int, inner_size: int, num_heads: int,
                 num_kv_heads: int, recompute_kv: bool) -> tuple[tuple[slice, slice], ...]:
    """The head chunks `sap_attention` runs the all-to-alls in (`inner_chunks`, checked)."""
    if inner_chunks == "auto":
        return head_chunks(num_heads, num_kv_heads, inner_size,
                           plan.chunks_for_heads(num_heads, num_kv_heads, outer_rank, recompute_kv))
    inner_chunks = check_inner_chunks(inner_chunks, recompute_kv)
    if inner_chunks > 1 and inner_size == 1:
        raise ValueError(f"inner_chunks={inner_chunks} chunks the Ulysses all-to-alls, which an inner size of 1 "
                         f"does not have")
    heads = head_chunks(num_heads, num_kv_heads, inner_size, inner_chunks)
    if heads is None:
        raise ValueError(
            f"inner_chunks={inner_chunks} does not split the heads: each of the {inner_size} inner ranks holds "
            f"{num_heads // inner_size} query heads and {max(num_kv_heads, inner_size) // inner_size} KV heads; the "
            f"query heads must divide into the chunks, and each chunk must read whole groups of query heads per KV "
            f"head or lie within one"
        )
    return heads


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
    inner_chunks: int | str = "auto",
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
    `check_agreement`: when the plan, `recompute_kv`, attention shape, softmax scale or head chunks differ from what
    was last checked on these groups, all-reduce a hash of them (`verify_plan_agreement`)
    so that ranks that planned different batches fail together; the layers of one
    micro-batch check once (where they share a shape). A rank that keeps its plan while
    another changes does not enter the all-reduce: the changed rank fails at the group's
    timeout, and so does the other wherever it waits for that rank's messages (one whose
    program exchanges nothing returns its result for the plan it kept), so a caller that
    can hand one rank a cached plan while another plans a new batch (without Megatron's
    batch split, which checks every micro-batch) should call `verify_plan_agreement` per
    micro-batch for a clear message on every rank. A rank whose inputs fail this function's
    own checks first takes part, as a failed rank, in the check its peers are about to run:
    with `check_finite` on, the finite check, which they run on every call; else, where the
    group has not checked its plan yet, the agreement check (`announce_failure`). They raise
    at once, naming it, instead of waiting for it until the group's timeout.
    `check_finite` (default: the MEGATRON_SAP_CHECK_FINITE variable, "1" for on): raise on
    every rank when q, k or v of any rank holds NaN or Inf (one all-reduce and a host sync;
    on alike on every rank).
    `inner_chunks` (U > 1): the Ulysses all-to-alls in that many head chunks, run under the
    kernels (`RankProgram.chunked`); "auto": `plan.inner_chunks(recompute_kv)` where these
    heads split so, else 1. More than 1 needs `recompute_kv=False` and heads that split
    (`planning.program.head_chunks`); ranks that ask for different counts fail the
    agreement check.
    """
    finite = check_finite if check_finite is not None else os.environ.get("MEGATRON_SAP_CHECK_FINITE") == "1"
    try:
        if not check_bool(causal, "causal"):
            raise ValueError("sap_attention computes causal attention only (causal=False is not supported)")
        _check_inputs(q, k, v, plan, groups)
        check_schedule(schedule, allow_auto=True)
        check_bool(recompute_kv, "recompute_kv")
        check_bool(check_agreement, "check_agreement")
        if check_finite is not None and not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be True, False or None (MEGATRON_SAP_CHECK_FINITE), got {check_finite!r}")
        U = 1 if groups is None else groups.inner_size
        outer = _Outer(groups)
        heads = _head_chunks(inner_chunks, plan, outer.rank, U, q.shape[1], k.shape[1], recompute_kv)
        # checked as a count only where it is not what "auto" gives (which the plan and shape decide alike)
        auto = inner_chunks == "auto" or len(heads) == plan.chunks_for_heads(q.shape[1], k.shape[1], outer.rank,
                                                                             recompute_kv)
        scale = resolve_softmax_scale(q.shape[2], softmax_scale, q.dtype)
        # The backend and dtype are checked here, before any exchange is posted: an error
        # raised between posting and waiting would leave the peers' transfers pending.
        backend = resolve_backend(backend, q.device, q.dtype, q.shape[2])
    except Exception as error:
        # on q's GPU where it has one, as the peers' checks run (below)
        cuda = isinstance(q, torch.Tensor) and q.is_cuda
        with torch.cuda.device(q.device) if cuda else contextlib.nullcontext():
            if finite is True and _has_peers(groups):  # the peers run the finite check on every call
                tell_peers_of_failure(error, lambda: _check_finite(None, None, None, groups))
            elif check_agreement is True and finite is False and _peers_check_this_plan(plan, groups):
                tell_peers_of_failure(error, lambda: announce_failure(groups))
        raise
    # The checks' collectives go where q is (NCCL's on the current GPU: `collective_device`),
    # not to another GPU that happens to be current.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        if finite:
            _check_finite(q, k, v, groups)
        if groups is not None and groups.world_size > 1 and check_agreement:
            scale_key = _LAST_SCALE[groups.cp_group] = _scale_key(scale, q.shape[2])
            _check_agreement(plan, groups, recompute_kv, attention_shape(q, k), scale_key, None if auto else len(heads))
        if outer.group is not None:
            ready_for_batched_p2p(outer.group, f"outer group (cp_rank {groups.cp_rank})")
    if U == 1:
        return _SAPOuterAttention.apply(q, k, v, plan, outer, scale, backend, recompute_kv, schedule)
    k, v = replicate_kv_heads(k, v, U)  # heads checked by _check_inputs
    if len(heads) > 1:
        return _SAPChunkedAttention.apply(q, k, v, plan, groups, outer, scale, backend, schedule, heads)
    q_h, k_h, v_h = ScatterHeads.apply(groups.inner_group, INNER_STEP, q, k, v)
    out_h = _SAPOuterAttention.apply(q_h, k_h, v_h, plan, outer, scale, backend, recompute_kv, schedule)
    (out,) = GatherHeads.apply(groups.inner_group, INNER_STEP, out_h)
    return out
