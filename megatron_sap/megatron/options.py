"""Process-wide SAP settings chosen by command-line flags or by the caller.

Megatron builds core attention through a spec, so per-run settings (backend, cost model) cannot
travel through constructor arguments; they live here, set once by the launcher hooks
(`configure_sap`, from the `--sap-*` flags) or by a script (`set_sap_options`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_sap.attention import dtype_name
from megatron_sap.planning.cost_model import CostModel
from megatron_sap.planning.plan import check_choose_by
from megatron_sap.planning.program import SCHEDULES as PROGRAM_SCHEDULES
from megatron_sap.planning.program import check_schedule
from megatron_sap.validation import check_inner_chunks

BACKENDS = ("auto", "flash-attn", "aten-flash", "torch")  # megatron_sap.kernels backends
SCHEDULES = ("auto", *PROGRAM_SCHEDULES)  # sap_attention schedules


@dataclass(frozen=True)
class SAPOptions:
    """What SAP layers and the batch split use.

    backend: kernel choice handed to `sap_attention`.
    cost_preset / calibration_file: cost model the planner balances against (None: planner default).
    plan_cache_size: plans kept per process (None: planner default).
    check_agreement: verify every micro-batch (in the batch split) and on a plan's first use in a
        layer that all CP ranks planned the same batch (one small all-reduce); a mismatch would
        otherwise deadlock or corrupt attention.
    recompute_kv: fetch remote K/V again in backward instead of keeping it from forward.
    schedule: how a rank runs its program ("auto": one for every rank, `Plan.schedule`;
        "pipelined": each exchange's kernel calls overlap the next exchange; "gathered": each
        query piece once all its keys are in, as one kernel segment; see `sap_attention`).
    model_shape: (query heads, key/value heads, head dim, bytes per element) that one CP rank's
        attention computes (the model's heads over TP), which the cost model weighs; None: the
        preset's shape.
    attention_dtype: the dtype of the layers' attention inputs ("bfloat16", "float16", ...;
        a torch.dtype is taken by name). With `model_shape`, the batch split's agreement check
        covers the layers' own (shape and dtype), which then add none; None: the first layer
        checks them itself.
    gpus_per_node / tensor_parallel_size: the cost model takes gpus_per_node (None: the preset's)
        over the TP size as the CP ranks sharing a node (Megatron orders TP fastest), which
        decides the link class of each transfer.
    log_interval: every so many micro-batches global rank 0 logs a line about their plans
        (`megatron_sap.megatron.summary`); 0: never.
    choose_by: how the planner chooses among its candidates (`plan_sequences`): "estimate"
        (its own estimate, fast) or "timeline" (the near candidates compiled and timed, all
        ranks together: better plans where the estimate misleads, several times the
        planning time).
    inner_chunks: the Ulysses all-to-alls in that many head chunks under the kernels ("auto":
        the plan's choice, `Plan.inner_chunks`; see `sap_attention`).
    """

    backend: str = "auto"
    cost_preset: Optional[str] = None
    calibration_file: Optional[str] = None
    plan_cache_size: Optional[int] = None
    check_agreement: bool = True
    recompute_kv: bool = False
    schedule: str = "auto"
    model_shape: Optional[tuple[int, int, int, int]] = None
    attention_dtype: Optional[str] = None
    gpus_per_node: Optional[int] = None
    tensor_parallel_size: int = 1
    log_interval: int = 0
    choose_by: str = "estimate"
    inner_chunks: int | str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown SAP backend {self.backend!r}; choose from {BACKENDS}")
        check_schedule(self.schedule, allow_auto=True)
        if self.plan_cache_size is not None and self.plan_cache_size < 1:
            raise ValueError(f"plan_cache_size must be >= 1, got {self.plan_cache_size}")
        if self.cost_preset is not None and self.calibration_file is not None:
            raise ValueError("give either a SAP cost preset or a calibration file, not both")
        if self.cost_preset is not None:
            CostModel.preset(self.cost_preset)  # an unknown name fails here, not at the first batch
        if self.calibration_file is not None:
            CostModel.from_calibration(self.calibration_file)  # a bad file fails here, not at the first batch
        if self.model_shape is not None:
            object.__setattr__(self, "model_shape", tuple(self.model_shape))  # a cache key downstream
            if len(self.model_shape) != 4 or min(self.model_shape) < 1:
                raise ValueError(f"model_shape must be four positive integers (heads, kv heads, head dim, bytes), "
                                 f"got {self.model_shape}")
        if self.attention_dtype is not None:
            name = dtype_name(self.attention_dtype)
            if not isinstance(getattr(torch, name, None), torch.dtype) or not getattr(torch, name).is_floating_point:
                raise ValueError(f"attention_dtype must name a floating-point torch dtype (e.g. 'bfloat16'), "
                                 f"got {self.attention_dtype!r}")
            object.__setattr__(self, "attention_dtype", dtype_name(getattr(torch, name)))  # "half" -> "float16"
        check_choose_by(self.choose_by)
        check_inner_chunks(self.inner_chunks, self.recompute_kv)
        if self.log_interval < 0:
            raise ValueError(f"log_interval must be >= 0 (0: no SAP summary in the log), got {self.log_interval}")
        if (self.gpus_per_node is not None and self.gpus_per_node < 1) or self.tensor_parallel_size < 1:
            raise ValueError(f"gpus_per_node and tensor_parallel_size must be >= 1, got {self.gpus_per_node}, "
                             f"{self.tensor_parallel_size}")


_OPTIONS = SAPOptions()


def get_sap_options() -> SAPOptions:
    """The settings in force."""
    return _OPTIONS


def set_sap_options(**changes: Any) -> SAPOptions:
    """Replace some settings (unknown names raise TypeError) and return the new settings."""
    global _OPTIONS
    _OPTIONS = dataclasses.replace(_OPTIONS, **changes)
    return _OPTIONS


def reset_sap_options() -> None:
    """Back to the defaults (tests)."""
    global _OPTIONS
    _OPTIONS = SAPOptions()
