"""Split a packed micro-batch across the CP ranks the way SAP lays tokens out, and reduce its loss.

Megatron's own split (`get_thd_batch_on_this_cp_rank`) pads every document to a multiple of 2*CP
and deals zigzag chunks; SAP instead gives each rank the positions `plan.local_indices(cp_rank)`
of one plan computed from the global `cu_seqlens`. The same plan is what every attention layer
looks up, so the batch split and the layers always agree.
"""
from __future__ import annotations

import operator
from contextlib import contextmanager
from typing import Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

import megatron_sap as sap
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_sap.attention import announce_failure, last_softmax_scale, tell_peers_of_failure, verify_plan_agreement
from megatron_sap.validation import cu_seqlens_to_list

from .groups import _sap_groups, host_twin, sap_groups_from_parallel_state
from .options import get_sap_options
from .plans import plan_for, planning_cache
from .rope import install_sap_rope, register_token_positions
from .summary import record_plan, summary_wanted

GroupsLike = Union[None, dist.ProcessGroup, "sap.SAPGroups"]


def resolve_groups(cp_group: GroupsLike) -> Optional["sap.SAPGroups"]:
    """SAPGroups from an explicit SAPGroups, a CP process group, or Megatron's parallel state.

    A process group that is Megatron's CP group picks up its hierarchical [inner, outer] groups;
    any other process group is used flat. None means parallel_state's groups when Megatron is
    initialized, else a single rank.
    """
    if isinstance(cp_group, sap.SAPGroups):
        return cp_group if cp_group.world_size > 1 else None
    if cp_group is not None and not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"cp_group must be a CP process group, SAPGroups or None, got {type(cp_group).__name__}")
    megatron_ready = parallel_state.model_parallel_is_initialized()
    if cp_group is None:
        return sap_groups_from_parallel_state() if megatron_ready else None
    if megatron_ready and cp_group is parallel_state.get_context_parallel_group():
        return sap_groups_from_parallel_state()
    return _sap_groups(cp_group, None)


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Tensor:
    """Document boundaries of a packed [1, T] row whose position ids restart at 0 per document.

    Megatron's GPT datasets with `--reset-position-ids` produce such rows; this recovers the
    `cu_seqlens` the THD path needs from them.
    """
    if position_ids.dim() != 2 or position_ids.size(0) != 1:
        raise ValueError(f"position_ids must be [1, T] (micro-batch size 1), got shape {tuple(position_ids.shape)}")
    row = position_ids[0]
    if row.numel() == 0:
        raise ValueError("position_ids is an empty row (0 tokens)")
    starts = torch.nonzero(row == 0, as_tuple=False).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("position_ids must start a document (position 0) at token 0")
    total = torch.tensor([row.numel()], device=row.device, dtype=starts.dtype)
    return torch.cat([starts, total]).to(torch.int32)


def without_trailing_empty(documents: list[int]) -> list[int]:
    """`documents` (cu_seqlens) without the documents of no tokens at the end of the row: SFT rows
    from Megatron-LM core_v0.19 pad their cu_seqlens to the row length plus one entries with
    repeats of the row length (for collation). They hold nothing, and a 128K-token row planned
    with them (131,073 entries) takes about 0.2 s instead of a few ms."""
    end = len(documents)
    while end > 2 and documents[end - 2] == documents[end - 1]:
        end -= 1
    return documents if end == len(documents) else documents[:end]


def _as_cu_seqlens(cu_seqlens: Union[Tensor, list[int]], total_tokens: Optional[int],
                   device: torch.device) -> tuple[Tensor, list[int]]:
    """A validated 1-D int32 tensor on `device` and its values, without the documents of no tokens
    at the end of the row (`without_trailing_empty`); a [1, n] row (Megatron's data loaders) is
    accepted. Values given on the host go to the device without waiting for it. `total_tokens`:
    the batch length they must end at (None: not checked)."""
    if isinstance(cu_seqlens, Tensor) and cu_seqlens.dim() == 2 and cu_seqlens.size(0) == 1:
        cu_seqlens = cu_seqlens[0]
    values = without_trailing_empty(cu_seqlens_to_list(cu_seqlens))
    if total_tokens is not None and values[-1] != total_tokens:
        raise ValueError(f"cu_seqlens must end at the batch length {total_tokens}, got {values[-1]}")
    return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True), values


PACKING_KEYS = frozenset({"cu_seqlens", "cu_seqlens_padded", "max_seqlen"})  # batch entries that describe the packing
PLAN_KEY = "sap_plan"  # the entry a `loader.PlannedDataset` sample carries its pickled plan in


def _is_token_tensor(key: str, value: object) -> bool:
    """Whether a batch entry is one of the [1, T] tensors the split slices: not the packing
    entries, the mask, nor a sample's metadata of at most one element (a blend's `dataset_id`,
    which Megatron-LM's get_batch keeps from core_v0.18)."""
    return (isinstance(value, Tensor) and key not in ("attention_mask", PLAN_KEY) and key not in PACKING_KEYS
            and not (value.dim() < 2 and value.numel() <= 1))


def sap_split_batch(
    batch: Mapping[str, Optional[Tensor]],
    cu_seqlens: Union[Tensor, list[int]],
    cp_group: GroupsLike = None,
) -> tuple[dict[str, Optional[Tensor]], PackedSeqParams]:
    """This CP rank's share of a packed [1, T] batch, plus the PackedSeqParams the layers need.

    Every [1, T] tensor (tokens, labels, loss_mask, ...) is sliced to the plan's local positions
    ([1, T/P], in plan order); `position_ids` becomes each token's position inside its own document;
    `attention_mask` becomes None (documents come from cu_seqlens). The PackedSeqParams holds the
    global cu_seqlens (qkv_format "thd"; without documents of no tokens at the end of the row,
    such as the padding of SFT rows) and the longest document length. The SAP-aware RoPE is
    installed and told the per-token positions, keyed by the returned cu_seqlens tensor. The
    packing entries Megatron's THD batches carry (`cu_seqlens`, `cu_seqlens_padded`,
    `max_seqlen`), a sample's one-element metadata (a blend's `dataset_id`) and entries that
    are not tensors come back unchanged, as Megatron's own
    `get_thd_batch_on_this_cp_rank` leaves them. The plan a `PlannedDataset` sample carries
    (entry `sap_plan`, from the data loader's workers) goes to the plan cache
    (`adopt_loader_plan`) where it is this row's for this layout, and is left out of the
    result. `cu_seqlens` as a list of ints (read on the
    host, as the hooks read them from the data loader's CPU copy) is planned from without a
    device read; a device tensor is read back, which waits for the GPU. A rank whose batch is
    invalid raises its own error, and the other CP ranks, in the agreement check, an error
    naming it (with `check_agreement` on: the check is the split's only collective).
    """
    groups = resolve_groups(cp_group)
    with _failures_told_to_peers(groups):
        if not isinstance(batch, Mapping):
            raise TypeError(f"batch must be a mapping of names to [1, T] tensors (the batch dict), "
                            f"got {type(batch).__name__}")
        lengths = {key: value.shape for key, value in batch.items() if _is_token_tensor(key, value)}
        if not lengths:
            raise ValueError("batch holds no tensors to split")
        for key, shape in lengths.items():
            if len(shape) != 2 or shape[0] != 1:
                raise ValueError(f"batch[{key!r}] must be [1, T] (packed, micro-batch size 1), got {tuple(shape)}")
        total = {shape[1] for shape in lengths.values()}
        if len(total) != 1:
            raise ValueError(f"batch tensors disagree on the packed length: { {k: s[1] for k, s in lengths.items()} }")
        device = next(value.device for key, value in batch.items() if key in lengths)
        cu, values = _as_cu_seqlens(cu_seqlens, total.pop(), device)
        if PLAN_KEY in batch:
            from .loader import adopt_loader_plan, loader_plan_bytes  # loader imports this module

            adopt_loader_plan(loader_plan_bytes(batch), values, groups)
        plan = _plan_this_rank(cu, values, groups, summarise=True)
    indices, positions, params = _use_plan(plan, cu, values, groups, device)
    local: dict[str, Optional[Tensor]] = {}
    for key, value in batch.items():
        if key == PLAN_KEY:
            continue
        if key == "attention_mask" or value is None:
            local[key] = None
        elif not _is_token_tensor(key, value):
            local[key] = value
        elif key == "position_ids":
            local[key] = positions.to(value.dtype).unsqueeze(0)
        else:
            local[key] = value[:, indices]
    return local, params


def sap_packed_seq_params(documents: Union[list[int], Tensor], device: torch.device,
                          cp_group: GroupsLike = None) -> PackedSeqParams:
    """The PackedSeqParams of a packed row whose documents are `documents` (its cu_seqlens,
    best on the host: a device tensor is read back), for a rank that holds none of its
    tensors: a pipeline stage between the first and the last, whose input is the previous
    stage's output, already in the plan's token order. The same plan, agreement check and
    RoPE positions as `sap_split_batch` of that row."""
    groups = resolve_groups(cp_group)
    with _failures_told_to_peers(groups):
        cu, values = _as_cu_seqlens(documents, None, device)
        plan = _plan_this_rank(cu, values, groups)
    return _use_plan(plan, cu, values, groups, device)[2]


@contextmanager
def _failures_told_to_peers(groups: Optional["sap.SAPGroups"]) -> Iterator[None]:
    """Where the agreement check runs, an error raised in the block (this rank's batch or
    cu_seqlens is invalid, its plan cannot be made) is first announced in that check, which
    the other CP ranks are about to run: they raise at once, naming this rank, instead of
    waiting for its hash until the group's timeout. Then the error itself is raised."""
    try:
        yield
    except Exception as error:
        if groups is not None and get_sap_options().check_agreement:
            tell_peers_of_failure(error, lambda: announce_failure(groups, over=host_twin(groups.cp_group)))
        raise


def _plan_this_rank(cu: Tensor, values: list[int], groups: Optional["sap.SAPGroups"],
                    summarise: bool = False) -> "sap.Plan":
    """The plan of the row `cu` (`values` its cu_seqlens on the host); with `summarise` (a
    batch split), counted for the log line (`--sap-log-interval`)."""
    world = 1 if groups is None else groups.world_size
    if values[-1] % world:
        raise ValueError(f"packed length {values[-1]} is not divisible by the CP size {world}; pad the batch")
    # Once per micro-batch, where its batch is split (model chunks that read no data come here too):
    # whether its plan is made here or found in the cache.
    counting = summarise and summary_wanted()
    misses = planning_cache().misses if counting else 0
    plan = plan_for(cu, groups, values)
    if counting:
        record_plan(plan, made_here=planning_cache().misses > misses)
    return plan


def _use_plan(plan: "sap.Plan", cu: Tensor, values: list[int], groups: Optional["sap.SAPGroups"],
              device: torch.device) -> tuple[Tensor, Tensor, PackedSeqParams]:
    """This rank's (local indices, in-document positions, PackedSeqParams) of `plan`, the
    plan checked to be the other CP ranks' and its positions registered for the SAP RoPE."""
    options = get_sap_options()
    if groups is not None and options.check_agreement:
        # every micro-batch: cheap, and it also catches stale cached plans; with the model's
        # attention shape and dtype where the flags gave them, the layers need no check of their own
        shape = options.model_shape
        shape = None if shape is None or options.attention_dtype is None else (*shape[:3], options.attention_dtype)
        # the layers' softmax scale as last seen (the default before any): a model with a scale
        # of its own then adds no check after the first micro-batch
        verify_plan_agreement(plan, groups, options.recompute_kv, shape, over=host_twin(groups.cp_group),
                              softmax_scale=last_softmax_scale(groups))
    cp_rank = 0 if groups is None else groups.cp_rank
    indices = plan.local_indices(cp_rank).to(device, non_blocking=True)
    positions = plan.position_ids(cp_rank).to(device, non_blocking=True)
    install_sap_rope()
    register_token_positions(cu, positions)
    max_seqlen = max(map(operator.sub, values[1:], values))
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
    return indices, positions, params


def sap_loss(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    cp_group: GroupsLike = None,
) -> tuple[Tensor, Tensor]:
    """Token-mean loss of the whole packed row from this rank's share.

    Returns `(loss, mean)`. `loss` = local masked sum / global masked count: its gradients summed
    over the CP ranks (as a SUM all-reduce over data-parallel-with-CP does) equal the CP=1
    gradient of the mean; with an averaging all-reduce multiply it by the CP size. `mean` is the
    detached global mean (the same on every CP rank), the number to log.
    """
    if per_token_loss.shape != loss_mask.shape:
        raise ValueError(f"per-token loss {tuple(per_token_loss.shape)} and loss mask {tuple(loss_mask.shape)} differ")
    # In fp32 at least (as Megatron's loss functions): fp16 overflows and bf16 rounds a
    # 128K-token row's sums and counts.
    dtype = torch.promote_types(per_token_loss.dtype, torch.float32)
    mask = loss_mask.to(dtype)
    local_sum = (per_token_loss.to(dtype) * mask).sum()
    totals = torch.stack([local_sum.detach(), mask.sum()])
    groups = resolve_groups(cp_group)
    if groups is not None:
        dist.all_reduce(totals, group=groups.cp_group)
    count = totals[1].clamp(min=1)
    return local_sum / count, totals[0] / count
