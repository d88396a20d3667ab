"""Each micro-batch's documents for the pipeline stages that read no data.

Megatron-LM's `get_batch` gives a middle pipeline stage (neither first nor last) nothing: its
input is the previous stage's output and no data loader runs there. SAP's attention needs the
row's documents on every stage. So the first stage sends each micro-batch's documents, and the
plan a data loader's worker made for it, to the middle stages of its pipeline as it reads them
(`send_to_middle_stages`, host to host over `groups.pipeline_host_group`, without waiting), and a
middle stage receives them when its model runs that micro-batch (`receive_from_first_stage`).
That group is made right after `initialize_model_parallel` (`groups.prepare_pipeline_host_group`).
Every stage runs the forward passes of its micro-batches in the order the first stage reads
them (training and evaluation alike), so the messages need no tag. The last stage reads its own
data. A receive waits at most the pipeline group's timeout, so a first stage that died or sent
nothing fails the middle ones instead of hanging them.
"""
from __future__ import annotations

import pickle
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron_sap.comm.p2p import collective_device

from .groups import has_middle_stages, pipeline_host_group

_PENDING: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []  # sends in flight, with their buffers
MAX_PENDING = 256  # sends kept in flight at most; beyond, the oldest is waited for


def is_middle_stage() -> bool:
    """Whether this rank is on a pipeline stage between the first and the last."""
    return (has_middle_stages() and not parallel_state.is_pipeline_first_stage(ignore_virtual=True)
            and not parallel_state.is_pipeline_last_stage(ignore_virtual=True))


def send_to_middle_stages(documents: Optional[list[int]], plan_bytes: Optional[bytes]) -> None:
    """On a first pipeline stage with middle stages, post this micro-batch's documents (its
    cu_seqlens on the host) and pickled plan to each of them; elsewhere nothing."""
    if not has_middle_stages() or not parallel_state.is_pipeline_first_stage(ignore_virtual=True):
        return
    group, _, middle = pipeline_host_group()
    device = collective_device(group)
    payload = torch.frombuffer(bytearray(pickle.dumps((documents, plan_bytes), protocol=pickle.HIGHEST_PROTOCOL)),
                               dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    _PENDING[:] = [entry for entry in _PENDING if not entry[0].is_completed()]
    for stage in middle:
        for tensor in (size, payload):
            _PENDING.append((dist.isend(tensor, stage, group=group), size, payload))
    while len(_PENDING) > MAX_PENDING:
        _PENDING.pop(0)[0].wait()


def receive_from_first_stage() -> tuple[list[int], Optional[bytes]]:
    """On a middle pipeline stage (`is_middle_stage`), the next micro-batch's (documents, pickled
    plan or None) from its first stage."""
    if not is_middle_stage():
        raise ValueError("only a middle pipeline stage receives documents from its first stage")
    group, first, _ = pipeline_host_group()
    device = collective_device(group)
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, first, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, first, group=group)
    documents, plan_bytes = pickle.loads(payload.cpu().numpy().tobytes())
    if documents is None:
        raise ValueError(
            "the first pipeline stage read no documents for this micro-batch (no data loader copy on its host), so a "
            "middle stage cannot keep them apart"
        )
    return documents, plan_bytes
