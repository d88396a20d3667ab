"""Show how SAP lays out one packed batch: ``python -m megatron_sap.plan``.

Examples::

    python -m megatron_sap.plan        # the worked example of docs/planner.md
    python -m megatron_sap.plan --cu-seqlens 0,3000,3100,8192 --outer-size 4 --inner-size 2
    python -m megatron_sap.plan --lengths-from sharegpt --tokens 131072 --seed 0 \\
        --outer-size 16 --inner-size 4 --png layout.png
    python -m megatron_sap.plan --lengths-file my_lengths.txt --tokens 131072 --rows 8 --cp-size 32

Prints which document pieces every outer rank holds, its tokens, causal pairs, KV
traffic in and out, the imbalance, the modelled and ideal layer times and every
candidate placement's modelled time; optionally draws the layout as a PNG. With
`--cp-size P` instead of `--outer-size`, it compares every layout U x R = P the heads
allow within a node (modelled time, mean over `--rows` packed rows) and prints the
Megatron flags of the fastest: which `--hierarchical-context-parallel-sizes` to run
with on your own document lengths (`--lengths-file`: one length per line, or a .npy
array). `--lengths-from` packs the real corpora's lengths (stdlib, sharegpt) or a
synthetic mix's (longtail, uniform-short, bimodal; `bench.data.synthetic_lengths`).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .bench.data import SOURCES, lengths_of
from .comm.ulysses import check_heads
from .planning import PRESETS, CostModel, Plan, plan_sequences
from .planning.plan import CHOOSE_BY

MAX_PIECES_SHOWN = 8
# Without arguments: five documents on 4 outer groups of 2 ranks (docs/planner.md).
EXAMPLE_ARGS = ("--cu-seqlens", "0,3000,3100,3101,5000,8192", "--outer-size", "4", "--inner-size", "2")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        argv = list(EXAMPLE_ARGS)
        print(f"no arguments: the worked example of docs/planner.md ({' '.join(EXAMPLE_ARGS)}); "
              "--help lists the options", file=sys.stderr)
    parser = argparse.ArgumentParser(prog="python -m megatron_sap.plan", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--cu-seqlens", help="comma-separated document boundaries, e.g. 0,100,4096")
    source.add_argument("--lengths-from", choices=SOURCES,
                        help="pack rows of document lengths: a real corpus (stdlib, sharegpt) or a synthetic mix")
    source.add_argument("--lengths-file", type=Path, help="pack rows of these document lengths (one per line, or .npy; packed as "
                        "Megatron does: a document longer than a row goes on in the next rows)")
    parser.add_argument("--tokens", type=int, help="tokens T of a packed row (with --lengths-from/--lengths-file)")
    parser.add_argument("--seed", type=int, default=0, help="packing seed")
    parser.add_argument("--rows", type=int, default=1, help="packed rows to average over (with --cp-size)")
    layout = parser.add_mutually_exclusive_group(required=True)
    layout.add_argument("--outer-size", type=int, help="outer (P2P) CP size R: show this layout")
    layout.add_argument("--cp-size", type=int, help="CP size P: compare every layout U x R = P")
    parser.add_argument("--inner-size", type=int, default=1, help="inner (Ulysses) CP size U (with --outer-size)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="TP size: each rank has 1/TP of the heads, a node GPUs/TP CP ranks (an inner group of U * TP GPUs "
                             "that spans nodes is warned of)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h100", help="cost-model preset")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs of a node (default: the preset's)")
    parser.add_argument("--num-heads", type=int, help="query heads of the model (default: the preset's)")
    parser.add_argument("--num-kv-heads", type=int, help="key/value heads of the model (default: the preset's)")
    parser.add_argument("--head-dim", type=int, help="head dimension (default: the preset's)")
    parser.add_argument("--choose-by", choices=CHOOSE_BY, default="estimate",
                        help="how the planner chooses among its candidates (as --sap-choose-by)")
    parser.add_argument("--png", type=Path, help="also draw the layout into this PNG file (with --outer-size)")
    args = parser.parse_args(argv)
    packed = args.lengths_from or args.lengths_file
    if packed and args.tokens is None:
        parser.error("--lengths-from and --lengths-file need --tokens")
    if args.cu_seqlens and args.tokens is not None:
        parser.error("--tokens only applies to --lengths-from/--lengths-file; --cu-seqlens gives T itself")
    if args.cu_seqlens and args.seed != 0:
        parser.error("--seed only applies to --lengths-from/--lengths-file (the packing); --cu-seqlens is one row as given")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.tokens is not None and args.cp_size is not None and args.cp_size >= 1 and args.tokens % args.cp_size:
        parser.error(f"--tokens {args.tokens} must be a multiple of --cp-size {args.cp_size} (every CP rank holds "
                     f"T/CP tokens; Megatron-LM's sequence length is a multiple of 2 x CP)")
    for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size), ("--gpus-per-node", args.gpus_per_node)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.rows < 1 or (args.rows > 1 and not packed):
        parser.error("--rows must be >= 1, and more than one row needs --lengths-from or --lengths-file")
    if args.cp_size is not None and (args.inner_size != 1 or args.png):
        parser.error("--inner-size and --png go with --outer-size; --cp-size compares every inner size")
    if args.outer_size is not None and args.rows > 1:
        parser.error("--rows goes with --cp-size; --outer-size shows one row")
    return args


def batches_from_args(args: argparse.Namespace) -> list[list[int]]:
    """The cu_seqlens of the batches to show (one, unless `--rows` packs several)."""
    if args.cu_seqlens is not None:
        try:
            return [[int(x) for x in args.cu_seqlens.split(",")]]
        except ValueError:
            raise ValueError(f"--cu-seqlens must be comma-separated integers, got {args.cu_seqlens!r}") from None
    from .bench.packing import pack

    if args.lengths_file is not None:
        lengths = read_lengths(args.lengths_file)
    else:
        lengths = lengths_of(args.lengths_from)
    return pack(lengths, args.tokens, args.rows, seed=args.seed)


def read_lengths(path: Path) -> np.ndarray:
    """Document lengths from a .npy array or a text file of one integer per line."""
    try:
        with warnings.catch_warnings():  # an empty file: reported below
            warnings.simplefilter("ignore", UserWarning)
            if path.suffix == ".npy":
                lengths = np.load(path, allow_pickle=False)
            else:  # read as words and converted here: numpy before 2.3 reads "1.5" as 1 when asked for integers
                words = np.loadtxt(path, dtype=str, ndmin=1)
                lengths = np.array([int(word) for word in words.ravel().tolist()], dtype=np.int64).reshape(words.shape)
    except (OSError, ValueError, OverflowError) as err:
        if path.suffix == ".npy" and "pickled" in str(err):  # numpy's word for a file that is no .npy array
            err = "not a .npy array file (numpy.save's format); name a text file of lengths otherwise"
        raise ValueError(f"cannot read document lengths from {path}: {err}") from None
    if lengths.ndim != 1 or lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer) or (lengths < 0).any():
        raise ValueError(f"{path} must hold a non-empty list of non-negative integer document lengths")
    documents = lengths[lengths > 0]
    if not documents.size:
        raise ValueError(f"{path} holds no document of one token or more (every length is 0)")
    return documents


@dataclass(frozen=True)
class LayoutResult:
    """One layout U x R over the compared rows (means over rows)."""

    inner_size: int
    outer_size: int
    modelled_s: float
    ideal_s: float
    sent_bytes: float  # per rank per layer, forward + backward
    candidate: str  # the candidate chosen on most rows


def inner_sizes(cp_size: int, rank_model: CostModel) -> list[int]:
    """Inner sizes U a CP group of `cp_size` ranks can use, for the cost model of one TP
    rank's CP group (`per_tp_rank`): U divides P, U of its ranks fit in a node, and its
    heads split over U (`check_heads`)."""
    sizes = []
    for U in range(1, cp_size + 1):
        if cp_size % U or U > rank_model.gpus_per_node:
            continue
        try:
            check_heads(rank_model.num_heads, rank_model.num_kv_heads, U)
        except ValueError:
            continue
        sizes.append(U)
    return sizes


def per_tp_rank(model: CostModel, tensor_parallel_size: int) -> CostModel:
    """The cost model of one TP rank's CP group: 1/TP of the heads, and GPUs per node over TP
    CP ranks per node (Megatron places TP ranks next to each other)."""
    tp = tensor_parallel_size
    if tp < 1 or model.num_heads % tp:
        raise ValueError(f"the {model.num_heads} query heads do not split over tensor-parallel size {tp}")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:  # as Megatron's TransformerConfig asks
        raise ValueError(f"the {model.num_kv_heads} key/value heads must be a multiple or a divisor of "
                         f"tensor-parallel size {tp}")
    shaped = model.with_shape(model.num_heads // tp, max(1, model.num_kv_heads // tp), model.head_dim)
    return dataclasses.replace(shaped, gpus_per_node=max(model.gpus_per_node // tp, 1))


def compare_layouts(batches: list[list[int]], cp_size: int, model: CostModel, tensor_parallel_size: int = 1,
                    choose_by: str = "estimate") -> list[LayoutResult]:
    """Every usable layout U x R = `cp_size` (`inner_sizes`), modelled on `batches`."""
    if cp_size < 1:
        raise ValueError(f"--cp-size must be >= 1, got {cp_size}")
    shaped = per_tp_rank(model, tensor_parallel_size)
    results = []
    for U in inner_sizes(cp_size, shaped):  # U = 1 always: the cost model's heads divide by their KV heads
        plans = [plan_sequences(cu, outer_size=cp_size // U, inner_size=U, cost_model=shaped, cache=None, choose_by=choose_by)
                 for cu in batches]
        stats = [plan.stats() for plan in plans]
        strategies = [plan.strategy for plan in plans]
        results.append(LayoutResult(
            U, cp_size // U,
            float(np.mean([s["modelled_time_s"] for s in stats])),
            float(np.mean([s["ideal_time_s"] for s in stats])),
            float(np.mean([np.mean(s["sent_bytes_per_rank"]) for s in stats])),
            Counter(strategies).most_common(1)[0][0],  # ties: the first row's
        ))
    return results


# What SAP needs of a Megatron-LM run besides its layout (docs/megatron.md, "Three ways in").
MEGATRON_REQUIRED_FLAGS = ("--micro-batch-size 1 --reset-position-ids --reset-attention-mask --calculate-per-token-loss "
                           "--attention-dropout 0")


def layouts_table(results: list[LayoutResult], cp_size: int, tokens: int, choose_by: str = "estimate") -> str:
    """The compared layouts, fastest marked, and the Megatron flags to run it."""
    best = min(results, key=lambda r: r.modelled_s)
    lines = [f"{'U x R':>8} {'modelled ms':>12} {'vs ideal':>9} {'MiB sent/rank':>14}  candidate (most rows)"]
    for r in results:
        mark = "  <- fastest" if r is best else ""
        lines.append(
            f"{r.inner_size:>3} x {r.outer_size:<3} {r.modelled_s * 1e3:>12.3f} {r.modelled_s / r.ideal_s:>8.2f}x "
            f"{r.sent_bytes / 2**20:>14.1f}  {r.candidate}{mark}"
        )
    flags = f"--context-parallel-size {cp_size} --cp-comm-type sap"
    if best.inner_size > 1 and best.outer_size > 1:
        flags += f" --hierarchical-context-parallel-sizes {best.inner_size} {best.outer_size}"
    elif best.outer_size == 1:
        flags += f" --sap-inner-size {best.inner_size}"
    if choose_by != "estimate":
        flags += f" --sap-choose-by {choose_by}"
    lines += ["", f"fastest: {best.inner_size} x {best.outer_size}:  {flags}",
              f"with, for Megatron-LM's pretrain_gpt.py: {MEGATRON_REQUIRED_FLAGS} "
              "(--reset-* where rows bring no cu_seqlens of their own; docs/megatron.md)"]
    if tokens % (2 * cp_size):
        lines.append(f"note: Megatron-LM's argument check wants the sequence length ({tokens}) divisible by "
                     f"2 x CP = {2 * cp_size}; SAP itself needs only CP")
    return "\n".join(lines)


def _piece_text(plan: Plan, doc: int, start: int, end: int) -> str:
    """`d<doc>(<length>)` for a whole document, `d<doc>[a:b]` (offsets inside it) for a part."""
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
    documents, empty = sum(1 for n in lengths if n), sum(1 for n in lengths if not n)
    kv_mb = model.inner_kv_bytes_per_token(plan.inner_size) / 1e6
    how_run = (", exchanges as ring shifts" if plan.ring_exchanges else "") + (
        "" if stats["inner_chunks"] == 1 else f", all-to-alls in {stats['inner_chunks']} head chunks")
    lines = [
        f"batch: T={plan.total_tokens} tokens, {documents} document{'' if documents == 1 else 's'}"
        f"{f' and {empty} empty' if empty else ''} "
        f"(longest {max(lengths)}, {sum(1 for n in lengths if n > plan.local_tokens)} longer than T/P={plan.local_tokens})",
        f"layout: P={plan.world_size} CP ranks = outer R={plan.outer_size} x inner U={plan.inner_size}; "
        f"{plan.capacity} tokens per outer rank; cost model {model.name!r}",
        f"chosen: {plan.strategy}: modelled {stats['modelled_time_s'] * 1e3:.3f} ms (executor's schedule{how_run}; "
        f"planner's estimate {stats['planner_estimate_s'] * 1e3:.3f} ms), "
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
            f"{int(kv_out[r]):>8} {kv_in[r] * kv_mb:>7.1f} {kv_out[r] * kv_mb:>7.1f} {stats['outer_rank_time_s'][r] * 1e3:>8.3f}  "
            + " ".join(pieces)
        )
    lines += ["", "KV in/out: forward tokens received/sent by the outer rank; MB per inner rank (its head slice).", ""]
    lines.append("candidates (the planner's estimate of the forward+backward layer time"
                 + ("; timed: the executor's schedule, which chose" if plan.timed else "")
                 + ("; step-level: all ranks together, which chose among the near ones or rechecked the choice"
                    if plan.stepped else "") + "):")
    for name, seconds in sorted(plan.considered.items(), key=lambda kv: kv[1]):
        mark = "  <- chosen" if name == plan.strategy else ""
        timed = f"  (timed {plan.timed[name] * 1e3:.3f} ms)" if name in plan.timed else ""
        stepped = f"  (step-level {plan.stepped[name] * 1e3:.3f} ms)" if name in plan.stepped else ""
        lines.append(f"  {seconds * 1e3:9.3f} ms  {name}{timed}{stepped}{mark}")
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
        f"{plan.strategy}: modelled {plan.stats()['modelled_time_s'] * 1e3:.3f} ms, "
        f"ideal {plan.evaluation.ideal_s * 1e3:.3f} ms (T={plan.total_tokens}, U x R = {plan.inner_size} x {R})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # PNG whatever the name ends in


# From this many outer ranks the report's timeline (`Plan.stats`, every rank's program
# compiled and timed together) takes seconds; one document over all of them has R^2 steps.
SLOW_OUTER_SIZE = 256


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 on invalid input)."""
    args = parse_args(argv)
    if args.png is not None and importlib.util.find_spec("matplotlib") is None:
        print('error: --png needs matplotlib (pip install -e ".[bench]")', file=sys.stderr)
        return 2
    folder = None if args.png is None else args.png.resolve().parent
    if folder is not None and not folder.is_dir():  # said before any work, not after the layout
        print(f"error: cannot write the picture to {args.png}: no directory {folder}", file=sys.stderr)
        return 2
    if args.png is not None and (args.png.is_dir() or not args.png.name):
        print(f"error: cannot write the picture to {args.png!s}: it names a directory, not a file", file=sys.stderr)
        return 2
    outer = args.cp_size if args.cp_size is not None else args.outer_size
    if outer >= SLOW_OUTER_SIZE:
        print(f"note: up to {outer} outer ranks: the report times every rank's program together, which takes "
              f"minutes (and GBs) from about {SLOW_OUTER_SIZE * 4} outer ranks", file=sys.stderr)
    try:
        model = CostModel.preset(args.preset, **({} if args.gpus_per_node is None else {"gpus_per_node": args.gpus_per_node}))
        try:
            model = model.with_shape(  # a value given (even 0, which the cost model refuses) replaces the preset's
                model.num_heads if args.num_heads is None else args.num_heads,
                model.num_kv_heads if args.num_kv_heads is None else args.num_kv_heads,
                model.head_dim if args.head_dim is None else args.head_dim,
            )
        except ValueError as err:
            if args.num_kv_heads is not None or args.num_heads is None or args.num_heads < 1:
                raise
            raise ValueError(f"{err}: the {args.preset} preset has {model.num_kv_heads} key/value heads; "
                             "give the model's with --num-kv-heads") from err
        try:
            batches = batches_from_args(args)
        except RuntimeError as err:  # a corpus that cannot be read here
            raise ValueError(str(err)) from err
        if args.cp_size is not None:
            results = compare_layouts(batches, args.cp_size, model, args.tensor_parallel_size, args.choose_by)
        else:
            rank_model = per_tp_rank(model, args.tensor_parallel_size)
            if args.inner_size >= 1:  # else plan_sequences names the bad size
                check_heads(rank_model.num_heads, rank_model.num_kv_heads, args.inner_size)
            plan = plan_sequences(batches[0], outer_size=args.outer_size, inner_size=args.inner_size,
                                  cost_model=rank_model, cache=None, choose_by=args.choose_by)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.tensor_parallel_size > model.gpus_per_node:
        print(f"warning: a TP group of {args.tensor_parallel_size} GPUs spans nodes of {model.gpus_per_node}: the "
              f"layouts are modelled with one CP rank a node", file=sys.stderr)
    elif args.cp_size is None and args.inner_size > rank_model.gpus_per_node:
        print(f"warning: an inner group of {args.inner_size} CP ranks (x TP {args.tensor_parallel_size}) spans nodes "
              f"of {model.gpus_per_node} GPUs: its all-to-alls would cross nodes", file=sys.stderr)
    if args.cp_size is not None:
        print(f"layouts of CP size {args.cp_size}, T = {batches[0][-1]}, mean over {len(batches)} row(s), "
              f"{args.preset} preset, Hq={model.num_heads} Hkv={model.num_kv_heads} D={model.head_dim}, "
              f"TP={args.tensor_parallel_size}, {model.gpus_per_node} GPUs per node:")
        print(layouts_table(results, args.cp_size, batches[0][-1], args.choose_by))
        return 0
    print(describe(plan))
    if args.png is not None:
        try:
            draw(plan, args.png)
        except (OSError, ValueError) as err:
            print(f"error: cannot write the picture to {args.png}: {err}", file=sys.stderr)
            return 2
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
