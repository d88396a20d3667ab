"""`SAPDotProductAttention`: a drop-in Megatron core attention that runs SAP context parallelism.

Megatron builds it through a layer spec with the same keywords as its own core attention and calls
it with q/k/v after the projections and RoPE. Under SAP the local tokens are the ones
`plan.local_indices(cp_rank)` names (see `sap_split_batch`), so the layer only needs the global
`cu_seqlens` from `packed_seq_params` to find the plan (the batch split's own, without a host sync).
"""
from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

import megatron_sap as sap
from megatron_sap.kernels import resolve_backend
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from .compat import packed_rope_refusal
from .groups import sap_groups_from_pg_collection
from .options import get_sap_options
from .plans import plan_for, split_plan

logger = logging.getLogger(__name__)
_announced = False  # the first attention call logs what runs, once per process
# Per check that reads tensor values on the host, the tensors it last passed and their versions:
# the layers of one step get the same tensors, so each check reads them once per micro-batch
# (`_passed_before`).
_PASSED: dict[str, tuple[tuple[weakref.ref, ...], tuple[int, ...]]] = {}

# Documents come from cu_seqlens, so "padding" adds nothing to causal for packed rows.
_CAUSAL_MASKS = (AttnMaskType.causal, AttnMaskType.padding_causal)


class SAPDotProductAttention(MegatronModule):
    """Core attention for packed (THD) and SBHD inputs with SAP context parallelism.

    Builder keywords match Megatron's `DotProductAttention`/`TEDotProductAttention`; extra keywords
    Megatron adds in other versions are accepted and ignored. The CP groups come from
    `pg_collection` (`model_comm_pgs` in megatron-core 0.13-0.14: `cp`, plus `hcp` = [inner,
    outer] when hierarchical CP is configured) or, without one, from `parallel_state`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        model_comm_pgs: Any = None,
        **_unused: Any,
    ) -> None:
        super().__init__(config=config)
        if cp_comm_type not in (None, "sap"):
            raise ValueError(f"SAPDotProductAttention runs cp_comm_type 'sap', got {cp_comm_type!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"SAP attention has no attention dropout; set attention_dropout=0 (--attention-dropout 0), got {dropout}"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SAP attention supports softmax_type 'vanilla' only, got {config.softmax_type!r}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError(f"SAP attention does not support sliding windows (window_size={config.window_size})")
        refuse_unsupported_attention(config)
        if getattr(config, "fp8_dot_product_attention", False) or getattr(config, "fp8_multi_head_attention", False):
            warnings.warn("SAP attention computes in the inputs' dtype, not FP8: fp8_dot_product_attention / "
                          "fp8_multi_head_attention have no effect on it", stacklevel=2)
        if attn_mask_type not in _CAUSAL_MASKS:
            raise ValueError(f"SAP attention is causal self-attention, got attn_mask_type {attn_mask_type}")
        if attention_type != "self":
            raise ValueError(f"SAP attention is causal self-attention, got attention_type {attention_type!r}")
        self.groups = sap_groups_from_pg_collection(pg_collection if pg_collection is not None else model_comm_pgs)
        if self.groups is not None and getattr(config, "multi_latent_attention", False) and getattr(config, "apply_rope_fusion", False):
            raise ValueError(
                "SAP with context parallelism needs apply_rope_fusion=False for MLA: the fused MLA RoPE finds each "
                "token's position from Megatron's own CP layout (--no-rope-fusion)"
            )
        # The training code sets the config's yarn_* fields for GPTModel's YaRN.
        refusal = packed_rope_refusal(getattr(config, "multi_latent_attention", False),
                                      hasattr(config, "yarn_rotary_scaling_factor"))
        if self.groups is not None and refusal:
            raise ValueError(refusal)
        if self.groups is not None and getattr(config, "mtp_num_layers", None):
            raise ValueError(
                "SAP with context parallelism does not support multi-token prediction (mtp_num_layers): Megatron "
                "shifts the MTP labels and inputs along its own CP layout, not SAP's token order (train MTP at CP 1)"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # None: 1/sqrt(head dim of q), as TE does (MLA's q head dim is not kv_channels).
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the logits
        # back in the softmax, a numerical trick for fp16 that leaves the result unchanged: ignore it.
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        **_unused: Any,
    ) -> Tensor:
        """q [t, Hq, D] (THD) or [s, b, Hq, D] (SBHD); k/v with Hkv heads. Returns [t, Hq*D] / [s, b, Hq*D]."""
        if attention_bias is not None:
            raise ValueError("SAP attention does not take an attention_bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in _CAUSAL_MASKS:
            raise ValueError(f"SAP attention is causal self-attention, got attn_mask_type {mask_type}")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params).flatten(1)
        if query.dim() != 4:
            raise ValueError(f"SBHD attention expects q [s, b, heads, dim], got shape {tuple(query.shape)}")
        if packed_seq_params is not None:  # SBHD with b == 1 carrying packed documents
            if query.size(1) != 1:
                raise ValueError(f"packed SBHD input needs batch size 1, got {query.size(1)}")
            out = self._packed(query[:, 0], key[:, 0], value[:, 0], packed_seq_params)
            return out.flatten(1).unsqueeze(1)
        if mask_type == AttnMaskType.padding_causal and attention_mask is not None:
            # A padding mask would mark tokens to leave out, which rows of whole sequences cannot.
            raise ValueError(
                "SAP attention over unpacked SBHD rows takes no padding mask (attn_mask_type padding_causal with an "
                "attention_mask): pack the rows (THD with packed_seq_params) so padding is its own document"
            )
        if attention_mask is not None:
            _check_plain_causal(attention_mask, query.shape[0])
        return self._rows(query, key, value)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, values: Optional[list[int]] = None) -> Tensor:
        """One packed row of local tokens in plan order through `sap_attention`.

        MLA gives values a smaller head dim than queries and keys: the values are padded
        with zero columns to the query head dim and the output cut back, which leaves the
        result unchanged (zero value columns give zero output columns, and their
        gradients are dropped). A larger value head dim pads q and k instead.
        """
        plan = plan_for(cu_seqlens, self.groups, values)
        options = get_sap_options()
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        scale = self.softmax_scale if self.softmax_scale is not None else qk_dim**-0.5
        if not _announced:
            _announce(q, options.backend, self.groups, options.schedule)
        if v_dim < qk_dim:
            v = F.pad(v, (0, qk_dim - v_dim))
        elif v_dim > qk_dim:
            q, k = F.pad(q, (0, v_dim - qk_dim)), F.pad(k, (0, v_dim - qk_dim))
        out = sap.sap_attention(
            q,
            k,
            v,
            plan,
            self.groups,
            causal=True,
            softmax_scale=scale,
            backend=options.backend,
            check_agreement=options.check_agreement,
            recompute_kv=options.recompute_kv,
            schedule=options.schedule,
            inner_chunks=options.inner_chunks,
        )
        return out[..., :v_dim]

    def _packed(self, q: Tensor, k: Tensor, v: Tensor, params: PackedSeqParams) -> Tensor:
        """THD: the global cu_seqlens of the packed row."""
        if params.cu_seqlens_q is None:
            raise ValueError("packed_seq_params.cu_seqlens_q is required for packed SAP attention")
        cu = params.cu_seqlens_q
        for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            other = getattr(params, name, None)
            if other is None or other is cu:
                continue
            if self.groups is not None:  # tokens are permuted: RoPE finds their positions through `cu` itself
                raise ValueError(
                    f"SAP attention with context parallelism needs {name} to be None or the cu_seqlens_q tensor "
                    "itself, as sap_split_batch returns them (RoPE looks each token's position up by that tensor)"
                )
            if not _same_boundaries(other, cu):
                raise ValueError(
                    "SAP attention is self-attention: cu_seqlens_q and cu_seqlens_kv must match"
                    if name == "cu_seqlens_kv"
                    else f"SAP needs no per-document padding; pass {name}=None or equal to cu_seqlens_q"
                )
        if self.groups is not None and split_plan(cu) is None:
            # The tokens must be where the plan of this cu_seqlens puts them; a batch split another
            # way (Megatron's own THD split) would run without error and attend wrongly.
            raise ValueError(
                "SAP attention with context parallelism got packed cu_seqlens that no sap_split_batch made: pass "
                "the PackedSeqParams sap_split_batch (or sap_packed_seq_params) returns, with the same cu_seqlens "
                "tensor (not a copy), and the batch it split"
            )
        return self._attend(q, k, v, cu)

    def _rows(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """SBHD without packed params: every batch row is one sequence (CP size 1 only)."""
        if self.groups is not None:
            raise ValueError(
                "SAP with context parallelism needs packed batches: split them with sap_split_batch "
                "(it returns the packed_seq_params the layers need)"
            )
        s, b = q.shape[:2]
        if k.shape[:2] != (s, b):
            raise ValueError(
                f"SAP attention is self-attention over the same tokens: q has {s} positions, k/v {k.shape[0]} "
                "(a KV cache for inference is not supported)"
            )
        values = list(range(0, (b + 1) * s, s))  # planned from these, not read back from the device
        cu = torch.tensor(values, dtype=torch.int32).to(q.device, non_blocking=True)
        rows = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (q, k, v)]
        out = self._attend(*rows, cu, values)
        return out.reshape(b, s, -1).transpose(0, 1)


def refuse_unsupported_attention(settings: Any) -> None:
    """Raise for settings SAP attention cannot honour, read from a TransformerConfig or Megatron-LM's
    arguments (the same field names): DeepSeek sparse attention, and the per-head max attention
    logits that qk-clip and its logging read after every step."""
    if getattr(settings, "experimental_attention_variant", None) == "dsa":
        raise ValueError("SAP is dense causal attention: it does not support DeepSeek sparse attention "
                         "(experimental_attention_variant 'dsa', --experimental-attention-variant dsa)")
    for flag in ("qk_clip", "log_max_attention_logit"):
        if getattr(settings, flag, False):
            raise ValueError(f"SAP attention does not report the per-head max attention logits that {flag} "
                             f"(--{flag.replace('_', '-')}) needs: drop it")


def _versions(tensors: tuple[Tensor, ...]) -> tuple[int, ...] | None:
    """The tensors' version counters; None where one has none (an inference tensor, which
    inference mode may change in place unseen)."""
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


def _passed_before(check: str, *tensors: Tensor) -> bool:
    """Whether `check` last passed these very tensors, unchanged since (weak references: a
    tensor freed and another made in its place is not taken for it)."""
    known, versions = _PASSED.get(check), _versions(tensors)
    return (known is not None and versions is not None and known[1] == versions
            and all(ref() is t for ref, t in zip(known[0], tensors)))


def _passed(check: str, *tensors: Tensor) -> None:
    """Remember that `check` passed these tensors as they are now (not inference tensors,
    whose changes nothing counts: they are checked every time)."""
    versions = _versions(tensors)
    if versions is not None:
        _PASSED[check] = (tuple(weakref.ref(t) for t in tensors), versions)


def _same_boundaries(other: Tensor, cu: Tensor) -> bool:
    """Whether `other` holds `cu`'s values; the comparison waits for the device, so an equal
    pair is remembered (`_passed_before`)."""
    if _passed_before("same boundaries", other, cu):
        return True
    if not torch.equal(other.to(cu.device), cu):
        return False
    _passed("same boundaries", other, cu)
    return True


def _check_plain_causal(mask: Tensor, seq_len: int) -> None:
    """Refuse an SBHD row's attention mask that hides any token at or before the query.

    Rows of whole sequences attend causally: the future is hidden whatever the mask says
    (as in Transformer Engine's causal attention, which ignores the mask). A mask that
    also hides earlier tokens (`--reset-attention-mask`'s documents), which Megatron's
    local attention would apply, would be ignored: a wrong answer. The comparison waits
    for the device, once per mask: the layers of a step share it. This path runs
    without context parallelism only (SAP's packed rows carry no mask)."""
    if _passed_before("plain causal mask", mask):
        return
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (seq_len, seq_len):
        raise ValueError(f"SAP attention over SBHD rows of {seq_len} positions got an attention_mask of shape "
                         f"{tuple(mask.shape)}; expected [..., {seq_len}, {seq_len}]")
    past = torch.ones(seq_len, seq_len, dtype=torch.bool, device=mask.device).tril_()  # each query's keys
    if bool((mask.bool() & past).any()):  # True: masked out
        raise ValueError(
            "SAP attention over unpacked SBHD rows is plain causal attention: it got an attention_mask that also hides "
            "earlier tokens (e.g. --reset-attention-mask's documents), which it would ignore; pack the rows (THD "
            "with packed_seq_params, as sap_split_batch or the megatron_sap launcher make them) so the documents "
            "come from cu_seqlens, or pass attention_mask=None"
        )
    _passed("plain causal mask", mask)


def _announce(q: Tensor, backend: str, groups: Any, schedule: str) -> None:
    """Log, once per process, which kernel backend, schedule and CP layout SAP attention runs
    with (an "auto" backend that falls back to the torch kernels on a GPU is worth seeing)."""
    global _announced
    _announced = True
    kernels = resolve_backend(backend, q.device, q.dtype, q.shape[-1])
    layout = "no context parallelism" if groups is None else f"CP {groups.inner_size} inner x {groups.outer_size} outer"
    logger.info("megatron-sap: SAP core attention, %s, kernels %r (backend=%r) on %s in %s, schedule %r",
                layout, kernels, backend, q.device, q.dtype, schedule)
