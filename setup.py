from setuptools import find_packages, setup

setup(
    name="megatron-rlcorr",
    version="0.1.0",
    description="RL post-training on Megatron-Core with exact rollout correction (IS/RS) under TP/PP/CP/DP",
    packages=find_packages(include=["megatron_rlcorr", "megatron_rlcorr.*"]),
    python_requires=">=3.10",
    install_requires=[
        # torch is installed first by tools/test.sh (CPU wheel 2.13.0) when absent; a GPU
        # machine's own torch satisfies this range and is never replaced.
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.20",
        "pyyaml>=6.0",
        # Hugging Face checkpoints, tokenizers and prompt datasets (all read locally, never from a hub).
        "safetensors>=0.4.3",
        "tokenizers>=0.21",
        "transformers>=4.56,<6",
        "pyarrow>=15",
        # Megatron-Core's checkpoint writer (dist_checkpointing filesystem_async) imports it.
        "psutil>=5.9",
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]>=2.0"],
        "vllm": ["vllm==0.25.1"],  # rollout/vllm_engine.py is written against this version
        "math": ["math-verify>=0.7"],
        "plots": ["matplotlib>=3.7"],  # `analyze` and tools/ablate.py draw their figures with it
        "dev": ["pytest>=8.0", "pytest-timeout>=2.2", "matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["megatron-rlcorr=megatron_rlcorr.cli:main"]},
)
