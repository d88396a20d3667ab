"""Batched point-to-point exchanges for the compiled program.

One step of the program sends one contiguous buffer to a peer and receives one from
it (its partner in that exchange round; either side may be empty), posted together
with `batch_isend_irecv` so NCCL and gloo can run them while the caller computes.
Posting and `wait` turn a failure (a dead peer, a timeout) into an error naming the step
and the peers where the backend reports it there (gloo). NCCL's `wait` only makes the
compute stream wait; a failed or stuck exchange surfaces later, through its watchdog
(the process group's timeout, TORCH_NCCL_ASYNC_ERROR_HANDLING), which ends the job.

Inside `local_exchanges()` nothing is sent and every receive buffer is zero-filled:
one rank of a multi-rank op then runs alone in this process with exactly the buffers
it would allocate, which is how per-rank memory and kernel time are measured on a
single device.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from .traffic import record_send


@contextlib.contextmanager
def failure_named(description: str) -> Iterator[None]:
    """A communication call's failure in the block (a dead or stuck peer; the backend's
    error type varies: gloo, NCCL) raised as a RuntimeError "<description> failed: ..."."""
    try:
        yield
    except Exception as exc:
        raise RuntimeError(f"{description} failed: {exc}") from exc


@dataclass
class PendingExchange:
    """Handles of one posted step."""

    works: list
    description: str
    buffers: tuple  # the send and receive tensors, alive until the step completes

    def wait(self) -> None:
        for work in self.works:
            with failure_named(self.description):
                work.wait()


def post_exchange(
    send: torch.Tensor | None,
    send_peer: int | None,
    recv: torch.Tensor | None,
    recv_peer: int | None,
    group: dist.ProcessGroup | None,
    tag: int,
    what: str,
) -> PendingExchange:
    """Post a send of `send` to global rank `send_peer` and a receive into `recv` from `recv_peer`;
    `what` names the step in errors ("SAP step 2 of 5 ...")."""
    description = f"{what} (send to rank {send_peer}, receive from rank {recv_peer}, tag {tag})"
    if _local_depth:
        if send is not None and send.numel():
            record_send(send, send_peer, "p2p")
        if recv is not None:
            recv.zero_()
        return PendingExchange([], description, (send, recv))
    ops = []
    if send is not None and send.numel():
        record_send(send, send_peer, "p2p")
        ops.append(dist.P2POp(dist.isend, send, send_peer, group=group, tag=tag))
    if recv is not None and recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, recv_peer, group=group, tag=tag))
    with failure_named(description):  # gloo raises while posting when a peer's connection is already closed
        works = dist.batch_isend_irecv(ops) if ops else []
    return PendingExchange(works, description, (send, recv))


_local_depth = 0
# Weakly: a group destroyed (and collected) leaves, with its connections and threads.
_ready_groups: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective's tensors live on `group`: the current GPU when the group has NCCL
    (also as one backend of several, "cpu:gloo,cuda:nccl"), else the CPU. `sap_attention`
    makes its inputs' GPU current around its collectives; Megatron-LM sets each process's."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mark_ready(group: dist.ProcessGroup) -> None:
    """Record that `group` has run a collective (see `ready_for_batched_p2p`)."""
    _ready_groups.add(group)


def ready_for_batched_p2p(group: dist.ProcessGroup | None, what: str) -> None:
    """Run one collective on `group` before its first batched P2P call (once per group).

    With NCCL, the first call on a group creates its communicator and must include every
    rank of the group, while a batch of exchanges that follows may involve only some:
    an outer rank whose program moves nothing would otherwise leave the others waiting
    in their first exchange. Every rank of the group calls this (they run the same layer).
    """
    if group is None or _local_depth or group in _ready_groups:
        return
    with failure_named(f"SAP first collective on the {what}"):
        dist.all_reduce(torch.zeros(1, device=collective_device(group)), group=group)
    mark_ready(group)


@contextlib.contextmanager
def local_exchanges() -> Iterator[None]:
    """Exchanges inside the block send nothing and receive zeros (single-process measurements)."""
    global _local_depth
    _local_depth += 1
    try:
        yield
    finally:
        _local_depth -= 1
