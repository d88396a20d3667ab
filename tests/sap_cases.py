"""Random packed batches and the per-rank job for distributed SAP attention tests.

Kept apart from the test modules so pool workers import only this small file.
"""
from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}

_GROUPS: dict[tuple[int, int], object] = {}


def random_cu_seqlens(rng: random.Random, total: int, kind: str) -> list[int]:
    """cu_seqlens of `total` tokens drawn in one of several shapes of batch."""
    if kind == "one":
        lengths = [total]
    elif kind == "tiny":
        lengths = [rng.randint(1, 3) for _ in range(total)]
    elif kind == "long":
        lengths = [rng.randint(total // 3, total)]
        while sum(lengths) < total:
            lengths.append(rng.randint(1, total // 2))
    elif kind == "zeros":
        lengths = []
        while sum(lengths) < total:
            lengths.append(rng.choice([0, 0, 1, rng.randint(1, total // 4 + 1)]))
    else:  # mixture: a long-tailed mix of short and long documents
        lengths = []
        while sum(lengths) < total:
            lengths.append(max(1, int(rng.paretovariate(1.2) * 8)))
    cu = [0]
    for n in lengths:
        cu.append(min(total, cu[-1] + n))
        if cu[-1] == total:
            break
    if cu[-1] < total:
        cu.append(total)
    return cu


def force_ring_exchanges(plan):
    """`plan`, its outer ranks exchanging as ring shifts whatever it chose (plans weigh them
    at odd outer sizes only): its choice made, then overridden, its programs compiled anew
    and, where the plan keeps the times it chose by, those timed again."""
    from types import MappingProxyType

    from megatron_sap.planning.timeline import plan_schedule

    plan.exchange_order()
    plan._order = plan._levels = plan._backward_order = plan._backward_levels = MappingProxyType({})
    plan._ring = True
    plan._programs.clear()
    schedule, times, chunks = plan._chosen
    if times is not None:
        plan._chosen = (schedule, plan_schedule(plan, inner_chunks=chunks), chunks)
    return plan


def make_inputs(cu: list[int], heads: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v and an upstream gradient for the whole packed batch, float64."""
    gen = torch.Generator().manual_seed(seed)
    total = cu[-1]
    q = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(total, kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(total, kv_heads, dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def groups_for(inner: int, outer: int):
    """SAP groups of the whole world, created once per worker and layout."""
    import megatron_sap as sap

    if (inner, outer) not in _GROUPS:
        _GROUPS[(inner, outer)] = sap.init_sap_groups(inner_size=inner, outer_size=outer)
    return _GROUPS[(inner, outer)]


@contextlib.contextmanager
def counting_chunked_ops() -> Iterator[list[int]]:
    """Inside the block, the head chunks of each head-chunked SAP op run forward
    (`attention._SAPChunkedAttention`), in a list: none where every op ran unchunked."""
    from unittest import mock

    from megatron_sap import attention

    forward, chunks_run = attention._SAPChunkedAttention.forward, []

    def counted(ctx, *args):
        chunks_run.append(len(args[-1]))  # the head slices, one per chunk
        return forward(ctx, *args)

    with mock.patch.object(attention._SAPChunkedAttention, "forward", staticmethod(counted)):
        yield chunks_run


def run_rank(
    rank: int,
    world: int,
    cu: list[int],
    inner: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: str,
    seed: int,
    scale: float | None = None,
    recompute_kv: bool = False,
    fresh_plan: bool = False,
    perturb_doc: int | None = None,
    count_bytes: bool = False,
    tile: int | None = None,
    schedule: str = "pipelined",
    gpus_per_node: int | None = None,
    inner_chunks: int | str = "auto",
    cost_overrides: dict | None = None,
    ring: bool = False,
) -> dict:
    """One rank's forward and backward of sap_attention; returns its slices and gradients.
    `schedule`: sap_attention's, or "mixed" (pipelined on even outer ranks, gathered on odd).
    `tile`: plan with that kernel tile instead of the default model's (small tiles split
    the short documents of these tests into whole-tile chunks); `gpus_per_node`: plan
    with nodes of that many ranks; `cost_overrides`: other fields of the planning cost
    model; `ring`: a fresh plan whose outer ranks exchange as ring shifts, whatever it chose; `inner_chunks`: sap_attention's (the count run is in the result: "chunks_run",
    the head chunks of each chunked op that ran, none where the op ran unchunked)."""
    from dataclasses import replace

    import megatron_sap as sap
    from megatron_sap.comm.traffic import count_traffic
    from megatron_sap.planning import CostModel, PlanCache

    outer = world // inner
    groups = groups_for(inner, outer)
    model = CostModel.preset("h100")
    model = replace(model, tile=tile or model.tile, gpus_per_node=gpus_per_node or model.gpus_per_node,
                    **(cost_overrides or {}))
    plan = sap.plan_sequences(cu, outer_size=outer, inner_size=inner, cost_model=model,
                              cache=PlanCache() if fresh_plan or ring else sap.planning.DEFAULT_CACHE)
    if ring:
        force_ring_exchanges(plan)
    q, k, v, dout = make_inputs(cu, heads, kv_heads, dim, seed)
    if perturb_doc is not None:
        lo, hi = cu[perturb_doc], cu[perturb_doc + 1]
        for t in (q, k, v):
            t[lo:hi] += 1.0
    idx = plan.local_indices(groups.cp_rank)
    cast = DTYPES[dtype]
    ql, kl, vl = (t[idx].to(cast).requires_grad_() for t in (q, k, v))
    if schedule == "mixed":  # outer ranks alternate: a rank's schedule changes nothing for its peers
        schedule = ("pipelined", "gathered")[groups.outer_rank % 2]
    with count_traffic() as log, counting_chunked_ops() as chunks_run:
        out = sap.sap_attention(ql, kl, vl, plan, groups, softmax_scale=scale, recompute_kv=recompute_kv,
                                schedule=schedule, inner_chunks=inner_chunks)
        out.backward(dout[idx].to(cast))
    result = {
        "cp_rank": groups.cp_rank,
        "indices": idx,
        "out": out.detach(),
        "dq": ql.grad,
        "dk": kl.grad,
        "dv": vl.grad,
        "plan_inner_chunks": plan.inner_chunks(groups.outer_rank, recompute_kv),
        "chunks_run": chunks_run,
        "ring_exchanges": plan.ring_exchanges,
    }
    if count_bytes:
        result["p2p_bytes"] = log.total_bytes("p2p")
        result["a2a_bytes"] = log.total_bytes("a2a")
        result["bytes_by_peer"] = log.bytes_by_peer()
        result["stats"] = plan.stats(plan.cost_model.with_shape(heads, kv_heads, dim, ql.element_size()),
                                     recompute_kv=recompute_kv)
    return result


def collective_order(rank: int, world: int, cu: list[int], inner: int) -> list[tuple[str, tuple[int, ...]]]:
    """The collectives and batched P2P calls (kind, group ranks) of two sap_attention
    calls without the agreement check, after forgetting which groups were used before."""
    import torch.distributed as dist

    import megatron_sap as sap
    from megatron_sap.comm import p2p

    groups = groups_for(inner, world // inner)
    plan = sap.plan_sequences(cu, outer_size=world // inner, inner_size=inner)
    log: list[tuple[str, tuple[int, ...]]] = []
    real_all_reduce, real_batch = dist.all_reduce, dist.batch_isend_irecv

    def all_reduce(tensor, *args, group=None, **kwargs):
        log.append(("all_reduce", tuple(dist.get_process_group_ranks(group))))
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    def batch_isend_irecv(ops):
        log.append(("p2p", tuple(dist.get_process_group_ranks(ops[0].group))))
        return real_batch(ops)

    p2p._ready_groups.clear()
    dist.all_reduce, dist.batch_isend_irecv = all_reduce, batch_isend_irecv
    try:
        q, k, v, dout = make_inputs(cu, 4, 2, 8, seed=0)
        idx = plan.local_indices(groups.cp_rank)
        for _ in range(2):
            ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
            sap.sap_attention(ql, kl, vl, plan, groups, check_agreement=False).backward(dout[idx])
    finally:
        dist.all_reduce, dist.batch_isend_irecv = real_all_reduce, real_batch
    return log


# What would wait for the GPU if the tensor lived there: a read of its values on the host
# (item, tolist, bool/int/float, numpy, a copy to the CPU) or an op whose output size
# depends on the values (nonzero, unique, masked_select).
SYNCING_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu",
                   "numpy", "unique", "masked_select")
SYNCING_FUNCTIONS = ("nonzero", "unique", "masked_select", "equal", "allclose")


@contextlib.contextmanager
def host_reads_recorded(calls: list[str]):
    """Record in `calls`, as "name at file:line", every call of the SYNCING_* methods and
    functions that megatron_sap's own code makes (itself, or through torch's Python
    functions) while inside, outside the varlen kernels. On a GPU each would be a host sync;
    on the CPU they cost nothing, so this is how the CPU tests keep SAP's hot loop free of
    them (the GPU check confirms it with torch.cuda.set_sync_debug_mode). The kernels are
    left out: the flash kernels are checked on the GPU, and the torch backend validates
    `cu_seqlens` on the host where they live there. Reads by other code (Megatron's, a
    test's) are not recorded."""
    import os
    import sys

    import megatron_sap
    from megatron_sap import attention

    package = os.path.dirname(megatron_sap.__file__) + os.sep
    library = os.path.dirname(torch.__file__) + os.sep
    in_kernel = [0]
    saved: list[tuple[object, str, object]] = []

    def patch(owner, name, make):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, make(getattr(owner, name)))

    def recording(name):
        def make(real):
            def call(*args, **kwargs):
                if not in_kernel[0]:
                    frame = sys._getframe(1)
                    while frame is not None and frame.f_code.co_filename.startswith(library):
                        frame = frame.f_back
                    if frame is not None and frame.f_code.co_filename.startswith(package):
                        calls.append(f"{name} at {frame.f_code.co_filename.removeprefix(package)}:{frame.f_lineno}")
                return real(*args, **kwargs)
            return call
        return make

    def kernel(real):
        def call(*args, **kwargs):
            in_kernel[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                in_kernel[0] -= 1
        return call

    try:
        for name in SYNCING_METHODS:
            patch(torch.Tensor, name, recording(f"Tensor.{name}"))
        for name in SYNCING_FUNCTIONS:
            patch(torch, name, recording(f"torch.{name}"))
        for name in ("varlen_forward", "varlen_backward"):
            patch(attention, name, kernel)
        yield calls
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)


def host_reads(rank: int, world: int, cu: list[int], inner: int, schedule: str, recompute_kv: bool) -> list[str]:
    """The host reads (`host_reads_recorded`) of one rank's sap_attention forward and
    backward, after a first call that compiled the program and checked the plan's agreement."""
    import megatron_sap as sap

    groups = groups_for(inner, world // inner)
    plan = sap.plan_sequences(cu, outer_size=world // inner, inner_size=inner)
    q, k, v, dout = make_inputs(cu, 4, 2, 8, seed=0)
    idx = plan.local_indices(groups.cp_rank)
    calls: list[str] = []
    for recorded in (False, True):
        ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
        with host_reads_recorded(calls) if recorded else contextlib.nullcontext():
            out = sap.sap_attention(ql, kl, vl, plan, groups, schedule=schedule, recompute_kv=recompute_kv)
            out.backward(dout[idx])
    return calls
