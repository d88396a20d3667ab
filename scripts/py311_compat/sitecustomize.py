"""Lets Megatron-LM core_v0.18+ training code import on Python 3.11, for running the gated tests here.

Megatron-LM from core_v0.18 imports `typing.override` (Python 3.12). Put this directory first on
`PYTHONPATH` and Python runs this file at start-up, which supplies it from `typing_extensions`
(a torch dependency). For testing only: train on Python 3.12 (docs/megatron.md, "Releases after 0.16").
"""
import typing

if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override
