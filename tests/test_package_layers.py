"""The package's layers stay apart (docs/architecture.md): only `megatron_sap/megatron/`
imports Megatron, and the planning layer uses no process groups and nothing above it."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_sap"


def _imports(path: Path) -> set[str]:
    """Absolute module names a source file imports (anywhere in it, lazily or not)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _sources(under: Path) -> list[Path]:
    files = sorted(under.rglob("*.py"))
    assert files, f"no sources under {under}"
    return files


def test_only_the_megatron_subpackage_imports_megatron() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in _imports(path) if m == "megatron" or m.startswith("megatron."))
        for path in _sources(PACKAGE)
        if PACKAGE / "megatron" not in path.parents
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_planning_uses_no_process_groups_and_nothing_above_it() -> None:
    above = ("torch.distributed", "megatron_sap.comm", "megatron_sap.attention", "megatron_sap.kernels",
             "megatron_sap.megatron", "megatron")
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in _imports(path) if m.startswith(above))
        for path in _sources(PACKAGE / "planning")
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_the_import_scan_sees_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from megatron.core import parallel_state\n    import torch.distributed as dist\n")
    assert _imports(source) == {"megatron.core", "torch.distributed"}
