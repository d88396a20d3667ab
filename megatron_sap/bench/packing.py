"""Megatron-style packing of documents into micro-batch rows of exactly T tokens.

Documents are drawn from a shuffled stream (reshuffled each epoch) and concatenated;
the stream is cut every T tokens. The document straddling a cut is split: its
remainder continues at the start of the next batch, as Megatron's GPTDataset does, so
no token is dropped and a document longer than T spans several batches. Each batch is
described by its ``cu_seqlens``: document boundaries, starting at 0 and ending at T.
"""
from __future__ import annotations

import numpy as np


def pack(lengths: np.ndarray, T: int, num_batches: int, seed: int = 0) -> list[list[int]]:
    """`num_batches` packed rows of `T` tokens from documents of `lengths`, as cu_seqlens lists.

    Deterministic in `seed`. The first batch starts at the start of a document; every
    later batch starts with the remainder of the document cut at the previous boundary.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if T <= 0 or num_batches < 0:
        raise ValueError(f"need T > 0 and num_batches >= 0, got T={T}, num_batches={num_batches}")
    if lengths.size == 0 or (lengths <= 0).any():
        raise ValueError("lengths must be a non-empty array of positive document lengths")
    rng = np.random.default_rng(seed)
    order = rng.permutation(lengths.size)
    next_doc = 0
    carry = 0  # tokens of the current document not yet placed
    batches: list[list[int]] = []
    for _ in range(num_batches):
        cu = [0]
        filled = 0
        while filled < T:
            if carry == 0:
                if next_doc == order.size:
                    order = rng.permutation(lengths.size)
                    next_doc = 0
                carry = int(lengths[order[next_doc]])
                next_doc += 1
            take = min(carry, T - filled)
            filled += take
            carry -= take
            cu.append(filled)
        batches.append(cu)
    return batches
