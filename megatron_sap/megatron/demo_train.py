"""Train a tiny Megatron-Core GPT on CPU with SAP context parallelism and compare it with CP=1.

`run_demo_training(steps)` (also `python -m megatron_sap.megatron.demo_train`) packs real
documents (CPython standard-library sources, byte-level tokens), trains the same model once on
one process (CP=1, plain varlen attention) and once on four gloo processes with SAP (CP=4 as
2x2), and prints both loss curves side by side. Under
torchrun (`scripts/train_sap_local.sh`) it trains with SAP on gloo. The helpers
(`stdlib_documents`, `packed_batch`, `build_tiny_gpt`, `train_step`) are what the Megatron
acceptance test uses too.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sysconfig
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from megatron_sap.spawned import gather_results

VOCAB_SIZE = 256  # byte-level tokens
DEMO_DOC_LENGTHS = (301, 17, 64, 95, 1, 34)  # a long document, a one-token one, ... : 512 tokens


def stdlib_documents(lengths: tuple[int, ...] = DEMO_DOC_LENGTHS, *, skip: int = 0) -> tuple[Tensor, list[int]]:
    """Pack byte-tokenised CPython stdlib sources into one [1, T] row with the given document lengths.

    Deterministic: files are taken in sorted order (after `skip` files) and each document is the
    first `length` bytes of a file long enough. Returns (tokens [1, T] int64, cu_seqlens).
    """
    if not lengths or min(lengths) < 1:
        raise ValueError(f"document lengths must be positive, got {lengths}")
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[skip:]
    docs, files = [], iter(sources)
    for length in lengths:
        for path in files:
            data = path.read_bytes()
            if len(data) >= length:
                docs.append(torch.frombuffer(bytearray(data[:length]), dtype=torch.uint8).long())
                break
        else:
            raise ValueError(f"no standard-library file has {length} bytes left to use")
    cu = [0]
    for doc in docs:
        cu.append(cu[-1] + doc.numel())
    return torch.cat(docs).unsqueeze(0), cu


def packed_batch(tokens: Tensor, cu_seqlens: list[int]) -> dict[str, Tensor]:
    """Next-token labels within each document; the last token of a document carries no loss."""
    labels = torch.roll(tokens, -1, dims=1)
    loss_mask = torch.ones_like(tokens, dtype=torch.float32)
    loss_mask[0, torch.tensor(cu_seqlens[1:]) - 1] = 0.0
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(tokens.size(1)).unsqueeze(0),
    }


def build_tiny_gpt(seed: int = 1234, num_layers: int = 2, vp_stage: Optional[int] = None,
                   sequence_parallel: bool = False, **config_fields: Any) -> torch.nn.Module:
    """A 2-layer fp32 GPT (RoPE, GQA 4:2, SwiGLU, RMSNorm) with SAP core attention, built on CPU.

    Needs Megatron's parallel state initialized (e.g. by `initialize_sap_parallel`); the config
    carries its CP size and `cp_comm_type="sap"` as Megatron-LM's would. Under pipeline
    parallelism it is this rank's stage: its share of the layers, the embedding on the first
    stage and the output layer on the last; with a virtual pipeline, its model chunk `vp_stage`.
    `sequence_parallel` (with TP > 1, as `--sequence-parallel`) splits the activations outside
    attention and the MLP over the TP ranks along the sequence. `config_fields` set further
    `TransformerConfig` fields (e.g. activation recomputation).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_sap.megatron import get_gpt_layer_sap_spec, make_rotary_cpu_safe

    stages = parallel_state.get_pipeline_model_parallel_world_size()
    whole_stage = vp_stage is None  # no virtual pipeline: the rank's stage is one chunk
    chunk = {"ignore_virtual": True} if whole_stage else {"ignore_virtual": False, "vp_stage": vp_stage}
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        kv_channels=16,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        cp_comm_type="sap",
        pipeline_model_parallel_size=stages,
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32 if stages > 1 else None,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        **config_fields,
    )
    spec = get_gpt_layer_sap_spec(normalization="RMSNorm")
    if sequence_parallel:
        spec = _with_sequence_parallel_norms(spec, num_layers // (stages * (config.virtual_pipeline_model_parallel_size or 1)))
    torch.manual_seed(seed)
    model = GPTModel(
        config,
        spec,
        vocab_size=VOCAB_SIZE,
        max_sequence_length=4096,
        position_embedding_type="rope",
        pre_process=parallel_state.is_pipeline_first_stage(**chunk),
        post_process=parallel_state.is_pipeline_last_stage(**chunk),
        **({} if whole_stage else {"vp_stage": vp_stage}),
    )
    make_rotary_cpu_safe(model.rotary_pos_emb)
    return model


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built from Megatron's norm arguments, its weight marked `sequence_parallel`
    (each TP rank sees only its share of the sequence, so the gradient is summed over the TP
    group) as Transformer Engine's and Apex's norms mark theirs: Megatron's local spec refuses
    sequence parallelism with torch's own norm, and those two are not on a CPU machine."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _with_sequence_parallel_norms(layer_spec, layers: int):
    """The block of `layers` layers of `layer_spec` with `SequenceParallelRMSNorm` for every norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer_spec.submodules.input_layernorm = SequenceParallelRMSNorm
    layer_spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=SequenceParallelRMSNorm)


def reduce_gradients(model: torch.nn.Module) -> None:
    """All-reduce the gradients as DDP and Megatron's `finalize_model_grads` do: the weights that
    see only their TP rank's share of the sequence (norms under sequence parallelism) summed over
    the TP group, then every gradient summed over data-parallel-with-CP and divided by the
    data-parallel size (the sum over CP ranks completes the packed row's gradient, the division
    averages replicas)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        for param in model.parameters():
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if group.size() > 1:
        replicas = parallel_state.get_data_parallel_world_size()
        for param in model.parameters():
            dist.all_reduce(param.grad, group=group)
            param.grad /= replicas


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Tensor], cu_seqlens: list[int]) -> tuple[Tensor, float]:
    """One step: SAP split, forward, token-mean loss, backward, gradient all-reduce as DDP does
    (`reduce_gradients`), update.

    Returns (this rank's per-token losses in local order, the global mean loss).
    """
    from megatron_sap.megatron import sap_loss, sap_split_batch

    local, params = sap_split_batch(batch, cu_seqlens)
    optimizer.zero_grad()
    per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"], packed_seq_params=params)
    loss, mean = sap_loss(per_token, local["loss_mask"])
    loss.backward()
    reduce_gradients(model)
    optimizer.step()
    return per_token.detach(), float(mean)


def train_sap(inner: int, outer: int, steps: int, lr: float = 3e-3, tensor_parallel: int = 1,
              sequence_parallel: bool = False) -> list[float]:
    """Train the tiny GPT with SAP (CP = inner*outer) in an initialized process group; return the loss curve.

    World size must be a multiple of tensor_parallel*inner*outer (the rest is data parallelism,
    every replica training on the same packed row); `sequence_parallel` as in `build_tiny_gpt`.
    """
    from megatron.core import parallel_state

    from megatron_sap.megatron import initialize_sap_parallel

    initialize_sap_parallel(inner_size=inner, outer_size=outer, tensor_model_parallel_size=tensor_parallel)
    try:
        model = build_tiny_gpt(sequence_parallel=sequence_parallel)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        tokens, cu = stdlib_documents()
        batch = packed_batch(tokens, cu)
        return [train_step(model, optimizer, batch, cu)[1] for _ in range(steps)]
    finally:
        parallel_state.destroy_model_parallel()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train_worker(rank: int, world_size: int, port: int, inner: int, outer: int, steps: int, results) -> None:
    """One spawned process of a demo run: join the gloo group, train, report rank 0's curve."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        curve = train_sap(inner, outer, steps)
        if rank == 0:
            results.put(curve)
    finally:
        dist.destroy_process_group()


def _run(inner: int, outer: int, steps: int, timeout: float) -> list[float]:
    """Spawn inner*outer gloo processes and return the loss curve; fail fast if a worker dies."""
    world_size = inner * outer
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    procs = [
        context.Process(target=_train_worker, args=(rank, world_size, port, inner, outer, steps, results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    (curve,) = gather_results(results, procs, 1, timeout, f"demo training with {world_size} processes")
    return curve


def run_demo_training(steps: int = 5, timeout: float = 600.0) -> tuple[list[float], list[float]]:
    """Train with CP=1 and with SAP on 4 gloo ranks (2x2); print and return both loss curves."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    reference = _run(1, 1, steps, timeout)
    sap_curve = _run(2, 2, steps, timeout)
    print(f"{'step':>4}  {'CP=1 loss':>10}  {'SAP CP=4 (2x2) loss':>20}")
    for step, (a, b) in enumerate(zip(reference, sap_curve), start=1):
        print(f"{step:>4}  {a:>10.5f}  {b:>20.5f}")
    print(f"largest difference: {max(abs(a - b) for a, b in zip(reference, sap_curve)):.2e}")
    return reference, sap_curve


def main(argv: Optional[list[str]] = None) -> None:
    """CLI: under torchrun (RANK set) train with SAP on gloo; otherwise run the CP=1 vs SAP comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner-size", type=int, default=2, help="SAP inner level U (under torchrun)")
    parser.add_argument("--outer-size", type=int, default=2, help="SAP outer level R (under torchrun)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        run_demo_training(args.steps)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:  # the SAP layer's line saying what runs (layout, kernels), as Megatron-LM logs it
        logging.basicConfig(format="%(message)s")
        logging.getLogger("megatron_sap").setLevel(logging.INFO)
    try:
        curve = train_sap(args.inner_size, args.outer_size, args.steps)
        if dist.get_rank() == 0:
            for step, loss in enumerate(curve, start=1):
                print(f"step {step:>4}  loss {loss:.5f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
