"""The explicit cost model SAP plans against.

One attention layer (forward plus backward) is modelled per rank as kernel time on
tile-rounded (q, k) pairs plus point-to-point transfers over two link classes
(intra-node and inter-node), each message paying a fixed latency. Every number is a
field with a documented default so that presets and calibration files can replace it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..validation import positive_int

LINK_INTRA = "intra"
LINK_INTER = "inter"
# The longest row the model's times must stay finite for: int32 cu_seqlens (the kernels')
# hold fewer tokens.
LARGEST_ROW_TOKENS = 2**31


@dataclass(frozen=True)
class CostModel:
    """Hardware rates and model shape used to estimate attention time.

    Rates are per GPU. Bandwidths are GB/s per direction (1 GB = 1e9 bytes).
    """

    name: str = "h100"
    gpus_per_node: int = 8
    attention_tflops: float = 400.0  # effective forward attention rate
    backward_factor: float = 2.5  # backward FLOPs / forward FLOPs
    intra_node_gbps: float = 360.0
    inter_node_gbps: float = 45.0
    message_latency_us: float = 15.0
    tile: int = 128  # kernel tile: a segment shorter than a tile still costs a tile
    # The pipelined schedule's kernel time over the gathered schedule's for the same pairs
    # (one segment per source, and the lse merges); 1.0 (not measured) in the presets, fitted
    # by the GPU check. Chooses the schedule (`Plan.schedule`); the placement weighs a rank's
    # pipelined tile pairs at it against its gathered ones and counts the fewer (`Tally`).
    pipelined_kernel_factor: float = 1.0
    num_heads: int = 32  # Hq
    num_kv_heads: int = 8  # Hkv
    head_dim: int = 128
    bytes_per_element: int = 2  # bf16

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"CostModel.name must be a string, got {self.name!r}")
        for field in ("gpus_per_node", "tile", "num_heads", "num_kv_heads", "head_dim", "bytes_per_element"):
            # numpy integers too, as ints: equal models compare equal
            object.__setattr__(self, field, positive_int(getattr(self, field), f"CostModel.{field}"))
        for field in ("attention_tflops", "intra_node_gbps", "inter_node_gbps", "backward_factor",
                      "pipelined_kernel_factor", "message_latency_us"):
            value = getattr(self, field)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"CostModel.{field} must be a finite number, got {value!r}")
            object.__setattr__(self, field, float(value))
            if value < 0 or (value == 0 and field != "message_latency_us"):
                raise ValueError(f"CostModel.{field} must be {'>= 0' if field == 'message_latency_us' else 'positive'}, "
                                 f"got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"CostModel.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        self._check_times()

    def _check_times(self) -> None:
        """Finite fields can still give times that overflow to infinity or vanish to zero
        (1e-300 TFLOP/s, a bandwidth of 1e-320 GB/s), and then every candidate's modelled
        time is inf or NaN: the rates must keep the times of a row of up to
        LARGEST_ROW_TOKENS tokens finite, and a pair's kernel time and a byte's transfer
        time above zero."""
        row = float(LARGEST_ROW_TOKENS)
        try:
            kernel = {
                "a pair's forward": self.compute_seconds(1.0),
                "a pair's backward": self.compute_seconds(1.0, backward=True),
                "a pair's pipelined backward": self.compute_seconds(1.0, backward=True) * self.pipelined_kernel_factor,
                "a row's forward": self.compute_seconds(row * row),
                "a row's pipelined backward": self.compute_seconds(row * row, backward=True) * self.pipelined_kernel_factor,
            }
            links = {field: (1.0 / self.bandwidth(link), row * self.kv_bytes_per_token / self.bandwidth(link))
                     for field, link in (("intra_node_gbps", LINK_INTRA), ("inter_node_gbps", LINK_INTER))}
        except OverflowError as exc:  # integer fields too large for a float
            raise ValueError(f"CostModel fields too large for its times: {exc}") from None
        for what, seconds in kernel.items():
            if not 0.0 < seconds < math.inf:
                raise ValueError(
                    f"CostModel kernel times out of range: {what} takes {seconds:g} s with attention_tflops="
                    f"{self.attention_tflops:g}, backward_factor={self.backward_factor:g}, pipelined_kernel_factor="
                    f"{self.pipelined_kernel_factor:g} and {self.num_heads} heads of {self.head_dim} (a row holds up to "
                    f"{LARGEST_ROW_TOKENS} tokens; every time must be finite and above zero)")
        for field, (per_byte, row_seconds) in links.items():
            if not (0.0 < per_byte and row_seconds < math.inf):
                raise ValueError(f"CostModel.{field} = {getattr(self, field):g} gives transfer times out of range "
                                 f"({per_byte:g} s per byte, {row_seconds:g} s for a row's K/V)")
        if not self.message_latency_us * 1e-6 * row < math.inf:
            raise ValueError(f"CostModel.message_latency_us = {self.message_latency_us:g} gives message times out of range")

    # ---- construction -------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "CostModel":
        """A named preset (`h100`, `h200`, `cpu`), with fields optionally overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown cost-model preset {name!r}; known: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    @classmethod
    def from_calibration(cls, source: str | os.PathLike | dict, base: str = "h100") -> "CostModel":
        """Replace preset rates by measured ones.

        `source` is a dict or a JSON file whose keys are CostModel fields (unknown keys
        are rejected); the GPU check script writes such a file.
        """
        if not isinstance(source, dict):
            try:
                with open(source) as f:
                    source = json.load(f)
            except (OSError, ValueError, RecursionError) as exc:  # missing, unreadable, not JSON, nested too deep
                raise ValueError(f"cannot read the cost-model calibration file {os.fspath(source)!r}: {exc}") from exc
        values = source.get("cost_model", source) if isinstance(source, dict) else source
        if not isinstance(values, dict):
            raise ValueError(f"a calibration is a JSON object of CostModel fields, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"calibration has unknown CostModel fields {unknown}; known: {sorted(known)}")
        name = values.get("name", base)
        if not isinstance(name, str):
            raise ValueError(f"calibration name must be a string, got {name!r}")
        base_name = name if name in PRESETS else base
        return dataclasses.replace(cls.preset(base_name), **values)

    def with_shape(self, num_heads: int, num_kv_heads: int, head_dim: int, bytes_per_element: int | None = None) -> "CostModel":
        """The same hardware with another model shape."""
        return dataclasses.replace(
            self,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            bytes_per_element=self.bytes_per_element if bytes_per_element is None else bytes_per_element,
        )

    # ---- compute --------------------------------------------------------------------
    def block_pairs(self, q_len: int, k_len: int, causal: bool) -> int:
        """Tile-rounded (q, k) pairs a kernel spends on one block.

        A causal block is bottom-right aligned (k_len >= q_len): the lower triangle of
        tiles of its last q_len keys, plus every tile of the q_len x (k_len - q_len)
        rectangle before them (as `cuts.tile_pairs`). A full block is every tile of the
        q_len x k_len rectangle.
        """
        if q_len <= 0 or k_len <= 0:
            return 0
        t = self.tile
        nq, nk = math.ceil(q_len / t), math.ceil(k_len / t)
        if causal:
            return t * t * (nq * (nq + 1) // 2 + nq * math.ceil(max(k_len - q_len, 0) / t))
        return t * t * nq * nk

    @property
    def flops_per_pair(self) -> float:
        """Forward FLOPs per (q, k) pair: QK^T and PV, 2*D each, for every query head."""
        return 4.0 * self.head_dim * self.num_heads

    def compute_seconds(self, pairs: float, backward: bool = False, head_fraction: float = 1.0) -> float:
        """Kernel time for `pairs` tile-rounded pairs over `head_fraction` of the heads."""
        flops = pairs * self.flops_per_pair * head_fraction
        if backward:
            flops *= self.backward_factor
        return flops / (self.attention_tflops * 1e12)

    # ---- communication --------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all KV heads."""
        return 2 * self.num_kv_heads * self.head_dim * self.bytes_per_element

    def inner_kv_bytes_per_token(self, inner_size: int) -> float:
        """Bytes of one token's K and V that one of `inner_size` inner ranks moves: its share
        of the KV heads, or one whole (replicated) head when there are fewer heads than ranks."""
        return self.kv_bytes_per_token * max(self.num_kv_heads, inner_size) / self.num_kv_heads / inner_size

    @property
    def q_bytes_per_token(self) -> int:
        """Bytes of one token's query (or output) over all query heads."""
        return self.num_heads * self.head_dim * self.bytes_per_element

    def bandwidth(self, link: str) -> float:
        """Bytes per second of a link class."""
        if link == LINK_INTRA:
            return self.intra_node_gbps * 1e9
        if link == LINK_INTER:
            return self.inter_node_gbps * 1e9
        raise ValueError(f"unknown link class {link!r}; expected {LINK_INTRA!r} or {LINK_INTER!r}")

    def transfer_seconds(self, nbytes: float, link: str, messages: int = 1) -> float:
        """Time to move `nbytes` over one link class in `messages` messages."""
        if nbytes <= 0 and messages <= 0:
            return 0.0
        return messages * self.message_latency_us * 1e-6 + nbytes / self.bandwidth(link)

    def node_of(self, cp_rank: int) -> int:
        """Node holding a CP rank, with CP ranks laid out contiguously over nodes."""
        return cp_rank // self.gpus_per_node

    def link_between(self, cp_rank_a: int, cp_rank_b: int) -> str:
        """Link class between two CP ranks."""
        return LINK_INTRA if self.node_of(cp_rank_a) == self.node_of(cp_rank_b) else LINK_INTER


# The GPU presets are nominal rates. Measured ones replace them through a calibration file
# (`CostModel.from_calibration`, `--sap-calibration-file`): docs/calibration.json holds the rates
# fitted on one H200 with PyTorch's FlashAttention-2 kernels (315 TFLOP/s on the model's
# tile-rounded pairs, backward 2.85x the forward time, the pipelined schedule's kernels 1.27x
# the gathered one's, 2026-12-04; four runs since 2026-11-30 gave 315-319 and 2.84-2.85;
# scripts/gpu_check.py).
PRESETS: dict[str, CostModel] = {
    # H100 SXM: NVLink 4 (~360 GB/s achievable per direction), one 400 Gb/s NIC per GPU.
    "h100": CostModel(),
    # H200 SXM: same die as H100 with faster HBM3e; NVLink ~450 GB/s, 400 Gb/s NIC per GPU.
    "h200": CostModel(name="h200", attention_tflops=450.0, intra_node_gbps=450.0, inter_node_gbps=48.0),
    # CPU gloo, for sanity runs of the model against wall time on this machine.
    "cpu": CostModel(
        name="cpu",
        gpus_per_node=64,
        attention_tflops=0.02,
        intra_node_gbps=2.0,
        inter_node_gbps=2.0,
        message_latency_us=50.0,
        tile=64,
        bytes_per_element=4,
    ),
}
