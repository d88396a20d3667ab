"""Measured part of the benchmark: every method's real implementation, forward and
backward, on gloo CPU processes.

Each of MEASURED_WORLD spawned processes runs every method on one packed batch per
corpus: one run counted by `count_traffic` (also the warm-up), one under
`track_peak_memory`, then timed repeats between barriers. Bytes are split into link
classes with a virtual node of MEASURED_NODE ranks and set next to each method's model
for the same shape.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from megatron_sap.planning.cost_model import CostModel
from megatron_sap.spawned import gather_results

from . import scale
from .data import CORPORA, document_lengths
from .packing import pack
from .scale import SAP, Target

MiB = float(1 << 20)
MAX_BYTES_VS_RING = 0.30
MEASURED_WORLD = 4
MEASURED_NODE = 2  # ranks per (virtual) node, so that 2 x 2 layouts cross a node boundary
MEASURED_T = 8 * 1024
MEASURED_SHAPE = dict(num_heads=8, num_kv_heads=4, head_dim=32, bytes_per_element=4)  # float32
MEASURED_REPEATS = 3
WORKER_TIMEOUT_S = 600


@dataclass(frozen=True)
class Measured:
    """One method's real run on the gloo CPU processes."""

    corpus: str
    method: str
    layout: str
    wall_s: float  # median over repeats of forward + backward, rank 0, between barriers
    sent_intra: list[int]  # per rank, counted at the send sites
    sent_inter: list[int]
    peak_bytes: list[int]  # per rank, the op's peak during forward + backward (no inputs, output, grads)
    model_intra: list[float]  # the method's model for the same shape
    model_inter: list[float]
    model_peak: float  # NaN where the model does not report it


def measured_cost_model() -> CostModel:
    """The CPU preset with the measured shape and a node of MEASURED_NODE ranks."""
    return CostModel.preset("cpu", gpus_per_node=MEASURED_NODE, **MEASURED_SHAPE)


def measured_runs() -> list[tuple[str, int]]:
    """(method, inner size) of every measured run: SAP flat and 2 x 2, then the baselines."""
    inner = MEASURED_NODE
    return [(SAP, 1), (SAP, inner), ("p2p", 1), ("all_gather", 1), ("a2a", MEASURED_WORLD), ("a2a+p2p", inner)]


def _inputs(total: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output gradient of the whole packed row (same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    h, hkv, d = MEASURED_SHAPE["num_heads"], MEASURED_SHAPE["num_kv_heads"], MEASURED_SHAPE["head_dim"]
    shapes = [(total, h, d), (total, hkv, d), (total, hkv, d), (total, h, d)]
    return tuple(torch.randn(*s, generator=gen) for s in shapes)


def _worker(rank: int, store: str, batches: dict[str, list[int]], repeats: int, results) -> None:
    """One gloo rank: run every method on every corpus's batch and report rank-local numbers."""
    import torch.distributed as dist

    import megatron_sap as sap
    from megatron_sap import baselines
    from megatron_sap.baselines import shard
    from megatron_sap.comm.traffic import count_traffic
    from megatron_sap.memory import track_peak_memory

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=MEASURED_WORLD,
                            timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    try:
        model = measured_cost_model()
        groups = {U: sap.init_sap_groups(inner_size=U, outer_size=MEASURED_WORLD // U, gpus_per_node=MEASURED_NODE)
                  for U in sorted({u for m, u in measured_runs() if m == SAP} | {MEASURED_NODE})}
        for corpus, cu in batches.items():
            q, k, v, dout = _inputs(cu[-1], seed=0)
            for method, U in measured_runs():
                if method == SAP:
                    plan = sap.plan_sequences(cu, outer_size=MEASURED_WORLD // U, inner_size=U, cost_model=model)
                    idx = plan.local_indices(rank)
                    local = [t[idx].clone() for t in (q, k, v, dout)]
                    g = groups[U]

                    def step(ql, kl, vl, plan=plan, g=g):
                        return sap.sap_attention(ql, kl, vl, plan, g, check_agreement=False)
                else:
                    mod = baselines.get(method)
                    lay = mod.layout(cu, MEASURED_WORLD, inner_size=U) if method == "a2a+p2p" else mod.layout(cu, MEASURED_WORLD)
                    local = [shard(t, lay, rank) for t in (q, k, v, dout)]
                    group = ((groups[U].inner_group, groups[U].outer_group) if method == "a2a+p2p"
                             else dist.group.WORLD)

                    def step(ql, kl, vl, mod=mod, lay=lay, group=group):
                        return mod.attention(ql, kl, vl, lay, group)

                def run() -> None:
                    ql, kl, vl = (t.clone().requires_grad_() for t in local[:3])
                    step(ql, kl, vl).backward(local[3])

                with count_traffic() as log:  # doubles as the warm-up
                    run()
                with track_peak_memory("cpu") as mem:
                    run()
                # run() allocates its input copies, the output and the three gradients too:
                # leave them out, so the peak is the op's own memory (kernel scratch included).
                q_bytes, k_bytes, v_bytes = (t.numel() * t.element_size() for t in local[:3])
                op_peak = mem.peak_bytes - (3 * q_bytes + 2 * (k_bytes + v_bytes))
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    run()
                    dist.barrier()
                    times.append(time.perf_counter() - start)
                by_peer = log.bytes_by_peer()
                intra = sum(b for p, b in by_peer.items() if p // MEASURED_NODE == rank // MEASURED_NODE)
                results.put((corpus, method, U, rank, statistics.median(times), intra,
                             sum(by_peer.values()) - intra, op_peak))
    finally:
        dist.destroy_process_group()


def measured_points(repeats: int) -> list[Measured]:
    """Run the measured part on MEASURED_WORLD spawned gloo processes."""
    import torch.multiprocessing as mp

    batches = {c: pack(document_lengths(c), MEASURED_T, 1, seed=2)[0] for c in CORPORA}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    expected = len(batches) * len(measured_runs()) * MEASURED_WORLD
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, os.path.join(tmp, "store"), batches, repeats, results))
                 for r in range(MEASURED_WORLD)]
        for p in procs:
            p.start()
        got = gather_results(results, procs, expected, WORKER_TIMEOUT_S, "measured run")
    model = measured_cost_model()
    out = []
    for corpus, cu in batches.items():
        for method, U in measured_runs():
            rows = sorted((g for g in got if g[:3] == (corpus, method, U)), key=lambda g: g[3])
            stats = scale.raw_stats(method, cu, MEASURED_WORLD, U, model)
            out.append(Measured(
                corpus=corpus, method=method, layout=f"{U}x{MEASURED_WORLD // U}",
                wall_s=rows[0][4],
                sent_intra=[g[5] for g in rows], sent_inter=[g[6] for g in rows], peak_bytes=[g[7] for g in rows],
                model_intra=[float(x) for x in stats["sent_bytes_intra_per_rank"]],
                model_inter=[float(x) for x in stats["sent_bytes_inter_per_rank"]],
                model_peak=float(np.max(stats.get("peak_extra_bytes_per_rank", np.nan))),
            ))
    return out


def measured_table(rows: list[Measured]) -> str:
    """Wall time relative to the fastest baseline, measured vs modelled bytes, peak memory."""
    lines = [
        "| corpus | method | U x R | wall ms (median of fwd+bwd) | vs best baseline | KiB sent/rank measured "
        "(intra + inter) | modelled (intra + inter) | op peak MiB measured (max rank) | op peak MiB formula |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    KiB = 1024.0
    for corpus in CORPORA:
        group = [r for r in rows if r.corpus == corpus]
        best = min((r.wall_s for r in group if r.method != SAP), default=float("nan"))
        for r in group:
            m_intra, m_inter = np.mean(r.sent_intra) / KiB, np.mean(r.sent_inter) / KiB
            e_intra, e_inter = np.mean(r.model_intra) / KiB, np.mean(r.model_inter) / KiB
            peak = "n/a" if np.isnan(r.model_peak) else f"{r.model_peak / MiB:.1f}"
            lines.append(
                f"| {corpus} | {r.method} | {r.layout} | {r.wall_s * 1e3:.0f} | {r.wall_s / best:.2f}x "
                f"| {m_intra + m_inter:.0f} ({m_intra:.0f} + {m_inter:.0f}) | {e_intra + e_inter:.0f} "
                f"({e_intra:.0f} + {e_inter:.0f}) | {max(r.peak_bytes) / MiB:.1f} | {peak} |"
            )
    return "\n".join(lines)


def measured_targets(rows: list[Measured]) -> list[Target]:
    """Measured bytes against the ring, measured bytes against the model, wall time."""
    out = []
    for corpus in CORPORA:
        group = [r for r in rows if r.corpus == corpus]
        ring = next(r for r in group if r.method == "p2p")
        ring_bytes = sum(ring.sent_intra) + sum(ring.sent_inter)
        best = min((r for r in group if r.method != SAP), key=lambda r: r.wall_s)
        for s in (r for r in group if r.method == SAP):
            sent = sum(s.sent_intra) + sum(s.sent_inter)
            share = sent / ring_bytes
            # Rounded up: a share or ratio over its limit never reads as the limit.
            out.append(Target(f"measured, {corpus} SAP {s.layout}: at most {MAX_BYTES_VS_RING:.0%} of the ring's bytes",
                              share <= MAX_BYTES_VS_RING, f"{scale.rounded_up(share * 100, 1):.1f}%"))
            ratio = s.wall_s / best.wall_s
            out.append(Target(f"measured, {corpus} SAP {s.layout}: wall time no slower than the best baseline",
                              ratio <= 1.0, f"{scale.rounded_up(ratio):.2f}x of {best.method} ({best.layout})"))
        exact = [r for r in group  # to the byte
                 if np.allclose(r.sent_intra, r.model_intra, rtol=0, atol=0.5)
                 and np.allclose(r.sent_inter, r.model_inter, rtol=0, atol=0.5)]
        out.append(Target(f"measured, {corpus}: bytes per link class equal the model's for every method",
                          len(exact) == len(group),
                          f"{len(exact)}/{len(group)} methods exact"
                          + "".join(f"; {r.method} {r.layout} differs" for r in group if r not in exact)))
    return out
