"""Shared pytest fixtures: `dist_pool`, a module-scoped pool of gloo workers (see dist_pool.py)."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Workers unpickle jobs by module name, so dist_pool and the test modules must be importable by
# their plain names in every import mode, not only pytest's default `prepend`.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from dist_pool import WorkerPool  # noqa: E402


@pytest.fixture(scope="module")
def dist_pool(request: pytest.FixtureRequest) -> Iterator[WorkerPool]:
    """A WorkerPool shared by a module's tests; parametrize it indirectly with the world size.

    `@pytest.mark.parametrize("dist_pool", [4, 8], indirect=True)`: pytest groups the tests by
    size, so each size starts once per module.
    """
    world_size = getattr(request, "param", None)
    if world_size is None:
        pytest.fail('dist_pool needs a world size: @pytest.mark.parametrize("dist_pool", [4], indirect=True)')
    with WorkerPool(world_size) as pool:
        yield pool
