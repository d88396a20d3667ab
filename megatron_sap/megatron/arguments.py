"""Megatron-LM command-line flags for SAP.

`add_sap_args` is an `extra_args_provider` (Megatron calls it with its parser and uses the parser
it returns); `chain_args_providers(existing)` is one that adds the SAP flags and chains the
provider a script already passes (`pretrain_gpt.py` passes the model-optimizer one). `sap_settings_from_args` resolves the parsed
flags (SAP levels default from `--hierarchical-context-parallel-sizes`) and applies the options.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable, Optional

from megatron_sap.comm.ulysses import check_heads
from megatron_sap.planning import PRESETS
from megatron_sap.planning.plan import CHOOSE_BY
from megatron_sap.planning.program import head_chunks
from megatron_sap.validation import check_inner_chunks

from .options import BACKENDS, SCHEDULES, SAPOptions, set_sap_options

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def _inner_chunks(value: str) -> int | str:
    """--sap-inner-chunks: "auto" or a positive int (`check_inner_chunks`)."""
    try:
        number = int(value)
    except ValueError:
        number = None
    try:
        return check_inner_chunks(value if value == "auto" or number is None else number, name="--sap-inner-chunks")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_sap_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `sap` argument group (used with `--cp-comm-type sap`); a parser that has it
    already (a `pretrain_gpt.py` patched with patches/, run through the launcher) is returned as is."""
    if "--sap-inner-size" in parser._option_string_actions:
        return parser
    group = parser.add_argument_group(title="sap", description="Sequence-Aware Parallelism for packed sequences")
    group.add_argument(
        "--sap-inner-size", type=int, default=None,
        help="SAP inner (intra-node, Ulysses) level U; default: first entry of "
        "--hierarchical-context-parallel-sizes, else context-parallel size / R, else 1",
    )
    group.add_argument(
        "--sap-outer-size", type=int, default=None,
        help="SAP outer (point-to-point) level R; default: second entry of "
        "--hierarchical-context-parallel-sizes, else context-parallel size / U",
    )
    group.add_argument("--sap-backend", choices=BACKENDS, default="auto", help="attention kernel backend")
    group.add_argument(
        "--sap-cost-preset", choices=sorted(PRESETS), default=None,
        help="hardware cost model the planner balances against",
    )
    group.add_argument(
        "--sap-calibration-file", default=None,
        help="JSON of measured cost-model rates (as scripts/gpu_check.sh writes docs/calibration.json); not with --sap-cost-preset",
    )
    group.add_argument("--sap-plan-cache-size", type=int, default=None, help="plans kept per process")
    group.add_argument(
        "--sap-check-agreement", action=argparse.BooleanOptionalAction, default=True,
        help="check once per micro-batch that all CP ranks hold the same cu_seqlens, layout, cost model, "
        "attention shape and --sap-recompute-kv",
    )
    group.add_argument(
        "--sap-plan-in-data-loader", action=argparse.BooleanOptionalAction, default=True,
        help="plan every micro-batch in the data loader's worker processes, ahead of the training loop",
    )
    group.add_argument(
        "--sap-recompute-kv", action="store_true",
        help="fetch remote K/V again in backward instead of keeping it from forward (less memory, more traffic)",
    )
    group.add_argument(
        "--sap-schedule", choices=SCHEDULES, default="auto",
        help="pipelined: each exchange's kernel calls overlap the next exchange; gathered: each query piece "
        "once all its keys are in, as one kernel segment (no merges); auto: one for every rank, what the cost model "
        "times faster for all ranks together (beyond 16 outer ranks: for the plan's slowest rank)",
    )
    group.add_argument(
        "--sap-choose-by", choices=CHOOSE_BY, default="estimate",
        help="how the planner chooses among its candidate placements: estimate (its own estimate, fast) or "
        "timeline (the near candidates' programs compiled and timed, all ranks together: better plans where "
        "the estimate misleads, several times the planning time; best with --sap-plan-in-data-loader)",
    )
    group.add_argument(
        "--sap-inner-chunks", type=_inner_chunks, default="auto",
        help="run the Ulysses all-to-alls (--sap-inner-size > 1) in this many head chunks under the attention "
        "kernels; auto: what the cost model times soonest done (more than one only where the inner groups are "
        "the nodes); not with --sap-recompute-kv",
    )
    group.add_argument(
        "--sap-log-interval", type=int, default=0,
        help="every N micro-batches, log on global rank 0 a line about their SAP plans (modelled time over the "
        "ideal, pair imbalance, K/V moved, plans made in the training process); 0: never",
    )
    _check_levels_when_parsed(parser)
    return parser


def _check_levels_when_parsed(parser: argparse.ArgumentParser) -> None:
    """Check SAP's CP levels as soon as the flags are parsed: Megatron-LM's `validate_args`
    asserts the product of `--hierarchical-context-parallel-sizes` without a message, before
    any SAP hook runs. (`parse_args` goes through `parse_known_args`.)"""
    parse_known_args = parser.parse_known_args

    def parse_and_check(*args, **kwargs):
        namespace, extras = parse_known_args(*args, **kwargs)
        if sap_requested(namespace):
            check_hierarchical_sizes(getattr(namespace, "hierarchical_context_parallel_sizes", None),
                                     getattr(namespace, "context_parallel_size", 1) or 1)
        return namespace, extras

    parser.parse_known_args = parse_and_check


def sap_requested(args: argparse.Namespace) -> bool:
    """True when `--cp-comm-type` is `sap` (for every layer; mixing with other types is refused)."""
    comm = getattr(args, "cp_comm_type", None)
    types = [comm] if isinstance(comm, str) or comm is None else list(comm)
    if "sap" not in types:
        return False
    if any(t != "sap" for t in types):
        raise ValueError(f"--cp-comm-type sap cannot be mixed with other CP types per layer, got {types}")
    return True


def check_hierarchical_sizes(hierarchical: Optional[list[int]], cp_size: int) -> None:
    """`--hierarchical-context-parallel-sizes` as SAP takes it: none, or [inner, outer], each
    >= 1, whose product is the CP size."""
    if not hierarchical:
        return
    if len(hierarchical) != 2:
        raise ValueError(f"SAP needs two hierarchical CP levels [inner, outer], got {hierarchical}")
    if min(hierarchical) < 1:
        raise ValueError(f"--hierarchical-context-parallel-sizes {hierarchical[0]} {hierarchical[1]}: each size must be >= 1")
    if hierarchical[0] * hierarchical[1] != cp_size:
        raise ValueError(f"--hierarchical-context-parallel-sizes {hierarchical[0]} {hierarchical[1]}: "
                         f"the product must equal --context-parallel-size {cp_size}")


def chain_args_providers(*providers: Optional[ArgsProvider]) -> ArgsProvider:
    """One provider that applies each given provider in turn (None entries are skipped), then
    adds the `sap` argument group (`add_sap_args`, once: it may be among them)."""
    active = [provider for provider in providers if provider is not None]
    if add_sap_args not in active:
        active.append(add_sap_args)

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for each in active:
            parser = each(parser)
        return parser

    return provider


@dataclass(frozen=True)
class SAPSettings:
    """Resolved SAP levels plus the layer options."""

    inner_size: int
    outer_size: int
    options: SAPOptions


def sap_settings_from_args(args: argparse.Namespace) -> SAPSettings:
    """Resolve the SAP levels against the CP size, apply the options, and return both.

    Raises ValueError when the levels do not multiply to `--context-parallel-size` or contradict
    `--hierarchical-context-parallel-sizes`.
    """
    cp_size = getattr(args, "context_parallel_size", 1) or 1
    hierarchical = getattr(args, "hierarchical_context_parallel_sizes", None)
    check_hierarchical_sizes(hierarchical, cp_size)
    inner, outer = args.sap_inner_size, args.sap_outer_size
    for flag, value in (("--sap-inner-size", inner), ("--sap-outer-size", outer)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if hierarchical:
        if inner not in (None, hierarchical[0]) or outer not in (None, hierarchical[1]):
            raise ValueError(
                f"--sap-inner-size/--sap-outer-size ({inner}, {outer}) contradict "
                f"--hierarchical-context-parallel-sizes {list(hierarchical)}"
            )
        inner, outer = hierarchical
    if inner is None and outer is not None and cp_size % outer:
        raise ValueError(f"--sap-outer-size {outer} must divide --context-parallel-size {cp_size}")
    if outer is None and inner is not None and cp_size % inner:
        raise ValueError(f"--sap-inner-size {inner} must divide --context-parallel-size {cp_size}")
    if inner is None:
        inner = cp_size // (outer or cp_size)
    if outer is None:
        outer = cp_size // inner
    if inner < 1 or outer < 1 or inner * outer != cp_size:
        given = (f"--hierarchical-context-parallel-sizes {inner} {outer}" if hierarchical
                 else f"--sap-inner-size {inner} x --sap-outer-size {outer}")
        raise ValueError(f"{given}: the product must equal --context-parallel-size {cp_size}")
    shape = model_shape_from_args(args)
    if shape is not None:  # at start-up, not at the first attention after the model is built
        try:
            check_heads(shape[0], shape[1], inner)
        except ValueError as exc:
            raise ValueError(f"the attention heads of one tensor-parallel rank do not split over the SAP inner "
                             f"(Ulysses) size {inner}: {exc}") from None
    chunks = args.sap_inner_chunks
    if chunks not in ("auto", 1):
        if args.sap_recompute_kv:
            raise ValueError(f"--sap-inner-chunks {chunks} needs --sap-recompute-kv off (every chunk would fetch the "
                             f"K/V again)")
        if inner == 1:
            raise ValueError(f"--sap-inner-chunks {chunks} chunks the Ulysses all-to-alls: it needs --sap-inner-size > 1")
        if shape is not None and head_chunks(shape[0], shape[1], inner, chunks) is None:
            raise ValueError(f"--sap-inner-chunks {chunks} does not split the {shape[0] // inner} query heads (and "
                             f"{max(shape[1], inner) // inner} KV heads) of each inner rank into chunks that read "
                             f"whole KV heads")
    local_gpus = os.environ.get("LOCAL_WORLD_SIZE", "")  # GPUs of this node, as torchrun sets it
    options = set_sap_options(
        backend=args.sap_backend,
        cost_preset=args.sap_cost_preset,
        calibration_file=args.sap_calibration_file,
        plan_cache_size=args.sap_plan_cache_size,
        check_agreement=args.sap_check_agreement,
        recompute_kv=args.sap_recompute_kv,
        schedule=args.sap_schedule,
        model_shape=shape,
        attention_dtype=attention_dtype_from_args(args),
        gpus_per_node=int(local_gpus) if local_gpus.isdigit() else None,
        tensor_parallel_size=getattr(args, "tensor_model_parallel_size", 1) or 1,
        log_interval=args.sap_log_interval,
        choose_by=args.sap_choose_by,
        inner_chunks=args.sap_inner_chunks,
    )
    return SAPSettings(inner_size=inner, outer_size=outer, options=options)


def flat_layout_hint(args: argparse.Namespace, settings: SAPSettings) -> Optional[str]:
    """A hint where SAP runs flat (U = 1) only because no level was given, while its CP
    ranks span nodes and an inner (Ulysses) level inside a node would fit: across nodes
    that layout is usually faster (docs/megatron.md, "Choosing U and R"). None otherwise,
    or where the node size is unknown (no LOCAL_WORLD_SIZE)."""
    given = (args.sap_inner_size is not None or args.sap_outer_size is not None
             or getattr(args, "hierarchical_context_parallel_sizes", None))
    per_node, tp = settings.options.gpus_per_node, settings.options.tensor_parallel_size
    if given or settings.inner_size != 1 or per_node is None:
        return None
    cp, node_cp = settings.outer_size, per_node // tp  # Megatron orders TP fastest, then CP
    if cp <= node_cp:
        return None
    from megatron_sap.plan import inner_sizes  # the layouts the printed command compares

    from .plans import planning_cost_model

    inner = inner_sizes(cp, planning_cost_model())[-1]  # the heads of one TP rank, its CP ranks per node
    if inner == 1:
        return None
    shape = settings.options.model_shape
    compare = f"python -m megatron_sap.plan --cp-size {cp} --tensor-parallel-size {tp} --gpus-per-node {per_node}"
    if shape is not None:
        compare += f" --num-heads {args.num_attention_heads} --num-kv-heads {_kv_heads(args)} --head-dim {shape[2]}"
    if args.sap_cost_preset:
        compare += f" --preset {args.sap_cost_preset}"
    return (f"SAP runs flat (1 x {cp}) over CP ranks on {-(-cp // node_cp)} nodes ({node_cp} per node): across nodes an inner "
            f"(Ulysses) level inside each node is usually faster (docs/megatron.md, \"Choosing U and R\"). Compare the "
            f"layouts on your document lengths with `{compare} --lengths-file LENGTHS --tokens "
            f"{getattr(args, 'seq_length', None) or 'T'}` and, where it says so, add "
            f"--hierarchical-context-parallel-sizes {inner} {cp // inner} (--sap-inner-size 1 keeps the flat "
            f"layout without this warning)")


def _kv_heads(args: argparse.Namespace) -> int:
    """The model's key/value heads: --num-query-groups with --group-query-attention, else the query heads."""
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    return groups or args.num_attention_heads


def attention_dtype_from_args(args: argparse.Namespace) -> str:
    """The dtype Megatron-LM's layers attend in: their parameters' (--bf16, --fp16, else float32)."""
    return "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else "float32"


def model_shape_from_args(args: argparse.Namespace) -> Optional[tuple[int, int, int, int]]:
    """(query heads, key/value heads, head dim, bytes per element) of one CP rank's attention
    from Megatron-LM's model flags: the heads over the TP size; None without them. With
    --multi-latent-attention every query head has its own key head, of --qk-head-dim plus
    --qk-pos-emb-head-dim, and the values are padded to that (or it to theirs,
    `SAPDotProductAttention`)."""
    heads = getattr(args, "num_attention_heads", None)
    if not heads:
        return None
    if getattr(args, "multi_latent_attention", False):
        qk_dim = (getattr(args, "qk_head_dim", None) or 0) + (getattr(args, "qk_pos_emb_head_dim", None) or 0)
        head_dim, groups = max(qk_dim, getattr(args, "v_head_dim", None) or 0), heads
    else:
        hidden = getattr(args, "hidden_size", None)
        head_dim = getattr(args, "kv_channels", None) or (hidden // heads if hidden else None)
        groups = _kv_heads(args)
    if not head_dim:
        return None
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    nbytes = 2 if getattr(args, "bf16", False) or getattr(args, "fp16", False) else 4
    return max(heads // tp, 1), max(groups // tp, 1), int(head_dim), nbytes
