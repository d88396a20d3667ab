"""Run every outer rank's compiled program in turn, in one process.

Same kernel calls and merges as the distributed op, with the transfers replaced by
indexing into the sender's tensors. Used to check a plan on one device (the GPU check
script times each rank's kernel work this way) and in tests without processes. The
inner (Ulysses) level only splits heads, so one simulated outer rank stands for its
whole inner group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import _backward_calls, _forward_calls, _local_forward, _write_forward
from .kernels import accumulation_dtype, add_rows, resolve_softmax_scale, take_rows
from .planning import Plan
from .validation import check_qkv


@dataclass
class SimulatedResult:
    """Global (packed-order) outputs and gradients, and per-rank kernel seconds if timed."""

    out: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    forward_seconds: list[float]
    backward_seconds: list[float]


def _timer(device: torch.device):
    """Returns (start, stop) callables measuring seconds without a host sync in between."""
    if device.type == "cuda":
        def start():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def stop(ev):
            end = torch.cuda.Event(enable_timing=True)
            end.record()

            def seconds() -> float:
                end.synchronize()  # elapsed_time raises until the device has reached both events
                return ev.elapsed_time(end) / 1e3

            return seconds

        return start, stop
    import time

    def start_cpu():
        return time.perf_counter()

    def stop_cpu(t0):
        elapsed = time.perf_counter() - t0
        return lambda: elapsed

    return start_cpu, stop_cpu


def _source(kv: torch.Tensor, received: list[torch.Tensor | None]) -> torch.Tensor:
    """The gathered schedule's source rows: the local ones, then every step's received ones."""
    return torch.cat([kv, *(x for x in received if x is not None)])


@torch.no_grad()  # gradients come from the programs' backward calls, not from autograd
def simulate_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    dout: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    backend: str = "auto",
    schedule: str = "pipelined",
) -> SimulatedResult:
    """Causal attention of the whole packed batch (q [T, Hq, D], k/v [T, Hkv, D]) by `plan`'s programs
    in `schedule` ("auto": each outer rank in `plan.schedule(outer_rank)`, as `sap_attention` runs).

    With `dout`, also the gradients. Per-rank kernel time is recorded (CUDA events on GPU).
    """
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a megatron_sap Plan from plan_sequences, got {type(plan).__name__}")
    check_qkv(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != plan.total_tokens:
            raise ValueError(f"{name} must be the whole batch [T={plan.total_tokens}, heads, head_dim], "
                             f"got shape {tuple(t.shape)}")
    scale = resolve_softmax_scale(q.shape[2], softmax_scale, q.dtype)
    acc_dtype = accumulation_dtype(q)
    device = q.device
    R = plan.outer_size
    start, stop = _timer(device)
    idx = [plan.group_indices(r).to(device) for r in range(R)]
    programs = [plan.program(r, device, schedule) for r in range(R)]
    qs = [q.index_select(0, i) for i in idx]
    kvs = [torch.stack([k.index_select(0, i), v.index_select(0, i)], 1) for i in idx]

    def sender_step(src: int, round_: int):
        return next(s for s in programs[src].transfers if s.round == round_)

    def received(step) -> torch.Tensor:
        return take_rows(kvs[step.recv_peer], sender_step(step.recv_peer, step.round).send_rows)

    outs, lses, fwd_timers = [], [], []
    gathered = [program.schedule == "gathered" for program in programs]
    for r in range(R):
        recvs = [received(s) if s.recv_tokens else None for s in programs[r].transfers]
        source = _source(kvs[r], recvs) if gathered[r] else None  # the executor receives into it
        t0 = start()
        if gathered[r]:
            acc_out = torch.empty_like(qs[r])
            acc_lse = torch.empty((q.shape[1], len(qs[r])), dtype=acc_dtype, device=device)
            _write_forward(programs[r].local_calls, qs[r], kvs[r], acc_out, acc_lse, scale, backend)
            for step in programs[r].transfers:
                _write_forward(step.calls, qs[r], source, acc_out, acc_lse, scale, backend)
        else:
            acc_out, acc_lse = _local_forward(programs[r], qs[r], kvs[r], scale, backend)
            for step, recv in zip(programs[r].transfers, recvs):
                if recv is not None:
                    _forward_calls(step.calls, qs[r], recv, acc_out, acc_lse, scale, backend)
        fwd_timers.append(stop(t0))
        outs.append(acc_out.to(q.dtype))
        lses.append(acc_lse)
    out = torch.empty_like(q)
    for r in range(R):
        out.index_copy_(0, idx[r], outs[r])
    result = SimulatedResult(out, None, None, None, [], [])
    if dout is None:
        result.forward_seconds = [f() for f in fwd_timers]
        return result

    dqs = [torch.zeros(x.shape, dtype=acc_dtype, device=device) for x in qs]
    dkvs = [torch.zeros(x.shape, dtype=acc_dtype, device=device) for x in kvs]
    bwd_timers = []
    for r in range(R):
        douts = dout.index_select(0, idx[r])
        recvs = [received(s) if s.recv_tokens else None for s in programs[r].transfers]
        grads = []
        source = _source(kvs[r], recvs) if gathered[r] else None  # kept from forward by the executor
        t0 = start()
        if gathered[r]:
            grad_source = torch.zeros(source.shape, dtype=acc_dtype, device=device)
            for step in programs[r].transfers:
                _backward_calls(step.calls, douts, qs[r], outs[r], lses[r], source, dqs[r], grad_source, scale, backend)
            dkvs[r] += grad_source[: len(kvs[r])]
            sizes = [s.recv_tokens for s in programs[r].transfers]
            for step, grad in zip(programs[r].transfers, torch.split(grad_source[len(kvs[r]):], sizes)):
                if step.recv_tokens:
                    grads.append((step, grad))
        for step, recv in zip(programs[r].transfers, recvs):  # the executor's order: remote blocks first
            if recv is not None and not gathered[r]:
                grad = torch.zeros(recv.shape, dtype=acc_dtype, device=device)
                _backward_calls(step.calls, douts, qs[r], outs[r], lses[r], recv, dqs[r], grad, scale, backend)
                grads.append((step, grad))
        _backward_calls(programs[r].local_calls, douts, qs[r], outs[r], lses[r], kvs[r], dqs[r], dkvs[r], scale, backend)
        bwd_timers.append(stop(t0))
        for step, grad in grads:  # deliver to the owner, as the backward exchange does
            add_rows(dkvs[step.recv_peer], sender_step(step.recv_peer, step.round).send_rows, grad.to(q.dtype))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for r in range(R):
        dq.index_copy_(0, idx[r], dqs[r].to(q.dtype))
        dk.index_copy_(0, idx[r], dkvs[r][:, 0].to(k.dtype))
        dv.index_copy_(0, idx[r], dkvs[r][:, 1].to(v.dtype))
    result.dq, result.dk, result.dv = dq, dk, dv
    result.forward_seconds = [f() for f in fwd_timers]
    result.backward_seconds = [f() for f in bwd_timers]
    return result
