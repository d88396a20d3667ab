"""Scale model: modelled attention-layer time (forward + backward) from 8 to 1,024 GPUs.

For each corpus, cost-model preset, packed length T and CP size P, a few batches are
packed from the real length distribution; SAP's plan and every baseline's analytic
model are evaluated on each batch by the shared cost model and the results averaged.
Nothing here runs attention: these are the cost model's numbers, which the measured
CPU part of ``python -m megatron_sap.bench`` and the GPU check keep honest.

    python -m megatron_sap.bench.scale [--quick] [--img-dir docs/img]
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from megatron_sap import baselines
from megatron_sap.planning.cost_model import LINK_INTER, LINK_INTRA, CostModel
from megatron_sap.planning.evaluate import ulysses_exposed_seconds, whole_documents_s
from megatron_sap.planning.plan import inner_chunk_choices

from .data import CORPORA, document_lengths
from .packing import pack

SAP = "sap"
BASELINES: tuple[str, ...] = ("p2p", "all_gather", "a2a", "a2a+p2p")
METHODS: tuple[str, ...] = (SAP,) + BASELINES
PRESETS: tuple[str, ...] = ("h100", "h200")
SCALE_P: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)
SCALE_T: tuple[int, ...] = (32 * 1024, 128 * 1024, 512 * 1024, 1024 * 1024)
MIN_TOKENS_PER_RANK = 512  # smaller shards are not a CP configuration anyone runs
SCALE_BATCHES = 2  # packed batches averaged per point, in `make bench` and this module's CLI
MAX_FLAT_SAP_RANKS = 64  # beyond this SAP runs two-level (U x R); a flat plan over 1,024 ranks is slow to plan


@dataclass(frozen=True)
class MethodPoint:
    """One method at one configuration, averaged over the packed batches."""

    corpus: str
    preset: str
    T: int
    P: int
    inner: int  # U: ranks of the inner (head-parallel, intra-node) level; P = U * R
    method: str
    time_s: float  # modelled layer time (makespan), forward + backward
    ideal_s: float  # every document computed whole, tile-rounded, / P at full rate, no communication
    compute_s: float  # kernel time of the busiest rank, forward + backward
    comm_s: float  # transfer time of the busiest sender, forward + backward, no overlap
    sent_bytes_mean: float  # per rank, forward + backward
    intra_bytes_mean: float
    inter_bytes_mean: float
    pairs_mean: float
    imbalance: float
    padding_tokens: float
    peak_extra_bytes: float
    candidate: str
    bound_s: float = float("nan")  # SAP: no plan at this layout is modelled faster (see `sap_bound_s`)

    @property
    def comm_bound(self) -> bool:
        """Whether moving data takes longer than computing on the busiest rank."""
        return self.comm_s > self.compute_s

    @property
    def layout(self) -> str:
        """``U x R`` of the configuration."""
        return f"{self.inner}x{self.P // self.inner}"


def baseline_inner(method: str, P: int, model: CostModel) -> int:
    """Inner (all-to-all) degree a baseline runs with: Ulysses over all P ranks for
    ``a2a``, one node's worth (capped by KV heads) for ``a2a+p2p``, none otherwise."""
    if method == "a2a":
        return P
    if method == "a2a+p2p":
        return max(1, min(P, model.gpus_per_node, model.num_kv_heads))
    return 1


def raw_stats(method: str, cu_seqlens: list[int], P: int, inner: int, model: CostModel) -> dict[str, Any]:
    """``plan.stats()`` for SAP, ``model_stats`` for a baseline; ValueError if not applicable."""
    if method == SAP:
        import megatron_sap as sap

        plan = sap.plan_sequences(cu_seqlens, outer_size=P // inner, inner_size=inner, cost_model=model, cache=None)
        return plan.stats()
    return baselines.get(method).model_stats(cu_seqlens, P, model, inner_size=inner)


def sap_bound_s(cu_seqlens: list[int], P: int, inner: int, model: CostModel) -> float:
    """A time no SAP plan at layout U x R can beat under the cost model.

    Every plan computes at least the whole documents' tile-rounded work, spread evenly,
    and pays the Ulysses all-to-alls that no kernel hides (all of them in one head chunk;
    with the plan's head-chunk choices, `inner_chunk_choices`, the first and the last of
    each pass, `ulysses_exposed_seconds`). The outer group holding the last
    token of the longest document (L tokens) needs its L - 1 earlier keys; it holds at
    most T / R of them and its node at most T / R per outer group on the node, so at
    least L - T / R arrive, of which those beyond the node's tokens cross nodes. Each
    pass waits for its transfers, forward for K/V and backward for dK/dV.
    """
    U, R = inner, P // inner
    T = cu_seqlens[-1]
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    ideal = whole_documents_s(lengths, P, model)
    group = T / R
    groups_per_node = max(1, model.gpus_per_node // U)
    longest = max(lengths)
    remote = max(0.0, longest - group)
    inter = max(0.0, longest - groups_per_node * group)
    kv = model.kv_bytes_per_token / U
    transfer = (inter * kv / model.bandwidth(LINK_INTER) + (remote - inter) * kv / model.bandwidth(LINK_INTRA))
    exposed = min(ulysses_exposed_seconds(model, group, U, R, c) for c in inner_chunk_choices(model, U))
    return max(ideal, 2 * transfer) + exposed


def summarise(stats: dict[str, Any], model: CostModel) -> dict[str, float]:
    """Scalar summary of one batch's stats dict."""
    pairs = np.asarray(stats["pairs_per_rank"], dtype=np.float64)
    sent = np.asarray(stats["sent_bytes_per_rank"], dtype=np.float64)
    intra = np.asarray(stats["sent_bytes_intra_per_rank"], dtype=np.float64)
    inter = np.asarray(stats["sent_bytes_inter_per_rank"], dtype=np.float64)
    compute = model.compute_seconds(pairs.max()) + model.compute_seconds(pairs.max(), backward=True)
    comm = float(np.max(intra / model.bandwidth("intra") + inter / model.bandwidth("inter")))
    return {
        "time_s": float(stats["modelled_time_s"]),
        "ideal_s": float(stats["ideal_time_s"]),
        "compute_s": compute,
        "comm_s": comm,
        "sent_bytes_mean": float(sent.mean()),
        "intra_bytes_mean": float(intra.mean()),
        "inter_bytes_mean": float(inter.mean()),
        "pairs_mean": float(pairs.mean()),
        "imbalance": float(stats["imbalance"]),
        "padding_tokens": float(np.sum(stats["padding_tokens"])),
        # NaN where a method's model does not report its operator memory.
        "peak_extra_bytes": float(np.max(stats.get("peak_extra_bytes_per_rank", np.nan))),
    }


def evaluate_method(
    method: str,
    batches: list[list[int]],
    P: int,
    inner: int,
    model: CostModel,
    corpus: str,
    preset: str,
) -> MethodPoint | None:
    """Average one method's modelled stats over `batches`; None where a baseline does not
    apply (e.g. heads not divisible by the Ulysses degree). SAP's errors propagate: a point
    SAP cannot plan must fail the run, not drop out of the targets."""
    rows, candidates = [], []
    for cu in batches:
        try:
            stats = raw_stats(method, cu, P, inner, model)
        except ValueError:
            if method == SAP:
                raise
            return None
        rows.append(summarise(stats, model))
        if method == SAP:
            rows[-1]["bound_s"] = sap_bound_s(cu, P, inner, model)
        candidates.append(str(stats.get("candidate", method)))
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    common = max(set(candidates), key=candidates.count)
    return MethodPoint(corpus=corpus, preset=preset, T=int(batches[0][-1]), P=P, inner=inner, method=method,
                       candidate=common, **mean)


def head_parallel_sizes(P: int, model: CostModel) -> list[int]:
    """Head-parallel degrees U > 1 within a node: powers of two up to one node's worth,
    capped by the KV heads, dividing P."""
    node = min(model.gpus_per_node, model.num_kv_heads)
    return [1 << i for i in range(1, node.bit_length()) if P % (1 << i) == 0]


def sap_layouts(P: int, model: CostModel) -> list[int]:
    """Inner sizes U that SAP is evaluated with at P ranks: flat (U=1) and every
    `head_parallel_sizes` degree, on one node too (as ``a2a+p2p`` is: a user may launch
    either there); each with at most MAX_FLAT_SAP_RANKS outer ranks, except one node's
    worth, which is always weighed."""
    node = min(model.gpus_per_node, model.num_kv_heads)
    return [U for U in [1, *head_parallel_sizes(P, model)] if P // U <= MAX_FLAT_SAP_RANKS or U == node]


def baseline_layouts(method: str, P: int, model: CostModel) -> list[int]:
    """Inner sizes U a baseline is evaluated with: for ``a2a+p2p`` every
    `head_parallel_sizes` degree, on one node too (a mixed layout can beat both pure ones
    there), its default `baseline_inner` where there is none; else its default."""
    if method == "a2a+p2p":
        return head_parallel_sizes(P, model) or [baseline_inner(method, P, model)]
    return [baseline_inner(method, P, model)]


def project(
    corpora: Iterable[str] = CORPORA,
    presets: Iterable[str] = PRESETS,
    Ps: Iterable[int] = SCALE_P,
    Ts: Iterable[int] = SCALE_T,
    num_batches: int = SCALE_BATCHES,
    seed: int = 0,
    num_kv_heads: int | None = None,
) -> list[MethodPoint]:
    """Every method at every (corpus, preset, T, P) point with at least
    MIN_TOKENS_PER_RANK tokens per rank, once per layout: SAP's from `sap_layouts`,
    the baselines' from `baseline_layouts`. `num_kv_heads` replaces the presets' KV
    heads (the query heads: a model without grouped-query attention); the points'
    preset then reads `preset_label`'s name, such as "h100-kv32"."""
    points: list[MethodPoint] = []
    overrides = {} if num_kv_heads is None else {"num_kv_heads": num_kv_heads}
    for corpus in corpora:
        lengths = document_lengths(corpus)
        for T in Ts:
            batches = pack(lengths, T, num_batches, seed)
            for name in presets:
                model = CostModel.preset(name, **overrides)
                preset = preset_label(name, num_kv_heads)
                for P in Ps:
                    if T // P < MIN_TOKENS_PER_RANK:
                        continue
                    for U in sap_layouts(P, model):
                        point = evaluate_method(SAP, batches, P, U, model, corpus, preset)
                        if point is not None:
                            points.append(point)
                    for method in BASELINES:
                        for U in baseline_layouts(method, P, model):
                            point = evaluate_method(method, batches, P, U, model, corpus, preset)
                            if point is not None:
                                points.append(point)
    return points


def preset_label(preset: str, num_kv_heads: int | None = None) -> str:
    """How the points of `preset` name it, with its KV heads where they are replaced."""
    return preset if num_kv_heads is None else f"{preset}-kv{num_kv_heads}"


def best(points: list[MethodPoint], sap: bool) -> MethodPoint | None:
    """Fastest SAP layout (sap=True) or fastest baseline (sap=False) among `points`."""
    pool = [p for p in points if (p.method == SAP) == sap]
    return min(pool, key=lambda p: p.time_s) if pool else None


def group_points(points: list[MethodPoint]) -> dict[tuple[str, str, int, int], list[MethodPoint]]:
    """Points keyed by (corpus, preset, T, P)."""
    out: dict[tuple[str, str, int, int], list[MethodPoint]] = {}
    for p in points:
        out.setdefault((p.corpus, p.preset, p.T, p.P), []).append(p)
    return out


@dataclass(frozen=True)
class ScaleRow:
    """SAP against the best baseline at one (corpus, preset, T, P)."""

    corpus: str
    preset: str
    T: int
    P: int
    sap: MethodPoint
    baseline: MethodPoint
    p2p: MethodPoint | None
    sap_bound_s: float  # the lowest `MethodPoint.bound_s` over the SAP layouts weighed

    @property
    def speedup(self) -> float:
        return self.baseline.time_s / self.sap.time_s

    @property
    def sap_over_ideal(self) -> float:
        return self.sap.time_s / self.sap.ideal_s

    @property
    def ceiling(self) -> float:
        """The most any SAP plan could gain over the best baseline here (`sap_bound_s`,
        the lowest over the SAP layouts weighed)."""
        return self.baseline.time_s / self.sap_bound_s


def scale_rows(points: list[MethodPoint]) -> list[ScaleRow]:
    """One row per configuration that has both a SAP and a baseline result."""
    rows = []
    for (corpus, preset, T, P), group in group_points(points).items():
        s, b = best(group, sap=True), best(group, sap=False)
        if s is None or b is None:
            continue
        p2p = next((p for p in group if p.method == "p2p"), None)
        bound = min(p.bound_s for p in group if p.method == SAP)
        rows.append(ScaleRow(corpus, preset, T, P, s, b, p2p, bound))
    return rows


def fmt_tokens(n: int) -> str:
    """32768 -> '32K', 1048576 -> '1M'."""
    return f"{n // (1 << 20)}M" if n % (1 << 20) == 0 else f"{n // 1024}K"


def rounded_down(ratio: float, digits: int = 2) -> float:
    """A speed-up to `digits` decimals, rounded down: a ratio under a target never reads as it."""
    scale = 10 ** digits
    return math.floor(round(ratio * scale, 9)) / scale  # round first: 1.29 * 100 is 128.99999999999997


def rounded_up(ratio: float, digits: int = 2) -> float:
    """A ratio to `digits` decimals, rounded up: one over a limit never reads as it."""
    scale = 10 ** digits
    return math.ceil(round(ratio * scale, 9)) / scale


def scale_table(rows: list[ScaleRow]) -> str:
    """Markdown table of the projection (speed-ups and ceilings `rounded_down`)."""
    lines = [
        "| corpus | preset | T | P | SAP layout | SAP ms | SAP/ideal | best baseline | its ms | bound | speedup | ceiling | p2p comm/compute |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r.p2p.comm_s / r.p2p.compute_s:.2f}" if r.p2p else "n/a"
        lines.append(
            f"| {r.corpus} | {r.preset} | {fmt_tokens(r.T)} | {r.P} | {r.sap.layout} | {r.sap.time_s * 1e3:.3f} "
            f"| {r.sap_over_ideal:.3f} | {r.baseline.method} ({r.baseline.layout}) | {r.baseline.time_s * 1e3:.3f} "
            f"| {'comm' if r.baseline.comm_bound else 'compute'} | {rounded_down(r.speedup):.2f}x | {rounded_down(r.ceiling):.2f}x | {ratio} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """A stated target, what was measured against it, and whether it holds."""

    name: str
    met: bool
    detail: str


def scale_targets(rows: list[ScaleRow], gpus_per_node: int = 8) -> list[Target]:
    """Scale-model targets: >= 1.5x over a communication-bound best baseline; within
    1.05x of ideal on one node; the cross-node p2p ring turning communication-bound."""
    out = []
    bound = [r for r in rows if r.baseline.comm_bound]
    if bound:
        worst = min(bound, key=lambda r: r.speedup)
        misses = [r for r in bound if r.speedup < 1.5]
        unreachable = [r for r in misses if r.ceiling < 1.5]
        # Where a plan could reach 1.5x: how close to the ideal (all compute spread evenly,
        # nothing else) it would have to come, against where SAP is.
        needed = [(r.baseline.time_s / 1.5 / r.sap.ideal_s, r.sap_over_ideal) for r in misses if r.ceiling >= 1.5]
        out.append(Target(
            "scale: >= 1.5x faster than the best baseline where it is communication-bound",
            not misses,
            f"{len(bound) - len(misses)}/{len(bound)} points; lowest {rounded_down(worst.speedup):.2f}x at "
            f"{worst.corpus} {worst.preset} T={fmt_tokens(worst.T)} P={worst.P} vs {worst.baseline.method}"
            + (f"; at {len(unreachable)} of the {len(misses)} misses no SAP plan could reach 1.5x "
               f"(ceiling {rounded_down(min(r.ceiling for r in unreachable)):.2f}-{rounded_down(max(r.ceiling for r in unreachable)):.2f}x)"
               if unreachable else "")
            + (f"; {'the other' if unreachable else 'the'} {len(needed)} would need SAP within {min(n for n, _ in needed):.2f}-"
               f"{max(n for n, _ in needed):.2f}x of the ideal (it is at {min(a for _, a in needed):.2f}-"
               f"{max(a for _, a in needed):.2f}x there)" if needed else ""),
        ))
    else:
        out.append(Target("scale: >= 1.5x faster than the best baseline where it is communication-bound",
                          False, "no point has a communication-bound best baseline: target not exercised"))
    node = [r for r in rows if r.P <= gpus_per_node]
    if node:
        worst = max(node, key=lambda r: r.sap_over_ideal)
        out.append(Target(
            "scale: SAP within 1.05x of ideal on one node",
            worst.sap_over_ideal <= 1.05,
            f"worst {worst.sap_over_ideal:.3f}x at {worst.corpus} {worst.preset} T={fmt_tokens(worst.T)} P={worst.P}",
        ))
    else:
        out.append(Target("scale: SAP within 1.05x of ideal on one node", False,
                          f"no point at P <= {gpus_per_node}: target not exercised"))
    ring = [r for r in rows if r.p2p is not None]
    if ring:
        by_p: dict[int, list[float]] = {}
        for r in ring:
            by_p.setdefault(r.P, []).append(r.p2p.comm_s / r.p2p.compute_s)
        med = {P: float(np.median(v)) for P, v in sorted(by_p.items())}
        first_bound = next((P for P, v in med.items() if v > 1.0), None)
        grows = all(b >= a for a, b in zip(list(med.values()), list(med.values())[1:]))
        out.append(Target(
            "scale: the p2p KV ring becomes communication-bound as P grows",
            grows and first_bound is not None,
            "median comm/compute by P: " + ", ".join(f"{P}: {v:.2f}" for P, v in med.items())
            + (f"; bound from P={first_bound}" if first_bound else "; never bound"),
        ))
    else:
        out.append(Target("scale: the p2p KV ring becomes communication-bound as P grows", False,
                          "no point with the ring: target not exercised"))
    return out


def targets_table(targets: list[Target]) -> str:
    """Markdown table of targets, met or MISSED."""
    lines = ["| target | met | measured |", "|---|---|---|"]
    lines += [f"| {t.name} | {'yes' if t.met else '**MISSED**'} | {t.detail} |" for t in targets]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run the projection, print the tables and write the scale plots."""
    from . import plots

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one corpus, one preset, fewer points")
    parser.add_argument("--batches", type=int, default=SCALE_BATCHES,
                        help=f"packed batches averaged per point (default {SCALE_BATCHES}, as in make bench)")
    parser.add_argument("--kv-heads", type=int, help="KV heads of the model (default: the presets'; as many as the "
                                                     "query heads for a model without grouped-query attention)")
    parser.add_argument("--img-dir", help="where the plots go (default: docs/img; with --quick or --kv-heads, none "
                                          "unless given, so that such a run leaves the published plots alone)")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    if args.kv_heads is not None:
        try:
            for preset in PRESETS:
                CostModel.preset(preset, num_kv_heads=args.kv_heads)
        except ValueError as exc:
            parser.error(f"--kv-heads {args.kv_heads}: {exc}")
    if args.img_dir is not None:
        try:  # before the projection: where the plots go
            Path(args.img_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--img-dir {args.img_dir}: {exc}")
    start = time.perf_counter()
    if args.quick:
        points = project(corpora=("sharegpt",), presets=("h100",), Ps=(8, 64, 512), Ts=(128 * 1024, 1 << 20),
                         num_batches=args.batches, num_kv_heads=args.kv_heads)
    else:
        points = project(num_batches=args.batches, num_kv_heads=args.kv_heads)
    rows = scale_rows(points)
    print(scale_table(rows))
    print()
    print(targets_table(scale_targets(rows)))
    img_dir = args.img_dir or (None if args.quick or args.kv_heads is not None else "docs/img")
    if img_dir is not None:
        for path in plots.scale_plots(points, Path(img_dir)):
            print("wrote", path)
    print(f"scale model: {len(points)} method points in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
