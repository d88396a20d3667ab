#!/usr/bin/env python
"""The K/V tokens SAP's candidates move against their modelled time, on the benchmark's rows.

The planner takes the fastest candidate and, among those within TIME_TOLERANCE (1%) of
it, the one that moves the fewest K/V tokens. This script builds every candidate to the
end on the rows `make bench` models (its packed rows of each corpus and T) and
prints, per row, the forward K/V tokens moved as a share of the `(P - 1) T` the ring sends
(its padding aside): by the chosen plan; by the candidate that moves the fewest, with its
modelled time over the fastest candidate's; and by the one that moves the fewest within
wider bands of the fastest time (docs/benchmarks.md, "Targets").

    python scripts/candidate_bytes.py                       # 1 x 8, both corpora, 32K and 128K
    python scripts/candidate_bytes.py --inner 8 --outer 4 --bands 0.01 0.05
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_sap.bench.__main__ import BENCH_BATCHES, BENCH_SEED, BENCH_T  # noqa: E402
from megatron_sap.bench.data import CORPORA, document_lengths  # noqa: E402
from megatron_sap.bench.packing import pack  # noqa: E402
from megatron_sap.planning import PRESETS, CostModel, plan_sequences  # noqa: E402
from megatron_sap.planning.candidates import candidates  # noqa: E402
from megatron_sap.planning.evaluate import evaluate  # noqa: E402
from megatron_sap.planning.placement import build_all  # noqa: E402
from megatron_sap.planning.plan import DEFAULT_SLACKS  # noqa: E402


def candidate_shares(cu: list[int], outer: int, inner: int, model: CostModel, bands: list[float]) -> dict:
    """Forward K/V tokens moved over the ring's `(P - 1) T`: by the chosen plan ("chosen"; "rechecked":
    whether its choice was timed against another candidate, `RECHECK_MARGIN`), by
    the candidate that moves the fewest ("least", and "least_time", its modelled time over
    the fastest candidate's) and by the fewest-moving candidate within each band of the
    fastest time ("bands"), every candidate built to the end."""
    total, world = cu[-1], outer * inner
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    built = build_all(candidates(cu[:-1], lengths, outer, total // outer, model, DEFAULT_SLACKS, inner))
    evaluations = [evaluate(placement, inner, model) for placement in built.values()]
    fastest = min(ev.makespan_s for ev in evaluations)
    ring = (world - 1) * total
    chosen = plan_sequences(cu, outer_size=outer, inner_size=inner, cost_model=model, cache=None)
    least = min(evaluations, key=lambda ev: (ev.traffic_total, ev.makespan_s))
    return {
        "chosen": chosen.evaluation.traffic_total / ring,
        "rechecked": bool(chosen.timed),
        "least": least.traffic_total / ring,
        "least_time": least.makespan_s / fastest,
        "bands": {band: min(ev.traffic_total for ev in evaluations if ev.makespan_s <= fastest * (1 + band)) / ring
                  for band in bands},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", type=int, default=1, help="inner (Ulysses) size U")
    parser.add_argument("--outer", type=int, default=8, help="outer size R")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(BENCH_T))
    parser.add_argument("--rows", type=int, default=BENCH_BATCHES, help="packed rows per corpus and T")
    parser.add_argument("--preset", default="h100", choices=sorted(PRESETS))
    parser.add_argument("--bands", type=float, nargs="+", default=[0.01, 0.03, 0.05, 0.10],
                        help="bands over the fastest modelled time")
    args = parser.parse_args()
    if args.inner < 1 or args.outer < 1 or args.rows < 1:
        parser.error(f"--inner, --outer and --rows must be >= 1, got {args.inner}, {args.outer} and {args.rows}")
    for total in args.tokens:
        if total < 1 or total % (args.inner * args.outer):
            parser.error(f"--tokens {total} must be a positive multiple of P = {args.inner} x {args.outer}")
    if any(not 0 <= band < float("inf") for band in args.bands):
        parser.error(f"--bands must be finite and >= 0, got {args.bands}")
    model = CostModel.preset(args.preset)
    print(f"{args.inner} x {args.outer}, {args.preset}: forward K/V tokens moved over the ring's (P - 1) T")
    for corpus in CORPORA:
        for total in args.tokens:
            for row, cu in enumerate(pack(document_lengths(corpus), total, args.rows, seed=BENCH_SEED)):
                s = candidate_shares(cu, args.outer, args.inner, model, args.bands)
                bands = ", ".join(f"within {b:.0%}: {share:.2f}" for b, share in s["bands"].items())
                print(f"{corpus} T={total} row {row}: chosen {s['chosen']:.2f} | least {s['least']:.2f} at "
                      f"{s['least_time']:.2f}x the fastest | {bands}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
