#!/usr/bin/env python
"""What choosing by the timeline gains over choosing by the estimate, and what it costs.

For packed rows of both corpora, each layout is planned twice (`choose_by="estimate"`, the
default, and `"timeline"`) and both plans are timed by the executor's schedule of their
compiled programs, all ranks together (`stats()["modelled_time_s"]`). Prints, per corpus,
row length and layout, the timeline choice's time over the estimate choice's (median, best
and worst row, and how many rows it is faster on) and the median planning time of each
(process CPU time, the plan cache bypassed). docs/planner.md, "Choosing by the timeline",
keeps a run.

    python scripts/choose_by_timeline.py [UxR ...] [--rows 6] [--preset h100]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_sap.bench.data import CORPORA, document_lengths  # noqa: E402
from megatron_sap.bench.packing import pack  # noqa: E402
from megatron_sap.planning import CostModel, plan_sequences  # noqa: E402
from planner_ab import parse_layouts  # noqa: E402  (scripts/, the running script's folder, is on the path)

LAYOUTS = ("1x8", "4x8", "8x8", "1x16", "2x16", "4x16")
TOKENS = (32 * 1024, 128 * 1024)


def planned(cu: list[int], outer: int, inner: int, model: CostModel, choose_by: str) -> tuple[float, float]:
    """(the plan's modelled layer time, the CPU seconds planning took)."""
    start = time.process_time()
    plan = plan_sequences(cu, outer_size=outer, inner_size=inner, cost_model=model, cache=None, choose_by=choose_by)
    seconds = time.process_time() - start
    return plan.stats()["modelled_time_s"], seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layouts", nargs="*", default=list(LAYOUTS), help="U x R layouts")
    parser.add_argument("--rows", type=int, default=6, help="packed rows per corpus, row length and layout")
    parser.add_argument("--preset", default="h100", help="cost-model preset")
    parser.add_argument("--seed", type=int, default=42, help="packing seed")
    args = parser.parse_args()
    layouts = parse_layouts(parser, args.layouts)
    if args.rows < 1:
        parser.error(f"--rows must be >= 1, got {args.rows}")
    model = CostModel.preset(args.preset)
    print("| corpus | T | U x R | timeline / estimate: median | best | worst | rows faster | plan ms: estimate | timeline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for corpus in CORPORA:
        lengths = document_lengths(corpus)
        for tokens in TOKENS:
            rows = pack(lengths, tokens, args.rows, args.seed)
            for inner, outer in layouts:
                ratios, plan_s = [], {"estimate": [], "timeline": []}
                for cu in rows:
                    times = {}
                    for choose_by in plan_s:
                        times[choose_by], seconds = planned(cu, outer, inner, model, choose_by)
                        plan_s[choose_by].append(seconds)
                    ratios.append(times["timeline"] / times["estimate"])
                faster = sum(r < 1 - 1e-9 for r in ratios)
                print(f"| {corpus} | {tokens // 1024}K | {inner}x{outer} | {statistics.median(ratios):.3f} | "
                      f"{min(ratios):.3f} | {max(ratios):.3f} | {faster}/{len(ratios)} | "
                      f"{statistics.median(plan_s['estimate']) * 1e3:.1f} | {statistics.median(plan_s['timeline']) * 1e3:.1f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
