"""Each micro-batch's documents for the model chunks that read no data.

Megatron-LM's `get_batch` gives a batch only to the first pipeline stage and the last (with a
virtual pipeline, only to the first stage's first model chunk and the last stage's last): the
other chunks take their input from the chunk before them, and no data loader runs for them.
SAP's attention needs the row's documents in every chunk. So the first stage sends each
micro-batch's documents, and the plan a data loader's worker made for it, to the other stages
that run such chunks as it reads them (`send_documents`: host to host over
`groups.pipeline_host_group`, made right after `initialize_model_parallel`, without waiting), and
such a chunk takes them when it runs that micro-batch (`documents_for`), from the messages its
rank received in order (or, on the first stage, from the documents it read).

Every model chunk runs the forward passes of its micro-batches in the order the first stage
reads them (training and evaluation alike, interleaved or not), so the messages need no tag: a
rank keeps each micro-batch's documents until all its chunks that need them have taken them. A
receive waits at most the pipeline group's timeout, so a first stage that died or sent nothing
fails the others instead of hanging them.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron_sap.comm.p2p import collective_device

from .groups import documents_cross_stages, pipeline_host_group

_PENDING: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []  # sends in flight, with their buffers
MAX_PENDING = 256  # sends kept in flight at most; beyond, the oldest is waited for

Documents = tuple[list[int], Optional[bytes]]  # a micro-batch's cu_seqlens (on the host) and pickled plan


@dataclass
class _Inbox:
    """One rank's documents of the micro-batches its chunks that read no data have not all
    taken yet: `held[i]` is micro-batch `first + i`; `taken[chunk]` counts what a chunk took."""

    group: dist.ProcessGroup  # the pipeline group it is for
    held: list[Documents] = field(default_factory=list)
    first: int = 0
    taken: dict[int, int] = field(default_factory=dict)


_INBOXES: dict[int, _Inbox] = {}  # id(pipeline group) -> its inbox on this rank


def _inbox() -> _Inbox:
    group = parallel_state.get_pipeline_model_parallel_group()
    inbox = _INBOXES.get(id(group))
    if inbox is None or inbox.group is not group:
        inbox = _INBOXES[id(group)] = _Inbox(group)
    return inbox


def _chunks() -> int:
    return parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1


def reads_no_data(chunk: Optional[int]) -> bool:
    """Whether this rank's model chunk `chunk` (`GPTModel.vp_stage`; None without a virtual
    pipeline) gets no batch from `pretrain_gpt.get_batch`."""
    if not documents_cross_stages():
        return False
    chunk, last_chunk = chunk or 0, _chunks() - 1
    stage, last_stage = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size() - 1
    return not (stage == 0 and chunk == 0) and not (stage == last_stage and chunk == last_chunk)


def rank_reads_no_data() -> bool:
    """Whether no model chunk of this rank gets a batch from `pretrain_gpt.get_batch` (a middle
    pipeline stage's): all of them take each micro-batch's documents and plan from the first
    stage (`documents_for`)."""
    return all(reads_no_data(chunk) for chunk in range(_chunks()))


def send_documents(documents: Optional[list[int]], plan_bytes: Optional[bytes]) -> None:
    """On a first pipeline stage whose pipeline has chunks that read no data, post this
    micro-batch's documents and pickled plan to the stages that run them (and keep them for its
    own, with a virtual pipeline); elsewhere nothing."""
    if not documents_cross_stages() or not parallel_state.is_pipeline_first_stage(ignore_virtual=True):
        return
    if _chunks() > 1:
        _inbox().held.append((documents, plan_bytes))
    group, _, receivers = pipeline_host_group()
    device = collective_device(group)
    payload = torch.frombuffer(bytearray(pickle.dumps((documents, plan_bytes), protocol=pickle.HIGHEST_PROTOCOL)),
                               dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    _PENDING[:] = [entry for entry in _PENDING if not entry[0].is_completed()]
    for stage in receivers:
        for tensor in (size, payload):
            _PENDING.append((dist.isend(tensor, stage, group=group), size, payload))
    while len(_PENDING) > MAX_PENDING:
        _PENDING.pop(0)[0].wait()


def documents_for(chunk: Optional[int]) -> Documents:
    """The documents (and pickled plan or None) of the next micro-batch of this rank's model
    chunk `chunk`, one that reads no data (`reads_no_data`)."""
    if not reads_no_data(chunk):
        raise ValueError(f"model chunk {chunk} of this rank reads its own data; it takes no documents from the first stage")
    inbox, chunk = _inbox(), chunk or 0
    index = inbox.taken.get(chunk, 0)
    inbox.taken[chunk] = index + 1
    while index >= inbox.first + len(inbox.held):
        if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            raise RuntimeError(f"model chunk {chunk} runs micro-batch {index} before the first chunk read it")
        inbox.held.append(_receive())
    documents, plan_bytes = inbox.held[index - inbox.first]
    # Drop what every chunk of this rank that reads no data has taken.
    needing = [c for c in range(_chunks()) if reads_no_data(c)]
    done = min(inbox.taken.get(c, 0) for c in needing)
    del inbox.held[: max(done - inbox.first, 0)]
    inbox.first = max(inbox.first, done)
    if documents is None:
        raise ValueError(
            "the first pipeline stage read no documents for this micro-batch (no data loader copy on its host), so the "
            "model chunks that read no data cannot keep them apart"
        )
    return documents, plan_bytes


def _receive() -> Documents:
    """The next message from this rank's first pipeline stage."""
    group, first, _ = pipeline_host_group()
    device = collective_device(group)
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, first, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, first, group=group)
    return pickle.loads(payload.cpu().numpy().tobytes())
