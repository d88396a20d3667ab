"""`make demo`: one packed batch of real documents through SAP on 4 gloo ranks.

Runs sap_attention (forward and backward) and the Megatron/TE-style zigzag KV ring on
the same batch in the same processes, checks SAP against an independent dense float64
reference computed per document, and prints agreement and the bytes each method
really sent. Then, if megatron-core is installed, trains a tiny GPTModel with SAP next
to CP=1 (`megatron_sap.demo_train`).
"""
from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def _inputs(total: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    dout = torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def _worker(rank: int, store_path: str, cu: list[int], results) -> None:
    import megatron_sap as sap
    from megatron_sap.baselines import ring_p2p, shard
    from megatron_sap.comm.traffic import count_traffic

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        groups = sap.init_sap_groups(inner_size=1, outer_size=WORLD)
        plan = sap.plan_sequences(cu, outer_size=WORLD)
        q, k, v, dout = _inputs(cu[-1], seed=0)
        idx = plan.local_indices(groups.cp_rank)
        ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
        with count_traffic() as sap_log:
            out = sap.sap_attention(ql, kl, vl, plan, groups)
            out.backward(dout[idx])
        ring = ring_p2p.layout(cu, WORLD)
        qr, kr, vr = (shard(t, ring, rank).requires_grad_() for t in (q, k, v))
        with count_traffic() as ring_log:
            out_ring = ring_p2p.attention(qr, kr, vr, ring, dist.group.WORLD)
            out_ring.backward(shard(dout, ring, rank))
        results.put((rank, idx, out.detach(), ql.grad, kl.grad, vl.grad, sap_log.total_bytes(), ring_log.total_bytes(), ring.padding_tokens))
    finally:
        dist.destroy_process_group()


def _reference(cu: list[int]) -> dict[str, torch.Tensor]:
    """Dense float64 attention, one document at a time (documents never see each other)."""
    from megatron_sap.reference import dense_attention

    q, k, v, dout = _inputs(cu[-1], seed=0)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    outs = []
    for a, b in zip(cu, cu[1:]):
        if b > a:
            o, _ = dense_attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), causal=True)
            outs.append(o)
    out = torch.cat(outs)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def attention_demo(total: int = 4096, seed: int = 0) -> None:
    """The SAP-vs-ring run on one packed batch of CPython standard-library sources."""
    import megatron_sap as sap
    from megatron_sap.bench.data import document_lengths
    from megatron_sap.bench.packing import pack

    cu = pack(document_lengths("stdlib"), total, 1, seed=seed)[0]
    plan = sap.plan_sequences(cu, outer_size=WORLD)
    print(f"batch: {total} tokens, {len(cu) - 1} documents (CPython stdlib sources, cl100k tokens)")
    print(f"longest document {max(b - a for a, b in zip(cu, cu[1:]))} tokens; plan: {plan.strategy}")
    for r in range(WORLD):
        pieces = ", ".join(f"d{d}[{s - cu[d]}:{e - cu[d]}]" for d, s, e in plan.pieces(r))
        print(f"  rank {r}: {pieces}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, os.path.join(tmp, "store"), cu, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        got = [results.get(timeout=300) for _ in range(WORLD)]
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"demo worker exited with {p.exitcode}")
    ref = _reference(cu)
    full = {name: torch.zeros_like(ref[name]) for name in ref}
    for rank, idx, *tensors, _, _, _ in got:
        for name, t in zip(("out", "dq", "dk", "dv"), tensors):
            full[name][idx] = t
    print("SAP vs dense float64 reference (max abs error):")
    print("  " + ", ".join(f"{n} {float((full[n] - ref[n]).abs().max()):.2e}" for n in full))
    got.sort(key=lambda g: g[0])
    sap_bytes = [g[-3] for g in got]
    ring_bytes = [g[-2] for g in got]
    stats = plan.stats(plan.cost_model.with_shape(HEADS, KV_HEADS, HEAD_DIM, 8))
    print(f"bytes sent per rank, forward+backward (float64, {HEADS} heads / {KV_HEADS} KV heads, dim {HEAD_DIM}):")
    print(f"  SAP      measured {sap_bytes}  plan {[int(b) for b in stats['sent_bytes_per_rank']]}")
    print(f"  KV ring  measured {ring_bytes}  (padding {got[0][-1]} tokens)")
    print(f"  SAP moved {sum(sap_bytes) / max(1, sum(ring_bytes)):.1%} of the ring's bytes; "
          f"attention-pair imbalance {stats['imbalance']:.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args(argv)
    attention_demo(args.tokens, args.seed)
    if not args.skip_training:
        from megatron_sap.demo_train import run_demo_training

        run_demo_training()


if __name__ == "__main__":
    main()
