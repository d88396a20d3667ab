"""Single-process tests of the Megatron layer pieces: core attention, RoPE, specs, batch split."""
from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.common.embeddings import rope_utils  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.multi_token_prediction import get_mtp_layer_spec  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_sap.megatron import (  # noqa: E402
    SAPDotProductAttention,
    cu_seqlens_from_position_ids,
    rotate_by_positions,
    sap_loss,
    sap_split_batch,
    swap_core_attention,
    use_sap_core_attention,
)
from megatron_sap.megatron.rope import _sap_apply_rotary_pos_emb, install_sap_rope, token_positions  # noqa: E402
from megatron_sap.reference import dense_attention  # noqa: E402

CU = [0, 5, 6, 19, 32]
ONE_RANK = SimpleNamespace(cp=SimpleNamespace(size=lambda: 1, rank=lambda: 0))


def _config(**overrides) -> TransformerConfig:
    values = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, attention_dropout=0.0, use_cpu_initialization=True,
    )
    values.update(overrides)
    return TransformerConfig(**values)


def _attention(**kwargs) -> SAPDotProductAttention:
    args = dict(config=_config(), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                pg_collection=ONE_RANK)
    args.update(kwargs)
    return SAPDotProductAttention(**args)


def _qkv(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, 4, 16, generator=gen), torch.randn(tokens, 2, 16, generator=gen),
            torch.randn(tokens, 2, 16, generator=gen))


def _params(cu: list[int], **overrides) -> PackedSeqParams:
    cu_t = torch.tensor(cu, dtype=torch.int32)
    values = dict(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, max_seqlen_q=13, max_seqlen_kv=13)
    values.update(overrides)
    return PackedSeqParams(**values)


def test_thd_matches_dense_reference_with_gqa() -> None:
    q, k, v = _qkv(CU[-1])
    out = _attention()(q, k, v, None, packed_seq_params=_params(CU))
    expected, _ = dense_attention(q.double(), k.double(), v.double(), torch.tensor(CU))
    assert out.shape == (CU[-1], 64)
    torch.testing.assert_close(out, expected.float().flatten(1), rtol=1e-5, atol=1e-5)


def test_first_call_logs_the_kernels_once(monkeypatch, caplog) -> None:
    from megatron_sap.megatron import attention

    monkeypatch.setattr(attention, "_announced", False)
    q, k, v = _qkv(CU[-1])
    with caplog.at_level("INFO", logger=attention.__name__):
        for _ in range(2):
            _attention()(q, k, v, None, packed_seq_params=_params(CU))
    lines = [r.getMessage() for r in caplog.records if "megatron-sap" in r.getMessage()]
    assert len(lines) == 1 and "kernels 'torch' (backend='auto')" in lines[0] and "no context parallelism" in lines[0]
    assert "schedule 'auto'" in lines[0]


@pytest.mark.parametrize("qk_dim, v_dim", [(24, 16), (16, 24)], ids=["mla-values-smaller", "values-larger"])
def test_value_head_dim_may_differ(qk_dim: int, v_dim: int) -> None:
    """MLA: values have their own head dim; output and gradients match the dense reference."""
    gen = torch.Generator().manual_seed(5)
    total = CU[-1]
    q = torch.randn(total, 4, qk_dim, generator=gen, requires_grad=True)
    k = torch.randn(total, 4, qk_dim, generator=gen, requires_grad=True)
    v = torch.randn(total, 4, v_dim, generator=gen, requires_grad=True)
    out = _attention()(q, k, v, None, packed_seq_params=_params(CU))
    assert out.shape == (total, 4 * v_dim)
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected, _ = dense_attention(*leaves, torch.tensor(CU))
    expected.flatten(1).backward(grad.double())
    torch.testing.assert_close(out, expected.float().flatten(1), rtol=1e-5, atol=1e-5)
    for got, leaf in zip((q.grad, k.grad, v.grad), leaves):
        torch.testing.assert_close(got, leaf.grad.float(), rtol=1e-5, atol=1e-5)


def test_sbhd_rows_are_separate_sequences() -> None:
    s, b = 8, 3
    q, k, v = (t.reshape(b, s, *t.shape[1:]).transpose(0, 1) for t in _qkv(s * b, seed=1))
    out = _attention()(q, k, v, None)
    assert out.shape == (s, b, 64)
    for row in range(b):
        expected, _ = dense_attention(q[:, row].double(), k[:, row].double(), v[:, row].double(), torch.tensor([0, s]))
        torch.testing.assert_close(out[:, row], expected.float().flatten(1), rtol=1e-5, atol=1e-5)


def test_packed_sbhd_with_batch_one() -> None:
    q, k, v = (t.unsqueeze(1) for t in _qkv(CU[-1], seed=2))
    out = _attention()(q, k, v, None, packed_seq_params=_params(CU, qkv_format="sbhd"))
    expected, _ = dense_attention(q[:, 0].double(), k[:, 0].double(), v[:, 0].double(), torch.tensor(CU))
    assert out.shape == (CU[-1], 1, 64)
    torch.testing.assert_close(out[:, 0], expected.float().flatten(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(config=_config(attention_dropout=0.1)), "attention_dropout"),
        (dict(attn_mask_type=AttnMaskType.no_mask), "causal"),
        (dict(attention_type="cross"), "attention_type 'cross'"),
        (dict(cp_comm_type="p2p"), "cp_comm_type"),
    ],
)
def test_unsupported_construction_is_rejected(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        _attention(**kwargs)


def test_bad_forward_inputs_are_rejected() -> None:
    attn = _attention()
    q, k, v = _qkv(CU[-1])
    with pytest.raises(ValueError, match="attention_bias"):
        attn(q, k, v, None, attention_bias=torch.zeros(1), packed_seq_params=_params(CU))
    other = torch.tensor([0, 16, 32], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        attn(q, k, v, None, packed_seq_params=_params(CU, cu_seqlens_kv=other))
    with pytest.raises(ValueError, match="padding"):
        attn(q, k, v, None, packed_seq_params=_params(CU, cu_seqlens_q_padded=other))
    with pytest.raises(ValueError, match="tokens"):
        attn(q[:-4], k[:-4], v[:-4], None, packed_seq_params=_params(CU))
    rows = [t[:16].reshape(8, 2, *t.shape[1:]) for t in (q, k, v)]  # SBHD, two unpacked rows of 8
    padding = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="takes no padding mask"):
        attn(*rows, padding, attn_mask_type=AttnMaskType.padding_causal)
    assert attn(*rows, padding, attn_mask_type=AttnMaskType.causal).shape == (8, 2, q.shape[1] * q.shape[2])


def test_sbhd_mask_hiding_earlier_tokens_is_refused() -> None:
    """Megatron's local attention applies the mask it gets; SAP's SBHD rows attend causally,
    so a mask of documents (as --reset-attention-mask makes) must be refused, not ignored."""
    attn = _attention()
    q, k, v = _qkv(16)
    rows = [t.reshape(8, 2, *t.shape[1:]) for t in (q, k, v)]
    future = torch.ones(8, 8, dtype=torch.bool).triu(1)  # True: masked out
    plain = future.expand(2, 1, 8, 8)
    torch.testing.assert_close(attn(*rows, plain), attn(*rows, None))
    documents = future.clone()
    documents[5:, :5] = True  # tokens 5.. start a document of their own
    with pytest.raises(ValueError, match="hides earlier tokens.*pack the rows"):
        attn(*rows, documents.expand(2, 1, 8, 8))
    plain_again = future.expand(2, 1, 8, 8).clone()
    attn(*rows, plain_again)  # checked and remembered ...
    plain_again.copy_(documents.expand(2, 1, 8, 8))  # ... until it changes
    with pytest.raises(ValueError, match="hides earlier tokens"):
        attn(*rows, plain_again)
    with pytest.raises(ValueError, match="attention_mask of shape"):
        attn(*rows, future[:4, :4])


def test_sparse_and_logit_reporting_attention_are_refused() -> None:
    with pytest.raises(ValueError, match="DeepSeek sparse attention"):
        _attention(config=SimpleNamespace(**{**vars(_config()), "experimental_attention_variant": "dsa"}))
    for flag in ("qk_clip", "log_max_attention_logit"):
        with pytest.raises(ValueError, match=f"max attention logits that {flag}"):
            _attention(config=SimpleNamespace(**{**vars(_config()), flag: True}))
    with pytest.warns(UserWarning, match="not FP8"):
        _attention(config=SimpleNamespace(**{**vars(_config()), "fp8_dot_product_attention": True}))


def test_swap_refuses_a_core_attention_that_is_not_dense() -> None:
    class DSAttention(torch.nn.Module):
        pass

    class KitchenFlashAttention(torch.nn.Module):  # dense, under another backend's name
        pass

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=DSAttention)
    with pytest.raises(ValueError, match="core_attention is DSAttention, which SAP .* cannot replace"):
        swap_core_attention(spec)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=torch.nn.Module, submodules=object())
    with pytest.raises(ValueError, match="core_attention is Module with submodules"):
        swap_core_attention(spec)
    spec.submodules.self_attention.submodules.core_attention = KitchenFlashAttention
    assert _core_attentions(swap_core_attention(spec), []) == [SAPDotProductAttention]


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_positions_match_megatron_thd_rope_at_cp1(interleaved: bool, mla: bool) -> None:
    """Rotating a permuted row by registered positions equals Megatron's own THD RoPE, permuted
    (MLA's too, which de-interleaves the rotary half first)."""
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(CU[-1], 4, 16, generator=gen)
    freqs = torch.rand(13, 1, 1, 16, generator=gen) * 10
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=interleaved, multi_latent_attention=mla)
    one_rank = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    cu = torch.tensor(CU, dtype=torch.int32)
    extra = {}
    if mla and "mla_rotary_interleaved" in inspect.signature(rope_utils.apply_rotary_pos_emb).parameters:
        extra["mla_rotary_interleaved"] = True  # core_v0.19 on: MLA's de-interleaving is this argument
    expected = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=one_rank, **extra)

    order = torch.randperm(CU[-1], generator=gen)
    starts = torch.tensor(CU[:-1]).repeat_interleave(torch.diff(torch.tensor(CU)))
    positions = (torch.arange(CU[-1]) - starts)[order]
    got = rotate_by_positions(t[order], freqs, positions, interleaved=interleaved, multi_latent_attention=mla)
    torch.testing.assert_close(got, expected[order])


def test_installed_rope_only_changes_registered_batches() -> None:
    from megatron.core.transformer import attention

    install_sap_rope()
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    one_rank = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    t = torch.randn(CU[-1], 2, 8)
    freqs = torch.rand(13, 1, 1, 8)
    unregistered = torch.tensor(CU, dtype=torch.int32)
    torch.testing.assert_close(
        attention.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=unregistered, cp_group=one_rank),
        rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=unregistered, cp_group=one_rank),
    )
    two_ranks = SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    with pytest.raises(ValueError, match="no sap_split_batch call registered"):  # Megatron's layout would be wrong here
        attention.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=unregistered, cp_group=two_ranks)
    row_freqs = torch.rand(CU[-1], 1, 1, 8)
    torch.testing.assert_close(  # no packed batch: Megatron's
        attention.apply_rotary_pos_emb(t[:, None], row_freqs, config, cp_group=two_ranks),
        rope_utils.apply_rotary_pos_emb(t[:, None], row_freqs, config, cp_group=two_ranks),
    )
    tokens = torch.arange(CU[-1]).unsqueeze(0)
    _, params = sap_split_batch({"tokens": tokens}, CU)
    positions = token_positions(params.cu_seqlens_q)
    torch.testing.assert_close(
        attention.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=params.cu_seqlens_q, cp_group=one_rank),
        rotate_by_positions(t, freqs, positions),
    )
    whole_row = torch.randn(2 * CU[-1], 2, 8)  # the split's params with a row it did not split
    with pytest.raises(ValueError, match=f"SAP's RoPE got {2 * CU[-1]} tokens of a packed row whose batch split gave "
                                         f"this rank {CU[-1]}: run the model on the local batch"):
        attention.apply_rotary_pos_emb(whole_row, freqs, config, cu_seqlens=params.cu_seqlens_q, cp_group=one_rank)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("mscale", [1.0, 0.7])
def test_installed_rope_rotates_each_document_as_megatron_rotates_it_alone(interleaved: bool, mscale: float) -> None:
    """The installed RoPE on a split batch (CP 1) against Megatron-Core's own rotation of each
    document run alone as a sequence, with the config's interleaving and the caller's mscale."""
    from megatron.core.transformer import attention

    install_sap_rope()
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=interleaved, multi_latent_attention=False)
    one_rank = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    t = torch.randn(CU[-1], 2, 8, dtype=torch.float64)
    freqs = torch.rand(13, 1, 1, 8, dtype=torch.float64) * 6
    _, params = sap_split_batch({"tokens": torch.arange(CU[-1]).unsqueeze(0)}, CU)
    rotated = attention.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=params.cu_seqlens_q, mscale=mscale,
                                             cp_group=one_rank)
    for start, end in zip(CU, CU[1:]):
        alone = rope_utils.apply_rotary_pos_emb(t[start:end, None], freqs[: end - start], config, mscale=mscale,
                                                cp_group=one_rank)
        torch.testing.assert_close(rotated[start:end], alone[:, 0], rtol=1e-12, atol=1e-12)


def test_rope_takes_the_mla_interleaving_argument_of_newer_releases() -> None:
    """megatron-core 0.19 passes `mla_rotary_interleaved` (True from multi-latent attention)
    instead of reading `config.multi_latent_attention`: a SAP batch is rotated by it, any other
    call gets it passed on; an argument the rotation does not know is refused on a SAP batch
    (never silently ignored) and passed on otherwise."""
    calls = []

    def megatron_rope(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, **kwargs):
        calls.append(kwargs)
        return t

    rope = _sap_apply_rotary_pos_emb(megatron_rope)
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    one_rank = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    t = torch.randn(CU[-1], 2, 8)
    freqs = torch.rand(13, 1, 1, 8)
    _, params = sap_split_batch({"tokens": torch.arange(CU[-1]).unsqueeze(0)}, CU)
    cu, positions = params.cu_seqlens_q, token_positions(params.cu_seqlens_q)
    for mla in (True, False):
        torch.testing.assert_close(rope(t, freqs, config, cu_seqlens=cu, cp_group=one_rank, mla_rotary_interleaved=mla),
                                   rotate_by_positions(t, freqs, positions, multi_latent_attention=mla))
    mla_config = SimpleNamespace(**{**vars(config), "multi_latent_attention": True})  # releases before 0.19
    torch.testing.assert_close(rope(t, freqs, mla_config, cu_seqlens=cu, cp_group=one_rank),
                               rotate_by_positions(t, freqs, positions, multi_latent_attention=True))
    assert not calls
    with pytest.raises(TypeError, match="does not support the argument.*future_flag"):
        rope(t, freqs, config, cu_seqlens=cu, cp_group=one_rank, future_flag=1)
    rope(t, freqs, config, mla_rotary_interleaved=True, future_flag=1)  # not a SAP batch: Megatron's
    rope(t, freqs, config)
    assert calls == [{"mla_rotary_interleaved": True, "future_flag": 1}, {}]


def test_split_batch_slices_by_plan_and_builds_packed_params() -> None:
    tokens = torch.arange(100, 100 + CU[-1]).unsqueeze(0)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(1, CU[-1]),
             "position_ids": torch.arange(CU[-1]).unsqueeze(0), "attention_mask": torch.ones(1, 1, 32, 32)}
    local, params = sap_split_batch(batch, CU)
    order = local["tokens"][0] - 100
    assert sorted(order.tolist()) == list(range(CU[-1]))
    assert torch.equal(local["labels"], local["tokens"] + 1)
    starts = torch.tensor(CU[:-1]).repeat_interleave(torch.diff(torch.tensor(CU)))
    assert torch.equal(local["position_ids"][0], (torch.arange(CU[-1]) - starts)[order])
    assert local["attention_mask"] is None
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == CU
    assert params.max_seqlen_q == params.max_seqlen_kv == 13
    assert params.cu_seqlens_q_padded is None and getattr(params, "cp_group", None) is None  # cp_group: 0.16+


def test_split_batch_leaves_the_packing_entries_as_they_are() -> None:
    """A THD batch that still holds its packing (as Megatron's data loaders build it) splits
    like one without: those entries, a sample's one-element metadata (a blend's `dataset_id`)
    and non-tensors come back unchanged."""
    tokens = torch.arange(CU[-1]).unsqueeze(0)
    cu = torch.tensor([CU], dtype=torch.int32)
    max_seqlen = torch.tensor([13], dtype=torch.int32)
    dataset_id = torch.tensor([1], dtype=torch.int16)  # a blended dataset's, collated (kept from core_v0.18)
    batch = {"tokens": tokens, "cu_seqlens": cu, "cu_seqlens_padded": cu, "max_seqlen": max_seqlen, "step": 3,
             "dataset_id": dataset_id}
    local, params = sap_split_batch(batch, cu)
    plain, _ = sap_split_batch({"tokens": tokens}, CU)
    assert torch.equal(local["tokens"], plain["tokens"])
    assert local["cu_seqlens"] is cu and local["cu_seqlens_padded"] is cu and local["max_seqlen"] is max_seqlen
    assert local["step"] == 3 and local["dataset_id"] is dataset_id and params.cu_seqlens_q.tolist() == CU
    with pytest.raises(ValueError, match=r"batch\['labels'\] must be \[1, T\]"):  # a sequence entry is no metadata
        sap_split_batch({"tokens": tokens, "labels": tokens[0]}, CU)


def test_split_batch_drops_the_empty_documents_that_pad_an_sft_rows_boundaries() -> None:
    """SFT rows (Megatron-LM core_v0.19) pad `cu_seqlens` with repeats of the row length: the split
    plans without those documents of no tokens (the same layout), empty documents inside the row stay."""
    tokens = torch.arange(CU[-1]).unsqueeze(0)
    padded = torch.tensor([[*CU, *[CU[-1]] * 40]], dtype=torch.int32)
    local, params = sap_split_batch({"tokens": tokens}, padded)
    plain, _ = sap_split_batch({"tokens": tokens}, CU)
    assert torch.equal(local["tokens"], plain["tokens"]) and params.cu_seqlens_q.tolist() == CU
    inner_empty = [0, 0, 5, 5, 19, CU[-1]]
    assert sap_split_batch({"tokens": tokens}, [*inner_empty, CU[-1]])[1].cu_seqlens_q.tolist() == inner_empty


@pytest.mark.parametrize(
    "batch, cu, match",
    [
        ({"tokens": torch.zeros(2, 32, dtype=torch.long)}, CU, r"\[1, T\]"),
        ({"tokens": torch.zeros(1, 32), "labels": torch.zeros(1, 31)}, CU, "disagree"),
        ({"tokens": torch.zeros(1, 30)}, CU, "batch length"),
        ({"tokens": torch.zeros(1, 32)}, [0, 20, 10, 32], "non-decreasing"),
        ({"attention_mask": None}, CU, "no tensors"),
    ],
)
def test_split_batch_rejects_bad_input(batch, cu, match) -> None:
    with pytest.raises(ValueError, match=match):
        sap_split_batch(batch, cu)


def test_packed_seq_params_take_boundaries_as_a_list_or_a_tensor() -> None:
    from megatron_sap.megatron import sap_packed_seq_params

    cpu = torch.device("cpu")
    by_list = sap_packed_seq_params(CU, cpu)
    for given in (torch.tensor(CU), torch.tensor([CU], dtype=torch.int32)):
        params = sap_packed_seq_params(given, cpu)
        assert torch.equal(params.cu_seqlens_q, by_list.cu_seqlens_q) and params.max_seqlen_q == by_list.max_seqlen_q
    with pytest.raises(ValueError, match="cu_seqlens"):
        sap_packed_seq_params(torch.tensor([], dtype=torch.int64), cpu)


def test_cu_seqlens_from_reset_position_ids() -> None:
    position_ids = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    assert cu_seqlens_from_position_ids(position_ids).tolist() == [0, 3, 4, 8]
    with pytest.raises(ValueError, match="position 0"):
        cu_seqlens_from_position_ids(torch.tensor([[1, 2, 0]]))
    with pytest.raises(ValueError, match="empty row"):
        cu_seqlens_from_position_ids(torch.zeros(1, 0, dtype=torch.long))


def test_loss_is_the_token_mean_on_one_rank() -> None:
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    loss, mean = sap_loss(losses, mask)
    assert float(loss.detach()) == pytest.approx(8 / 3) and float(mean) == pytest.approx(8 / 3)
    loss.backward()
    torch.testing.assert_close(losses.grad, mask / 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_loss_of_half_precision_losses_is_summed_in_fp32(dtype) -> None:
    """A 128K-token row's sum overflows fp16 (and its count rounds in bf16): the sums run in fp32."""
    losses = torch.full((1, 70000), 2.0, dtype=dtype)
    losses[0, 0] = 100.0
    loss, mean = sap_loss(losses, torch.ones(1, 70000))
    want = (2.0 * 69999 + 100.0) / 70000
    assert loss.dtype == torch.float32
    assert float(loss) == pytest.approx(want, rel=1e-6) and float(mean) == pytest.approx(want, rel=1e-6)


def _core_attentions(node, found: list) -> list:
    """Every core_attention entry below a spec (test-side walk, independent of the swap code)."""
    if isinstance(node, (list, tuple)):
        for item in node:
            _core_attentions(item, found)
    elif isinstance(node, ModuleSpec):
        _core_attentions(node.submodules, found)
    elif hasattr(node, "__dataclass_fields__") and not isinstance(node, type):
        for name in node.__dataclass_fields__:
            value = getattr(node, name)
            if name == "core_attention":
                found.append(value)
            else:
                _core_attentions(value, found)
    return found


@pytest.mark.parametrize(
    "spec_kwargs", [{}, {"num_experts": 4}, {"multi_latent_attention": True}], ids=["dense", "moe", "mla"]
)
def test_swap_core_attention_in_layer_specs(spec_kwargs) -> None:
    spec = get_gpt_layer_local_spec(**spec_kwargs)
    swapped = swap_core_attention(spec)
    assert _core_attentions(swapped, []) == [SAPDotProductAttention]
    assert SAPDotProductAttention not in _core_attentions(spec, [])  # the input spec is left alone


def test_swap_core_attention_in_mtp_layer_spec() -> None:
    mtp = get_mtp_layer_spec(get_gpt_layer_local_spec(), use_transformer_engine=False)
    found = _core_attentions(swap_core_attention(mtp), [])
    assert found and all(c is SAPDotProductAttention for c in found)


def test_swap_core_attention_rejects_specs_without_attention() -> None:
    with pytest.raises(ValueError, match="no core_attention"):
        swap_core_attention(ModuleSpec(module=torch.nn.Identity))


def test_provider_patch_covers_spec_builders_and_undoes() -> None:
    undo = use_sap_core_attention()
    try:
        assert _core_attentions(get_gpt_layer_local_spec(num_experts=2), []) == [SAPDotProductAttention]
    finally:
        undo()
    assert SAPDotProductAttention not in _core_attentions(get_gpt_layer_local_spec(), [])


def test_te_layer_spec_gets_sap_core_attention() -> None:
    pytest.importorskip("transformer_engine", reason="the TE layer spec needs Transformer Engine")
    from megatron_sap.megatron import get_gpt_layer_sap_spec

    assert _core_attentions(get_gpt_layer_sap_spec(use_transformer_engine=True), []) == [SAPDotProductAttention]


def test_te_layer_spec_without_transformer_engine_says_so(monkeypatch) -> None:
    import importlib.util

    from megatron_sap.megatron import get_gpt_layer_sap_spec

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine" else real(name, *a))
    with pytest.raises(ImportError, match="needs Transformer Engine"):
        get_gpt_layer_sap_spec(use_transformer_engine=True)


def test_layers_reuse_the_split_plan_without_replanning(monkeypatch) -> None:
    import megatron_sap

    tokens = torch.arange(CU[-1]).unsqueeze(0)
    _, params = sap_split_batch({"tokens": tokens}, CU)
    monkeypatch.setattr(megatron_sap, "plan_sequences", lambda *a, **k: pytest.fail("layer re-planned the batch"))
    q, k, v = _qkv(CU[-1])
    assert _attention()(q, k, v, None, packed_seq_params=params).shape == (CU[-1], 64)


def test_split_rows_run_rope_and_attention_without_host_reads() -> None:
    """After the batch split, SAP's RoPE and core attention read no tensor values on the
    host in forward or backward (each read would be a host sync per layer on a GPU;
    `sap_cases.host_reads_recorded`)."""
    from megatron.core.transformer import attention

    from sap_cases import host_reads_recorded

    install_sap_rope()
    tokens = torch.arange(CU[-1]).unsqueeze(0)
    _, params = sap_split_batch({"tokens": tokens}, CU)
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    freqs = torch.rand(13, 1, 1, 16)
    layer = _attention()
    calls: list[str] = []
    for recorded in (False, True):  # the first call logs the kernels and compiles the program
        q, k, v = (t.requires_grad_() for t in _qkv(CU[-1]))
        with host_reads_recorded(calls) if recorded else contextlib.nullcontext():
            q_rot, k_rot = (attention.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=params.cu_seqlens_q,
                                                           cp_group=ONE_RANK.cp) for t in (q, k))
            layer(q_rot, k_rot, v, None, packed_seq_params=params).sum().backward()
    assert calls == []
    assert q.grad is not None and k.grad is not None


def test_layers_after_the_first_read_no_tensor_values_in_sbhd_rows_and_copied_boundaries() -> None:
    """Unpacked SBHD rows (with a plain causal mask), and THD params whose cu_seqlens_kv is an
    equal copy of cu_seqlens_q: the first layer of a step may compare on the host, the next
    layers of the step read nothing back (a host sync per layer on a GPU)."""
    from sap_cases import host_reads_recorded

    s, b = 8, 2
    rows = [t.reshape(b, s, *t.shape[1:]).transpose(0, 1) for t in _qkv(s * b, seed=4)]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s)
    cu = torch.tensor(CU, dtype=torch.int32)
    params = _params(CU, cu_seqlens_q=cu, cu_seqlens_kv=cu.clone())
    packed = _qkv(CU[-1], seed=5)
    first, second = _attention(layer_number=1), _attention(layer_number=2)
    first(*rows, mask)
    first(*packed, None, packed_seq_params=params)
    calls: list[str] = []
    with host_reads_recorded(calls):
        second(*rows, mask)
        second(*packed, None, packed_seq_params=params)
    assert calls == []


def test_inference_tensors_are_checked_on_every_call() -> None:
    """Tensors made in inference mode have no version counter, so the checks that remember
    an input they passed (a plain causal mask, a cu_seqlens_kv equal to cu_seqlens_q) check
    them on every call: they crashed there, and an in-place change must still be seen."""
    s = 8
    rows = [t.unsqueeze(1) for t in _qkv(s, seed=4)]
    packed = _qkv(CU[-1], seed=5)
    cu = torch.tensor(CU, dtype=torch.int32)
    layer = _attention()
    with torch.no_grad():
        expected_rows = layer(*rows, torch.ones(1, 1, s, s, dtype=torch.bool).triu(1))
        expected_packed = layer(*packed, None, packed_seq_params=_params(CU, cu_seqlens_q=cu, cu_seqlens_kv=cu.clone()))
    with torch.inference_mode():
        mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
        cu_q, cu_kv = cu.clone(), cu.clone()
        params = _params(CU, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
        for _ in range(2):
            assert torch.equal(layer(*rows, mask), expected_rows)
            assert torch.equal(layer(*packed, None, packed_seq_params=params), expected_packed)
        mask[0, 0, 5, 2] = True
        with pytest.raises(ValueError, match="hides earlier tokens"):
            layer(*rows, mask)
        cu_kv[1] += 1
        with pytest.raises(ValueError, match="cu_seqlens_kv"):
            layer(*packed, None, packed_seq_params=params)


def test_layers_run_the_schedule_of_the_options(monkeypatch) -> None:
    """`--sap-schedule` reaches `sap_attention` through the options."""
    import megatron_sap
    from megatron_sap.megatron.options import reset_sap_options, set_sap_options

    seen = []
    real = megatron_sap.sap_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["schedule"])
        return real(*args, **kwargs)

    monkeypatch.setattr(megatron_sap, "sap_attention", spy)
    q, k, v = _qkv(CU[-1])
    try:
        for schedule in ("gathered", "pipelined", "auto"):
            set_sap_options(schedule=schedule)
            _attention()(q, k, v, None, packed_seq_params=_params(CU))
    finally:
        reset_sap_options()
    assert seen == ["gathered", "pipelined", "auto"]
    with pytest.raises(ValueError, match="unknown SAP schedule 'ring'"):
        set_sap_options(schedule="ring")
    reset_sap_options()


# ---- settings under which SAP would be silently wrong ---------------------------------------------
def _two_ranks(monkeypatch) -> None:
    """Layers built from here on see a CP group of two ranks (no process group needed to build one)."""
    import megatron_sap.megatron.attention as attention_module

    groups = SimpleNamespace(inner_size=1, outer_size=2, world_size=2, cp_rank=0)
    monkeypatch.setattr(attention_module, "sap_groups_from_pg_collection", lambda pg: groups)


def test_mla_with_fused_rope_is_refused_under_context_parallelism(monkeypatch) -> None:
    """MLA's fused RoPE kernels place tokens by Megatron's own CP layout, not SAP's."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, attention_dropout=0.0,
        use_cpu_initialization=True, apply_rope_fusion=True,
    )
    _attention(config=config)  # one rank: tokens are not permuted, the fused kernels are right
    _two_ranks(monkeypatch)
    with pytest.raises(ValueError, match="apply_rope_fusion=False for MLA"):
        _attention(config=config)


def _mla_config():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, attention_dropout=0.0,
        use_cpu_initialization=True, apply_rope_fusion=False,
    )


def _yarn_config():
    config = _config()
    config.yarn_rotary_scaling_factor = 4.0  # as the training code sets it for GPTModel's YaRN
    return config


@pytest.mark.parametrize("make_config, keeps_table, message", [
    (_mla_config, "mla_keeps_packed_rope_table", "megatron-core 0.14 or later for multi-latent attention"),
    (_yarn_config, "gpt_yarn_keeps_packed_rope_table", "megatron-core 0.16 or later for YaRN"),
], ids=["mla", "gpt-yarn"])
def test_rotary_tables_cut_to_megatrons_layout_are_refused_under_context_parallelism(
        monkeypatch, make_config, keeps_table, message) -> None:
    """megatron-core 0.13's MLA and 0.15's GPTModel YaRN cut the rotary table to Megatron's own
    CP layout: refused there under CP, built on later releases and at CP 1 (`make test-compat`
    runs those releases); a model without either is built under CP on every release."""
    from megatron_sap.megatron import compat

    config = make_config()
    _attention(config=config)
    _two_ranks(monkeypatch)
    _attention()  # neither
    if getattr(compat, keeps_table)():
        _attention(config=config)
    else:
        with pytest.raises(ValueError, match=message):
            _attention(config=config)


def test_multi_token_prediction_is_refused_under_context_parallelism(monkeypatch) -> None:
    """Megatron shifts MTP's labels along its own CP layout: under SAP the model would train on
    wrong targets, so the layers of an MTP model refuse CP > 1 (at CP 1 they are built)."""
    _attention(config=_config(mtp_num_layers=1))
    _two_ranks(monkeypatch)
    with pytest.raises(ValueError, match="does not support multi-token prediction"):
        _attention(config=_config(mtp_num_layers=1))


@pytest.mark.parametrize("name", ["cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"])
def test_boundaries_must_be_the_split_tensor_under_context_parallelism(monkeypatch, name) -> None:
    """RoPE finds a token's position through the cu_seqlens tensor the batch split registered;
    an equal copy would miss it and rotate by Megatron's own layout."""
    _two_ranks(monkeypatch)
    attn = _attention()
    q, k, v = _qkv(16)
    params = _params([0, 7, 16])
    setattr(params, name, params.cu_seqlens_q.clone())
    with pytest.raises(ValueError, match=f"needs {name} to be None or the cu_seqlens_q tensor itself"):
        attn(q, k, v, None, packed_seq_params=params)


def test_packed_params_no_split_made_are_refused_under_context_parallelism(monkeypatch) -> None:
    """Parameters built by hand (or a batch split by Megatron's own THD split): the tokens are not
    where the plan of their cu_seqlens puts them, so attention would run and be wrong."""
    _two_ranks(monkeypatch)
    q, k, v = _qkv(16)
    with pytest.raises(ValueError, match="got packed cu_seqlens that no sap_split_batch made"):
        _attention()(q, k, v, None, packed_seq_params=_params([0, 7, 16]))


def test_a_layer_on_other_levels_than_the_split_is_refused() -> None:
    """A layer built with other CP levels than the batch split would read tokens in another order."""
    from megatron_sap.megatron.plans import plan_for

    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    plan_for(cu, None)
    with pytest.raises(ValueError, match="split for SAP levels 1 x 1, but a layer runs with 1 x 2"):
        plan_for(cu, SimpleNamespace(inner_size=1, outer_size=2))


def test_rows_need_keys_for_every_query() -> None:
    q = torch.randn(8, 1, 4, 16)
    k = v = torch.randn(12, 1, 2, 16)
    with pytest.raises(ValueError, match="KV cache for inference is not supported"):
        _attention()(q, k, v, None)
