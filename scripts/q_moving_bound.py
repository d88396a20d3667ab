#!/usr/bin/env python
"""How much moving queries to the keys (instead of K/V to the queries) could save.

For the plan SAP chooses on real packed rows, every (source, destination) pair of outer
ranks is allowed to move whichever is smaller: the K/V the destination needs from the
source (k, v forward; dk, dv back), or the destination's queries that need them (q out,
partial output and lse back; dout, output and lse out, dq back; `--query-factor 4` drops
the output sent again for the backward). The moved compute is not charged, so this is an
upper bound on the bytes saved at the busiest rank (docs/planner.md, "The compiled program").

    python scripts/q_moving_bound.py [--kv-heads 32]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_sap.bench.data import document_lengths  # noqa: E402
from megatron_sap.bench.packing import pack  # noqa: E402
from megatron_sap.planning import CostModel, plan_sequences  # noqa: E402
from megatron_sap.planning.program import _Layout  # noqa: E402

# The scale model's communication-bound points where SAP misses 1.5x: (corpus, T, inner U, outer R).
POINTS = (("stdlib", 32 * 1024, 8, 8), ("stdlib", 128 * 1024, 8, 8), ("stdlib", 1024 * 1024, 8, 8),
          ("sharegpt", 32 * 1024, 4, 8), ("sharegpt", 128 * 1024, 4, 8), ("sharegpt", 1024 * 1024, 4, 16))


def busiest_rank_bytes(cu: list[int], inner: int, outer: int, model: CostModel, query_factor: int) -> dict:
    """The busiest outer rank's bytes (sent + received), K/V only and with the cheaper side per pair."""
    layout = _Layout(plan_sequences(cu, outer, inner, cost_model=model, cache=None).placement)
    kv_bytes = 2 * model.inner_kv_bytes_per_token(inner)  # forward K/V, backward dK/dV
    lse_bytes = 4 * model.num_heads / inner
    q_bytes = query_factor * model.q_bytes_per_token / inner + (query_factor - 2) * lse_bytes
    kv_only, cheaper = np.zeros(outer), np.zeros(outer)
    pairs = switched = 0
    for src in range(outer):
        for dst in range(outer):
            keys = layout.needed(src, dst) if src != dst else []
            if not keys:
                continue
            queries = {q for key in keys for q in layout.queries_of(dst, key)}
            by_kv = sum(p.length for p in keys) * kv_bytes
            by_q = sum(p.length for p in queries) * q_bytes
            for rank in (src, dst):
                kv_only[rank] += by_kv
                cheaper[rank] += min(by_kv, by_q)
            pairs += 1
            switched += by_q < by_kv
    return {"kv_only": kv_only.max(), "cheaper": cheaper.max(), "pairs": pairs, "switched": switched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="h100")
    parser.add_argument("--query-factor", type=int, default=5, choices=(4, 5))
    parser.add_argument("--kv-heads", type=int, default=8,
                        help="KV heads of the model (the preset has 32 query heads; 32 here: no GQA)")
    args = parser.parse_args()
    model = CostModel.preset(args.preset, num_kv_heads=args.kv_heads)
    for corpus, total, inner, outer in POINTS:
        cu = pack(document_lengths(corpus), total, 1, seed=0)[0]
        r = busiest_rank_bytes(cu, inner, outer, model, args.query_factor)
        print(f"{corpus} T={total} {inner}x{outer}: busiest rank {r['kv_only'] / 1e6:.1f} MB K/V only, "
              f"{r['cheaper'] / 1e6:.1f} MB ({r['cheaper'] / r['kv_only']:.0%}) with the cheaper side per pair; "
              f"{r['switched']} of {r['pairs']} pairs would move queries")


if __name__ == "__main__":
    main()
