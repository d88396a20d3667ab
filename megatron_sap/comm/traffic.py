"""Counting the bytes that executors really send.

Every send site of SAP and of the baselines calls `record_send`; a `count_traffic()`
block collects the totals per peer so tests and benchmarks compare measured traffic
with the plan's model. Outside such a block recording costs one attribute check.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class TrafficLog:
    """Bytes sent by this process, keyed by (kind, peer global rank)."""

    sent_bytes: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))

    def total_bytes(self, kind: str | None = None) -> int:
        return sum(b for (k, _), b in self.sent_bytes.items() if kind is None or k == kind)

    def bytes_by_peer(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for (_, peer), b in self.sent_bytes.items():
            out[peer] += b
        return dict(out)


_active: list[TrafficLog] = []


def record_send(tensor: torch.Tensor, peer: int, kind: str = "p2p") -> None:
    """Note that `tensor` is being sent to global rank `peer` (`kind`: p2p, a2a, allgather, ...)."""
    if not _active:
        return
    nbytes = tensor.numel() * tensor.element_size()
    for log in _active:
        log.sent_bytes[(kind, peer)] += nbytes


@contextlib.contextmanager
def count_traffic() -> Iterator[TrafficLog]:
    """Collect every `record_send` made inside the block."""
    log = TrafficLog()
    _active.append(log)
    try:
        yield log
    finally:
        _active.remove(log)
