#!/usr/bin/env python
"""Planning time, this checkout against another revision, row by row in one process.

    python scripts/planner_ab.py REV [UxR ...]      # default layouts: 1x8 8x8 1x64
    python scripts/planner_ab.py REV --uniform 50 500   # rows of short documents instead

The speed of plain Python on a shared machine moves by tens of percent from minute to
minute, so two separate `make bench` runs say little about a planner change. This
script extracts `megatron_sap/` at REV into a temporary directory (as the package
`megatron_sap_at_rev`), packs 128K-token rows of both corpora that each layout has not
seen, and plans every row with both versions, alternating which goes first, the plan
cache bypassed. Times are the process's CPU time (a minute when other work holds the
cores counts less). It checks that both versions place every token alike (the exit
status is 1 where they do not, after every row) and prints the median fresh-plan time of
each and their ratio.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OLD = "megatron_sap_at_rev"


def import_revision(rev: str, into: Path):
    """The planner module of `megatron_sap` at `rev`, imported under another package name."""
    result = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "megatron_sap"], capture_output=True)
    if result.returncode:
        raise SystemExit(f"planner_ab: cannot read megatron_sap at revision {rev!r}: {result.stderr.decode().strip()}")
    archive = result.stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))  # Python >= 3.11.4
    (into / "megatron_sap").rename(into / OLD)
    for path in (into / OLD).rglob("*.py"):
        path.write_text(path.read_text().replace("megatron_sap", OLD))
    sys.path.insert(0, str(into))
    return importlib.import_module(f"{OLD}.planning.plan")


def parse_layouts(parser: argparse.ArgumentParser, texts: list[str]) -> list[tuple[int, int]]:
    """(U, R) of each "UxR" in `texts`; a parser error names the first that is not one."""
    layouts = []
    for text in texts:
        sizes = text.split("x")
        if len(sizes) != 2 or not all(x.isdigit() and int(x) > 0 for x in sizes):
            parser.error(f"layouts are UxR with positive integers, e.g. 8x8; got {text!r}")
        layouts.append((int(sizes[0]), int(sizes[1])))
    return layouts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the git revision to compare with")
    parser.add_argument("layouts", nargs="*", default=["1x8", "8x8", "1x64"], help="U x R layouts")
    parser.add_argument("--rows", type=int, default=24, help="rows per corpus and layout")
    parser.add_argument("--uniform", nargs=2, type=int, metavar=("MIN", "MAX"),
                        help="instead of the corpora, rows of document lengths drawn uniformly from [MIN, MAX]")
    args = parser.parse_args()
    layouts = parse_layouts(parser, args.layouts)
    if args.rows < 1:
        parser.error(f"--rows must be >= 1, got {args.rows}")
    if args.uniform and not 1 <= args.uniform[0] <= args.uniform[1]:
        parser.error(f"--uniform MIN MAX needs 1 <= MIN <= MAX, got {args.uniform[0]} {args.uniform[1]}")

    from megatron_sap.bench.data import CORPORA, document_lengths
    from megatron_sap.bench.packing import pack
    from megatron_sap.planning import plan as new

    differ = 0  # rows the two versions place differently
    with tempfile.TemporaryDirectory() as tmp:
        old = import_revision(args.rev, Path(tmp))
        if args.uniform:
            low, high = args.uniform
            corpora = {f"{low}-{high}": np.random.default_rng(0).integers(low, high + 1, size=100_000)}
        else:
            corpora = {corpus: document_lengths(corpus) for corpus in CORPORA}
        for corpus, lengths in corpora.items():
            for index, (inner, outer) in enumerate(layouts):
                layout = f"{inner}x{outer}"
                times: dict[str, list[float]] = {"rev": [], "now": []}
                for i, cu in enumerate(pack(lengths, 128 * 1024, args.rows, seed=5 + index)):
                    order = (("rev", old), ("now", new)) if i % 2 == 0 else (("now", new), ("rev", old))
                    pieces = {}
                    for name, module in order:
                        gc.collect()  # a collection of what earlier rows left would be counted to one version
                        start = time.process_time()
                        plan = module.plan_sequences(cu, outer_size=outer, inner_size=inner, cache=None)
                        times[name].append(time.process_time() - start)
                        pieces[name] = [tuple(rank) for rank in plan.placement.ranks]
                    if pieces["rev"] != pieces["now"]:
                        differ += 1
                        print(f"{corpus} {layout} row {i}: the placements differ")
                rev_ms, now_ms = (statistics.median(times[k]) * 1e3 for k in ("rev", "now"))
                print(f"{corpus:9s} {layout:5s} {args.rev}: {rev_ms:6.2f} ms   now: {now_ms:6.2f} ms   ratio {now_ms / rev_ms:.2f}",
                      flush=True)
    if differ:
        print(f"{differ} rows placed differently by {args.rev} and this checkout")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
