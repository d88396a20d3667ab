"""Shared pytest fixtures: `dist_pool`, the module's pool of gloo workers of a given size (see dist_pool.py), and
`load_script`, which imports one of the project's scripts/ as a module."""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

# Workers unpickle jobs by module name, so dist_pool and the test modules must be importable by
# their plain names in every import mode, not only pytest's default `prepend`.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from dist_pool import WorkerPool  # noqa: E402


@pytest.fixture(scope="module")
def _module_dist_pools() -> Iterator[dict[int, WorkerPool]]:
    """The module's pools by world size: each starts on first use and stops after the module."""
    pools: dict[int, WorkerPool] = {}
    try:
        yield pools
    finally:
        for pool in pools.values():
            pool.close()


@pytest.fixture
def dist_pool(request: pytest.FixtureRequest, _module_dist_pools: dict[int, WorkerPool]) -> WorkerPool:
    """A WorkerPool shared by a module's tests; parametrize it indirectly with the world size.

    `@pytest.mark.parametrize("dist_pool", [4, 8], indirect=True)`. Each size starts once per
    module, however many parametrize marks name it (pytest would restart a parametrized
    module-scoped fixture whenever the parameter's position changes).
    """
    world_size = getattr(request, "param", None)
    if world_size is None:
        pytest.fail('dist_pool needs a world size: @pytest.mark.parametrize("dist_pool", [4], indirect=True)')
    if world_size not in _module_dist_pools:
        _module_dist_pools[world_size] = WorkerPool(world_size)
    return _module_dist_pools[world_size]


@pytest.fixture
def load_script() -> Callable[[str], ModuleType]:
    """Imports `scripts/<name>.py` (the scripts are not a package) as a module."""

    def load(name: str) -> ModuleType:
        path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
