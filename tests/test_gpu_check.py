"""scripts/gpu_check.py, the GPU machine's one script, run here in its CPU dry run: every
check's own code (batches, plans, timing, calibration, the Megatron batch split, the
report) runs at small sizes, so that a GPU session does not find its bugs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sap.planning import CostModel

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    # Two threads: the suite runs one test at a time, and the torch ops here are most of it.
    # The mirror folder does not exist yet, as gpu_check.sh's $OUT may not on a fresh machine.
    mirror = out.parent / "mirror" / "nested"
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--mirror", str(mirror)],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "2"})
    return result, out


def test_the_mirror_gets_the_report_and_the_calibration(dry_run):
    result, out = dry_run
    mirror = out.parent / "mirror" / "nested"
    assert (mirror / "report.json").read_text() == out.read_text()
    assert (mirror / "calibration.json").read_text() == out.with_name("calibration.json").read_text()


@pytest.mark.parametrize("name", ["calibration.json", "."])
def test_a_report_path_that_is_the_calibration_or_a_folder_is_refused(tmp_path, name):
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path / name)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "must be a file other than calibration.json" in result.stderr


def _expected_checks() -> list[str]:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    names = [check.__name__ for check in gpu_check.CHECKS]
    return names[:1] + [f"torch/{kind}" for kind in ("accuracy", "no_host_syncs", "speed")] + names[1:]


def test_every_check_runs_and_passes(dry_run):
    result, out = dry_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert list(report["checks"]) == _expected_checks()
    failed = {name: check.get("error") for name, check in report["checks"].items() if not check["ok"]}
    assert report["ok"] and not failed, failed
    assert "dry run" in report["device"]
    # megatron-core is installed here: the batch split ran, and took the loader's plan.
    split = report["checks"]["batch_split_no_host_syncs"]
    assert "skipped" not in split and split["planned_by_the_loader"]["plan_taken_from_the_loader"]
    accuracy = report["checks"]["torch/accuracy"]
    assert accuracy["max_error"] <= accuracy["tolerance"]


def test_the_calibration_it_writes_is_read_by_the_cost_model(dry_run):
    _, out = dry_run
    calibration = json.loads((out.parent / "calibration.json").read_text())
    assert "pipelined_kernel_factor" in calibration["cost_model"]  # added by sap_executor_vs_kernels
    model = CostModel.from_calibration(out.parent / "calibration.json")
    assert model.attention_tflops == pytest.approx(calibration["cost_model"]["attention_tflops"])


def test_a_dry_run_needs_an_out_path():
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--dry-run needs --out" in result.stderr


def test_sap_executor_times_run_in_each_schedule_and_as_auto_picks(dry_run):
    _, out = dry_run
    times = json.loads(out.read_text())["checks"]["method_executor_times"]
    assert times["sap_cost_model"].startswith("calibration.json (pipelined_kernel_factor")  # this run's calibration
    rows = [key.rsplit("/", 1)[0] for key in times if key.endswith("/sap_schedules")]
    assert rows
    for row in rows:
        assert {f"{row}/{m}" for m in ("sap", "sap-pipelined", "sap-gathered", "p2p", "sap_schedules")} <= set(times)
        assert set(times[f"{row}/sap_schedules"]) <= {"pipelined", "gathered"}
        assert len(times[f"{row}/sap_schedules"]) == times["shape"]["world"]


def _run_only(out: Path, names: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--only", names],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})


def test_only_reruns_the_named_checks_and_keeps_the_rest(dry_run, tmp_path):
    _, full = dry_run
    out = tmp_path / "report.json"
    out.write_text(full.read_text())
    (tmp_path / "calibration.json").write_text(full.with_name("calibration.json").read_text())
    before = json.loads(out.read_text())
    for _ in range(2):
        result = _run_only(out, "torch_backend_accuracy,sap_executor_vs_kernels")
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    after = json.loads(out.read_text())
    assert list(after["checks"]) == list(before["checks"]) and after["date"] == before["date"]
    rerun = {name for name, check in after["checks"].items() if "date" in check}
    assert rerun == {"torch_backend_accuracy", "sap_executor_vs_kernels"}
    assert all(after["checks"][name] == before["checks"][name] for name in set(before["checks"]) - rerun)
    # The rerun's factor replaces the calibration's; the fitted rates stay, the source names the factor once.
    calibration = json.loads((tmp_path / "calibration.json").read_text())
    fitted = json.loads(full.with_name("calibration.json").read_text())
    factor = after["checks"]["sap_executor_vs_kernels"]["pipelined_kernel_factor"]
    assert calibration["cost_model"] == {**fitted["cost_model"], "pipelined_kernel_factor": factor}
    assert calibration["source"].count("pipelined_kernel_factor") == 1


def test_only_refuses_unknown_checks_a_missing_report_and_one_from_elsewhere(dry_run, tmp_path):
    _, full = dry_run
    missing = _run_only(tmp_path / "none.json", "rank_memory")
    assert missing.returncode == 2 and "cannot be read" in missing.stderr
    out = tmp_path / "report.json"
    out.write_text(full.read_text())
    unknown = _run_only(out, "rank_memory,kernel_speed")
    assert unknown.returncode == 2 and "unknown check(s) ['kernel_speed']" in unknown.stderr
    elsewhere = json.loads(full.read_text())
    elsewhere["device"] = "NVIDIA H200"
    out.write_text(json.dumps(elsewhere))
    result = _run_only(out, "rank_memory")
    assert result.returncode == 2 and "was written elsewhere" in result.stderr and "'device'" in result.stderr


def test_without_the_corpora_it_stops_before_any_check(tmp_path):
    """No cached document lengths and no tokenizer (a GPU machine without .cache/megatron_sap
    carried along): the run ends at once, naming the fix, instead of spending GPU time on
    checks that fail on it."""
    code = (
        "import sys, runpy; sys.argv = ['gpu_check.py', '--dry-run', '--out', sys.argv[1]]; "
        "import megatron_sap.bench.data as data; "
        "data.document_lengths = lambda corpus: (_ for _ in ()).throw(RuntimeError('no cached lengths')); "
        f"sys.path.insert(0, {str(SCRIPT.parent)!r}); import gpu_check; sys.exit(gpu_check.main())"
    )
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no cached lengths" in result.stdout and "gpu_check.sh --prepare" in result.stdout
    assert not out.exists()


def test_a_skipped_check_reads_as_skipped_not_ok():
    from megatron_sap.bench.gpu_report import _checks_table

    table = _checks_table({"batch_split_no_host_syncs": {"ok": True, "skipped": "megatron-core is not importable"},
                           "sap_simulated": {"ok": True}})
    assert "| batch_split_no_host_syncs | skipped: megatron-core is not importable |" in table
    assert "| sap_simulated | ok |" in table
