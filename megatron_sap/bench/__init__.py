"""Benchmarks: real document-length corpora, Megatron-style packing, the scale model and plots.

Run ``python -m megatron_sap.bench`` (``make bench``) for the full report, or
``python -m megatron_sap.bench.scale`` for the projection to 1,024 GPUs.
"""
