"""Plans made in the data loader's worker processes, ahead of the training loop.

`PlannedDataset` wraps a Megatron dataset: each sample gets its SAP plan, made from the row's
documents (read from the sample's CPU tensors) for this rank's layout and cost model, with this
rank's program compiled, and pickled into a uint8 tensor under `PLAN_KEY`. The loader's workers
make it while the training process runs earlier micro-batches; the batch hook
(`hooks.wrap_get_batch_on_this_tp_rank`) hands it to the plan cache (`adopt_loader_plan`), where
the batch split and the layers find it. A plan made for another layout, cost model or row is
not used: the training process then plans the row itself.
"""
from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch.utils.data import Dataset

import megatron_sap as sap

from .batch import PLAN_KEY, GroupsLike, cu_seqlens_from_position_ids, resolve_groups, without_trailing_empty
from .options import get_sap_options
from .plans import adopt_plan, planning_cost_model, sap_levels

logger = logging.getLogger(__name__)


def host_boundaries(sample: Any, reset_position_ids: bool, from_device: bool = False) -> Optional[list[int]]:
    """The documents of a micro-batch as the data loader gave it, read from its host (CPU)
    tensors: its `cu_seqlens`, else the restarts of its position ids, else the whole row (as
    `hooks.row_cu_seqlens` finds them on the device). None where the sample is not one row
    ([1, S], or [S] before the loader collates it) of CPU tensors: then the split reads them
    from the device. `from_device`: tensors on a device are read too (which waits for it)."""

    def readable(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (from_device or t.device.type == "cpu")

    if not isinstance(sample, Mapping):
        return None
    tokens = sample.get("tokens")
    if not readable(tokens) or tokens.dim() not in (1, 2):
        return None
    if tokens.dim() == 2 and tokens.size(0) != 1:
        return None
    given = sample.get("cu_seqlens")
    if given is not None:
        if not readable(given):
            return None
        return without_trailing_empty(given.flatten().tolist())
    if not reset_position_ids:
        return [0, tokens.numel()]
    positions = sample.get("position_ids")
    if not readable(positions) or positions.numel() != tokens.numel():
        return None
    return cu_seqlens_from_position_ids(positions.reshape(1, -1)).tolist()


@dataclass(frozen=True)
class LoaderPlanning:
    """What a worker needs to plan a row as this training rank would."""

    outer_size: int
    inner_size: int
    cost_model: "sap.CostModel"
    outer_rank: int
    schedule: str
    recompute_kv: bool
    reset_position_ids: bool
    choose_by: str = "estimate"

    def plan(self, sample: Mapping[str, Any]) -> Optional["sap.Plan"]:
        """The sample's plan with this rank's program compiled; None where its documents are
        not on the host (`host_boundaries`)."""
        documents = host_boundaries(sample, self.reset_position_ids)
        if documents is None:
            return None
        plan = sap.plan_sequences(documents, outer_size=self.outer_size, inner_size=self.inner_size,
                                  cost_model=self.cost_model, cache=None, choose_by=self.choose_by)
        plan.program(self.outer_rank, schedule=self.schedule, recompute_kv=self.recompute_kv)
        plan.group_indices(self.outer_rank)  # the batch split's indices, made once
        return plan


class PlannedDataset(Dataset):
    """`dataset` whose samples carry their SAP plan (`PLAN_KEY`), made where the sample is made:
    in the data loader's worker processes. Other attributes are the dataset's (Megatron's
    samplers read some)."""

    def __init__(self, dataset: Any, planning: LoaderPlanning) -> None:
        self.dataset, self.planning = dataset, planning

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        dataset = self.__dict__.get("dataset")  # absent while unpickling (a spawned worker)
        if dataset is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(dataset, name)

    def __getitem__(self, index: Any) -> Any:
        sample = self.dataset[index]
        plan = self.planning.plan(sample) if isinstance(sample, Mapping) else None
        if plan is None:
            return sample
        data = bytearray(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
        return {**sample, PLAN_KEY: torch.frombuffer(data, dtype=torch.uint8)}


def loader_plan_bytes(sample: Any) -> Optional[bytes]:
    """The pickled plan a loader's sample (or collated micro-batch) carries, if any."""
    data = sample.get(PLAN_KEY) if isinstance(sample, Mapping) else None
    if not isinstance(data, torch.Tensor) or data.device.type != "cpu" or data.dtype != torch.uint8:
        return None
    if data.dim() == 2 and data.size(0) == 1:  # collated: one row per micro-batch
        data = data[0]
    return data.numpy().tobytes() if data.dim() == 1 else None


def adopt_loader_plan(data: Optional[bytes], documents: Optional[list[int]],
                      cp_group: GroupsLike = None) -> Optional["sap.Plan"]:
    """The plan a worker made, put where `plans.plan_for` finds it, if it is the plan of this
    row (`documents`) for the layout of `cp_group` (as `sap_split_batch` takes it; None:
    Megatron's parallel state) and this process's cost model; else None (planned here)."""
    global _refusal_logged
    if data is None or documents is None:
        return None
    known = _ADOPTED.get(id(data))
    plan = known[1] if known is not None and known[0] is data else pickle.loads(data)
    if (isinstance(plan, sap.Plan) and list(plan.cu_seqlens) == documents
            and (plan.inner_size, plan.outer_size) == sap_levels(resolve_groups(cp_group)) and adopt_plan(plan)):
        _ADOPTED[id(data)] = (data, plan)  # the bytes held, so that no other object takes their identity
        while len(_ADOPTED) > ADOPTED_KEPT:
            del _ADOPTED[next(iter(_ADOPTED))]
        return plan
    if not _refusal_logged:  # the workers plan for nothing: worth seeing once
        _refusal_logged = True
        logger.warning("megatron-sap: a plan made in the data loader's workers does not fit this micro-batch (another "
                       "row, SAP layout, cost model, load slacks or --sap-choose-by); such rows are planned in the training process")
    return None


_refusal_logged = False
# The plans last adopted, by their bytes: the model chunks of a pipeline stage that read no data
# adopt each micro-batch's plan from the same bytes, unpickled once (in a virtual pipeline the
# chunks take a few micro-batches in turn).
ADOPTED_KEPT = 8
_ADOPTED: dict[int, tuple[bytes, "sap.Plan"]] = {}


def loader_planning(reset_position_ids: bool) -> LoaderPlanning:
    """How this training rank plans (its SAP groups, one rank before Megatron's exist; the SAP
    options), for the loader's workers: called where the data loader is built, after both."""
    groups = resolve_groups(None)
    options = get_sap_options()
    inner, outer, rank = (1, 1, 0) if groups is None else (groups.inner_size, groups.outer_size, groups.outer_rank)
    return LoaderPlanning(outer, inner, planning_cost_model(), rank, options.schedule, options.recompute_kv,
                          reset_position_ids, options.choose_by)
