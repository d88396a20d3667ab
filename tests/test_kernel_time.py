"""Per-rank work of every method, as timed by the GPU check, covers exactly the causal pairs."""
from __future__ import annotations

import random

import pytest
import torch

from megatron_sap.bench.kernel_time import query_runs, rank_work, time_work
from sap_cases import random_cu_seqlens


def total_pairs(cu: list[int]) -> int:
    return sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu, cu[1:]))


@pytest.mark.parametrize("method, world, inner", [("sap", 4, 1), ("sap", 4, 2), ("p2p", 4, 1), ("all_gather", 4, 1), ("a2a", 4, 1), ("a2a+p2p", 4, 2)])
def test_rank_work_covers_every_causal_pair_once(method, world, inner):
    cu = random_cu_seqlens(random.Random(world + inner), 4 * 96, "mixture")
    work = rank_work(method, cu, world, inner)
    assert len(work) == world
    assert sum(w.pairs * w.head_fraction for w in work) == pytest.approx(total_pairs(cu))


def test_query_runs_split_at_documents_and_gaps():
    cu = [0, 3, 10]
    runs = query_runs(torch.tensor([0, 1, 2, 3, 4, 7, 8, -1]), cu)
    assert runs == ((0, 0, 3), (3, 3, 5), (3, 7, 9))


def test_time_work_runs_on_cpu():
    cu = [0, 50, 64]
    (work,) = rank_work("sap", cu, 1)
    forward, backward = time_work(work, 4, 2, 16, device="cpu", dtype=torch.float32, repeats=1)
    assert forward > 0 and backward > 0
