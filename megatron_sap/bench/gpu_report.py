"""The GPU section of docs/benchmarks.md, rendered from the GPU check's report.

`scripts/gpu_check.sh` runs where CUDA is (`make bench` does not) and writes
docs/gpu_results.json and docs/calibration.json; this module turns the report into
tables so the benchmark page shows the last GPU measurements with their date and
device. Nothing here measures.
"""
from __future__ import annotations

import json
from pathlib import Path

METHODS = ("sap", "sap-pipelined", "sap-gathered", "p2p", "all_gather", "a2a")  # the SAP variants: its schedules


def gpu_section(path: Path) -> tuple[str, str] | None:
    """(title, markdown body) of the GPU measurements in `path`, or None when there is no report."""
    if not path.exists():
        return None
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"the GPU check's report {path} is not JSON: {exc}") from None
    if not isinstance(report, dict) or not isinstance(report.get("checks"), dict):
        raise ValueError(f"the GPU check's report {path} has no 'checks' (write it with scripts/gpu_check.sh)")
    checks = report["checks"]
    title = (f"Measured on one GPU: {report['device']}, {report['date'][:10]} "
             f"(torch {report['torch']}, CUDA {report['cuda']}, flash-attn {report['flash_attn'] or 'not installed'})")
    parts = [
        f"From `{path.as_posix()}`, written by `scripts/gpu_check.sh` on that machine (not by `make bench`). "
        f"All checks {'passed' if report.get('ok') else 'did NOT pass'}.",
        _checks_table(checks),
    ]
    for name, result in checks.items():
        if name.endswith("/speed") and result.get("ok"):
            parts.append(_speed_table(name.split("/")[0], result))
    if checks.get("method_kernel_times", {}).get("ok"):
        parts.append(_method_table(checks["method_kernel_times"]))
    if checks.get("sap_executor_vs_kernels", {}).get("ok"):
        parts.append(_executor_table(checks["sap_executor_vs_kernels"]))
    if checks.get("method_executor_times", {}).get("ok"):
        parts.append(_executor_times_table(checks["method_executor_times"]))
    if checks.get("rank_memory", {}).get("ok"):
        parts.append(_memory_table(checks["rank_memory"]))
    if checks.get("host_planning_time", {}).get("ok"):
        parts.append(_planning_table(checks["host_planning_time"]))
    return title, "\n\n".join(parts)


def _checks_table(checks: dict) -> str:
    lines = ["| check | result | max error (tolerance) | seconds |", "|---|---|---|---|"]
    for name, result in checks.items():
        error = f"{result['max_error']:.2e} ({result['tolerance']:.0e})" if "max_error" in result else ""
        status = "ok" if result["ok"] else f"FAILED: {result.get('error', '')}"
        if result.get("skipped"):  # ran nothing: not a pass
            status = f"skipped: {result['skipped']}"
        if "date" in result:  # rerun alone (gpu_check.py --only)
            status += f" (rerun {result['date'][:10]})"
        lines.append(f"| {name} | {status} | {error} | {result.get('seconds', '')} |")
    return "\n".join(lines)


def _speed_table(backend: str, result: dict) -> str:
    shape = result["shape"]
    lines = [
        f"Kernel speed, `{backend}`, causal, {shape['heads_q']} query / {shape['heads_kv']} KV heads, head dim "
        f"{shape['head_dim']}, {shape['dtype']} (TFLOP/s on real causal pairs; backward counted as 2.5x the forward FLOPs):",
        "",
        "| documents | tokens | forward ms | backward ms | forward TFLOP/s | backward TFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in result.items():
        if isinstance(row, dict) and "forward_ms" in row:
            lines.append(f"| {name} ({row['documents']}) | {row['tokens']} | {row['forward_ms']:.2f} | "
                         f"{row['backward_ms']:.2f} | {row['forward_tflops']:.0f} | {row['backward_tflops']:.0f} |")
    return "\n".join(lines)


def _method_table(result: dict) -> str:
    shape = result["shape"]
    lines = [
        f"Attention kernel time per rank of each method's work at P = {shape['world']} (one packed row; each rank's "
        "kernel calls run in turn on the one GPU, forward + backward, no communication). The busiest rank sets "
        "the layer's compute time:",
        "",
        "| row | method | busiest rank ms | mean rank ms | max / mean | busiest vs SAP |",
        "|---|---|---|---|---|---|",
    ]
    lines += _per_rank_rows(result)
    calibration = result.get("calibration")
    if calibration:
        rates, error = calibration["cost_model"], calibration["relative_error"]
        lines += [
            "",
            f"Calibration (`docs/calibration.json`, `--sap-calibration-file`): the cost model's tile-rounded pairs fitted "
            f"to all {calibration['ranks']} ranks above give {rates['attention_tflops']:.0f} TFLOP/s forward and a "
            f"backward factor of {rates['backward_factor']:.2f}. With them the model's per-rank kernel time is off "
            f"by {error['median']:+.1%} at the median, {error['min']:+.1%} to {error['max']:+.1%} at the extremes "
            "(the smallest ranks, 1-2 ms, run slower than their pairs predict, since launch and per-document "
            "overheads are not modelled; ranks of a few long documents run faster).",
        ]
    return "\n".join(lines)


def _executor_rows(result: dict) -> list[tuple[str, dict]]:
    """(label, row) of each executor timing: one per batch (reports before the gathered
    schedule), or one per batch and schedule, each with the batch's one-call times."""
    rows = []
    for key, row in result.items():
        if not isinstance(row, dict):
            continue
        if "executor_ms_per_rank" in row:
            rows.append((key, row))
        for schedule in ("pipelined", "gathered"):
            if "executor_ms_per_rank" in row.get(schedule, {}):
                rows.append((f"{key}, {schedule}", {**row, **row[schedule]}))
    return rows


def _executor_table(result: dict) -> str:
    lines = [
        "SAP's compute per rank as the executor runs it (the program's kernel calls, index selects and, "
        "pipelined, lse merges, forward + backward, transfers replaced by local indexing) against the same work "
        "in one varlen call per pass:",
        "",
        "| row | kernel calls per rank | executor ms (busiest rank) | one call ms (busiest rank) | ratio | "
        "forward only: executor / one call ms |",
        "|---|---|---|---|---|---|",
    ]
    rows = _executor_rows(result)
    for key, row in rows:
        calls = row["kernel_calls_per_rank"]
        forward = "not recorded"
        if "executor_forward_ms_per_rank" in row:
            forward = f"{max(row['executor_forward_ms_per_rank']):.2f} / {max(row['one_call_forward_ms_per_rank']):.2f}"
        lines.append(f"| {key} | {min(calls)}-{max(calls)} | {max(row['executor_ms_per_rank']):.2f} | "
                     f"{max(row['one_call_ms_per_rank']):.2f} | {row['busiest_executor_over_busiest_one_call']:.2f}x | "
                     f"{forward} |")
    if "pipelined_kernel_factor" in result:
        lines += ["", f"Pipelined over gathered executor time, every rank of both rows: "
                  f"{result['pipelined_kernel_factor']:.2f} (the cost model's `pipelined_kernel_factor`)."]
    for key, row in rows:
        by_op = row.get("device_time_by_op", {})
        if "top" in by_op:
            ops = "; ".join(f"`{name}` {ms:.1f} ms ({count} calls)" for name, ms, count in by_op["top"][:6])
            lines += ["", f"{key}, every rank's program once (forward + backward), {by_op['total_ms']:.1f} ms of device "
                      f"time; the ops with the most: {ops}."]
    return "\n".join(lines)


def _executor_times_table(result: dict) -> str:
    intro = ("Each rank's whole attention op (the method's executor: kernel calls, gathers, merges, buffers), forward + "
             "backward, with its exchanges local, so without the communication")
    if "sap_cost_model" in result:
        intro += (f". `sap` runs each rank in the schedule `--sap-schedule auto` picks with {result['sap_cost_model']}; "
                  "`sap-pipelined` and `sap-gathered` run every rank in one schedule")
    lines = [intro + ":", "", "| row | method | busiest rank ms | mean rank ms | max / mean | busiest vs SAP |",
             "|---|---|---|---|---|---|"]
    lines += _per_rank_rows(result)
    for key, schedules in sorted(result.items()):
        if key.endswith("/sap_schedules"):
            chosen = ", ".join(f"{name} {schedules.count(name)}" for name in sorted(set(schedules)))
            lines += ["", f"{key.rsplit('/', 1)[0]}: `auto` ran {chosen} of {len(schedules)} ranks."]
    return "\n".join(lines)


def _per_rank_rows(result: dict) -> list[str]:
    """Table rows of per-rank forward + backward times, keyed "<row>/<method>" in `result`:
    the busiest and mean rank, their ratio, and the busiest against SAP's in the same row."""
    lines = []
    for row in sorted({key.rsplit("/", 1)[0] for key in result if key.count("/") == 2}):
        busiest = {}
        for method in METHODS:
            times = result.get(f"{row}/{method}")
            if times is None:
                continue
            per_rank = [f + b for f, b in zip(times["forward_ms_per_rank"], times["backward_ms_per_rank"])]
            busiest[method], mean = max(per_rank), sum(per_rank) / len(per_rank)
            lines.append(f"| {row} | {method} | {busiest[method]:.2f} | {mean:.2f} | {busiest[method] / mean:.3f} | "
                         f"{busiest[method] / busiest.get('sap', busiest[method]):.2f}x |")
    return lines


MEMORY_NOTE = (
    "Neither formula counts the kernels' own workspace and outputs, which is where the measured peaks exceed "
    "them: for SAP, one call's gathered rows and outputs; for p2p, in each backward step, a kernel call's dq, dk "
    "and dv, their stacked and fp32 copies, a zero-padded dK/dV, the third buffer of the dK/dV hop and the "
    "kernel's own workspace (the flash backward's fp32 dq accumulator, and its dK/dV over every query head "
    "under GQA, summed to the KV heads after)."
)


def _memory_table(result: dict) -> str:
    lines = [
        "Peak memory per rank (`torch.cuda.max_memory_allocated`; each rank run alone with local exchanges; output "
        "and input gradients included, the inputs not), next to the method's formula plus output and gradients:",
        "",
        "| row | method | peak MiB (max rank) | peak MiB (min rank) | formula MiB (max rank) |",
        "|---|---|---|---|---|",
    ]
    for key, row in result.items():
        if isinstance(row, dict) and "peak_MiB_per_rank" in row:
            where, method = key.rsplit("/", 1)
            peaks = row["peak_MiB_per_rank"]
            lines.append(f"| {where} | {method} | {max(peaks):.0f} | {min(peaks):.0f} | "
                         f"{max(row['formula_plus_output_and_grads_MiB']):.0f} |")
    lines += ["", MEMORY_NOTE]
    return "\n".join(lines)


def _planning_table(result: dict) -> str:
    lines = [
        f"Planning on the GPU machine's CPU ({result['cpu']}, one thread), as `make bench` measures it on its own "
        "machine (a fresh plan of packed 128K-token rows, a cache hit, outer rank 0's program"
        + (f", its index tensors on {result['program_device']}" if result.get("program_device") else "") + "):",
        "",
        "| corpus | U x R | fresh plan ms (median) | fresh plan ms (min) | cache hit us (median) | "
        "rank 0's program ms (median) |",
        "|---|---|---|---|---|---|",
    ]
    shipped = all("unpickle_median_ms" in row for row in result["rows"])  # reports before 2026-12-01 lack it
    if shipped:
        lines[2] += " plan and program from a loader worker: unpickle ms (median) |"
        lines[3] += "---|"
    for row in result["rows"]:
        lines.append(f"| {row['corpus']} | {row['layout']} | {row['fresh_median_ms']:.1f} | {row['fresh_min_ms']:.1f} | "
                     f"{row['hit_median_us']:.0f} | {row['program_median_ms']:.1f} |"
                     + (f" {row['unpickle_median_ms']:.1f} |" if shipped else ""))
    return "\n".join(lines)
