"""A periodic line in the training log about the plans SAP trains with (`--sap-log-interval`).

Every `log_interval` micro-batches, global rank 0 logs what the plans of its last micro-batches
look like under the cost model: the attention layer's time as the planner estimates it
(`plan.stats()["planner_estimate_s"]`; the joint schedule of every rank's program, which
`stats()` also times, would cost a compile per rank) over the ideal (every document whole,
spread evenly, no communication), the attention-pair imbalance (the busiest
outer rank over the mean), the forward K/V moved between outer groups as a share of what a
KV ring over them sends (padding aside), the candidates chosen most, and how many plans the
training process made itself (the others came from the data loader's workers, or were rows
seen before, through the plan cache). Everything comes from the plans' evaluations, which
compiling a plan's program computes anyway: nothing is read from the GPU.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch.distributed as dist

import megatron_sap as sap

from .options import get_sap_options

logger = logging.getLogger(__name__)


class PlanSummary:
    """The plans of the micro-batches since the last line (`record`, `line`)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.over_ideal: list[float] = []
        self.imbalance: list[float] = []
        self.ring_share: list[float] = []
        self.candidates: Counter[str] = Counter()
        self.layouts: Counter[tuple[int, int]] = Counter()
        self.made_here = 0

    def record(self, plan: "sap.Plan", made_here: bool) -> None:
        """Count one micro-batch's plan; `made_here`: planned in this process (not found in the plan cache)."""
        evaluation = plan.evaluation
        self.over_ideal.append(evaluation.makespan_s / evaluation.ideal_s if evaluation.ideal_s > 0 else 1.0)
        pairs = evaluation.exact_pairs
        mean = float(pairs.mean())
        self.imbalance.append(float(pairs.max()) / mean if mean > 0 else 1.0)
        if plan.outer_size > 1:
            self.ring_share.append(evaluation.traffic_total / ((plan.outer_size - 1) * plan.total_tokens))
        self.candidates[plan.placement.strategy] += 1
        self.layouts[plan.inner_size, plan.outer_size] += 1
        self.made_here += bool(made_here)

    def line(self) -> str:
        """One log line about the micro-batches recorded since the last reset."""
        n = len(self.over_ideal)
        layouts = ", ".join(f"{u} x {r}" for u, r in self.layouts)
        text = (f"megatron-sap: last {n} micro-batches ({layouts}): the planner's attention time "
                f"{sum(self.over_ideal) / n:.2f}x the ideal (worst {max(self.over_ideal):.2f}x), pair imbalance "
                f"{sum(self.imbalance) / n:.3f} (worst {max(self.imbalance):.3f})")
        if self.ring_share:
            text += (f", K/V moved between outer groups {100 * sum(self.ring_share) / len(self.ring_share):.1f}% "
                     f"of a KV ring's (most {100 * max(self.ring_share):.1f}%)")
        chosen = ", ".join(f"{name} {count}" for name, count in self.candidates.most_common(2))
        return text + f"; plans made in this process {self.made_here} of {n}; chosen: {chosen}"


_SUMMARY = PlanSummary()


def summary_wanted() -> bool:
    """Whether this process logs the summary: a log interval set, and global rank 0."""
    return get_sap_options().log_interval > 0 and not (dist.is_initialized() and dist.get_rank() != 0)


def record_plan(plan: "sap.Plan", made_here: bool) -> None:
    """Count this micro-batch's plan (`made_here`: planned in this process) and, every
    `log_interval` micro-batches (the SAP options), log the summary line (`summary_wanted`)."""
    if not summary_wanted():
        return
    _SUMMARY.record(plan, made_here)
    if len(_SUMMARY.over_ideal) >= get_sap_options().log_interval:
        logger.info(_SUMMARY.line())
        _SUMMARY.reset()


def reset_summary() -> None:
    """Forget the micro-batches counted so far (tests)."""
    _SUMMARY.reset()
