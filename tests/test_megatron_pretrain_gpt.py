"""Megatron-LM's own `pretrain_gpt.get_batch`, `forward_step` and `loss_func` through the SAP hooks.

Gated on a Megatron-LM checkout ($MEGATRON_LM_PATH, any tag from core_v0.13 to core_v0.19, with its
megatron-core first on PYTHONPATH; see docs/megatron.md). `initialize_megatron` stops at its CUDA
check on CPU, so the job sets up what it would (the parsed args, the timers, model parallelism
through the hooked `initialize_model_parallel`) and calls the script's functions directly, with
`.cuda()` a no-op and the CPU as the current device. A packed row of three documents (restarting position ids, as GPTDataset
gives them with --reset-position-ids) must give the summed loss of its documents run one at a
time, at CP 1 and at CP 2 (there through Megatron's data loader, which plans the row).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator, Sequence
from unittest import mock

import pytest
import torch

from dist_pool import make_pool_fixture

pytest.importorskip("megatron.core")
MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
pytestmark = pytest.mark.skipif(not MEGATRON_LM, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.13 to v0.19)")

pool2 = make_pool_fixture(2, timeout=300, destroy_job_groups=True)

ROW = 64
DOCUMENTS = (0, 20, 27, ROW)


def _flags(cp: int) -> list[str]:
    return (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
            f"--kv-channels 16 --ffn-hidden-size 128 --swiglu --normalization RMSNorm --disable-bias-linear "
            f"--seq-length {ROW} --max-position-embeddings 4096 --micro-batch-size 1 --attention-dropout 0 "
            f"--context-parallel-size {cp} --cp-comm-type sap --reset-position-ids --reset-attention-mask --calculate-per-token-loss "
            "--sap-log-interval 1 --no-rope-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-masked-softmax-fusion "
            "--no-gradient-accumulation-fusion").split()


def _sample(documents: tuple[int, ...] = DOCUMENTS) -> dict:
    """The packed row: three documents (`documents`: their cu_seqlens), position ids restarting
    at each (as GPTDataset gives them with --reset-position-ids)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, ROW + 1), generator=generator)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(documents, documents[1:])]).unsqueeze(0)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, ROW), "position_ids": positions}


@contextlib.contextmanager
def _on_cpu() -> Iterator[None]:
    """The script's GPU calls on the CPU: `.cuda()` a no-op, the CPU as the current device."""
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self), \
            mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        yield


def _set_args(flags: list[str], rank: int, world_size: int) -> object:
    """Megatron-LM's parsed args (with the SAP flags) and timers, as `initialize_megatron` sets them."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args

    from megatron_sap.megatron import add_sap_args

    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *flags]):
        args = parse_args(add_sap_args)
    args.rank, args.world_size, args.params_dtype = rank, world_size, torch.float32
    global_vars.set_args(args)
    global_vars._GLOBAL_TIMERS = None
    global_vars._set_timers(args)
    return args


def _hooked_pretrain_gpt():
    """The checkout's `pretrain_gpt` module, imported with the SAP training hooks installed."""
    sys.path.insert(0, MEGATRON_LM)
    from megatron_sap.megatron.hooks import install_training_hooks

    install_training_hooks()
    import pretrain_gpt

    return pretrain_gpt


def _forward_step(pretrain_gpt):
    """The script's `forward_step` as the hooked `pretrain` hands it to Megatron's schedules: from
    core_v0.18 with its data iterator recorded (`hooks.wrap_forward_step`)."""
    import megatron.training.utils as training_utils

    from megatron_sap.megatron.compat import training_layout
    from megatron_sap.megatron.hooks import wrap_forward_step

    if training_layout(training_utils) == "core-utils":
        return wrap_forward_step(pretrain_gpt.forward_step)
    return pretrain_gpt.forward_step


def run_pretrain_gpt_rank(rank: int, world_size: int, patched_script: str | None = None, rows: str = "pretraining",
                          choose_by: str = "estimate") -> dict:
    """(summed loss, loss tokens) of this rank's share of the row at CP 1 (every rank alone) and at
    CP 2, from the script's `forward_step` and loss function; and the summed loss of the
    documents run one at a time. The checkout's script through the hooks, or `patched_script`
    (the fork patch applied) without them, SAP configured as its patched initialize.py does. With
    `rows` other than pretraining, the row is `_row_with_cu_seqlens` (see `ROWS`); `choose_by`:
    --sap-choose-by."""
    import importlib.util

    sys.path.insert(0, MEGATRON_LM)
    from megatron_sap.megatron.hooks import configure_sap, install_training_hooks

    if patched_script is None:
        install_training_hooks()
        import pretrain_gpt
    else:
        spec = importlib.util.spec_from_file_location("pretrain_gpt", patched_script)
        pretrain_gpt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pretrain_gpt)
    from megatron.core import mpu

    from megatron_sap.megatron.demo_train import build_tiny_gpt
    from megatron_sap.megatron.options import reset_sap_options

    torch.set_num_threads(1)
    sample = _row(rows)
    losses = {}
    summary = logging.getLogger("megatron_sap.megatron.summary")
    lines = _Lines()
    summary.addHandler(lines)
    summary.setLevel(logging.INFO)
    with _on_cpu():
        for cp in (1, 2):
            args = _set_args([*_flags(cp), "--sap-choose-by", choose_by], rank, world_size)
            args.create_attention_mask_in_dataloader = True  # Megatron's default; the hooks turn it off
            _set_rows(args, rows)
            try:
                sizes = None if patched_script is None else configure_sap(args)
                mpu.initialize_model_parallel(1, 1, context_parallel_size=cp, hierarchical_context_parallel_sizes=sizes)
                model = build_tiny_gpt()
                data = iter([dict(sample)])
                if cp == 2 and patched_script is None:  # through Megatron's data loader, its rows planned there
                    data = _through_data_loader(args, [{k: v[0] for k, v in sample.items()}])
                output, loss_func = _forward_step(pretrain_gpt)(data, model)
                if cp == 2 and patched_script is None:
                    from megatron_sap.planning.plan import DEFAULT_CACHE

                    losses["cache"] = (DEFAULT_CACHE.hits, DEFAULT_CACHE.misses)
                    losses["chosen by"] = {plan.choose_by for plan in DEFAULT_CACHE._plans.values()}
                loss, count = loss_func(output)[:2]
                losses[cp] = (float(loss), int(count))
                if cp == 1:  # the documents one at a time, unpacked: what packing must not change
                    losses["documents"] = _documents_loss(model, sample, DOCUMENTS)
            finally:
                mpu.destroy_model_parallel()
                reset_sap_options()
    summary.removeHandler(lines)
    losses["summary"] = lines.messages  # --sap-log-interval 1: a line per micro-batch, rank 0 only
    return losses


class _Lines(logging.Handler):
    """The messages logged to it."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _through_data_loader(args, dataset) -> Iterator[dict]:
    """The micro-batches of `dataset` through Megatron-LM's data loader, which plans them (the plan
    cache emptied first, so that a hit is the loader's plan)."""
    import megatron.training.training as training_loop

    from megatron_sap.planning.plan import DEFAULT_CACHE

    args.dataloader_type, args.num_workers = "single", 1  # the hook wraps loaders with workers
    loader = training_loop.build_pretraining_data_loader(dataset, 0)
    loader.num_workers = 0  # a pool worker is daemonic, it cannot start any: the rows are fetched here
    DEFAULT_CACHE.clear()
    return iter(loader)


def _documents_loss(model, row: dict, documents: Sequence[int]) -> float:
    """The summed loss of the row's documents (their cu_seqlens) run one at a time, unpacked."""
    return sum(float(model(row["tokens"][:, a:b], None, None, labels=row["labels"][:, a:b]).sum())
               for a, b in zip(documents, documents[1:]))


def _assert_cp1s_loss(results: list[dict]) -> None:
    assert all(r[1] == results[0][1] for r in results)  # CP 1: each rank alone on the whole row
    cp1_loss, cp1_tokens = results[0][1]
    assert cp1_tokens == ROW
    assert abs(cp1_loss - results[0]["documents"]) <= 1e-5 * abs(cp1_loss)
    assert sum(r[2][1] for r in results) == ROW  # CP 2: each token's loss on one rank
    assert abs(sum(r[2][0] for r in results) - cp1_loss) <= 1e-5 * abs(cp1_loss)


@pytest.mark.parametrize("rows", ["sft", "inter-document-masking"])
def test_rows_with_cu_seqlens_through_the_hooks_give_cp1s_loss(pool2, rows: str) -> None:
    """SFT rows and rows of --dataloader-inter-document-masking bring their own `cu_seqlens`
    (padded, as core_v0.19's `SFTDataset` and `GPTDataset` pad them): the same losses as the
    documents one at a time, at CP 1 and 2, the loader's plan taken."""
    _skip_rows_where_unsupported(rows)
    results = pool2.run(run_pretrain_gpt_rank, rows=rows)
    _assert_cp1s_loss(results)
    assert all(r["cache"] == (1, 0) for r in results), [r["cache"] for r in results]


# A real GPTDataset with --dataloader-inter-document-masking (core_v0.19): documents of these
# lengths, each ending in the EOD token, packed into rows of ROW tokens (a document may continue
# in the next row).
DATASET_DOCUMENTS = (30, 7, 41, 12, 25, 50)
DATASET_ROWS = 2


class _Tokenizer:
    """What GPTDataset reads of a tokenizer."""

    eod = 0
    pad = -1
    vocab_size = 256
    unique_identifiers = {"class": "_Tokenizer"}


def _gpt_dataset(directory: str):
    """The GPTDataset over the documents `_write_documents` put in `directory`, as Megatron-LM's
    data builder makes it with --dataloader-inter-document-masking and --reset-position-ids."""
    import numpy
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    prefix = os.path.join(directory, "documents")
    config = GPTDatasetConfig(
        random_seed=0, sequence_length=ROW, blend=([prefix], None), split="1,0,0", tokenizer=_Tokenizer(),
        reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        inter_document_masking=True, path_to_cache=os.path.join(directory, "cache"), mmap_bin_files=False)
    return GPTDataset(IndexedDataset(prefix, mmap=False), prefix, numpy.arange(len(DATASET_DOCUMENTS)), DATASET_ROWS,
                      Split.train, config)


def _write_documents(directory: str) -> None:
    """The documents as Megatron-LM's preprocessing writes them (an indexed dataset), and the
    dataset's sample index (as the data builder's first rank writes it before the others read it)."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = os.path.join(directory, "documents")
    generator = torch.Generator().manual_seed(1)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for length in DATASET_DOCUMENTS:
        document = torch.randint(1, _Tokenizer.vocab_size, (length,), generator=generator, dtype=torch.int32)
        document[-1] = _Tokenizer.eod
        builder.add_item(document)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    _gpt_dataset(directory)


def run_gpt_dataset_rank(rank: int, world_size: int, directory: str) -> dict:
    """(summed loss, loss tokens) of each row of the GPTDataset in `directory` through the script's
    `forward_step`: at CP 1 (every rank alone) from the dataset's samples collated, at CP 2 through
    Megatron's data loader over the dataset (each rank its share); at CP 1 also the summed loss of
    each row's documents (by its own `cu_seqlens`) run one at a time."""
    pretrain_gpt = _hooked_pretrain_gpt()
    from megatron.core import mpu
    from torch.utils.data import default_collate

    from megatron_sap.megatron.demo_train import build_tiny_gpt
    from megatron_sap.megatron.options import reset_sap_options
    from megatron_sap.planning.plan import DEFAULT_CACHE

    torch.set_num_threads(1)
    dataset = _gpt_dataset(directory)
    found: dict = {}
    with _on_cpu():
        for cp in (1, 2):
            args = _set_args(_flags(cp), rank, world_size)
            _set_rows(args, "inter-document-masking")
            try:
                mpu.initialize_model_parallel(1, 1, context_parallel_size=cp)
                model = build_tiny_gpt()
                if cp == 1:
                    rows = [default_collate([dataset[i]]) for i in range(len(dataset))]
                    data = iter([dict(row) for row in rows])
                else:
                    data = _through_data_loader(args, dataset)
                for i in range(len(dataset)):
                    output, loss_func = _forward_step(pretrain_gpt)(data, model)
                    loss, count = loss_func(output)[:2]
                    found[(cp, i)] = (float(loss), int(count))
                if cp == 2:
                    found["cache"] = (DEFAULT_CACHE.hits, DEFAULT_CACHE.misses)
                if cp == 1:  # each row's documents one at a time, unpacked
                    for i, row in enumerate(rows):
                        cu = row["cu_seqlens"][0].tolist()
                        documents = cu[: cu.index(ROW) + 1]
                        found[("documents", i)] = (len(documents) - 1, _documents_loss(model, row, documents))
            finally:
                mpu.destroy_model_parallel()
                reset_sap_options()
    return found


def test_gpt_dataset_rows_through_the_hooks_give_cp1s_loss(pool2, tmp_path) -> None:
    """Rows of a real GPTDataset with --dataloader-inter-document-masking (its own `cu_seqlens`,
    padded, and a document cut at a row's end) give their documents' losses one at a time, at CP 1
    and summed over the ranks at CP 2, where Megatron's data loader over the dataset plans them."""
    import importlib.util

    _skip_rows_where_unsupported("inter-document-masking")
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        pytest.skip("GPTDataset needs the checkout's compiled helpers (make -C megatron/core/datasets)")
    _write_documents(str(tmp_path))
    results = pool2.run(run_gpt_dataset_rank, str(tmp_path))
    for i in range(DATASET_ROWS):
        count, documents = results[0][("documents", i)]
        assert count > 1  # a packed row
        assert all(r[(1, i)] == results[0][(1, i)] for r in results)  # CP 1: each rank alone on the whole row
        cp1_loss, cp1_tokens = results[0][(1, i)]
        assert cp1_tokens == ROW and abs(cp1_loss - documents) <= 1e-5 * abs(cp1_loss)
        shares = [r[(2, i)] for r in results]
        assert sum(tokens for _, tokens in shares) == ROW
        assert abs(sum(loss for loss, _ in shares) - cp1_loss) <= 1e-5 * abs(cp1_loss)
    assert all(r["cache"] == (DATASET_ROWS, 0) for r in results), [r["cache"] for r in results]  # the loader's plans


def test_pretrain_gpt_through_the_hooks_gives_cp1s_loss(pool2) -> None:
    results = pool2.run(run_pretrain_gpt_rank)
    _assert_cp1s_loss(results)
    assert all(r["cache"] == (1, 0) for r in results), [r["cache"] for r in results]  # at CP 2 the split took the plan the loader made
    # --sap-log-interval 1: global rank 0 logs each micro-batch's plan (CP 1's made here, CP 2's the loader's), rank 1 nothing
    first, second = results[0]["summary"]
    assert first.startswith("megatron-sap: last 1 micro-batches (1 x 1): ") and "made in this process 1 of 1" in first
    assert second.startswith("megatron-sap: last 1 micro-batches (1 x 2): ") and "made in this process 0 of 1" in second
    assert "K/V moved between outer groups" in second and not results[1]["summary"]


def test_pretrain_gpt_with_plans_chosen_by_the_timeline(pool2) -> None:
    """--sap-choose-by timeline: the loader plans the row so, the split takes that plan, and the
    loss is CP 1's."""
    results = pool2.run(run_pretrain_gpt_rank, None, "pretraining", "timeline")
    _assert_cp1s_loss(results)
    assert all(r["cache"] == (1, 0) and r["chosen by"] == {"timeline"} for r in results), results


patched_pool2 = make_pool_fixture(2, timeout=300, destroy_job_groups=True)  # fresh workers: no hooks installed there


def test_patched_pretrain_gpt_gives_cp1s_loss(patched_pool2, tmp_path) -> None:
    """The fork patch (core_v0.16) alone: the patched script's own get_batch trains packed rows."""
    import re
    import shutil
    import subprocess

    with open(os.path.join(MEGATRON_LM, "megatron", "core", "package_info.py")) as info:
        if re.search(r"^MINOR = (\d+)", info.read(), re.M).group(1) != "16":
            pytest.skip("the fork patch is for core_v0.16")
    shutil.copy(os.path.join(MEGATRON_LM, "pretrain_gpt.py"), tmp_path / "pretrain_gpt.py")
    patch = os.path.join(os.path.dirname(__file__), os.pardir, "patches", "megatron-lm-core_v0.16.1-sap.patch")
    applied = subprocess.run(["git", "apply", "--include=pretrain_gpt.py", os.path.abspath(patch)], cwd=tmp_path,
                             capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    _assert_cp1s_loss(patched_pool2.run(run_pretrain_gpt_rank, str(tmp_path / "pretrain_gpt.py")))


pool6 = make_pool_fixture(6, timeout=600, destroy_job_groups=True)
# (TP, CP, model chunks per stage) beside three pipeline stages, on six ranks; two chunks: a virtual pipeline
PIPELINE_LAYOUTS = ((1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 2), (1, 2, 2))


def _pass_on(output: torch.Tensor, chunk: int, chunks: int) -> bool:
    """Send this chunk's output to the next (the next stage's same chunk, or after the last stage
    the first stage's next chunk), unless it is the last chunk of the last stage; whether it did."""
    import torch.distributed as dist
    from megatron.core import mpu

    if mpu.is_pipeline_last_stage(ignore_virtual=True) and chunk == chunks - 1:
        return False
    dist.send(output.contiguous(), mpu.get_pipeline_model_parallel_next_rank())
    return True


def _take_input(model, tokens: int, chunk: int, requires_grad: bool = False) -> torch.Tensor | None:
    """The previous chunk's output as this chunk's input, returned (none for the first stage's
    first chunk); with `requires_grad`, for its gradient to go back."""
    import torch.distributed as dist
    from megatron.core import mpu

    if mpu.is_pipeline_first_stage(ignore_virtual=True) and chunk == 0:
        return None
    hidden = torch.empty(tokens, 1, 64)
    dist.recv(hidden, mpu.get_pipeline_model_parallel_prev_rank())
    hidden.requires_grad_(requires_grad)
    model.set_input_tensor(hidden)
    return hidden


def _document_forward(models: list, chunk: int, row: dict, a: int, b: int) -> torch.Tensor:
    """Model chunk `chunk`'s output for the row's tokens a:b run alone, by Megatron's own forward
    without the hooks (a single sequence: no packed parameters anywhere): the tokens on the first
    stage's first chunk, the labels on the last stage's last, its input set before."""
    from megatron.core import mpu

    forward = type(models[0]).forward.__wrapped__
    if mpu.is_pipeline_first_stage(ignore_virtual=True) and chunk == 0:
        return forward(models[chunk], row["tokens"][:, a:b], row["position_ids"][:, a:b], None)
    last = mpu.is_pipeline_last_stage(ignore_virtual=True) and chunk == len(models) - 1
    return forward(models[chunk], None, None, None, labels=row["labels"][:, a:b] if last else None)


def _release_layouts(rows: str = "pretraining") -> list[tuple[int, int, int]]:
    """The (TP, CP, chunks per stage) of `PIPELINE_LAYOUTS` this release runs (virtual pipelines
    from core_v0.15; SFT rows at TP 1 only on core_v0.16 and v0.17, whose SFT broadcast over TP
    the hooks refuse)."""
    from megatron_sap.megatron.compat import chunk_aware_get_batch, packed_get_batch

    return [layout for layout in PIPELINE_LAYOUTS
            if (layout[2] == 1 or chunk_aware_get_batch()) and not (rows == "sft" and layout[0] > 1 and packed_get_batch())]


@contextlib.contextmanager
def _pipeline_chunks(rank: int, world_size: int, tp: int, cp: int, chunks: int) -> Iterator[list]:
    """Megatron-LM's args and parallel state for three pipeline stages of `chunks` model chunks
    at this TP and CP, and this rank's chunks of the tiny GPT; torn down after."""
    from megatron.core import mpu

    from megatron_sap.megatron.demo_train import build_tiny_gpt
    from megatron_sap.megatron.options import reset_sap_options

    flags = [*_flags(cp), "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", "3"]
    flags[flags.index("--num-layers") + 1] = str(3 * chunks)
    if chunks > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", "1"]
    _set_args(flags, rank, world_size)
    try:
        mpu.initialize_model_parallel(tp, 3, chunks if chunks > 1 else None, context_parallel_size=cp)
        yield [build_tiny_gpt(num_layers=3 * chunks, vp_stage=c if chunks > 1 else None) for c in range(chunks)]
    finally:
        mpu.destroy_model_parallel()
        reset_sap_options()


# The rows a run reads: pretraining rows (documents found from the position ids), SFT rows (--sft)
# and rows of --dataloader-inter-document-masking (core_v0.19), the last two with their own padded
# `cu_seqlens`.
ROWS = ("pretraining", "sft", "inter-document-masking")


def _row_with_cu_seqlens(documents: tuple[int, ...] = DOCUMENTS) -> dict:
    """The row as core_v0.19's `SFTDataset` (`--sft`) and `GPTDataset` with
    `--dataloader-inter-document-masking` give it: `_sample` with its own `cu_seqlens`, padded
    with repeats of the row length to ROW + 1 entries, and `max_seqlen`."""
    sample = _sample(documents)
    sample["cu_seqlens"] = torch.tensor([[*documents, *[ROW] * (ROW + 1 - len(documents))]], dtype=torch.int32)
    sample["max_seqlen"] = torch.tensor([max(b - a for a, b in zip(documents, documents[1:]))], dtype=torch.int32)
    return sample


def _row(rows: str, documents: tuple[int, ...] = DOCUMENTS) -> dict:
    """The packed row of these documents as `rows` (see `ROWS`) come."""
    return _sample(documents) if rows == "pretraining" else _row_with_cu_seqlens(documents)


def _set_rows(args, rows: str) -> None:
    """Megatron-LM's args for reading `rows` (see `ROWS`)."""
    args.sft = rows == "sft"
    args.dataloader_inter_document_masking = rows == "inter-document-masking"


def _skip_rows_where_unsupported(rows: str, stages: bool = False) -> None:
    """Skip `rows` where the checkout has none, and SFT rows through pipeline `stages` where the
    hooks refuse them (core_v0.17)."""
    from megatron_sap.megatron.compat import sft_split_on_every_stage

    if rows == "inter-document-masking":
        with open(os.path.join(MEGATRON_LM, "megatron", "training", "arguments.py")) as arguments:
            if "--dataloader-inter-document-masking" not in arguments.read():
                pytest.skip("--dataloader-inter-document-masking arrives in core_v0.19")
    if rows == "sft" and stages and sft_split_on_every_stage():
        pytest.skip("the hooks refuse --sft with pipeline stages on core_v0.17")


def _every_chunk_reads(rows: str) -> bool:
    """Whether `get_batch` reads the data in every model chunk: rows with their own `cu_seqlens`
    from core_v0.18 (they go to every stage); else only the first stage's first chunk and the last
    stage's last."""
    import megatron.training.utils as training_utils

    from megatron_sap.megatron.compat import training_layout

    return rows != "pretraining" and training_layout(training_utils) == "core-utils"


def run_pipeline_rank(rank: int, world_size: int, rows: str = "pretraining") -> dict:
    """The row's summed loss and loss tokens through three pipeline stages of the script's
    `forward_step` (the activations passed by hand, forward only), per layout of
    `PIPELINE_LAYOUTS` the release runs, on the last stage's ranks. Only the first stage's first
    chunk and the last stage's last read data (rows with their own `cu_seqlens` from core_v0.18,
    every chunk): the others' documents come from the first stage through the hooks."""
    pretrain_gpt = _hooked_pretrain_gpt()
    from megatron.core import mpu
    from megatron.training import get_args

    torch.set_num_threads(1)
    sample = _row(rows)
    losses = {}
    summary = logging.getLogger("megatron_sap.megatron.summary")
    lines = _Lines()
    summary.addHandler(lines)
    summary.setLevel(logging.INFO)
    with _on_cpu():
        for tp, cp, chunks in _release_layouts(rows):
            with _pipeline_chunks(rank, world_size, tp, cp, chunks) as models:
                _set_rows(get_args(), rows)
                first, last = mpu.is_pipeline_first_stage(ignore_virtual=True), mpu.is_pipeline_last_stage(ignore_virtual=True)
                for chunk, model in enumerate(models):
                    reads = (first and chunk == 0) or (last and chunk == chunks - 1) or _every_chunk_reads(rows)
                    reads = reads and mpu.get_tensor_model_parallel_rank() == 0  # Megatron-LM's loaders: TP source only
                    _take_input(model, ROW // cp, chunk)
                    with torch.no_grad():
                        output, loss_func = _forward_step(pretrain_gpt)(iter([dict(sample)]) if reads else None, model)
                    if not _pass_on(output, chunk, chunks):
                        loss, count = loss_func(output)[:2]
                        losses[(tp, cp, chunks)] = (float(loss), int(count))
                if cp == 1:  # the documents one at a time, unpacked, through the same chunks
                    documents = _documents_one_at_a_time(models, sample)
                    if last:
                        losses[("documents", tp, chunks)] = documents
    return losses


def _documents_one_at_a_time(models: list, sample: dict, documents: tuple[int, ...] = DOCUMENTS) -> float:
    """The summed loss of the row's documents run one at a time through this rank's model
    chunks, each called directly (a single sequence: no packed parameters anywhere); on the
    last stage, else 0."""
    total = 0.0
    with torch.no_grad():
        for a, b in zip(documents, documents[1:]):
            for chunk, model in enumerate(models):
                _take_input(model, b - a, chunk)
                output = _document_forward(models, chunk, sample, a, b)
                if not _pass_on(output, chunk, len(models)):
                    total += float(output.sum())
    return total


def test_pretrain_gpt_through_three_pipeline_stages(pool6) -> None:
    """Megatron-LM's `get_batch` gives the middle stage (and with a virtual pipeline every chunk
    but the first stage's first and the last stage's last) nothing, and the last stage's second
    TP rank no tokens; through the hooks they keep the documents apart all the same. At CP 1 the
    packed row's loss is that of its documents run one at a time through the same chunks (at TP 1
    and TP 2, whose weights releases before core_v0.16 initialise otherwise); at CP 2 the ranks'
    shares add up to CP 1's."""
    _assert_pipeline_losses(pool6.run(run_pipeline_rank), _release_layouts())


@pytest.mark.parametrize("rows", ["sft", "inter-document-masking"])
def test_rows_with_cu_seqlens_through_three_pipeline_stages(pool6, rows: str) -> None:
    """As above with SFT rows and rows of --dataloader-inter-document-masking (padded `cu_seqlens`),
    which from core_v0.18 every model chunk reads: the chunks SAP gives the first stage's documents
    still take them from there, once per micro-batch."""
    _skip_rows_where_unsupported(rows, stages=True)
    _assert_pipeline_losses(pool6.run(run_pipeline_rank, rows=rows), _release_layouts(rows))


def _assert_pipeline_losses(results: list[dict], layouts: list[tuple[int, int, int]]) -> None:
    for tp, cp, chunks in layouts:
        if cp == 1:  # the whole row on each rank of the last stage: two data-parallel replicas at TP 1, two TP ranks
            packed = [r[(tp, 1, chunks)] for r in results if (tp, 1, chunks) in r]
            documents = [r[("documents", tp, chunks)] for r in results if ("documents", tp, chunks) in r]
            assert len(packed) == len(documents) == 2 and all(count == ROW for _, count in packed)
            assert all(abs(loss - d) <= 1e-5 * abs(d) for (loss, _), d in zip(packed, documents)), (packed, documents)
        else:  # each CP rank its share, TP 1's weights
            reference = next(r[("documents", 1, chunks)] for r in results if ("documents", 1, chunks) in r)
            shares = [r[(tp, cp, chunks)] for r in results if (tp, cp, chunks) in r]
            assert len(shares) == 2 and sum(count for _, count in shares) == ROW
            assert abs(sum(loss for loss, _ in shares) - reference) <= 1e-5 * abs(reference)


OTHER_DOCUMENTS = (0, 9, 50, ROW)


@contextlib.contextmanager
def _schedule_on_cpu() -> Iterator[None]:
    """Megatron-Core's pipeline schedules on the CPU: the tensors they put on "cuda" on the CPU,
    their device syncs no-ops."""
    def on_cpu(make):
        def made(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)
        return made

    with mock.patch.object(torch, "zeros", on_cpu(torch.zeros)), mock.patch.object(torch, "empty", on_cpu(torch.empty)), \
            mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None):
        yield


def run_interleaved_schedule_rank(rank: int, world_size: int, rows: str = "pretraining") -> dict:
    """Megatron-Core's interleaved pipeline schedule itself (forward only) over three stages of
    two model chunks, the script's `forward_step`, two iterations of three micro-batches (the row,
    a row of other documents, the row again; then the other way round; as `rows`
    come, see `ROWS`), at CP 1 and CP 2: each micro-batch's summed loss on the last
    stage's ranks, and at CP 1 the documents' run one at a time through the same chunks."""
    pretrain_gpt = _hooked_pretrain_gpt()
    from megatron.core import mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_sap.megatron.demo_train import build_tiny_gpt
    from megatron_sap.megatron.options import reset_sap_options

    torch.set_num_threads(1)
    layouts = (DOCUMENTS, OTHER_DOCUMENTS, DOCUMENTS, OTHER_DOCUMENTS, DOCUMENTS, OTHER_DOCUMENTS)  # two iterations
    batches = [_row(rows, documents) for documents in layouts]
    found: dict = {}
    with _on_cpu():
        for cp in (1, 2):
            flags = [*_flags(cp), "--pipeline-model-parallel-size", "3", "--num-layers-per-virtual-pipeline-stage", "1"]
            flags[flags.index("--num-layers") + 1] = "6"
            _set_rows(_set_args(flags, rank, world_size), rows)
            try:
                mpu.initialize_model_parallel(1, 3, 2, context_parallel_size=cp)
                models = [build_tiny_gpt(num_layers=6, vp_stage=chunk) for chunk in (0, 1)]
                data = [iter([dict(row) for row in batches]) for _ in models]  # one iterator per chunk, as Megatron-LM's
                losses = []
                for _ in range(2):
                    with torch.no_grad(), _schedule_on_cpu():
                        losses += get_forward_backward_func()(
                            forward_step_func=_forward_step(pretrain_gpt), data_iterator=data, model=models,
                            num_microbatches=len(batches) // 2, seq_length=ROW, micro_batch_size=1, forward_only=True)
                if losses:
                    found[cp] = [float(loss["lm loss"][0]) for loss in losses]
                if cp == 1:
                    references = [_documents_one_at_a_time(models, row, documents) for row, documents in zip(batches, layouts)]
                    if mpu.is_pipeline_last_stage(ignore_virtual=True):
                        found["documents"] = references
            finally:
                mpu.destroy_model_parallel()
                reset_sap_options()
    return found


@pytest.mark.parametrize("rows", ROWS)
def test_interleaved_schedule_through_the_hooks(pool6, rows: str) -> None:
    """The real interleaved schedule runs each rank's chunks in its own order (several
    micro-batches through chunk 0 before chunk 1); every micro-batch's loss is its documents'
    one at a time, at CP 1 and summed over the CP ranks at CP 2. SFT rows (from core_v0.18 every
    chunk reads them) too: the chunks that take the first stage's documents get each
    micro-batch's once."""
    from megatron_sap.megatron.compat import chunk_aware_get_batch

    if not chunk_aware_get_batch():
        pytest.skip("virtual pipelines are refused before core_v0.15")
    _skip_rows_where_unsupported(rows, stages=True)
    results = pool6.run(run_interleaved_schedule_rank, rows=rows)
    references = [r["documents"] for r in results if "documents" in r]
    assert len(references) == 2 and references[0] == references[1]
    reference = references[0]
    assert reference[0] == reference[2] == reference[4] and reference[0] != reference[1]
    for cp in (1, 2):
        per_rank = [r[cp] for r in results if cp in r]
        assert len(per_rank) == 2 and all(len(losses) == len(reference) for losses in per_rank)
        if cp == 1:  # two data-parallel replicas, the whole row each
            for losses in per_rank:
                assert all(abs(loss - ref) <= 1e-5 * abs(ref) for loss, ref in zip(losses, reference)), (losses, reference)
        else:  # each CP rank its share
            sums = [a + b for a, b in zip(*per_rank)]
            assert all(abs(total - ref) <= 1e-5 * abs(ref) for total, ref in zip(sums, reference)), (sums, reference)


def _grads(models: list) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, by chunk and name (zeros where it has none)."""
    return {f"{chunk}.{name}": (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for chunk, model in enumerate(models) for name, p in model.named_parameters()}


def _documents_backward_one_at_a_time(models: list, rows: list[dict], layouts: list[tuple[int, ...]]) -> None:
    """Backpropagate the summed loss of every row's documents, each run alone through this rank's
    model chunks (activations and their gradients passed by hand), into the parameters' grads."""
    import torch.distributed as dist
    from megatron.core import mpu

    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    chunks = len(models)
    for row, documents in zip(rows, layouts):
        for a, b in zip(documents, documents[1:]):
            inputs, outputs = [], []
            for chunk, model in enumerate(models):
                inputs.append(_take_input(model, b - a, chunk, requires_grad=True))
                outputs.append(_document_forward(models, chunk, row, a, b))
                _pass_on(outputs[-1].detach(), chunk, chunks)
            for chunk in reversed(range(chunks)):
                if last and chunk == chunks - 1:
                    outputs[chunk].sum().backward()
                else:
                    grad = torch.empty_like(outputs[chunk])
                    dist.recv(grad, mpu.get_pipeline_model_parallel_next_rank())
                    outputs[chunk].backward(grad)
                if inputs[chunk] is not None:
                    dist.send(inputs[chunk].grad.contiguous(), mpu.get_pipeline_model_parallel_prev_rank())


def run_schedule_backward_rank(rank: int, world_size: int) -> dict:
    """Megatron-Core's pipeline schedule forward and backward over three stages (one model chunk
    each, or two in the interleaved schedule from core_v0.15), three micro-batches of two document
    layouts, the script's `forward_step`, summed per-token loss, per layout of `PIPELINE_LAYOUTS`:
    this rank's pipeline stage and parameter gradients, and at CP 1 the gradients of the
    documents run one at a time through the same chunks."""
    pretrain_gpt = _hooked_pretrain_gpt()
    from megatron.core import mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    torch.set_num_threads(1)
    layouts = [DOCUMENTS, OTHER_DOCUMENTS, DOCUMENTS]
    rows = [_sample(documents) for documents in layouts]
    found: dict = {}
    with _on_cpu():
        for tp, cp, chunks in _release_layouts():
            with _pipeline_chunks(rank, world_size, tp, cp, chunks) as models:
                for model in models:
                    model.config.calculate_per_token_loss = True  # as Megatron-LM sets it from the flag
                data = [iter([dict(row) for row in rows]) for _ in models]  # one iterator per chunk, as Megatron-LM's
                with _schedule_on_cpu():
                    get_forward_backward_func()(
                        forward_step_func=_forward_step(pretrain_gpt), data_iterator=data, model=models,
                        num_microbatches=len(rows), seq_length=ROW, micro_batch_size=1, forward_only=False)
                found[(tp, cp, chunks)] = (mpu.get_pipeline_model_parallel_rank(), _grads(models))
                if cp == 1:
                    for model in models:
                        model.zero_grad(set_to_none=True)
                    _documents_backward_one_at_a_time(models, rows, layouts)
                    found[("documents", tp, chunks)] = _grads(models)
    return found


def _differ(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[str]:
    """The parameters whose gradients differ from the reference's by more than float32 noise."""
    assert grads.keys() == reference.keys()
    return [name for name, g in grads.items()
            if not torch.allclose(g, reference[name], rtol=1e-4, atol=1e-5 * float(reference[name].abs().max()) + 1e-7)]


def test_pipeline_schedules_backward_through_the_hooks(pool6) -> None:
    """Training steps through Megatron-Core's own pipeline schedules (three stages, and two chunks
    per stage interleaved from core_v0.15): at CP 1, at TP 1 and TP 2, every parameter's gradient
    equals that of the documents run one at a time through the same chunks; at CP 2 the two CP
    ranks' gradients add up to CP 1's, on every stage."""
    results = pool6.run(run_schedule_backward_rank)
    for tp, cp, chunks in _release_layouts():
        found = [r[(tp, cp, chunks)] for r in results]
        assert sorted(stage for stage, _ in found) == [0, 0, 1, 1, 2, 2]
        if cp == 1:
            for r, (_, grads) in zip(results, found):
                assert any(float(g.abs().max()) > 0 for g in grads.values())
                assert not _differ(grads, r[("documents", tp, chunks)]), (tp, chunks, _differ(grads, r[("documents", tp, chunks)]))
            continue
        whole = {stage: grads for stage, grads in (r[(1, 1, chunks)] for r in results)}
        for stage in range(3):
            shares = [grads for s, grads in found if s == stage]
            summed = {name: shares[0][name] + shares[1][name] for name in shares[0]}
            assert not _differ(summed, whole[stage]), (chunks, stage, _differ(summed, whole[stage]))
