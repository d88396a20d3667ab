"""The SAP line in the training log (`--sap-log-interval`, megatron_sap.megatron.summary)."""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_sap as sap  # noqa: E402
from megatron_sap.megatron import sap_packed_seq_params, sap_split_batch  # noqa: E402
from megatron_sap.megatron.arguments import add_sap_args, chain_args_providers, sap_settings_from_args  # noqa: E402
from megatron_sap.megatron.options import reset_sap_options, set_sap_options  # noqa: E402
from megatron_sap.megatron.summary import PlanSummary, record_plan, reset_summary  # noqa: E402

LOGGER = "megatron_sap.megatron.summary"
ROWS = ([0, 3000, 3100, 3101, 5000, 8192], [0, 8192], [0, 100, 8192], [0, 4096, 8192])


@pytest.fixture(autouse=True)
def _fresh():
    reset_summary()
    yield
    reset_summary()
    reset_sap_options()


def test_summary_numbers_are_the_plans_own() -> None:
    """Each figure of the line is the mean (and worst) over the recorded plans of what
    `plan.stats()` reports for them: the planner's estimate over the ideal, the pair
    imbalance, and the forward K/V received over what a KV ring over the outer groups sends."""
    summary = PlanSummary()
    plans = [sap.plan_sequences(cu, outer_size=4, inner_size=2, cache=None) for cu in ROWS]
    for made_here, plan in zip((True, False, True, True), plans):
        summary.record(plan, made_here)
    stats = [plan.stats() for plan in plans]
    over_ideal = [s["planner_estimate_s"] / s["ideal_time_s"] for s in stats]
    imbalance = [s["imbalance"] for s in stats]
    ring = [sum(s["recv_tokens_per_outer_rank"]) / (3 * 8192) for s in stats]
    assert summary.over_ideal == pytest.approx(over_ideal) and summary.imbalance == pytest.approx(imbalance)
    assert summary.ring_share == pytest.approx(ring) and max(ring) > 0
    line = summary.line()
    assert line.startswith(f"megatron-sap: last 4 micro-batches (2 x 4): the planner's attention time "
                           f"{sum(over_ideal) / 4:.2f}x the ideal (worst {max(over_ideal):.2f}x), pair imbalance "
                           f"{sum(imbalance) / 4:.3f} (worst {max(imbalance):.3f}), K/V moved between outer groups "
                           f"{100 * sum(ring) / 4:.1f}% of a KV ring's (most {100 * max(ring):.1f}%)")
    assert "plans made in this process 3 of 4" in line
    summary.reset()
    summary.record(plans[0], False)
    assert "last 1 micro-batches" in summary.line() and "plans made in this process 0 of 1" in summary.line()


def test_the_batch_split_logs_every_interval_on_rank_0(caplog) -> None:
    """With log_interval N the batch split logs one line per N micro-batches (none without it);
    a one-rank split has no K/V to move and says nothing of it."""
    from megatron_sap.planning.plan import DEFAULT_CACHE

    caplog.set_level(logging.INFO, logger=LOGGER)
    DEFAULT_CACHE.clear()  # the rows planned by other tests of this process would be hits
    tokens = torch.arange(8192).unsqueeze(0)
    sap_split_batch({"tokens": tokens}, ROWS[0])
    assert not [r for r in caplog.records if r.name == LOGGER]
    set_sap_options(log_interval=3)
    for i in range(7):
        sap_split_batch({"tokens": tokens}, ROWS[i % len(ROWS)])
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2 and all(line.startswith("megatron-sap: last 3 micro-batches (1 x 1)") for line in lines)
    assert not any("K/V moved" in line for line in lines)
    # rows 0, 1, 2 then 3, 0, 1: row 0 was split (and planned) before the interval was set
    assert "plans made in this process 2 of 3" in lines[0] and "plans made in this process 1 of 3" in lines[1]
    for _ in range(3):  # a model chunk that reads no data (a middle pipeline stage) does not count the micro-batch again
        sap_packed_seq_params(ROWS[1], torch.device("cpu"))
    sap_split_batch({"tokens": tokens}, ROWS[0])
    sap_split_batch({"tokens": tokens}, ROWS[1])
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 3 and lines[2].startswith("megatron-sap: last 3 micro-batches (1 x 1)")


def test_other_ranks_log_nothing(caplog, monkeypatch) -> None:
    from megatron_sap.megatron import summary

    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setattr(summary.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(summary.dist, "get_rank", lambda: 1)
    set_sap_options(log_interval=1)
    record_plan(sap.plan_sequences(ROWS[0], outer_size=2), True)
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_the_flag_sets_the_interval_and_refuses_a_negative_one() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser = chain_args_providers(None, add_sap_args)(parser)
    assert sap_settings_from_args(parser.parse_args([])).options.log_interval == 0
    assert sap_settings_from_args(parser.parse_args(["--sap-log-interval", "100"])).options.log_interval == 100
    with pytest.raises(ValueError, match="log_interval must be >= 0"):
        sap_settings_from_args(parser.parse_args(["--sap-log-interval", "-1"]))
