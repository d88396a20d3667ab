"""Per-rank work of every method, as timed by the GPU check, covers exactly the causal pairs."""
from __future__ import annotations

import random
from bisect import bisect_right
from itertools import accumulate

import pytest
import torch

from megatron_sap.bench.kernel_time import RankWork, fit_calibration, modelled_pairs, query_runs, rank_work, time_work
from megatron_sap.planning import CostModel
from sap_cases import random_cu_seqlens


def total_pairs(cu: list[int]) -> int:
    return sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu, cu[1:]))


@pytest.mark.parametrize("method, world, inner", [("sap", 4, 1), ("sap", 4, 2), ("p2p", 4, 1), ("all_gather", 4, 1), ("a2a", 4, 1), ("a2a+p2p", 4, 2)])
def test_rank_work_covers_every_causal_pair_once(method, world, inner):
    cu = random_cu_seqlens(random.Random(world + inner), 4 * 96, "mixture")
    work = rank_work(method, cu, world, inner)
    assert len(work) == world
    assert sum(w.pairs * w.head_fraction for w in work) == pytest.approx(total_pairs(cu))
    # Each run's queries attend to every key of their own document up to themselves: every
    # query row is computed once over all the heads (the ranks' head fractions add up to 1).
    cover = torch.zeros(cu[-1], dtype=torch.float64)
    for w in work:
        for doc_start, start, end in w.runs:
            doc = bisect_right(cu, start) - 1
            assert cu[doc] == doc_start and start < end <= cu[doc + 1], (doc_start, start, end)
            cover[start:end] += w.head_fraction
    assert torch.allclose(cover, torch.ones_like(cover)), cover


def test_query_runs_split_at_documents_and_gaps():
    cu = [0, 3, 10]
    runs = query_runs(torch.tensor([0, 1, 2, 3, 4, 7, 8, -1]), cu)
    assert runs == ((0, 0, 3), (3, 3, 5), (3, 7, 9))


def test_time_work_times_the_ranks_work_in_one_call_each(monkeypatch):
    """Each timed call is the rank's whole work: one causal varlen call whose segments are
    its query runs against every key of their document up to their end, on its share of
    the heads; the forward once more than timed (its output feeds the backward)."""
    from megatron_sap.bench import kernel_time

    cu = random_cu_seqlens(random.Random(2), 4 * 96, "mixture")
    work = rank_work("sap", cu, 4, 2)[1]
    calls = {"forward": [], "backward": []}

    def recorder(name, kernel):
        def record(*args, **kwargs):
            q, k = (args[0], args[1]) if name == "forward" else (args[1], args[2])
            cu_q, cu_k = (args[3], args[4]) if name == "forward" else (args[6], args[7])
            calls[name].append((q.shape[1], k.shape[1], cu_q.tolist(), cu_k.tolist(), kwargs["causal"]))
            return kernel(*args, **kwargs)
        return record

    monkeypatch.setattr(kernel_time, "varlen_forward", recorder("forward", kernel_time.varlen_forward))
    monkeypatch.setattr(kernel_time, "varlen_backward", recorder("backward", kernel_time.varlen_backward))
    forward, backward = time_work(work, 8, 4, 16, device="cpu", dtype=torch.float32, repeats=2)
    assert forward > 0 and backward > 0
    assert len(calls["forward"]) == 3 and len(calls["backward"]) == 2
    q_lengths = [e - s for _, s, e in work.runs]
    k_lengths = [e - d for d, _, e in work.runs]
    expected = (4, 2, [0, *accumulate(q_lengths)], [0, *accumulate(k_lengths)], True)
    assert work.head_fraction == 0.5 and all(call == expected for call in calls["forward"] + calls["backward"])
    assert sum(q * (2 * k - q + 1) // 2 for q, k in zip(q_lengths, k_lengths)) == work.pairs


def test_modelled_pairs_round_each_run_to_tiles():
    model = CostModel.preset("h100", tile=4)
    # queries 5..9 of a document from 0: keys 0..4 full (2 x 2 tiles), diagonal 5x5 (3 tiles); a 3-token doc: 1 tile
    work = RankWork(((0, 5, 10), (10, 10, 13)), head_fraction=0.5)
    assert modelled_pairs(work, model) == 0.5 * 16 * (4 + 3 + 1)


def test_calibration_recovers_the_rates_that_made_the_times():
    truth = CostModel.preset("h200", attention_tflops=123.0, backward_factor=2.7)
    cu = random_cu_seqlens(random.Random(5), 8 * 512, "mixture")
    samples = []
    for method in ("sap", "p2p", "all_gather"):
        for work in rank_work(method, cu, 8, cost_model=truth):
            forward = truth.compute_seconds(modelled_pairs(work, truth))
            samples.append((work, forward, forward * 2.7))
    fit = fit_calibration(samples, CostModel.preset("h200"))
    assert fit["cost_model"]["attention_tflops"] == pytest.approx(123.0)
    assert fit["cost_model"]["backward_factor"] == pytest.approx(2.7)
    assert max(abs(e) for e in fit["relative_error"].values()) < 1e-9
    assert CostModel.from_calibration(fit).attention_tflops == pytest.approx(123.0)
    slow_rank = [(samples[0][0], samples[0][1] * 2, samples[0][2] * 2), *samples[1:]]
    assert fit_calibration(slow_rank, CostModel.preset("h200"))["relative_error"]["min"] < -0.4
    with pytest.raises(ValueError, match="at least one rank"):
        fit_calibration([(samples[0][0], 0.0, 0.0)], truth)


def test_committed_calibration_loads():
    """docs/calibration.json, as the GPU check wrote it, is a file --sap-calibration-file takes."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "calibration.json"
    model = CostModel.from_calibration(path)
    assert model.name == "h200" and 50 < model.attention_tflops < 2000 and 1 < model.backward_factor < 5


def test_rank_seconds_times_each_methods_whole_op_on_cpu():
    from megatron_sap.bench.rank_memory import rank_seconds

    cu = [0, 100, 130, 900, 1024]
    for method, schedule in (("sap", "auto"), ("sap", "pipelined"), ("sap", "gathered"), ("p2p", "auto")):
        forward, backward = rank_seconds(method, cu, 4, 3, 4, 2, 16, schedule=schedule, repeats=1)
        assert forward > 0 and backward > 0
    with pytest.raises(ValueError, match="schedule"):
        rank_seconds("sap", cu, 4, 3, 4, 2, 16, schedule="zigzag", repeats=1)
    with pytest.raises(ValueError, match="'sap' or 'p2p'"):
        rank_seconds("a2a", cu, 4, 0, 4, 2, 16)
