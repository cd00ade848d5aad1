from setuptools import find_packages, setup

setup(
    name="megatron-rlcorr",
    version="0.1.0",
    description="RL post-training on Megatron-Core with exact rollout correction (IS/RS) under TP/PP/CP/DP",
    packages=find_packages(include=["megatron_rlcorr", "megatron_rlcorr.*"]),
    python_requires=">=3.10",
    install_requires=[
        # torch is installed first by tools/test.sh (CPU wheel 2.13.0) when absent; a GPU
        # machine's own torch is never replaced (tools/_env.sh). The floor is megatron-core's own
        # (0.16-0.19 require torch>=2.6.0), written 2.6.0a0 so that NGC's pre-release builds of 2.6
        # (2.6.0a0+nv...), which PEP 440 orders before 2.6.0, meet it.
        "torch>=2.6.0a0",
        "megatron-core>=0.16.1,<0.20",
        "pyyaml>=6.0",
        # Hugging Face checkpoints, tokenizers and prompt datasets (all read locally, never from a hub).
        "safetensors>=0.4.3",
        "tokenizers>=0.21",
        "transformers>=4.56,<6",
        "pyarrow>=15",
        # tool configs of multi-turn rollouts: their JSON Schemas checked, tool-call arguments validated
        "jsonschema>=4.18",
        # Megatron-Core's checkpoint writer (dist_checkpointing filesystem_async) imports it.
        "psutil>=5.9",
    ],
    extras_require={
        # Transformer Engine for the megatron-core that pip picks: 0.16.1 on Python < 3.12 declares
        # >=2.9,<2.12; 0.17-0.19 (Python 3.12) are built against TE 2.14-2.17, and 0.19.2 ran with
        # 2.20.2 on an H100. [pytorch] builds the torch extension for the local torch's CUDA.
        "te": ['transformer-engine[pytorch]>=2.9,<2.12; python_version < "3.12"',
               'transformer-engine[pytorch]>=2.9,<2.21; python_version >= "3.12"'],
        "vllm": ["vllm==0.25.1"],  # rollout/vllm_engine.py is written against this version
        "math": ["math-verify>=0.7"],
        "plots": ["matplotlib>=3.7"],  # `analyze` and tools/ablate.py draw their figures with it
        # trainer.logger's trackers (rl/trackers.py). mlflow-skinny is enough: the client logs to
        # MLFLOW_TRACKING_URI (a tracking server) or to a file store in the run directory, and neither
        # needs MLflow's server package or SQLAlchemy (a sqlite:// tracking URI does: install mlflow then).
        "tensorboard": ["tensorboard>=2.14"],
        "wandb": ["wandb>=0.19,<1"],
        "mlflow": ["mlflow-skinny>=3.0,<4"],
        # wandb 0.31: tests/distributed/test_trackers_run.py reads offline runs with `wandb leet inspect`
        # pytest-xdist: tools/test.sh runs the suite on two worker processes; filelock: the workers build the
        # session's tiny checkpoints once between them (tests/conftest.py)
        "dev": ["pytest>=8.0", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "filelock>=3.12", "matplotlib>=3.7",
                "tensorboard>=2.14", "wandb>=0.31,<1", "mlflow-skinny>=3.0,<4"],
    },
    entry_points={"console_scripts": ["megatron-rlcorr=megatron_rlcorr.cli:main"]},
)
