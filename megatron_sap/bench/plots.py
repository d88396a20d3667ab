"""PNG figures for docs/benchmarks.md: bytes and modelled time against P, imbalance per
method, and the placement of one packed batch."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend first)
import numpy as np  # noqa: E402

from .scale import BASELINES, SAP, MethodPoint, fmt_tokens  # noqa: E402

COLORS = {SAP: "tab:red", "p2p": "tab:blue", "all_gather": "tab:orange", "a2a": "tab:green", "a2a+p2p": "tab:purple"}
MiB = float(1 << 20)


def _series(points: list[MethodPoint], corpus: str, preset: str, T: int, method: str) -> list[MethodPoint]:
    """Points of one method along P (its fastest layout at each P), sorted by P."""
    pool = [p for p in points if (p.corpus, p.preset, p.T, p.method) == (corpus, preset, T, method)]
    by_p: dict[int, MethodPoint] = {}
    for p in pool:
        if p.P not in by_p or p.time_s < by_p[p.P].time_s:
            by_p[p.P] = p
    return [by_p[P] for P in sorted(by_p)]


def _grid(points: list[MethodPoint], Ts: Sequence[int]):
    """One row of panels per corpus, one column per T."""
    corpora = sorted({p.corpus for p in points})
    fig, axes = plt.subplots(len(corpora), len(Ts), figsize=(5.2 * len(Ts), 3.8 * len(corpora)), squeeze=False)
    return corpora, fig, axes


def _plotted_ts(points: list[MethodPoint]) -> list[int]:
    """The T values plotted, one column each: all of them if two or fewer, else the second
    smallest and the largest."""
    Ts = sorted({p.T for p in points})
    return Ts if len(Ts) <= 2 else [Ts[1], Ts[-1]]


def _method_lines(ax, points: list[MethodPoint], corpus: str, preset: str, T: int, value) -> None:
    """One line per method (SAP at its best layout) of `value(point)` against P."""
    for method in (SAP,) + BASELINES:
        s = _series(points, corpus, preset, T, method)
        if s:
            ax.plot([p.P for p in s], [value(p) for p in s], "o-", color=COLORS[method],
                    label=method if method != SAP else "sap (best layout)")


def bytes_vs_p(points: list[MethodPoint], path: Path, preset: str = "h100") -> Path:
    """Mean bytes sent per rank per layer (fwd+bwd) against P, one panel per corpus x T."""
    Ts = _plotted_ts(points)
    corpora, fig, axes = _grid(points, Ts)
    for i, corpus in enumerate(corpora):
        for j, T in enumerate(Ts):
            ax = axes[i][j]
            _method_lines(ax, points, corpus, preset, T, lambda p: p.sent_bytes_mean / MiB)
            ax.set_xscale("log", base=2)
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_title(f"{corpus}, T={fmt_tokens(T)}")
            ax.set_xlabel("CP ranks P")
            ax.set_ylabel("MiB sent per rank per layer")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Bytes sent per rank, forward + backward ({preset} model shape)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def time_vs_p(points: list[MethodPoint], path: Path, preset: str) -> Path:
    """Modelled layer time against P per method, with SAP's ideal (no communication)."""
    Ts = _plotted_ts(points)
    corpora, fig, axes = _grid(points, Ts)
    for i, corpus in enumerate(corpora):
        for j, T in enumerate(Ts):
            ax = axes[i][j]
            _method_lines(ax, points, corpus, preset, T, lambda p: p.time_s * 1e3)
            s = _series(points, corpus, preset, T, SAP)
            if s:
                ax.plot([p.P for p in s], [p.ideal_s * 1e3 for p in s], "k--", lw=1, label="ideal (work / P)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{corpus}, T={fmt_tokens(T)}")
            ax.set_xlabel("CP ranks P (8 per node)")
            ax.set_ylabel("modelled ms per layer")
            ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Modelled attention layer time, forward + backward ({preset})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def scale_plots(points: list[MethodPoint], img_dir: Path) -> list[Path]:
    """Bytes and time against P for the projection; one time figure per preset, and one
    bytes figure (the bytes depend on the model shape, not on the links): the default
    preset's, else the first preset's, named after it."""
    img_dir.mkdir(parents=True, exist_ok=True)
    presets = sorted({p.preset for p in points})
    shape = "h100" if "h100" in presets else presets[0]
    name = "scale_bytes_vs_p.png" if shape == "h100" else f"scale_bytes_vs_p_{shape}.png"
    out = [bytes_vs_p(points, img_dir / name, shape)]
    for preset in presets:
        out.append(time_vs_p(points, img_dir / f"scale_time_vs_p_{preset}.png", preset))
    return out


def imbalance_bars(points: list[MethodPoint], path: Path) -> Path:
    """Max/mean attention pairs per rank for each method at each benchmark configuration."""
    configs = sorted({(p.corpus, p.T, p.P, p.inner) for p in points if p.method == SAP})
    methods = (SAP,) + BASELINES
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(configs)), 4.0))
    for m, method in enumerate(methods):
        values = []
        for corpus, T, P, inner in configs:
            match = [p for p in points if (p.corpus, p.T, p.P, p.method) == (corpus, T, P, method)
                     and (method != SAP or p.inner == inner)]
            values.append(match[0].imbalance if match else np.nan)
        ax.bar(np.arange(len(configs)) + (m - len(methods) / 2 + 0.5) * width, values, width,
               color=COLORS[method], label=method)
    ax.axhline(1.10, color="k", ls="--", lw=1, label="target 1.10")
    ax.set_xticks(np.arange(len(configs)))
    ax.set_xticklabels([f"{c}\nT={fmt_tokens(T)} P={P}\nSAP {u}x{P // u}" for c, T, P, u in configs], fontsize=7)
    ax.set_ylabel("max / mean pairs per rank")
    ax.set_ylim(bottom=1.0)
    ax.legend(fontsize=8, ncol=3)
    ax.set_title("Attention work imbalance (modelled)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def placement_picture(
    pieces_per_rank: list[list[tuple[int, int, int]]],
    cu_seqlens: list[int],
    path: Path,
    title: str,
) -> Path:
    """Which document pieces each rank holds, in local order, with the packed row on top.

    `pieces_per_rank[r]` is rank r's list of (doc, start, end) in global token positions.
    Colours identify documents; a document split over several ranks shows its colour
    on each of them.
    """
    cmap = plt.get_cmap("tab20")
    R = len(pieces_per_rank)
    fig, ax = plt.subplots(figsize=(11, 0.45 * (R + 2) + 1.2))
    bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
    for d, (a, b) in enumerate(bounds):
        ax.barh(R + 0.6, (b - a) / cu_seqlens[-1], left=a / cu_seqlens[-1], color=cmap(d % 20), edgecolor="white",
                linewidth=0.3, height=0.8)
    local_tokens = max(sum(e - s for _, s, e in pieces) for pieces in pieces_per_rank) or 1
    split_docs = {d for d in range(len(bounds))
                  if sum(any(p[0] == d for p in pieces) for pieces in pieces_per_rank) > 1}
    for r, pieces in enumerate(pieces_per_rank):
        pos = 0
        for d, s, e in pieces:
            ax.barh(R - 1 - r, (e - s) / local_tokens, left=pos / local_tokens, color=cmap(d % 20),
                    edgecolor="black" if d in split_docs else "white", linewidth=0.8 if d in split_docs else 0.3,
                    height=0.8)
            pos += e - s
    ax.set_yticks([R + 0.6] + list(range(R)))
    ax.set_yticklabels(["packed row"] + [f"rank {R - 1 - i}" for i in range(R)])
    ax.set_xlabel("fraction of tokens (packed row: of T; ranks: of the largest local shard)")
    ax.set_xlim(0, 1)
    ax.set_title(title + f"\n{len(bounds)} segments, {len(split_docs)} split over ranks (outlined)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
