"""One real launch of the tiny CPU recipe from the command line, shared by the tests that need one:
`bash tools/launch.sh recipes/tiny_cpu.yaml` on this machine with 2 processes, which is torchrun
(`python -m torch.distributed.run ... -m megatron_rlcorr.train --config recipes/tiny_cpu.yaml`).

Each interpreter costs seconds (torch, Megatron-Core), so the launch runs once per session
(`tiny_cpu_launch`, registered in tests/conftest.py) and each test asserts its own part of it:
test_trainer.py's torchrun end-to-end test the metrics, checkpoint and console of the run,
test_launch.py's two-process run the launcher's exit code, node log and console, test_console.py
that the console shows none of the known warnings. None writes into the run's directory.

Also the launcher's helpers for tests/unit/test_launch.py: the environment it reads, cleared, and the
call.
"""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rlcorr.runtime import VERBOSE_ENV
from tests.dist_pool import free_port
from tests.session_once import once

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "tools" / "launch.sh"
# What the launcher reads: cleared so that the machine running the tests (a SLURM job, a shell
# with NCCL settings) does not change the outcome.
LAUNCH_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "PYTHON", "LOG_DIR",
               "CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_NCCL_AVOID_RECORD_STREAMS", "NCCL_IB_TIMEOUT",
               "NCCL_P2P_NET_CHUNKSIZE", "PYTORCH_CUDA_ALLOC_CONF")
# 3 steps of 4 prompts x 4 samples with dynamic sampling, saved at the end (the run's last step).
LAUNCH_STEPS = 3
LAUNCH_OVERRIDES = (f"trainer.steps={LAUNCH_STEPS}", "data.prompts_per_step=4", "rollout.n=4",
                    "trainer.micro_batch_size=4", "trainer.save_every=0", "trainer.logger=[console]",
                    "algorithm.dynamic_sampling.enabled=true")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    # `python` is the interpreter running the tests, which imports the project: the recipe is checked
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def launch(*args: str, env: dict[str, str], cwd: Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def tiny_cpu_launch(tmp_path_factory):
    """The launch, finished (whether it succeeded is each test's to assert): `proc` (its exit code;
    stdout: the launcher's lines and torchrun's stdout and stderr, the ranks' included; stderr: the
    launcher's own), `log` (LOG_DIR's node0.log), `run_dir` (the recipe's run under
    trainer.output_dir) and `steps`. Once per test run, on whichever pytest-xdist worker asks first
    (tests/session_once.py)."""

    def run(out: Path) -> dict:
        env = clean_env(PYTHON=sys.executable, NNODES="1", GPUS_PER_NODE="2", MASTER_PORT=str(free_port()),
                        LOG_DIR=str(out / "logs"), CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
        env.pop(VERBOSE_ENV, None)  # the console a newcomer sees: the known warnings hidden
        proc = launch("recipes/tiny_cpu.yaml", *LAUNCH_OVERRIDES, f"trainer.output_dir={out}", env=env, timeout=240)
        return dict(args=proc.args, returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)

    out, proc = once(tmp_path_factory, "tiny_cpu_launch", run)
    log = out / "logs" / "node0.log"  # absent when the launcher refused the launch
    return SimpleNamespace(proc=subprocess.CompletedProcess(**proc), log=log.read_text() if log.exists() else "",
                           run_dir=out / "tiny_cpu", steps=LAUNCH_STEPS)
