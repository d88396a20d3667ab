"""scripts/planner_ab.py: this checkout's planner against a git revision, row by row."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_compares_with_a_revision() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "planner_ab.py"), "HEAD", "2x4", "--rows", "2"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]  # 1 where the placements differ
    lines = [line for line in result.stdout.splitlines() if "ratio" in line]
    assert len(lines) == 2 and all(" 2x4 " in line and "HEAD:" in line for line in lines), result.stdout


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_compares_on_rows_of_uniform_lengths() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "planner_ab.py"), "HEAD", "2x4", "--rows", "2",
                             "--uniform", "50", "500"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]  # 1 where the placements differ
    lines = [line for line in result.stdout.splitlines() if "ratio" in line]
    assert len(lines) == 1 and lines[0].startswith("50-500") and " 2x4 " in lines[0], result.stdout
