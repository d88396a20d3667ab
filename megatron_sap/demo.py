"""`make demo`: packed rows of real documents through SAP on 4 gloo ranks.

Runs sap_attention (forward and backward) and the Megatron/TE-style zigzag KV ring on
the same rows in the same processes, checks SAP against an independent dense float64
reference computed per document, and prints agreement and the bytes each method
really sent. Then, if megatron-core is installed, trains a tiny GPTModel with SAP next
to CP=1 (`megatron_sap.megatron.demo_train`).
"""
from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .spawned import gather_results

WORLD = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def _inputs(total: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    dout = torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def _worker(rank: int, store_path: str, batches: list[list[int]], results) -> None:
    import megatron_sap as sap
    from megatron_sap.baselines import ring_p2p, shard
    from megatron_sap.comm.traffic import count_traffic

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        groups = sap.init_sap_groups(inner_size=1, outer_size=WORLD)
        for b, cu in enumerate(batches):
            plan = sap.plan_sequences(cu, outer_size=WORLD)
            q, k, v, dout = _inputs(cu[-1], seed=b)
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
            # numpy arrays travel by value: shared tensor storages would need this process alive
            # until the parent has read them
            tensors = tuple(t.numpy() for t in (out.detach(), ql.grad, kl.grad, vl.grad))
            results.put((b, rank, idx.numpy(), tensors, sap_log.total_bytes(), ring_log.total_bytes(),
                         ring.padding_tokens))
    finally:
        dist.destroy_process_group()


def _reference(cu: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Dense float64 attention, one document at a time (documents never see each other)."""
    from megatron_sap.reference import dense_attention

    q, k, v, dout = _inputs(cu[-1], seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    outs = []
    for a, b in zip(cu, cu[1:]):
        if b > a:
            o, _ = dense_attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), causal=True)
            outs.append(o)
    out = torch.cat(outs)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _run_workers(batches: list[list[int]]) -> list[tuple]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, os.path.join(tmp, "store"), batches, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        return gather_results(results, procs, WORLD * len(batches), 600, "demo attention run")


# float64 throughout: SAP's output and gradients must match the per-document reference to
# rounding, and the bytes counted at its send sites must be the plan's to the byte.
TOLERANCE = 1e-10


def attention_demo(total: int = 8192, num_batches: int = 3, seed: int = 0, corpus: str = "sharegpt") -> bool:
    """SAP and the KV ring on consecutive packed rows of a real corpus (`sharegpt` chats or
    `stdlib` code); whether every row passed its checks (printed after each)."""
    import megatron_sap as sap
    from megatron_sap.bench.data import document_lengths
    from megatron_sap.bench.packing import pack

    batches = pack(document_lengths(corpus), total, num_batches, seed=seed)
    got = _run_workers(batches)
    shape = sap.CostModel.preset("h100").with_shape(HEADS, KV_HEADS, HEAD_DIM, 8)
    print(f"{WORLD} gloo ranks, {corpus} corpus (cl100k tokens), rows of {total} tokens; "
          f"float64, {HEADS} query / {KV_HEADS} KV heads, head dim {HEAD_DIM}. Per row: the pieces of "
          f"documents each rank holds (dD[a:b]: tokens a to b of document D), SAP's output and gradients "
          f"against a dense reference computed document by document, and the bytes each method sent "
          f"(counted at its send sites; 'plan': what the plan's stats() predicted)")
    passed = True
    for b, cu in enumerate(batches):
        plan = sap.plan_sequences(cu, outer_size=WORLD)
        lengths = [e - s for s, e in zip(cu, cu[1:])]
        print(f"\nrow {b}: {len(lengths)} documents, longest {max(lengths)} tokens; placement {plan.strategy}")
        for r in range(WORLD):
            pieces = ", ".join(f"d{d}[{s - cu[d]}:{e - cu[d]}]" for d, s, e in plan.pieces(r))
            print(f"  rank {r}: {pieces}")
        ref = _reference(cu, seed=b)
        full = {name: torch.zeros_like(ref[name]) for name in ref}
        row = sorted((g for g in got if g[0] == b), key=lambda g: g[1])
        for _, _, idx, tensors, *_ in row:
            for name, t in zip(("out", "dq", "dk", "dv"), tensors):
                full[name][torch.from_numpy(idx)] = torch.from_numpy(t)
        errors = {n: float((full[n] - ref[n]).abs().max()) for n in full}
        print("  SAP vs dense float64 reference, max abs error: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
        sap_bytes, ring_bytes = [g[4] for g in row], [g[5] for g in row]
        stats = plan.stats(shape)
        planned = [int(x) for x in stats["sent_bytes_per_rank"]]
        print(f"  bytes sent per rank (forward + backward): SAP {sap_bytes} (plan {planned})")
        print(f"  KV ring {ring_bytes} with {row[0][6]} padding tokens")
        print(f"  SAP moved {sum(sap_bytes) / max(1, sum(ring_bytes)):.1%} of the ring's bytes; "
              f"attention-pair imbalance (busiest rank's pairs / the mean) {stats['imbalance']:.3f}")
        ok = max(errors.values()) <= TOLERANCE and sap_bytes == planned
        passed &= ok
        print(f"  check: errors within {TOLERANCE:.0e} and bytes as planned: {'passed' if ok else 'FAILED'}")
    return passed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", choices=("sharegpt", "stdlib"), default="sharegpt")
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args(argv)
    if args.tokens < WORLD or args.tokens % WORLD:
        parser.error(f"--tokens must be a positive multiple of the {WORLD} ranks, got {args.tokens}")
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    passed = attention_demo(args.tokens, args.batches, args.seed, args.corpus)
    if not args.skip_training:
        from megatron_sap.megatron.demo_train import run_demo_training

        print("\nA tiny GPT (megatron-core) trained 5 steps at CP=1 and with SAP on 4 gloo ranks (2 x 2); "
              "the same data and initial weights, float32:")
        reference, sap_curve = run_demo_training()
        gap = max(abs(a - b) for a, b in zip(reference, sap_curve))
        trained = gap <= 1e-4 * max(abs(x) for x in reference)
        print(f"check: SAP's losses equal CP=1's to float32 rounding: {'passed' if trained else 'FAILED'}")
        passed &= trained
    print(f"\ndemo: {'every check passed' if passed else 'a check FAILED'}")
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
