#!/usr/bin/env python
"""Check the CUDA attention kernels on a real GPU and record the numbers.

    python scripts/gpu_check.py --out docs/gpu_results.json

Each function in CHECKS takes no argument and returns a JSON-able dict that
contains "ok"; the runner records it under the function's name, records an
exception as a failure and goes on. To add a check, append to CHECKS.

Built-in checks, in the order they run:
  * flash_backends_present: at least one flash backend is usable on this GPU;
  * for every flash backend present (aten-flash, flash-attn):
    - accuracy in bf16 against the float64 dense reference on random packed
      batches: diagonal causal blocks, full blocks, key blocks merged with
      merge_partials, and backward per block with the merged out/lse;
    - no host syncs: forward and backward run under
      torch.cuda.set_sync_debug_mode("error");
    - speed: forward and backward TFLOP/s at Hq=32, Hkv=8, D=128, bf16, for a
      few document-length mixes of 128K tokens (causal FLOPs: pairs * 4 * D * Hq
      forward, 2.5 times that backward);
  * method_kernel_times: each method's attention work per rank (SAP, p2p,
    all_gather, a2a) on one packed batch of real documents, each rank's calls run
    in turn; the cost model's compute rates fitted to every rank of every method are
    written next to the report (calibration.json, readable by CostModel.from_calibration);
  * sap_simulated: every rank's compiled program of a packed batch run in turn on
    this GPU (bf16, the auto backend), in both schedules, against the float64
    reference per document;
  * sap_no_host_syncs: the sap_attention autograd op forward and backward under
    set_sync_debug_mode("error"): one rank, and one rank of a 4-rank plan (exchanges
    local) in both schedules;
  * batch_split_no_host_syncs: the Megatron batch split through the hooks, on a rank
    that reads the data, under set_sync_debug_mode("error");
  * sap_executor_vs_kernels: each SAP rank's compute as the executor runs it, in the
    pipelined and the gathered schedule, against the same work in one call per pass,
    and the device time by op of one run of every rank's program (torch.profiler);
    the pipelined over the gathered time is written to calibration.json as
    pipelined_kernel_factor;
  * method_executor_times: every rank's whole op, SAP (as `auto` picks with this run's
    calibration, and in each schedule) and the KV ring, forward and backward with local
    exchanges (the executors' compute without communication);
  * rank_memory: every rank's peak memory for SAP (also with recompute_kv, pipelined)
    and the KV ring (each rank run alone with local exchanges), beside the formulas;
  * torch_backend_accuracy: the torch backend's accuracy on the GPU in float32;
  * host_planning_time: planning on this machine's CPU, as `make bench` measures it
    (a fresh plan of packed 128K-token rows at P = 8 and 64, a cache hit, rank 0's
    program with its index tensors on the GPU): the planner runs on the training host's
    CPU, once per micro-batch.

    python scripts/gpu_check.py --dry-run --out /tmp/dry.json

runs every check on the CPU at small sizes (`DRY_RUN_SIZES`), the torch backend standing
in for the flash ones and without the host-sync checks: the test suite runs it, so that
the script's own code is tested where no GPU is (its report is no GPU result).

    python scripts/gpu_check.py --only sap_simulated,method_executor_times

reruns those checks alone into the existing report (same device, torch and flash-attn),
each marked with its date; the rest of the report stays.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import platform
import random
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_sap.kernels import available_backends, merge_partials, resolve_backend, varlen_backward, varlen_forward  # noqa: E402
from megatron_sap.reference import dense_attention  # noqa: E402

DEVICE = torch.device("cuda")  # the CPU with --dry-run


@dataclass(frozen=True)
class Sizes:
    """The batches the checks run: the GPU's, or small ones for `--dry-run` on the CPU."""

    shape: tuple[int, int, int]  # (query heads, key/value heads, head dim) of the speed, method and op checks
    accuracy_batches: dict[str, list[int]]  # document lengths of the accuracy checks
    speed_tokens: int  # tokens of each speed mix
    speed_budget_ms: float  # how long each speed measurement may repeat (3 runs at least)
    method_rows: tuple[tuple[str, int], ...]  # (corpus, tokens) of the per-method checks, 8 ranks
    simulated_rows: tuple[tuple[int, int, int], ...]  # (outer size, tokens, longest document) of sap_simulated
    op_lengths: tuple[int, ...]  # sap_no_host_syncs's documents (their sum a multiple of 4)
    split_tokens: int  # tokens of the batch split's rows
    planning_rows: int  # fresh rows per layout of host_planning_time


GPU_SIZES = Sizes(
    shape=(32, 8, 128),
    accuracy_batches={
        "tiny_docs": [1, 0, 2, 1, 5, 1, 0, 3] * 250,
        "mixed": [7, 0, 1000, 1, 33, 0, 700, 128, 2, 129, 900],
        "long": [1, 3000, 5],
    },
    speed_tokens=131_072,
    speed_budget_ms=1500.0,
    method_rows=(("stdlib", 32768), ("sharegpt", 131072)),
    simulated_rows=((4, 8192, 4096), (8, 16384, 6000)),
    op_lengths=(5, 0, 300, 1, 2000, 64, 3000, 2758),
    split_tokens=32768,
    planning_rows=16,
)
DRY_RUN_SIZES = Sizes(
    shape=(4, 2, 32),
    accuracy_batches={
        "tiny_docs": [1, 0, 2, 1, 5, 1, 0, 3] * 20,
        "mixed": [7, 0, 100, 1, 33, 0, 70, 128, 2, 129, 90],
        "long": [1, 300, 5],
    },
    speed_tokens=1024,
    speed_budget_ms=0.0,
    method_rows=(("sharegpt", 1024),),
    simulated_rows=((4, 512, 256), (8, 1024, 400)),
    op_lengths=(5, 0, 30, 1, 200, 64, 300, 200),
    split_tokens=1024,
    planning_rows=2,
)
SIZES = GPU_SIZES
BF16_TOLERANCE = 2e-2  # max error relative to the largest reference magnitude
FP32_TOLERANCE = 1e-4


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _host_syncs_raise():
    """Inside, a host sync raises (torch.cuda.set_sync_debug_mode("error")); on the CPU
    (`--dry-run`) there is nothing to check."""
    _sync()
    if DEVICE.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _device_name() -> str:
    return torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, dry run)"


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _rows(cu: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    starts = cu.tolist()
    return torch.cat([torch.arange(starts[i] + lo, starts[i] + hi) for i, (lo, hi) in enumerate(spans)]).to(DEVICE)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max absolute error over the largest reference magnitude; inf when got has NaN."""
    if want.numel() == 0:
        return 0.0
    if torch.isnan(got).any():
        return math.inf
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite].double(), want[~finite]):
        return math.inf  # -inf lse (rows without keys) must match exactly
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    return (got[finite].double() - want[finite]).abs().max().item() / max(scale, 1e-6)


def _reference(q, k, v, cu, dout, causal):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = dense_attention(*leaves, cu, causal=causal)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout.double()))


def _batch(lengths, heads_q, heads_kv, dim, dtype, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    total = sum(lengths)
    q, dout = (torch.randn(total, heads_q, dim, device=DEVICE, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(total, heads_kv, dim, device=DEVICE, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, dout


def _accuracy(backend: str, dtype: torch.dtype, tolerance: float) -> dict:
    """Errors of forward and backward against the reference: whole documents, then split key blocks."""
    errors = {}
    heads_q, heads_kv, dim = 8, 2, 128
    for seed, (name, lengths) in enumerate(SIZES.accuracy_batches.items()):
        cu, longest = _cu(lengths), max(lengths)
        q, k, v, dout = _batch(lengths, heads_q, heads_kv, dim, dtype, seed)
        for causal in (True, False):
            ref = _reference(q, k, v, cu, dout, causal)
            out, lse = varlen_forward(q, k, v, cu, cu, longest, longest, causal=causal, backend=backend)
            grads = varlen_backward(
                dout, q, k, v, ref[0].to(dtype), ref[1], cu, cu, longest, longest, causal=causal, backend=backend
            )
            for label, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref):
                errors[f"{name}/{'causal' if causal else 'full'}/{label}"] = _error(got, want)

        # Tail queries of each document against its keys in three blocks: [0, a) and [a, s) full, [s, L) causal.
        rng = random.Random(seed)
        parts = []
        for length in lengths:
            s = rng.randint(0, length)
            parts.append((rng.randint(0, s), s, length))
        tail = _rows(cu, [(s, n) for _, s, n in parts])
        dout_tail = torch.zeros_like(dout)
        dout_tail[tail] = dout[tail]
        ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _reference(q, k, v, cu, dout_tail, True)
        cu_tail = _cu([n - s for _, s, n in parts])
        blocks = []
        for spans, causal in (
            ([(0, a) for a, _, _ in parts], False),
            ([(a, s) for a, s, _ in parts], False),
            ([(s, n) for _, s, n in parts], True),
        ):
            keys, cu_k = _rows(cu, spans), _cu([hi - lo for lo, hi in spans])
            out, lse = varlen_forward(q[tail], k[keys], v[keys], cu_tail, cu_k, longest, longest, causal=causal, backend=backend)
            blocks.append((keys, cu_k, causal, out, lse))
        out, lse = blocks[0][3], blocks[0][4]
        for *_, out_b, lse_b in blocks[1:]:
            out, lse = merge_partials(out, lse, out_b, lse_b)
        dq = torch.zeros(len(tail), heads_q, dim, dtype=torch.float64, device=DEVICE)
        dk = torch.zeros(k.shape, dtype=torch.float64, device=DEVICE)
        dv = torch.zeros(v.shape, dtype=torch.float64, device=DEVICE)
        for keys, cu_k, causal, _, _ in blocks:
            dq_b, dk_b, dv_b = varlen_backward(
                dout[tail], q[tail], k[keys], v[keys], out, lse, cu_tail, cu_k, longest, longest,
                causal=causal, backend=backend,
            )
            dq += dq_b.double()
            dk[keys] += dk_b.double()
            dv[keys] += dv_b.double()
        for label, got, want in zip(
            ("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), (ref_out[tail], ref_lse[:, tail], ref_dq[tail], ref_dk, ref_dv)
        ):
            errors[f"{name}/merged_blocks/{label}"] = _error(got, want)
    worst = max(errors.values())
    return {"ok": worst <= tolerance, "tolerance": tolerance, "max_error": worst, "errors": errors}


def _no_host_syncs(backend: str) -> dict:
    """Forward and backward (including first-use probes) under set_sync_debug_mode("error")."""
    from megatron_sap.kernels import aten_flash, flash_attn_backend

    aten_flash.varlen.padded_lse.cache_clear()
    flash_attn_backend.varlen.padded_lse.cache_clear()
    lengths = [5, 0, 300, 1, 2000, 64]
    cu, longest = _cu(lengths), max(lengths)
    q, k, v, dout = _batch(lengths, *SIZES.shape, torch.bfloat16, 0)
    with _host_syncs_raise():
        out, lse = varlen_forward(q, k, v, cu, cu, longest, longest, causal=True, backend=backend)
        varlen_backward(dout, q, k, v, out, lse, cu, cu, longest, longest, causal=True, backend=backend)
    return {"ok": True}


SPEED_MIXES = {  # of SIZES.speed_tokens tokens (names for the GPU's 128K)
    "all_128": lambda tokens: [128] * (tokens // 128),
    "all_2K": lambda tokens: [2048] * (tokens // 2048) or [tokens],
    "mix_200_to_90K": lambda tokens: _log_uniform_lengths(200, min(90_000, tokens), tokens, seed=0),
    "one_128K": lambda tokens: [tokens],
}


def _log_uniform_lengths(low: int, high: int, total: int, seed: int) -> list[int]:
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(int(math.exp(rng.uniform(math.log(low), math.log(high)))))
    lengths[-1] -= sum(lengths) - total
    return lengths


def _elapsed_ms(fn: Callable[[], object]) -> float:
    """One call of fn in milliseconds: CUDA events on the GPU, the host clock on the CPU (`--dry-run`)."""
    if DEVICE.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _time_ms(fn: Callable[[], object]) -> float:
    """Median time of fn in milliseconds, with as many repeats as fit `SIZES.speed_budget_ms` (at least 3)."""
    fn()
    _sync()
    repeats = max(3, min(20, int(SIZES.speed_budget_ms / max(_elapsed_ms(fn), 1e-3))))
    times = sorted(_elapsed_ms(fn) for _ in range(repeats))
    return times[len(times) // 2]


def _speed(backend: str) -> dict:
    heads_q, heads_kv, dim = SIZES.shape
    results = {}
    for name, make in SPEED_MIXES.items():
        lengths = make(SIZES.speed_tokens)
        cu, longest = _cu(lengths), max(lengths)
        q, k, v, dout = _batch(lengths, heads_q, heads_kv, dim, torch.bfloat16, 1)
        out, lse = varlen_forward(q, k, v, cu, cu, longest, longest, causal=True, backend=backend)
        fwd_ms = _time_ms(lambda: varlen_forward(q, k, v, cu, cu, longest, longest, causal=True, backend=backend))
        bwd_ms = _time_ms(
            lambda: varlen_backward(dout, q, k, v, out, lse, cu, cu, longest, longest, causal=True, backend=backend)
        )
        fwd_flops = sum(n * (n + 1) // 2 for n in lengths) * 4 * dim * heads_q
        results[name] = {
            "tokens": sum(lengths),
            "documents": len(lengths),
            "forward_ms": fwd_ms,
            "backward_ms": bwd_ms,
            "forward_tflops": fwd_flops / fwd_ms / 1e9,
            "backward_tflops": 2.5 * fwd_flops / bwd_ms / 1e9,
        }
    return {"ok": True, "shape": {"heads_q": heads_q, "heads_kv": heads_kv, "head_dim": dim, "dtype": "bfloat16"}, **results}


def _flash_backends() -> list[str]:
    return [name for name in available_backends(DEVICE) if name != "torch"]


def _backends_under_test() -> list[str]:
    """The flash backends; on the CPU (`--dry-run`) the torch backend stands in for them."""
    return _flash_backends() if DEVICE.type == "cuda" else ["torch"]


def _bf16_accuracy(backend: str) -> dict:
    return _accuracy(backend, torch.bfloat16, BF16_TOLERANCE)


def _backend_checks() -> list[Callable[[], dict]]:
    """accuracy, no_host_syncs and speed for every flash backend usable on this GPU."""
    checks = []
    for backend in _backends_under_test():
        for kind, fn in (("accuracy", _bf16_accuracy), ("no_host_syncs", _no_host_syncs), ("speed", _speed)):
            check = functools.partial(fn, backend)
            check.__name__ = f"{backend}/{kind}"
            checks.append(check)
    return checks


def torch_backend_accuracy() -> dict:
    """The pure-PyTorch backend on the GPU (float32)."""
    return _accuracy("torch", torch.float32, FP32_TOLERANCE)


def flash_backends_present() -> dict:
    """At least one flash backend must be usable on this GPU."""
    names = _flash_backends()
    if DEVICE.type != "cuda":
        return {"ok": True, "backends": names, "dry_run": "no GPU: the torch backend stands in"}
    return {"ok": bool(names), "backends": names}


def _packed_batch(total: int, seed: int, max_len: int) -> list[int]:
    """cu_seqlens of one packed row: log-uniform document lengths from 16 to max_len."""
    lengths = _log_uniform_lengths(16, max_len, total, seed)
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


def sap_simulated() -> dict:
    """Every outer rank's program on this GPU (bf16) against the float64 reference, document by document."""
    import megatron_sap as sap
    from megatron_sap.simulate import simulate_plan

    errors = {}
    for outer, total, max_len in SIZES.simulated_rows:
        cu = _packed_batch(total, seed=outer, max_len=max_len)
        plan = sap.plan_sequences(cu, outer_size=outer, cost_model=sap.CostModel.preset("h200"))
        q, k, v, dout = _batch(torch.tensor(cu).diff().tolist(), 8, 2, 128, torch.bfloat16, seed=outer)
        refs = [_reference(q[a:b], k[a:b], v[a:b], _cu([b - a]), dout[a:b], True) for a, b in zip(cu, cu[1:]) if b > a]
        for schedule in ("pipelined", "gathered"):  # gathered: bottom-right causal segments of unequal lengths
            sim = simulate_plan(q, k, v, plan, dout, schedule=schedule)
            for name, got, i in (("out", sim.out, 0), ("dq", sim.dq, 2), ("dk", sim.dk, 3), ("dv", sim.dv, 4)):
                want = torch.cat([r[i] for r in refs])
                errors[f"{name}/R={outer}/{schedule}"] = _error(got, want)
            errors[f"forward_ms_per_rank/R={outer}/{schedule}"] = [round(t * 1e3, 3) for t in sim.forward_seconds]
            errors[f"backward_ms_per_rank/R={outer}/{schedule}"] = [round(t * 1e3, 3) for t in sim.backward_seconds]
    worst = max(v for key, v in errors.items() if not key.startswith(("forward", "backward")))
    return {"ok": worst <= BF16_TOLERANCE, "tolerance": BF16_TOLERANCE, "max_error": worst, "details": errors}


def sap_no_host_syncs() -> dict:
    """The sap_attention op forward and backward with host syncs turned into errors: one rank
    (P = 1), and the rank of a 4-rank plan that receives the most, alone with its exchanges
    made local, in both schedules."""
    from types import SimpleNamespace

    import megatron_sap as sap
    from megatron_sap.comm.p2p import local_exchanges

    lengths = list(SIZES.op_lengths)
    cu = _cu(lengths).cpu()
    q, k, v, dout = _batch(lengths, *SIZES.shape, torch.bfloat16, 3)
    runs = [("P=1", sap.plan_sequences(cu[:-1]), None, None, "auto")]
    plan4 = sap.plan_sequences(cu, outer_size=4)
    rank = max(range(4), key=lambda r: plan4.program(r, schedule="pipelined").recv_tokens)
    groups = SimpleNamespace(world_size=4, inner_size=1, outer_rank=rank, cp_rank=rank, outer_group=None,
                             outer_peer=lambda r: r)
    for schedule in ("pipelined", "gathered"):
        runs.append((f"P=4 rank {rank} {schedule}", plan4, groups, plan4.local_indices(rank).to(DEVICE), schedule))
    checked = []
    for name, plan, group, idx, schedule in runs:
        rows = slice(0, plan.local_tokens) if idx is None else idx
        ql, kl, vl = (t[rows].detach().clone().requires_grad_() for t in (q, k, v))
        grad = dout[rows].contiguous()
        with local_exchanges():
            def step():
                sap.sap_attention(ql, kl, vl, plan, group, check_agreement=False, schedule=schedule).backward(grad)

            step()  # compiles and caches the program on this device
            with _host_syncs_raise():
                step()
        checked.append(name)
    return {"ok": True, "runs": checked}


def method_kernel_times() -> dict:
    """Per-rank kernel time of each method's work on one packed batch of real documents, and the
    cost model's compute rates fitted to every rank of every method (calibration.json)."""
    from megatron_sap.bench.data import document_lengths
    from megatron_sap.bench.kernel_time import fit_calibration, rank_work, time_work
    from megatron_sap.bench.packing import pack
    from megatron_sap.planning import CostModel

    (heads_q, heads_kv, dim), world = SIZES.shape, 8
    model = CostModel.preset("h200")
    results: dict = {"shape": {"heads_q": heads_q, "heads_kv": heads_kv, "head_dim": dim, "world": world}}
    samples = []
    for corpus, total in SIZES.method_rows:
        cu = pack(document_lengths(corpus), total, 1, seed=0)[0]
        for method in ("sap", "p2p", "all_gather", "a2a"):
            fwd, bwd = [], []
            for work in rank_work(method, cu, world, cost_model=model):
                f, b = time_work(work, heads_q, heads_kv, dim, device=DEVICE, dtype=torch.bfloat16, repeats=5)
                samples.append((work, f, b))
                fwd.append(f * 1e3)
                bwd.append(b * 1e3)
            results[f"{corpus}/T={total}/{method}"] = {
                "forward_ms_per_rank": [round(x, 3) for x in fwd],
                "backward_ms_per_rank": [round(x, 3) for x in bwd],
                "max_over_mean": max(f + b for f, b in zip(fwd, bwd)) / (sum(fwd) + sum(bwd)) * world,
            }
    calibration = fit_calibration(samples, model)
    calibration["source"] = (
        f"scripts/gpu_check.py method_kernel_times: {_device_name()}, torch {torch.__version__}, "
        f"backend {resolve_backend('auto', DEVICE, torch.bfloat16, dim)}, bf16, Hq={heads_q} Hkv={heads_kv} D={dim}, "
        f"{datetime.date.today().isoformat()}"
    )
    results["calibration"] = calibration
    CALIBRATION_OUT.write_text(json.dumps(calibration, indent=2) + "\n")
    return {"ok": True, **results}


def sap_executor_vs_kernels() -> dict:
    """Each SAP rank's compute as the executor runs it (its compiled kernel calls, index
    selects and, pipelined, lse merges; `simulate_plan`, transfers replaced by indexing), in
    both schedules, against the same work in one varlen call per pass (`time_work`): what
    splitting the work into the program's blocks costs on the GPU. The pipelined over the
    gathered time, over every rank of both rows, is the cost model's
    `pipelined_kernel_factor` (added to calibration.json)."""
    from megatron_sap.bench.data import document_lengths
    from megatron_sap.bench.kernel_time import rank_work, time_work
    from megatron_sap.bench.packing import pack
    from megatron_sap.planning import CostModel, plan_sequences
    from megatron_sap.simulate import simulate_plan

    (heads_q, heads_kv, dim), world = SIZES.shape, 8
    model = CostModel.preset("h200")
    results: dict = {"shape": {"heads_q": heads_q, "heads_kv": heads_kv, "head_dim": dim, "world": world}}
    totals = {"pipelined": 0.0, "gathered": 0.0}
    for corpus, total in SIZES.method_rows:
        cu = pack(document_lengths(corpus), total, 1, seed=0)[0]
        plan = plan_sequences(cu, outer_size=world, cost_model=model)
        q, k, v, dout = _batch(torch.tensor(cu).diff().tolist(), heads_q, heads_kv, dim, torch.bfloat16, seed=1)
        one_call = [time_work(w, heads_q, heads_kv, dim, device=DEVICE, dtype=torch.bfloat16, repeats=3)
                    for w in rank_work("sap", cu, world, cost_model=model)]
        kernels = [(f + b) * 1e3 for f, b in one_call]
        row = {"one_call_ms_per_rank": [round(x, 3) for x in kernels],
               "one_call_forward_ms_per_rank": [round(f * 1e3, 3) for f, _ in one_call]}
        for schedule in ("pipelined", "gathered"):
            run = functools.partial(simulate_plan, q, k, v, plan, dout, schedule=schedule)
            run()  # warm-up: programs compiled and moved, kernels loaded
            runs = [run() for _ in range(3)]
            forward = [statistics.median(t) * 1e3 for t in zip(*(r.forward_seconds for r in runs))]
            backward = [statistics.median(t) * 1e3 for t in zip(*(r.backward_seconds for r in runs))]
            executor = [f + b for f, b in zip(forward, backward)]
            totals[schedule] += sum(executor)
            programs = [plan.program(r, schedule=schedule) for r in range(world)]
            row[schedule] = {
                "executor_ms_per_rank": [round(x, 3) for x in executor],
                "executor_forward_ms_per_rank": [round(x, 3) for x in forward],
                "busiest_executor_over_busiest_one_call": max(executor) / max(kernels),
                "kernel_calls_per_rank": [len(p.local_calls) + sum(len(t.calls) for t in p.transfers)
                                          for p in programs],
                "device_time_by_op": _device_time_by_op(run),
            }
        results[f"{corpus}/T={total}"] = row
    factor = totals["pipelined"] / totals["gathered"]
    results["pipelined_kernel_factor"] = round(factor, 3)
    if CALIBRATION_OUT.exists():  # written by method_kernel_times
        calibration = json.loads(CALIBRATION_OUT.read_text())
        calibration["cost_model"]["pipelined_kernel_factor"] = round(factor, 3)
        note = f"; pipelined_kernel_factor from sap_executor_vs_kernels, {_now()[:10]}"
        calibration["source"] = calibration["source"].split("; pipelined_kernel_factor")[0] + note  # a rerun's replaces
        CALIBRATION_OUT.write_text(json.dumps(calibration, indent=2) + "\n")
    return {"ok": True, **results}


def _device_time_by_op(fn: Callable[[], object], top: int = 12) -> dict:
    """Where one call of fn spends device time: the ops with the most self time (ms), from
    torch.profiler. A profiler failure is recorded, not raised."""
    try:
        from torch.profiler import ProfilerActivity, profile

        activity = ProfilerActivity.CUDA if DEVICE.type == "cuda" else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            fn()
            _sync()
        attr = "self_device_time_total" if DEVICE.type == "cuda" else "self_cpu_time_total"
        events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
        total = sum(getattr(e, attr) for e in events)
        return {"total_ms": round(total / 1e3, 3),
                "top": [[e.key[:80], round(getattr(e, attr) / 1e3, 3), e.count] for e in events[:top]]}
    except Exception as error:  # the numbers above stand without this breakdown
        return {"error": f"{type(error).__name__}: {error}"}


def method_executor_times() -> dict:
    """Each rank's whole attention op, SAP and the KV ring, forward and backward with its
    exchanges local: the executors' compute (kernel calls, gathers, merges, buffers) per rank,
    without the communication. SAP runs in each schedule, and as `--sap-schedule auto` runs
    it ("sap"): each rank in the schedule its cost model favours, with this run's calibration
    (its `pipelined_kernel_factor`) where sap_executor_vs_kernels wrote one."""
    from megatron_sap.bench.data import document_lengths
    from megatron_sap.bench.packing import pack
    from megatron_sap.bench.rank_memory import rank_seconds
    from megatron_sap.planning import CostModel, plan_sequences

    (heads_q, heads_kv, dim), world = SIZES.shape, 8
    calibrated = CALIBRATION_OUT.exists()
    model = CostModel.from_calibration(CALIBRATION_OUT, base="h200") if calibrated else CostModel.preset("h200")
    results: dict = {"shape": {"heads_q": heads_q, "heads_kv": heads_kv, "head_dim": dim, "world": world},
                     "sap_cost_model": f"{CALIBRATION_OUT.name} (pipelined_kernel_factor "
                                       f"{model.pipelined_kernel_factor:g})" if calibrated else "the h200 preset"}
    for corpus, total in SIZES.method_rows:
        cu = pack(document_lengths(corpus), total, 1, seed=0)[0]
        plan = plan_sequences(cu, outer_size=world, cost_model=model)
        results[f"{corpus}/T={total}/sap_schedules"] = [plan.schedule(r) for r in range(world)]
        for method, schedule in (("sap", "auto"), ("sap-pipelined", "pipelined"), ("sap-gathered", "gathered"),
                                 ("p2p", "auto")):
            times = [rank_seconds(method.split("-")[0], cu, world, r, heads_q, heads_kv, dim, device=DEVICE,
                                  dtype=torch.bfloat16, cost_model=model, schedule=schedule) for r in range(world)]
            results[f"{corpus}/T={total}/{method}"] = {
                "forward_ms_per_rank": [round(f * 1e3, 3) for f, _ in times],
                "backward_ms_per_rank": [round(b * 1e3, 3) for _, b in times],
            }
    return {"ok": True, **results}


def rank_memory() -> dict:
    """Every rank's peak memory (torch.cuda.max_memory_allocated), SAP (also with recompute_kv, pipelined)
    and the KV ring, beside the formulas.

    Each rank runs alone with local exchanges (megatron_sap.bench.rank_memory): one GPU
    measures what every rank of an 8-rank job allocates.
    """
    from megatron_sap.bench.data import document_lengths
    from megatron_sap.bench.packing import pack
    from megatron_sap.bench.rank_memory import ring_rank_memory, sap_rank_memory
    from megatron_sap.planning import CostModel

    (heads_q, heads_kv, dim), world = SIZES.shape, 8
    results = {}
    for corpus, total in SIZES.method_rows:
        cu = pack(document_lengths(corpus), total, 1, seed=0)[0]
        h200 = {"cost_model": CostModel.preset("h200")}
        for name, measure, kwargs in (("sap", sap_rank_memory, h200),
                                      ("sap-recompute-kv", sap_rank_memory, {**h200, "schedule": "pipelined", "recompute_kv": True}),
                                      ("p2p", ring_rank_memory, {})):
            rows = [measure(cu, world, r, heads_q, heads_kv, dim, device=DEVICE, dtype=torch.bfloat16, **kwargs)
                    for r in range(world)]
            results[f"{corpus}/T={total}/{name}"] = {
                "peak_MiB_per_rank": [round(m.measured / 2**20, 1) for m in rows],
                "formula_plus_output_and_grads_MiB": [round((m.formula + m.output_and_grads) / 2**20, 1) for m in rows],
            }
    return {"ok": True, **results}


def batch_split_no_host_syncs() -> dict:
    """The Megatron batch split through the hooks, as on a rank that reads the data: the
    loader's CPU row moved to the GPU, its documents read from the CPU copy, then split
    (`sap_split_batch`: plan, index copies, slicing), with host syncs turned into errors; a
    row planned here (cached) and one whose plan a data loader's worker made (unpickled and
    taken from the plan cache); and the packed parameters a middle pipeline stage makes from
    the documents its first stage sent (`sap_packed_seq_params`); one CP rank (no agreement
    check: with more, it all-reduces over a gloo group, on the host).
    Needs megatron-core: the machine's own, else the newest one `make test-compat` cached in
    .cache/."""
    from types import SimpleNamespace

    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no `megatron` package at all
        found = False
    if not found:
        cached = sorted(Path(__file__).resolve().parents[1].glob(".cache/megatron-core-*"))
        if not cached:
            return {"ok": True, "skipped": "megatron-core is not importable on this machine"}
        sys.path.insert(0, str(cached[-1]))
    from megatron_sap.megatron.batch import sap_packed_seq_params
    from megatron_sap.megatron.hooks import wrap_get_batch_on_this_tp_rank, wrap_get_thd_batch_on_this_cp_rank
    from megatron_sap.megatron.loader import PlannedDataset, loader_planning
    from megatron_sap.planning.plan import DEFAULT_CACHE

    args = SimpleNamespace(cp_comm_type=["sap"], reset_position_ids=True)
    get_batch = wrap_get_batch_on_this_tp_rank(
        lambda data_iterator: {k: v.to(DEVICE, non_blocking=True) for k, v in next(data_iterator).items()}, get_args=lambda: args)
    split = wrap_get_thd_batch_on_this_cp_rank(lambda *a, **k: None, get_args=lambda: args)

    def row(seed: int) -> tuple[list[int], dict]:
        """cu_seqlens and one packed [S] sample (32K tokens on the GPU), as a GPT dataset gives it."""
        lengths = _packed_batch(SIZES.split_tokens, seed, SIZES.split_tokens // 8)
        positions = torch.cat([torch.arange(b - a) for a, b in zip(lengths, lengths[1:])])
        tokens = torch.randint(0, 32000, (lengths[-1] + 1,))
        return lengths, {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": torch.ones(lengths[-1]),
                         "position_ids": positions}

    def step(sample: dict, checked: bool) -> tuple[dict, Any]:
        """The sample collated and pinned as the data loader gives it, then the hooked batch and split."""
        batch = torch.utils.data.default_collate([sample])
        if DEVICE.type == "cuda":
            batch = {k: v.pin_memory() for k, v in batch.items()}
        with _host_syncs_raise() if checked else contextlib.nullcontext():
            batch = get_batch(iter([batch]))
            cu, max_seqlen = batch.pop("cu_seqlens"), batch.pop("max_seqlen")
            return split(batch, cu, None, max_seqlen)

    results, ok = {}, True
    lengths, sample = row(11)
    step(sample, checked=False)  # plans the row (cached) and installs the RoPE hook
    local, params = step(sample, checked=True)
    ok &= params.cu_seqlens_q.tolist() == lengths and torch.equal(local["tokens"][0].cpu(), sample["tokens"])
    results["planned_here"] = {"documents": len(lengths) - 1, "tokens": lengths[-1]}
    # A row the data loader's worker planned (made here, in-process): the split takes its plan.
    lengths, sample = row(12)
    shipped = PlannedDataset([sample], loader_planning(reset_position_ids=True))[0]
    hits, misses = DEFAULT_CACHE.hits, DEFAULT_CACHE.misses
    local, params = step(shipped, checked=True)
    taken = (DEFAULT_CACHE.hits - hits, DEFAULT_CACHE.misses - misses) == (1, 0)
    ok &= taken and params.cu_seqlens_q.tolist() == lengths
    results["planned_by_the_loader"] = {"documents": len(lengths) - 1, "plan_taken_from_the_loader": taken}
    # A middle pipeline stage: the packed parameters of documents the first stage sent (host values).
    lengths, _ = row(13)
    with _host_syncs_raise():
        params = sap_packed_seq_params(lengths, DEVICE)
    ok &= params.cu_seqlens_q.tolist() == lengths
    results["middle_pipeline_stage"] = {"documents": len(lengths) - 1}
    return {"ok": bool(ok), **results}


def host_planning_time() -> dict:
    """Planning time on this machine's CPU, one thread (`megatron_sap.bench.planning_time`)."""
    from megatron_sap.bench import planning_time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `make bench` plans (a rank's planning runs beside its other host work)
    try:
        rows = planning_time.measure(num_batches=SIZES.planning_rows, device=str(DEVICE))
    finally:
        torch.set_num_threads(threads)
    return {"ok": True, "cpu": planning_time.cpu_name(), "program_device": str(DEVICE),
            "rows": planning_time.as_records(rows)}


CALIBRATION_OUT = Path("docs/calibration.json")
# The checks that pack rows of the real corpora (`bench.data.document_lengths`).
CORPUS_CHECKS = ("method_kernel_times", "sap_executor_vs_kernels", "method_executor_times", "rank_memory",
                 "host_planning_time")


def _corpora_missing() -> str | None:
    """Why the real corpora's document lengths cannot be had here (no cache, no tokenizer),
    before any GPU time goes to checks that would fail on it; None when they can."""
    from megatron_sap.bench.data import CORPORA, document_lengths

    try:
        for corpus in CORPORA:
            document_lengths(corpus)
    except RuntimeError as error:
        return str(error)
    return None

# Append further checks here (functions returning a dict with "ok").
CHECKS: list[Callable[[], dict]] = [
    flash_backends_present,
    method_kernel_times,
    sap_simulated,
    sap_no_host_syncs,
    batch_split_no_host_syncs,
    sap_executor_vs_kernels,
    method_executor_times,
    rank_memory,
    torch_backend_accuracy,
    host_planning_time,
]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _flash_attn_version() -> str | None:
    try:
        import flash_attn
    except ImportError:
        return None
    return flash_attn.__version__


def _report_to_update(path: Path, parser: argparse.ArgumentParser) -> dict:
    """The report `--only` updates: written on this device, with this torch and flash-attn,
    so that its results stay comparable."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        parser.error(f"--only updates the report at --out, but {path} cannot be read: {error}")
    if not isinstance(report, dict) or not isinstance(report.get("checks"), dict):
        parser.error(f"--only: {path} is not a GPU check report (no 'checks')")
    here = {"device": _device_name(), "torch": torch.__version__, "flash_attn": _flash_attn_version()}
    differ = {key: (report.get(key), value) for key, value in here.items() if report.get(key) != value}
    if differ:
        parser.error(f"--only: {path} was written elsewhere ((report, here): {differ}); run every check instead")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--out", type=Path, help="where to write the JSON report (default: docs/gpu_results.json)")
    parser.add_argument("--mirror", type=Path, help="a folder that also gets the report and calibration after every check")
    parser.add_argument("--dry-run", action="store_true",
                        help="every check on the CPU at small sizes, the torch backend standing in for the flash ones "
                             "and no host-sync checks: tests this script where there is no GPU (needs --out; no GPU result)")
    parser.add_argument("--only", metavar="CHECK[,CHECK...]",
                        help="run only these checks and replace their results in the report at --out, which must exist "
                             "(each rerun result records its date; the others and the report's date stay)")
    args = parser.parse_args()
    global CALIBRATION_OUT, DEVICE, SIZES
    if args.dry_run:
        if args.out is None:
            parser.error("--dry-run needs --out: its report is no GPU result, so it does not go to docs/")
        DEVICE, SIZES = torch.device("cpu"), DRY_RUN_SIZES
    elif not torch.cuda.is_available():
        print("gpu_check: CUDA is not available to this Python (a CPU build of torch?); no report written.")
        return 2
    args.out = args.out or Path("docs/gpu_results.json")
    CALIBRATION_OUT = args.out.with_name("calibration.json")
    if args.out.name == CALIBRATION_OUT.name or args.out.is_dir():
        parser.error(f"--out {args.out} must be a file other than calibration.json (which is written beside it)")
    checks = CHECKS[:1] + _backend_checks() + CHECKS[1:]
    if args.only is not None:
        wanted = set(args.only.split(","))
        unknown = sorted(wanted - {check.__name__ for check in checks})
        if unknown:
            parser.error(f"--only: unknown check(s) {unknown} here; known: {[check.__name__ for check in checks]}")
        report = _report_to_update(args.out, parser)
        checks = [check for check in checks if check.__name__ in wanted]
    if args.mirror is not None:
        args.mirror.mkdir(parents=True, exist_ok=True)  # a missing folder must not stop a GPU run at its first check
    if args.only is None:
        CALIBRATION_OUT.unlink(missing_ok=True)  # what this run leaves is its own (the report is rewritten below)
        report = {
            "date": _now(),
            "device": _device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "flash_attn": _flash_attn_version(),
            "checks": {},
        }
    missing = _corpora_missing() if any(check.__name__ in CORPUS_CHECKS for check in checks) else None
    if missing:
        print(f"gpu_check: the real corpora's document lengths are not available here ({missing}); run "
              "`bash scripts/gpu_check.sh --prepare` where the tokenizer is installed and copy .cache/megatron_sap "
              "to the GPU host. No check run.")
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for check in checks:
        name = check.__name__
        print(f"gpu_check: {name} ...", flush=True)
        started = time.perf_counter()
        try:
            result = check()
            _sync()
        except Exception as error:  # record and go on with the other checks
            result = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - started, 1)
        if args.only is not None:
            result["date"] = _now()
        report["checks"][name] = result
        report["ok"] = all(result["ok"] for result in report["checks"].values())
        args.out.write_text(json.dumps(report, indent=2) + "\n")  # after every check, in case the run is cut short
        if args.mirror:
            for path in (args.out, CALIBRATION_OUT):
                if path.exists():
                    shutil.copy(path, args.mirror / path.name)
        print(f"gpu_check: {name}: {'ok' if result['ok'] else 'FAILED'}", flush=True)

    print(f"gpu_check: {'all checks passed' if report['ok'] else 'SOME CHECKS FAILED'}; report in {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
