"""Peak memory of an operation: CUDA allocator statistics on GPU, tracked tensor
storages on CPU.

CPU PyTorch keeps no allocator statistics, so `track_peak_memory` follows every
storage that an operator creates inside the block (a dispatch mode sees each op's
outputs, those on an input's storage left out) until it is freed, and reports the peak of
the live total above what existed before. Views share their base's storage and are
counted once; a view of, or a write into, a tensor made before the block counts nothing.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class PeakMemory:
    """Bytes above the block's starting level: the peak, and what is allocated now."""

    peak_bytes: int = 0
    _now: Callable[[], int] = lambda: 0

    @property
    def live_bytes(self) -> int:
        """Memory allocated inside the block and still alive at this moment."""
        return self._now()


class _StorageTracker(TorchDispatchMode):
    def __init__(self, result: PeakMemory):
        super().__init__()
        self.result = result
        self.live = 0
        result._now = lambda: self.live
        self.seen: set[int] = set()

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(key)
        size = storage.nbytes()
        self.live += size
        self.result.peak_bytes = max(self.result.peak_bytes, self.live)

        def release(key=key, size=size) -> None:
            self.seen.discard(key)
            self.live -= size

        weakref.finalize(storage, release)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view, an in-place or out= write) is no new
        # memory: counted where that storage was made, if inside the block.
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in inputs:
                self._track(t)
        return out


@contextlib.contextmanager
def track_peak_memory(device: torch.device | str = "cpu") -> Iterator[PeakMemory]:
    """Measure the peak extra memory allocated inside the block on `device`."""
    result = PeakMemory()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result._now = lambda: torch.cuda.memory_allocated(device) - base
        yield result
        torch.cuda.synchronize(device)
        result.peak_bytes = torch.cuda.max_memory_allocated(device) - base
        return
    with _StorageTracker(result):
        yield result
