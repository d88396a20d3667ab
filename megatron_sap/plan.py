"""Show how SAP lays out one packed batch: ``python -m megatron_sap.plan``.

Examples::

    python -m megatron_sap.plan --cu-seqlens 0,3000,3100,8192 --outer-size 4 --inner-size 2
    python -m megatron_sap.plan --lengths-from sharegpt --tokens 131072 --seed 0 \\
        --outer-size 16 --inner-size 4 --png layout.png

Prints which document pieces every outer rank holds, its tokens, causal pairs, KV
traffic in and out, the imbalance, the modelled and ideal layer times and every
candidate placement's modelled time; optionally draws the layout as a PNG.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from .planning import PRESETS, CostModel, Plan, plan_sequences

MAX_PIECES_SHOWN = 8


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_sap.plan", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--cu-seqlens", help="comma-separated document boundaries, e.g. 0,100,4096")
    source.add_argument("--lengths-from", choices=("stdlib", "sharegpt"), help="pack one row of real document lengths")
    parser.add_argument("--tokens", type=int, help="tokens T of the packed row (with --lengths-from)")
    parser.add_argument("--seed", type=int, default=0, help="packing seed (with --lengths-from)")
    parser.add_argument("--outer-size", type=int, required=True, help="outer (P2P) CP size R")
    parser.add_argument("--inner-size", type=int, default=1, help="inner (Ulysses) CP size U")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h100", help="cost-model preset")
    parser.add_argument("--png", type=Path, help="also draw the layout into this PNG file")
    args = parser.parse_args(argv)
    if args.lengths_from and args.tokens is None:
        parser.error("--lengths-from needs --tokens")
    if args.cu_seqlens and args.tokens is not None:
        parser.error("--tokens only applies to --lengths-from; --cu-seqlens gives T itself")
    return args


def batch_from_args(args: argparse.Namespace) -> list[int]:
    """The cu_seqlens of the batch to show."""
    if args.cu_seqlens is not None:
        try:
            return [int(x) for x in args.cu_seqlens.split(",")]
        except ValueError:
            raise ValueError(f"--cu-seqlens must be comma-separated integers, got {args.cu_seqlens!r}") from None
    from .bench.data import document_lengths
    from .bench.packing import pack

    return pack(document_lengths(args.lengths_from), args.tokens, 1, seed=args.seed)[0]


def _piece_text(plan: Plan, doc: int, start: int, end: int) -> str:
    """`d<doc>` for a whole document, `d<doc>[a:b]` (offsets inside it) for a part."""
    doc_start, doc_end = plan.cu_seqlens[doc], plan.cu_seqlens[doc + 1]
    if (start, end) == (doc_start, doc_end):
        return f"d{doc}({end - start})"
    return f"d{doc}[{start - doc_start}:{end - doc_start}]"


def _cp_ranks(plan: Plan, outer_rank: int) -> str:
    first = outer_rank * plan.inner_size
    return str(first) if plan.inner_size == 1 else f"{first}-{first + plan.inner_size - 1}"


def describe(plan: Plan) -> str:
    """A human-readable report of the plan's layout, traffic and modelled times."""
    ev, stats, model = plan.evaluation, plan.stats(), plan.cost_model
    lengths = [b - a for a, b in zip(plan.cu_seqlens, plan.cu_seqlens[1:])]
    kv_mb = model.kv_bytes_per_token / plan.inner_size / 1e6
    lines = [
        f"batch: T={plan.total_tokens} tokens, {len(lengths)} documents "
        f"(longest {max(lengths)}, {sum(1 for n in lengths if n > plan.local_tokens)} longer than T/P={plan.local_tokens})",
        f"layout: P={plan.world_size} CP ranks = outer R={plan.outer_size} x inner U={plan.inner_size}; "
        f"{plan.capacity} tokens per outer rank; cost model {model.name!r}",
        f"chosen: {plan.strategy}: modelled {stats['modelled_time_s'] * 1e3:.3f} ms, "
        f"ideal {stats['ideal_time_s'] * 1e3:.3f} ms (x{stats['modelled_time_s'] / stats['ideal_time_s']:.2f}), "
        f"pair imbalance {stats['imbalance']:.3f}",
        "",
        f"{'outer':>5} {'cp ranks':>8} {'tokens':>7} {'pairs':>12} {'KV in':>8} {'KV out':>8} {'in MB':>7} {'out MB':>7} {'time ms':>8}  pieces",
    ]
    kv_in, kv_out = ev.traffic_tokens.sum(axis=0), ev.traffic_tokens.sum(axis=1)
    for r in range(plan.outer_size):
        pieces = [_piece_text(plan, *p) for p in plan.pieces(r)]
        if len(pieces) > MAX_PIECES_SHOWN:
            pieces = pieces[:MAX_PIECES_SHOWN] + [f"... +{len(pieces) - MAX_PIECES_SHOWN} more"]
        lines.append(
            f"{r:>5} {_cp_ranks(plan, r):>8} {plan.capacity:>7} {int(ev.exact_pairs[r]):>12} {int(kv_in[r]):>8} "
            f"{int(kv_out[r]):>8} {kv_in[r] * kv_mb:>7.1f} {kv_out[r] * kv_mb:>7.1f} {ev.rank_time_s[r] * 1e3:>8.3f}  "
            + " ".join(pieces)
        )
    lines += ["", "KV in/out: forward tokens received/sent by the outer rank; MB per inner rank (its head slice).", ""]
    lines.append("candidates (modelled forward+backward layer time):")
    for name, seconds in sorted(plan.considered.items(), key=lambda kv: kv[1]):
        mark = "  <- chosen" if name == plan.strategy else ""
        lines.append(f"  {seconds * 1e3:9.3f} ms  {name}{mark}")
    for name, seconds in sorted(plan.pruned.items(), key=lambda kv: kv[1]):
        lines.append(f"  >={seconds * 1e3:7.3f} ms  {name}  (given up at this floor)")
    return "\n".join(lines)


def draw(plan: Plan, path: Path) -> None:
    """Draw outer ranks as rows of their local token order, pieces coloured by document;
    dashed lines split a row among its inner ranks."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cmap = colormaps["tab20"]
    R = plan.outer_size
    fig = Figure(figsize=(10, 1.2 + 0.35 * R))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in range(R):
        x = 0
        for doc, start, end in plan.pieces(r):
            n = end - start
            ax.barh(r, n, left=x, height=0.8, color=cmap(doc % 20), edgecolor="black", linewidth=0.3)
            if n >= plan.capacity / 12:
                ax.text(x + n / 2, r, f"d{doc}", ha="center", va="center", fontsize=7)
            x += n
    for inner in range(1, plan.inner_size):  # inner ranks split the outer rank's order evenly
        ax.axvline(inner * plan.local_tokens, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(R), [f"outer {r} (cp {_cp_ranks(plan, r)})" for r in range(R)], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, plan.capacity)
    ax.set_xlabel("local token position")
    ax.set_title(
        f"{plan.strategy}: modelled {plan.evaluation.makespan_s * 1e3:.3f} ms, "
        f"ideal {plan.evaluation.ideal_s * 1e3:.3f} ms (T={plan.total_tokens}, P={R}x{plan.inner_size})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 on invalid input)."""
    args = parse_args(argv)
    try:
        cu = batch_from_args(args)
        plan = plan_sequences(
            cu, outer_size=args.outer_size, inner_size=args.inner_size, cost_model=CostModel.preset(args.preset), cache=None
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(describe(plan))
    if args.png is not None:
        draw(plan, args.png)
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
