"""Hooks that make an unmodified Megatron-LM (core_v0.13 to core_v0.19) train with `--cp-comm-type sap`.

`install_training_hooks()` patches, before the training script runs:

* `megatron.training.pretrain`: the SAP flags are chained onto whatever `extra_args_provider`
  the script passes (core_v0.13 to v0.17; from core_v0.18 the script parses its args itself, and
  `megatron.training.arguments.parse_args` takes the flags instead).
* `parallel_state.initialize_model_parallel` (Megatron-LM looks it up through `mpu` at call
  time): with SAP on, CP = U*R is initialized with Megatron's hierarchical CP groups [U, R], the
  SAP options are applied, layer specs are switched to SAP core attention and the SAP RoPE is
  installed (all before `get_model()` builds anything).
* `megatron.training.training.build_pretraining_data_loader`: the loader's workers plan every
  sample (`loader.PlannedDataset`), ahead of the training loop.
* `get_batch_on_this_tp_rank` (Megatron-LM's `megatron.training.utils` up to core_v0.17,
  megatron-core's `megatron.core.utils` from core_v0.18): on the ranks that read the data (TP
  source), each micro-batch's documents (and the plan a loader worker made) are read from the
  data loader's host copy and sent to the other TP ranks host to host, so that the split plans,
  or finds the plan, without reading boundaries back from the GPU (`host_boundaries`); on the
  first pipeline stage they also go to the stages whose model chunks read no data
  (`stages.send_documents`). From core_v0.18 `pretrain_gpt.get_batch` moves the loader's
  micro-batch to the GPU in place before that call, so `pretrain` hands the schedules a forward
  step whose data iterator keeps a host copy (`wrap_forward_step`); a model chunk that takes the
  first stage's documents reads none there (SFT rows reach every chunk from core_v0.18).
* core_v0.16 and v0.17, whose `pretrain_gpt.get_batch` has a packed (THD) path:
  `get_batch_on_this_tp_rank` makes an unpacked micro-batch a packed one (documents from
  `--reset-position-ids` restarts, else the whole row) so that `get_batch` takes that path, and
  `megatron.core.utils.get_thd_batch_on_this_cp_rank`, its split, becomes `sap_split_batch`.
* core_v0.13 to v0.15 (`megatron.training.utils.get_batch_on_this_cp_rank`) and core_v0.18 on
  (`megatron.core.utils.get_batch_on_this_cp_rank`): the CP split becomes `sap_split_batch` over
  the same documents; core_v0.19's `flatten_batch_for_packed_sequences` is skipped with SAP on.
* `GPTModel.forward`: called on tokens the SAP split made, it takes that split's packed
  parameters (core_v0.13 to v0.15 pass none; core_v0.18 on pass their own, built from the row's
  `cu_seqlens`), and in a model chunk that `get_batch` gives nothing (middle pipeline stages,
  virtual pipeline chunks), those of the documents the first stage sends.
* `get_gpt_heterogeneous_layer_spec` (in megatron-core, before `pretrain_gpt.py` or Megatron-LM's
  `gpt_builders` binds it by name): heterogeneous specs name their core attention directly,
  bypassing the providers, so it is swapped afterwards.

A checkout with the batch functions in neither place is refused by name before anything is
patched (`compat.training_layout`). Every hook defers to Megatron's original unless the parsed
args ask for SAP (`pretrain` and `parse_args` only add the `--sap-*` flags to the parser).
"""
from __future__ import annotations

import functools
import inspect
import operator
import sys
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.weak import WeakTensorKeyDictionary

from .arguments import add_sap_args, chain_args_providers, flat_layout_hint, sap_requested, sap_settings_from_args
from .attention import refuse_unsupported_attention
from .batch import cu_seqlens_from_position_ids, resolve_groups, sap_packed_seq_params, sap_split_batch
from .compat import (TRAINING_LAYOUT_REFUSED, chunk_aware_get_batch, mtp_takes_packed_rows, packed_get_batch,
                     packed_rope_refusal, sft_split_on_every_stage, training_layout)
from .groups import prepare_pipeline_host_group, tensor_parallel_host_group
from .loader import PLAN_KEY, PlannedDataset, adopt_loader_plan, host_boundaries, loader_plan_bytes, loader_planning
from .rope import install_sap_rope
from .stages import documents_for, rank_reads_no_data, reads_no_data, send_documents
from .specs import swap_core_attention, use_sap_core_attention

_INSTALLED = False


def _megatron_args() -> Any:
    """Megatron-LM's parsed args (the hooks only run inside its training loop)."""
    from megatron.training import get_args

    return get_args()


def wrap_pretrain(pretrain: Callable, record_batches: bool = False, get_args: Callable[[], Any] = _megatron_args) -> Callable:
    """`pretrain` with the SAP flags chained onto its `extra_args_provider` (core_v0.13 to v0.17;
    from core_v0.18 the script parses the args itself, see `wrap_parse_args`); with
    `record_batches`, its forward step's data iterator recorded (`wrap_forward_step`)."""
    signature = inspect.signature(pretrain)
    takes_flags = "extra_args_provider" in signature.parameters

    @functools.wraps(pretrain)
    def pretrain_with_sap_args(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        if takes_flags:
            bound.arguments["extra_args_provider"] = chain_args_providers(
                bound.arguments.get("extra_args_provider"), add_sap_args
            )
        if record_batches and bound.arguments.get("forward_step_func") is not None:
            bound.arguments["forward_step_func"] = wrap_forward_step(bound.arguments["forward_step_func"], get_args)
        return pretrain(*bound.args, **bound.kwargs)

    return pretrain_with_sap_args


def wrap_parse_args(parse_args: Callable) -> Callable:
    """Megatron-LM's `parse_args` with the SAP flags chained onto its `extra_args_provider`: from
    core_v0.18 `pretrain_gpt.py` parses the args itself (`parse_and_validate_args`), before `pretrain`."""
    if getattr(parse_args, "_sap_hook", False):
        return parse_args
    signature = inspect.signature(parse_args)

    @functools.wraps(parse_args)
    def parse_args_with_sap(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        bound.arguments["extra_args_provider"] = chain_args_providers(bound.arguments.get("extra_args_provider"), add_sap_args)
        return parse_args(*bound.args, **bound.kwargs)

    parse_args_with_sap._sap_hook = True
    return parse_args_with_sap


def configure_sap(args: Any) -> Optional[list[int]]:
    """Apply the SAP flags before Megatron builds groups and model; return the CP levels [U, R].

    Sets the SAP options, switches layer specs to SAP core attention and installs the SAP RoPE.
    The returned sizes (None at CP 1) are what `hierarchical_context_parallel_sizes` must be.
    """
    settings = sap_settings_from_args(args)
    _refuse_unsupported(args)
    # `--cp-comm-type sap sap ...` (one per layer) as one `sap`: Megatron-LM then gives every
    # layer the string, where up to core_v0.16 a layer reads a per-layer list at its 1-based
    # number and the last one reads past the end (IndexError while the model is built).
    if not isinstance(args.cp_comm_type, str):
        args.cp_comm_type = ["sap"]
    use_sap_core_attention()
    install_sap_rope()
    install_gpt_forward_hook()  # the fork patch leaves GPTModel as it is: chunks that read no data need it
    # SAP attends within documents by cu_seqlens and drops any mask: do not build an S x S one per
    # sample (64 GiB at 128K tokens) in the data loader, nor broadcast it over TP.
    if getattr(args, "create_attention_mask_in_dataloader", False):
        args.create_attention_mask_in_dataloader = False
    if args.context_parallel_size == 1:
        return None
    if getattr(args, "multi_latent_attention", False) and getattr(args, "apply_rope_fusion", False):
        # MLA's fused RoPE kernels find each token's position from Megatron's own CP layout.
        warnings.warn("SAP turns off RoPE fusion (as --no-rope-fusion would) for MLA: the fused MLA RoPE assumes Megatron's CP layout")
        args.apply_rope_fusion = False
    if not getattr(args, "calculate_per_token_loss", False):
        warnings.warn(
            "SAP gives CP ranks equal token counts but not equal loss-token counts: add "
            "--calculate-per-token-loss for a loss and gradients identical to CP=1"
        )
    elif getattr(args, "num_experts", None) and _balances_load(args):
        warnings.warn(
            f"with --calculate-per-token-loss Megatron scales the MoE load-balancing loss by each rank's tokens and "
            f"divides the gradients by all CP ranks' tokens, so under CP {args.context_parallel_size} that loss weighs "
            f"1/{args.context_parallel_size} of what it weighs at CP 1 (with any CP method): multiply "
            f"--moe-aux-loss-coeff by {args.context_parallel_size} to keep CP 1's balance"
        )
    hint = flat_layout_hint(args, settings)
    if hint:
        warnings.warn(hint)
    return [settings.inner_size, settings.outer_size]


def _balances_load(args: Any) -> bool:
    """Whether the MoE router has a load-balancing loss: a type other than "none" with a nonzero
    coefficient (each flag one value, or one per loss type)."""
    as_list = lambda value: list(value) if isinstance(value, (list, tuple)) else [value]  # noqa: E731
    types = as_list(getattr(args, "moe_router_load_balancing_type", "aux_loss"))
    coefficients = as_list(getattr(args, "moe_aux_loss_coeff", 0.0))
    return any(t != "none" for t in types) and any(coefficients)


def _refuse_unsupported(args: Any) -> None:
    """Raise for the Megatron-LM settings under which SAP would compute a wrong attention."""
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    cp = args.context_parallel_size or 1
    if getattr(args, "mtp_num_layers", None):
        if cp > 1:
            raise ValueError(
                "SAP does not support multi-token prediction with context parallelism (--mtp-num-layers): Megatron "
                "rolls the MTP inputs and labels along its own CP layout"
            )
        if not mtp_takes_packed_rows():
            raise ValueError(
                "SAP does not support multi-token prediction (--mtp-num-layers) before Megatron-LM core_v0.16: the "
                "hooks pack every row, at CP 1 too, and these releases' MTP layers refuse packed rows"
            )
    refusal = packed_rope_refusal(getattr(args, "multi_latent_attention", False),
                                  getattr(args, "position_embedding_type", None) == "yarn")
    if cp > 1 and refusal:
        raise ValueError(refusal)
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        raise ValueError(
            "SAP does not support --overlap-moe-expert-parallel-comm: its schedule builds the model's forward "
            "without the batch's packed-sequence parameters, so attention would not keep documents apart"
        )
    if _cuda_graphs_capture_attention(args):
        raise ValueError(
            "SAP does not run inside CUDA graphs that capture attention (--cuda-graph-impl / --enable-cuda-graph / "
            "--external-cuda-graph with a --cuda-graph-scope, or from core_v0.19 --cuda-graph-modules, that covers "
            "attention): it plans every micro-batch from its documents, and a captured graph would replay the first "
            "batch's transfers and kernel calls; capture only other parts (e.g. --cuda-graph-modules mlp, before "
            "core_v0.19 --cuda-graph-scope mlp) or drop CUDA graphs"
        )
    if getattr(args, "hybrid_context_parallel", False):
        raise ValueError("SAP replaces context parallelism; it cannot run with --hybrid-context-parallel")
    refuse_unsupported_attention(args)
    if pp > 1 and getattr(args, "virtual_pipeline_model_parallel_size", None) and not chunk_aware_get_batch():
        raise ValueError(
            "SAP supports a virtual (interleaved) pipeline (--num-layers-per-virtual-pipeline-stage / "
            "--num-virtual-stages-per-pipeline-rank) from Megatron-LM core_v0.15: before, get_batch gives every model "
            "chunk of the first and last stages a batch of its own"
        )
    if getattr(args, "sft", False) and tp > 1 and packed_get_batch():
        raise ValueError(
            f"SAP with --sft needs TP 1 (got TP={tp}): Megatron-LM core_v0.16 and v0.17's get_batch_on_this_tp_rank send the SFT "
            "batch's cu_seqlens and max_seqlen from the source TP rank in more broadcasts than the other TP ranks "
            "receive, so they would hang or read wrong boundaries; pretraining data with --reset-position-ids "
            "--reset-attention-mask works at any TP"
        )
    if getattr(args, "sft", False) and pp > 1 and sft_split_on_every_stage():
        raise ValueError(
            f"SAP with --sft and pipeline parallelism (got PP={pp}) needs Megatron-LM core_v0.16 or core_v0.18 on: "
            "core_v0.17's get_batch reads and splits SFT rows on every stage, which the hand-over of each "
            "micro-batch's documents from the first stage does not follow"
        )
    seq_length = getattr(args, "seq_length", None)
    if tp > 1 and getattr(args, "sequence_parallel", False) and seq_length and seq_length % (cp * tp):
        raise ValueError(
            f"SAP with --sequence-parallel needs --seq-length divisible by CP x TP = {cp} x {tp} (got {seq_length}): "
            "each CP rank's share of the row is split evenly over its TP ranks"
        )
    if getattr(args, "attention_dropout", 0.0):
        raise ValueError(
            f"SAP attention has no attention dropout; set attention_dropout=0 (--attention-dropout 0), got "
            f"{args.attention_dropout} (Megatron's default is 0.1)"
        )
    if (getattr(args, "micro_batch_size", 1) or 1) > 1:
        raise ValueError(f"SAP trains one packed row per micro-batch: use --micro-batch-size 1 (got {args.micro_batch_size})")
    if getattr(args, "window_size", None) is not None:
        raise ValueError(f"SAP attention does not support sliding windows: drop --window-size (got {args.window_size})")
    if getattr(args, "reset_attention_mask", False) and not getattr(args, "reset_position_ids", False):
        raise ValueError(
            "SAP finds the documents of a row from its position ids: add --reset-position-ids to "
            "--reset-attention-mask (without it every row would be one document)"
        )
    documents_from_data = getattr(args, "sft", False) or getattr(args, "dataloader_inter_document_masking", False)
    if getattr(args, "reset_position_ids", False) and not getattr(args, "reset_attention_mask", False) \
            and not documents_from_data:
        raise ValueError(
            "SAP keeps the documents of a row apart: add --reset-attention-mask to --reset-position-ids "
            "(without it Megatron lets every token attend to the earlier documents of its row, which SAP would "
            "not do), or drop --reset-position-ids to train each row as one sequence"
        )


def _cuda_graphs_capture_attention(args: Any) -> bool:
    """Whether Megatron's CUDA graphs are on with a scope that covers attention: 0.13 to 0.15's
    `--enable-cuda-graph` / `--external-cuda-graph` (scope "full" or "attn"), 0.16 to 0.18's
    `--cuda-graph-impl` with `--cuda-graph-scope` ([] for the whole layer, or a list with
    "attn" or "full_iteration"), from 0.19 with `--cuda-graph-modules` ([] for the whole
    layer, or a list with "attn"; the whole iteration is `--cuda-graph-impl full_iteration`)."""
    impl = getattr(args, "cuda_graph_impl", None)
    enabled = impl not in (None, "none") or getattr(args, "enable_cuda_graph", False) or getattr(args, "external_cuda_graph", False)
    if not enabled:
        return False
    if impl == "full_iteration":
        return True
    scope = getattr(args, "cuda_graph_modules", None)
    if scope is None:
        scope = getattr(args, "cuda_graph_scope", "full")
    names = [getattr(s, "name", s) for s in (scope if isinstance(scope, (list, tuple)) else [scope])]
    return not names or any(name in ("full", "attn", "full_iteration") for name in names)


def wrap_initialize_model_parallel(initialize: Callable, get_args: Callable[[], Any] = _megatron_args) -> Callable:
    """`initialize_model_parallel` that lays CP out for SAP and switches the model to SAP first."""

    @functools.wraps(initialize)
    def initialize_for_sap(*args: Any, **kwargs: Any) -> Any:
        megatron_args = get_args()
        if not sap_requested(megatron_args):
            return initialize(*args, **kwargs)
        sizes = configure_sap(megatron_args)
        if sizes is not None:
            kwargs["hierarchical_context_parallel_sizes"] = sizes
            megatron_args.hierarchical_context_parallel_sizes = sizes
        result = initialize(*args, **kwargs)
        prepare_pipeline_host_group()
        return result

    return initialize_for_sap


def row_cu_seqlens(batch: dict[str, Any], reset_position_ids: bool) -> torch.Tensor:
    """The documents of a [1, S] batch: position-id restarts, else the whole row as one."""
    tokens = batch["tokens"]
    if tokens.dim() != 2 or tokens.size(0) != 1:
        raise ValueError(f"SAP trains packed rows: use --micro-batch-size 1 (got tokens of shape {tuple(tokens.shape)})")
    if reset_position_ids:
        return cu_seqlens_from_position_ids(batch["position_ids"])
    return torch.tensor([0, tokens.size(1)], dtype=torch.int32, device=tokens.device)


class _Recorder:
    """A data iterator's items handed on, the last one kept: the data loader's host copy of the
    micro-batch that Megatron moves to the GPU. A dict item is kept as a shallow copy, since
    core_v0.18 on moves its tensors to the GPU in place."""

    def __init__(self, source: Iterator, chunk: Optional[int] = None) -> None:
        self.source, self.item, self.chunk = source, None, chunk  # chunk: the model chunk reading (`vp_stage`)

    def __iter__(self) -> _Recorder:
        return self

    def __next__(self) -> Any:
        item = next(self.source)
        self.item = dict(item) if isinstance(item, dict) else item
        return item


_RECORDING: list[_Recorder] = []  # the data iterators of the forward steps running now (core_v0.18 on)


def wrap_forward_step(forward_step: Callable, get_args: Callable[[], Any] = _megatron_args) -> Callable:
    """A training script's `forward_step(data_iterator, model, ...)` whose data iterator records
    what it hands out (core_v0.18 on: `pretrain_gpt.get_batch` moves the loader's micro-batch to the
    GPU in place before `get_batch_on_this_tp_rank` sees it), so that the batch hook reads the
    row's documents from the host copy, and which model chunk reads it (`_Recorder.chunk`). A
    function wrapped already is returned as it is."""
    if getattr(forward_step, "_sap_hook", False):
        return forward_step

    @functools.wraps(forward_step)
    def forward_step_recording(data_iterator: Any, *args: Any, **kwargs: Any) -> Any:
        if not sap_requested(get_args()):
            return forward_step(data_iterator, *args, **kwargs)
        model = args[0] if args else kwargs.get("model")
        # Also without an iterator (the TP ranks other than the source): the hook needs the chunk.
        recorder = _Recorder(data_iterator, _model_chunk(model))
        _RECORDING.append(recorder)
        try:
            return forward_step(None if data_iterator is None else recorder, *args, **kwargs)
        finally:
            _RECORDING.remove(recorder)

    forward_step_recording._sap_hook = True
    return forward_step_recording


def _model_chunk(model: Any) -> Optional[int]:
    """The `vp_stage` of a (wrapped) model chunk, None without one."""
    while model is not None and not hasattr(model, "vp_stage"):
        model = getattr(model, "module", None)
    return getattr(model, "vp_stage", None)


# A batch's row tensor (`_row_tensor`) -> (its documents read on the host, the boundary tensor
# they are the values of, None where the batch has none): what the split plans from without a
# device read.
_HOST_BOUNDARIES = WeakTensorKeyDictionary()


def _row_tensor(batch: dict[str, Any]) -> Optional[torch.Tensor]:
    """The batch's tokens, else its labels (the last pipeline stage's TP ranks other than the
    source get no tokens), else None."""
    for key in ("tokens", "labels"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            return value
    return None


def _host_documents(batch: dict[str, Any], boundaries: Optional[torch.Tensor]) -> Optional[list[int]]:
    """The documents `host_boundaries` read for this batch, if `boundaries` is the tensor they
    were read for (None: the batch had none, and the split derives them)."""
    row = _row_tensor(batch)
    entry = _HOST_BOUNDARIES.get(row) if row is not None else None
    return entry[0] if entry is not None and entry[1] is boundaries else None


# A rank that runs attention got no documents, nor what to find them from (the THD and CP splits).
NO_DOCUMENTS = ("SAP needs each micro-batch's documents on the ranks that run attention; this rank got neither them "
                "nor the tokens and position ids to find them")


def pack_unpacked_batch(batch: dict[str, Any], reset_position_ids: bool,
                        documents: Optional[list[int]] = None) -> dict[str, Any]:
    """Give a [1, S] batch without cu_seqlens its documents: `documents` (read on the host),
    else `row_cu_seqlens` (read on the device, from the tokens and position ids)."""
    row = _row_tensor(batch)
    if batch.get("cu_seqlens") is not None or row is None or (documents is None and batch.get("tokens") is None):
        return batch
    if documents is None:
        cu = row_cu_seqlens(batch, reset_position_ids)
        longest = (cu[1:] - cu[:-1]).max().reshape(1)
    else:
        device = row.device
        cu = torch.tensor(documents, dtype=torch.int32).to(device, non_blocking=True)
        longest = torch.tensor([max(map(operator.sub, documents[1:], documents))], dtype=torch.int32)
        longest = longest.to(device, non_blocking=True)
    batch["cu_seqlens"] = cu.unsqueeze(0)
    batch["max_seqlen"] = longest
    return batch


def _share_with_tp_ranks(found: Any, host_group: Callable[[], Optional[tuple[Any, int]]]) -> Any:
    """What the TP source `found` (a row's documents and its plan), on every rank of its TP
    group (over `host_group()`'s gloo group, host to host); `found` itself at TP 1."""
    group = host_group()
    if group is None:
        return found
    box = [found]
    dist.broadcast_object_list(box, src=group[1], group=group[0])
    return box[0]


def wrap_get_batch_on_this_tp_rank(get_batch: Callable, get_args: Callable[[], Any] = _megatron_args,
                                   pack: bool = True,
                                   host_group: Callable[[], Optional[tuple[Any, int]]] = tensor_parallel_host_group
                                   ) -> Callable:
    """`get_batch_on_this_tp_rank` for SAP. On a rank that reads the data (TP source), the
    batch's documents are read from the data loader's host copy (`host_boundaries`), with the
    plan a loader worker made (`loader.PlannedDataset`) where it has one; the other TP ranks,
    which get the batch by broadcast on the GPU, receive both from the source over a host group
    (`host_group`: a gloo twin of the TP group and the source's rank, None at TP 1). The plan
    goes to the plan cache (`loader.adopt_loader_plan`); the split then plans, or finds the
    plan, without waiting for the device. With `pack` (core_v0.16 and v0.17,
    whose `get_batch` has a packed path) every batch gets `cu_seqlens` (`pack_unpacked_batch`)
    so that `get_batch` takes that path. A function wrapped already is returned as it is (a
    patched `pretrain_gpt.py` run through the launcher)."""
    if getattr(get_batch, "_sap_hook", False):
        return get_batch
    signature = inspect.signature(get_batch)
    iterator_name = next(iter(signature.parameters))  # `data_iterator`, None on the other TP ranks

    @functools.wraps(get_batch)
    def get_packed_batch(*args: Any, **kwargs: Any) -> dict[str, Any]:
        megatron_args = get_args()
        if not sap_requested(megatron_args):
            return get_batch(*args, **kwargs)
        reset = bool(getattr(megatron_args, "reset_position_ids", False))
        bound = signature.bind(*args, **kwargs)
        recorder = None
        if bound.arguments.get(iterator_name) is not None:
            recorder = bound.arguments[iterator_name] = _Recorder(bound.arguments[iterator_name])
        batch = get_batch(*bound.args, **bound.kwargs)
        if isinstance(batch, dict):
            batch.pop(PLAN_KEY, None)  # Megatron's own keeps only the entries it knows
        documents = _take_documents(None if recorder is None else recorder.item, reset, host_group)
        if pack:
            batch = pack_unpacked_batch(batch, reset, documents)
            if (isinstance(batch, dict) and batch.get("cu_seqlens") is None and _row_tensor(batch) is not None
                    and getattr(megatron_args, "context_parallel_size", 1) > 1):
                # Unpacked, the batch would take Megatron's own CP split on this rank while the
                # TP source takes SAP's: labels in another order than the logits, no error.
                raise ValueError(f"{NO_DOCUMENTS} (its TP source could not read the micro-batch's documents: "
                                 "the data loader gave no one-row dict of tensors)")
        _keep_host_documents(batch, documents)
        return batch

    get_packed_batch._sap_hook = True
    return get_packed_batch


def wrap_core_get_batch_on_this_tp_rank(get_batch: Callable, get_args: Callable[[], Any] = _megatron_args,
                                        host_group: Callable[[], Optional[tuple[Any, int]]] = tensor_parallel_host_group
                                        ) -> Callable:
    """megatron-core's `get_batch_on_this_tp_rank(batch, ...)` (core_v0.18 on) for SAP: as
    `wrap_get_batch_on_this_tp_rank`, the micro-batch's documents and loader plan read on the TP
    source from the host copy its forward step's data iterator recorded (`wrap_forward_step`),
    else from the batch itself where its tensors are on the host, and shared with the other TP
    ranks. A function wrapped already is returned as it is."""
    if getattr(get_batch, "_sap_hook", False):
        return get_batch
    signature = inspect.signature(get_batch)

    @functools.wraps(get_batch)
    def get_batch_with_documents(*args: Any, **kwargs: Any) -> dict[str, Any]:
        megatron_args = get_args()
        if not sap_requested(megatron_args):
            return get_batch(*args, **kwargs)
        recording = _RECORDING[-1] if _RECORDING else None
        # SFT rows (`cu_seqlens` in the batch) reach every model chunk from core_v0.18; a chunk SAP
        # gives the first stage's documents takes them from there (`stages.documents_for`), and
        # its reading must not send them on again.
        takes_documents = recording is not None and reads_no_data(recording.chunk)
        bound = signature.bind(*args, **kwargs)
        item = None
        if not takes_documents and bound.arguments.get("tp_rank", 0) == 0:  # the source: the batch is the loader's
            recorded = None if recording is None else recording.item
            given = bound.arguments.get("batch")
            item = recorded if recorded is not None else dict(given) if isinstance(given, dict) else None
        batch = get_batch(*args, **kwargs)
        if isinstance(batch, dict):
            batch.pop(PLAN_KEY, None)
        if takes_documents:
            return batch
        documents = _take_documents(item, bool(getattr(megatron_args, "reset_position_ids", False)), host_group)
        _keep_host_documents(batch, documents)
        return batch

    get_batch_with_documents._sap_hook = True
    return get_batch_with_documents


def _take_documents(item: Any, reset_position_ids: bool, host_group: Callable[[], Optional[tuple[Any, int]]]
                    ) -> Optional[list[int]]:
    """The documents of the micro-batch the TP source read as `item` (None on the other TP
    ranks), on every rank of the TP group; its loader plan put in the plan cache and both sent
    on to the pipeline stages that read no data. The source reads them from the item's host
    copy, else, where the data loader gives its micro-batches on the device, from there: one
    wait for the GPU, which the split would pay anyway, and the other TP ranks get them (the
    last stage's others receive no tokens to find them from)."""
    found = (None, None)
    if item is not None:
        found = (host_boundaries(item, reset_position_ids, from_device=True), loader_plan_bytes(item))
    documents, plan_bytes = _share_with_tp_ranks(found, host_group)
    send_documents(documents, plan_bytes)
    adopt_loader_plan(plan_bytes, documents)
    return documents


def _keep_host_documents(batch: Any, documents: Optional[list[int]]) -> None:
    """Remember `documents` for the split of `batch` (`_host_documents`)."""
    row = _row_tensor(batch) if isinstance(batch, dict) else None
    if documents is not None and row is not None:
        _HOST_BOUNDARIES[row] = (documents, batch.get("cu_seqlens"))


def wrap_build_pretraining_data_loader(build: Callable, get_args: Callable[[], Any] = _megatron_args) -> Callable:
    """`build_pretraining_data_loader` whose dataset plans every sample in the loader's workers
    (`loader.PlannedDataset`), with SAP on and `--sap-plan-in-data-loader` (the default), for the
    loaders Megatron builds itself (`--dataloader-type single` or `cyclic`) with workers
    (`--num-workers` > 0: without, the training process would plan there and pay the pickling
    on top), except on a rank none of whose model chunks reads data (`stages.rank_reads_no_data`:
    they take the first stage's plans; with `--sft` from core_v0.18 a middle stage still reads
    the rows, for their boundaries). A function wrapped already is returned as it is."""
    if getattr(build, "_sap_hook", False):
        return build

    @functools.wraps(build)
    def build_planned(dataset: Any, *args: Any, **kwargs: Any) -> Any:
        megatron_args = get_args()
        if (dataset is not None and sap_requested(megatron_args) and getattr(megatron_args, "sap_plan_in_data_loader", True)
                and getattr(megatron_args, "dataloader_type", "single") in ("single", "cyclic")
                and getattr(megatron_args, "num_workers", 0) > 0 and not rank_reads_no_data()):
            dataset = PlannedDataset(dataset, loader_planning(bool(getattr(megatron_args, "reset_position_ids", False))))
        return build(dataset, *args, **kwargs)

    build_planned._sap_hook = True
    return build_planned


def wrap_get_thd_batch_on_this_cp_rank(split: Callable, get_args: Callable[[], Any] = _megatron_args) -> Callable:
    """Megatron's THD split replaced by `sap_split_batch` when SAP is on (same arguments and
    result). SAP splits over its own CP group and finds the longest document itself: a given
    `cp_size` or `cp_rank` must be that group's, and `max_seqlen` is not read. The documents are
    those the batch's tokens were read with on the host (`host_boundaries`), else the given
    boundaries, read from the device. A function wrapped already is returned as it is."""
    if getattr(split, "_sap_hook", False):
        return split

    @functools.wraps(split)
    def sap_thd_split(
        batch: dict[str, Any],
        cu_seqlens: torch.Tensor,
        cu_seqlens_padded: Optional[torch.Tensor],
        max_seqlen: torch.Tensor,
        cp_size: Optional[int] = None,
        cp_rank: Optional[int] = None,
    ) -> tuple[dict[str, Any], Any]:
        if not sap_requested(get_args()):
            return split(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size=cp_size, cp_rank=cp_rank)
        if cp_size is not None or cp_rank is not None:
            groups = resolve_groups(None)
            size, rank = (1, 0) if groups is None else (groups.world_size, groups.cp_rank)
            if cp_size not in (None, size) or cp_rank not in (None, rank):
                raise ValueError(
                    f"SAP splits the batch over its own CP group (size {size}, this rank {rank}), got "
                    f"cp_size={cp_size}, cp_rank={cp_rank}"
                )
        # Padding tokens belong to the document they follow; SAP needs no per-document padding.
        boundaries = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
        documents = _host_documents(batch, boundaries)
        return sap_split_batch(batch, boundaries.flatten() if documents is None else documents)

    sap_thd_split._sap_hook = True
    return sap_thd_split


_SPLIT_PARAMS = WeakTensorKeyDictionary()  # local row tensor (`_row_tensor`) of a batch the SAP split made -> its PackedSeqParams


def wrap_get_batch_on_this_cp_rank(split: Callable, get_args: Callable[[], Any] = _megatron_args) -> Callable:
    """Megatron's CP split of a [1, S] batch (Megatron-LM's, core_v0.13 to v0.15; megatron-core's,
    core_v0.18 on) replaced by `sap_split_batch` when SAP is on, at every CP size: the documents
    are those read on the host (`_host_documents`), else `row_cu_seqlens`, or the batch's own
    `cu_seqlens` where it has them. The entries come back in their order (`get_batch` returns
    `batch.values()`, or the entries by name); the packed parameters are kept for
    `GPTModel.forward`, keyed by the local tokens (see `wrap_gpt_forward`). A function wrapped
    already is returned as it is."""
    if getattr(split, "_sap_hook", False):
        return split

    @functools.wraps(split)
    def sap_cp_split(batch: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        megatron_args = get_args()
        if not sap_requested(megatron_args):
            return split(batch, *args, **kwargs)
        cu = batch.get("cu_seqlens")
        documents = _host_documents(batch, cu)
        if documents is None:
            if cu is None and batch.get("tokens") is None:
                raise ValueError(NO_DOCUMENTS)
            cu = row_cu_seqlens(batch, bool(getattr(megatron_args, "reset_position_ids", False))) if cu is None else cu
            documents = cu.flatten()
        local, params = sap_split_batch(batch, documents)
        _SPLIT_PARAMS[_row_tensor(local)] = params
        return local

    sap_cp_split._sap_hook = True
    return sap_cp_split


def wrap_gpt_forward(forward: Callable, get_args: Callable[[], Any] = _megatron_args) -> Callable:
    """`GPTModel.forward` that, called with SAP on, takes the micro-batch's packed parameters:
    those of the batch the SAP split made (`wrap_get_batch_on_this_cp_rank`: `pretrain_gpt.py`
    before core_v0.16 calls the model without any, from core_v0.18 with its own built from the
    row's `cu_seqlens`), found by its tokens or labels; in a model chunk that reads no data
    (`stages.reads_no_data`: a middle pipeline stage, a virtual pipeline chunk), those of the
    documents its first stage sends (`stages.documents_for`). Other calls keep what they are
    given (`_micro_batch_params`). A function wrapped already is returned as it is."""
    if getattr(forward, "_sap_hook", False):
        return forward
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def forward_with_packed_params(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        params = _micro_batch_params(bound.arguments, get_args)
        if params is not None:
            bound.arguments["packed_seq_params"] = params
        return forward(*bound.args, **bound.kwargs)

    forward_with_packed_params._sap_hook = True
    return forward_with_packed_params


def _micro_batch_params(arguments: dict[str, Any], get_args: Callable[[], Any]) -> Any:
    """The packed parameters `wrap_gpt_forward` gives a forward call with these arguments, or
    None to keep the given ones (Megatron's args are read only where there are some to give).
    Tokens the SAP split made get the split's parameters, and a model chunk that reads no data
    those of the first stage's documents, in place of any the script built (core_v0.18 on builds
    them from the row's `cu_seqlens`, which are not SAP's layout); a forward call with tokens the
    split did not make keeps its own."""
    for name in ("input_ids", "labels"):
        value = arguments.get(name)
        if isinstance(value, torch.Tensor):
            params = _SPLIT_PARAMS.get(value)
            return params if params is not None and sap_requested(get_args()) else None
    model = arguments["self"]
    chunk = getattr(model, "vp_stage", None)
    if not reads_no_data(chunk) or not sap_requested(get_args()):
        return None
    documents, plan_bytes = documents_for(chunk)
    adopt_loader_plan(plan_bytes, documents)
    parameter = next(model.parameters(), None)
    return sap_packed_seq_params(documents, torch.device("cpu") if parameter is None else parameter.device)


def wrap_flatten_batch_for_packed_sequences(flatten: Callable, get_args: Callable[[], Any] = _megatron_args) -> Callable:
    """megatron-core's `flatten_batch_for_packed_sequences` (0.19 on), which merges the rows of a
    micro-batch into one, skipped with SAP on: SAP trains one row per micro-batch (the split drops
    the documents of no tokens that pad SFT rows' boundaries itself), and the merge would read the
    boundaries back from the GPU and replace the tensors the documents read on the host are kept
    by (`_host_documents`)."""
    if getattr(flatten, "_sap_hook", False):
        return flatten

    @functools.wraps(flatten)
    def flatten_unless_sap(batch: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        if sap_requested(get_args()):
            return batch
        return flatten(batch, *args, **kwargs)

    flatten_unless_sap._sap_hook = True
    return flatten_unless_sap


def install_gpt_forward_hook() -> None:
    """`GPTModel.forward` wrapped by `wrap_gpt_forward` (idempotent)."""
    from megatron.core.models.gpt import GPTModel

    GPTModel.forward = wrap_gpt_forward(GPTModel.forward)


def wrap_spec_builder(build: Callable, get_args: Callable[[], Any] = _megatron_args) -> Callable:
    """A spec builder whose specs get SAP core attention when SAP is on."""

    @functools.wraps(build)
    def build_with_sap(*args: Any, **kwargs: Any) -> Any:
        spec = build(*args, **kwargs)
        return swap_core_attention(spec) if sap_requested(get_args()) else spec

    return build_with_sap


def install_training_hooks() -> None:
    """Patch Megatron-LM's training entry points for SAP (idempotent); run before the script imports them."""
    global _INSTALLED
    if _INSTALLED:
        return
    import megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs as heterogeneous
    import megatron.core.utils as core_utils
    import megatron.training
    import megatron.training.training as training_loop
    import megatron.training.utils as training_utils
    from megatron.core import parallel_state

    layout = training_layout(training_utils)
    if layout is None:
        raise RuntimeError(TRAINING_LAYOUT_REFUSED)  # before anything is patched
    in_core = layout == "core-utils"
    megatron.training.pretrain = wrap_pretrain(megatron.training.pretrain, record_batches=in_core)
    training_loop.build_pretraining_data_loader = wrap_build_pretraining_data_loader(training_loop.build_pretraining_data_loader)
    parallel_state.initialize_model_parallel = wrap_initialize_model_parallel(parallel_state.initialize_model_parallel)
    if in_core:  # core_v0.18 on
        import megatron.training.arguments as arguments

        arguments.parse_args = wrap_parse_args(arguments.parse_args)
        core_utils.get_batch_on_this_tp_rank = wrap_core_get_batch_on_this_tp_rank(core_utils.get_batch_on_this_tp_rank)
        core_utils.get_batch_on_this_cp_rank = wrap_get_batch_on_this_cp_rank(core_utils.get_batch_on_this_cp_rank)
        if hasattr(core_utils, "flatten_batch_for_packed_sequences"):  # core_v0.19
            core_utils.flatten_batch_for_packed_sequences = wrap_flatten_batch_for_packed_sequences(
                core_utils.flatten_batch_for_packed_sequences)
    else:
        training_utils.get_batch_on_this_tp_rank = wrap_get_batch_on_this_tp_rank(training_utils.get_batch_on_this_tp_rank,
                                                                                  pack=packed_get_batch())
        if packed_get_batch():  # core_v0.16 and v0.17
            core_utils.get_thd_batch_on_this_cp_rank = wrap_get_thd_batch_on_this_cp_rank(core_utils.get_thd_batch_on_this_cp_rank)
        else:  # core_v0.13 to v0.15
            training_utils.get_batch_on_this_cp_rank = wrap_get_batch_on_this_cp_rank(training_utils.get_batch_on_this_cp_rank)
    install_gpt_forward_hook()
    heterogeneous.get_gpt_heterogeneous_layer_spec = wrap_spec_builder(heterogeneous.get_gpt_heterogeneous_layer_spec)
    builders = sys.modules.get("gpt_builders")  # imported already: it holds the original by name
    if builders is not None and hasattr(builders, "get_gpt_heterogeneous_layer_spec"):
        builders.get_gpt_heterogeneous_layer_spec = heterogeneous.get_gpt_heterogeneous_layer_spec
    _INSTALLED = True
