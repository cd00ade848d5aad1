"""tools/launch.sh, the multi-node launcher: topology from the environment or SLURM, the NCCL and
Megatron-Core environment, input checks, the per-node log, and a real 2-process CPU run (the session's
one real launch, tests/launched.py, which test_trainer.py and test_console.py read too)."""
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.launched import ROOT, clean_env, launch
from tests.runs import read_metrics

TINY = "recipes/tiny_cpu.yaml"
# The launcher checks the recipe for its launch (with the `python` on PATH, the test's own here):
# these make the tiny recipe valid on every topology below (32, 16, 12 and 10 ranks).
ANY_WORLD = ("data.prompts_per_step=480", "trainer.micro_batch_size=1")
DEFAULT_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
               "NCCL_IB_TIMEOUT": "19", "NCCL_P2P_NET_CHUNKSIZE": "2097152"}


def exports(stdout: str) -> dict[str, str]:
    """The `export NAME=value` lines of a dry run."""
    pairs = [line[len("export "):].split("=", 1) for line in stdout.splitlines() if line.startswith("export ")]
    return dict(pairs)


def command_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("+ ")]
    assert len(lines) == 1, stdout
    return lines[0]


def fake_tool(directory: Path, name: str, script: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("#!/usr/bin/env bash\n" + script)
    path.chmod(0o755)
    return directory


def test_dry_run_with_explicit_topology(tmp_path):
    env = clean_env(NNODES="4", NODE_RANK="3", MASTER_ADDR="node-a", MASTER_PORT="6001", GPUS_PER_NODE="8",
                    NCCL_IB_TIMEOUT="22", LOG_DIR=str(tmp_path / "logs"))
    # --dry-run may come anywhere among the arguments.
    proc = launch(TINY, "trainer.steps=3", "--dry-run", "optim.lr=1e-4", *ANY_WORLD, env=env)
    assert proc.returncode == 0, proc.stderr
    assert command_line(proc.stdout) == (
        "+ python -m torch.distributed.run --nnodes=4 --node-rank=3 --nproc-per-node=8 --master-addr=node-a "
        "--master-port=6001 -m megatron_rlcorr.train --config recipes/tiny_cpu.yaml trainer.steps=3 optim.lr=1e-4 "
        + " ".join(ANY_WORLD))
    assert exports(proc.stdout) == {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "node-a", "MASTER_PORT": "6001",
                                    "GPUS_PER_NODE": "8", **DEFAULT_ENV,
                                    "NCCL_IB_TIMEOUT": "22"}  # the user's value wins
    assert "node3.log" in proc.stdout
    assert not (tmp_path / "logs").exists()  # a dry run creates nothing


def test_dry_run_defaults_without_slurm(tmp_path):
    bin_dir = fake_tool(tmp_path / "bin", "nvidia-smi",
                        '[ "$1" = -L ] || exit 1\n'
                        'for i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done\n')
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON="/opt/py/bin/python3")
    proc = launch("--dry-run", TINY, env=env)
    assert proc.returncode == 0, proc.stderr
    assert command_line(proc.stdout) == (
        "+ /opt/py/bin/python3 -m torch.distributed.run --nnodes=1 --node-rank=0 --nproc-per-node=4 "
        "--master-addr=127.0.0.1 --master-port=29500 -m megatron_rlcorr.train --config recipes/tiny_cpu.yaml")
    assert exports(proc.stdout) == {"NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": "29500", "GPUS_PER_NODE": "4", **DEFAULT_ENV}


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_dry_run_one_process_without_gpus():
    proc = launch(TINY, "--dry-run", env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert exports(proc.stdout)["GPUS_PER_NODE"] == "1"
    assert " --nproc-per-node=1 " in command_line(proc.stdout)


def test_dry_run_under_slurm(tmp_path):
    # The fake scontrol answers only the call the launcher should make.
    bin_dir = fake_tool(tmp_path / "bin", "scontrol",
                        '[ "$*" = "show hostnames gpu-[07-08]" ] || { echo "unexpected: $*" >&2; exit 1; }\n'
                        'printf "gpu-07\\ngpu-08\\n"\n')
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2",
                    SLURM_NODEID="1", SLURM_JOB_NODELIST="gpu-[07-08]", SLURM_GPUS_PER_NODE="h100:8")
    proc = launch(TINY, "--dry-run", *ANY_WORLD, env=env)
    assert proc.returncode == 0, proc.stderr
    assert command_line(proc.stdout) == (
        "+ python -m torch.distributed.run --nnodes=2 --node-rank=1 --nproc-per-node=8 --master-addr=gpu-07 "
        "--master-port=29500 -m megatron_rlcorr.train --config recipes/tiny_cpu.yaml " + " ".join(ANY_WORLD))
    assert exports(proc.stdout) == {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "gpu-07", "MASTER_PORT": "29500",
                                    "GPUS_PER_NODE": "8", **DEFAULT_ENV}


def test_slurm_fallbacks_and_user_values_first(tmp_path):
    bin_dir = fake_tool(tmp_path / "bin", "scontrol", 'printf "a1\\na2\\na3\\n"\n')
    base = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_NNODES="3", SLURM_NODEID="2",
                     SLURM_JOB_NODELIST="a[1-3]", SLURM_GPUS_ON_NODE="4", SLURM_GPUS_PER_NODE="h100:8")
    found = exports(launch(TINY, "--dry-run", *ANY_WORLD, env=base).stdout)
    # SLURM_NNODES when SLURM_JOB_NUM_NODES is missing; SLURM_GPUS_ON_NODE before SLURM_GPUS_PER_NODE.
    assert (found["NNODES"], found["NODE_RANK"], found["MASTER_ADDR"], found["GPUS_PER_NODE"]) == ("3", "2", "a1", "4")
    mine = exports(launch(TINY, "--dry-run", *ANY_WORLD, env={**base, "NNODES": "5", "NODE_RANK": "4", "MASTER_ADDR": "head",
                                                   "GPUS_PER_NODE": "2", "CUDA_DEVICE_MAX_CONNECTIONS": "8"}).stdout)
    assert (mine["NNODES"], mine["NODE_RANK"], mine["MASTER_ADDR"], mine["GPUS_PER_NODE"]) == ("5", "4", "head", "2")
    assert mine["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


@pytest.mark.parametrize("env, named", [
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK"),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "5", "MASTER_ADDR": "h"}, "SLURM_NODEID"),
    ({"GPUS_PER_NODE": "two"}, "GPUS_PER_NODE"),
    ({"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE"),
    ({"SLURM_GPUS_PER_NODE": "h100"}, "SLURM_GPUS_PER_NODE"),
    ({"NNODES": "-1"}, "NNODES"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
    ({"MASTER_PORT": "29500x"}, "MASTER_PORT"),
])
def test_bad_topology_exits_2_naming_the_variable(tmp_path, env, named):
    proc = launch(TINY, "--dry-run", env=clean_env(**env, LOG_DIR=str(tmp_path / "logs")))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stderr and "error" in proc.stderr
    assert "+ " not in proc.stdout
    assert not (tmp_path / "logs").exists()


def test_missing_recipe_exits_2_naming_the_file(tmp_path):
    for args in (("recipes/no_such_recipe.yaml", "--dry-run"), ("recipes/no_such_recipe.yaml",)):
        proc = launch(*args, env=clean_env(LOG_DIR=str(tmp_path / "logs")))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "recipes/no_such_recipe.yaml" in proc.stderr and "not found" in proc.stderr
    assert not (tmp_path / "logs").exists()
    proc = launch("--dry-run", env=clean_env())
    assert proc.returncode == 2 and "no recipe" in proc.stderr


def test_relative_recipe_from_another_directory(tmp_path):
    # The command runs from the repository root: a path relative to the caller becomes absolute.
    (tmp_path / "my.yaml").write_text("base: " + str(ROOT / TINY) + "\n")
    proc = launch("my.yaml", "--dry-run", env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert command_line(proc.stdout).endswith(f" --config {tmp_path / 'my.yaml'}")


def test_vllm_sleep_mode_refuses_expandable_segments(tmp_path):
    recipe = tmp_path / "vllm.yaml"
    recipe.write_text(f"base: {ROOT / TINY}\nrollout: {{engine: vllm}}\n")  # sleep_level: its default, 2
    env = clean_env(PYTHON=sys.executable, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128,expandable_segments:True")
    proc = launch(str(recipe), "--dry-run", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "expandable_segments:True" in proc.stderr and "rollout.sleep_level" in proc.stderr
    # No sleep mode, or no vLLM: the allocator setting is left alone (this vLLM recipe, without a
    # model.hf_checkpoint, is then refused by the recipe check for the launch, for that reason only).
    for proc in (launch(str(recipe), "--dry-run", "rollout.sleep_level=0", env=env),
                 launch(str(recipe), "--dry-run", env={**env, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})):
        assert proc.returncode == 2 and "expandable_segments" not in proc.stderr, proc.stderr
        assert "set model.hf_checkpoint" in proc.stderr
    assert launch(TINY, "--dry-run", env=env).returncode == 0


def test_recipe_checked_for_the_launch_world_and_roles_printed(tmp_path):
    # rollout.placement separate: the last num_ranks ranks of the launch generate, the others train;
    # the recipe is checked for the launch world less those (3 - 1 = 2 trainer ranks: dp 2 divides 16 prompts).
    env = clean_env(PYTHON=sys.executable, NNODES="1", GPUS_PER_NODE="3", LOG_DIR=str(tmp_path / "logs"))
    separate = ("rollout.placement=separate", "rollout.num_ranks=1")
    proc = launch(TINY, "--dry-run", *separate, env=env)
    assert proc.returncode == 0, proc.stderr
    assert ("# ranks: 3 ranks (1 node(s) x 3): 2 train (ranks 0..1), 1 generate (ranks 2..2; rollout.placement: "
            "separate); the recipe validates for this launch") in proc.stdout.splitlines()
    assert " --nproc-per-node=3 " in command_line(proc.stdout)  # torchrun starts the whole launch
    # The same 3 ranks colocated: dp 3 does not divide the 16 prompts per step, refused before any start.
    proc = launch(TINY, "--dry-run", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "for a launch of 3 ranks (1 node(s) x 3)" in proc.stderr and "data-parallel size 3" in proc.stderr
    assert "+ " not in proc.stdout
    # Too many rollout ranks: nothing left to train; and the message names the trainer ranks when their layout fails.
    proc = launch(TINY, *separate[:1], "rollout.num_ranks=3", env=env)
    assert proc.returncode == 2 and "rollout.num_ranks=3 leaves no trainer in a launch of 3 ranks" in proc.stderr
    proc = launch(TINY, "--dry-run", *separate[:1], "rollout.num_ranks=2", env={**env, "GPUS_PER_NODE": "5"})
    assert proc.returncode == 2 and ("the trainer ranks are 3 (5 launched less rollout.num_ranks=2, rollout.placement: "
                                     "separate): data.prompts_per_step=16 must be divisible") in proc.stderr
    assert not (tmp_path / "logs").exists()  # a refused launch creates nothing
    # 2 ranks colocated: every rank generates, then trains.
    proc = launch(TINY, "--dry-run", env={**env, "GPUS_PER_NODE": "2"})
    assert proc.returncode == 0, proc.stderr
    assert "# ranks: 2 ranks (1 node(s) x 2): all generate, then train (rollout.placement: colocated)" in proc.stdout


def test_recipe_not_checked_without_the_package(tmp_path):
    fake_python = fake_tool(tmp_path / "bin", "nopython", "exit 1\n") / "nopython"
    proc = launch(TINY, "--dry-run", "rollout.placement=separate", "rollout.num_ranks=1",
                  env=clean_env(PYTHON=str(fake_python), GPUS_PER_NODE="3"))
    assert proc.returncode == 0, proc.stderr
    assert (f"# ranks: 3 ranks (1 node(s) x 3); the recipe was not checked here ({fake_python} could not load "
            "megatron_rlcorr): the ranks check it at start") in proc.stdout


def test_log_and_exit_code_of_torchrun(tmp_path):
    # A stand-in for the interpreter: both output streams, then a failure.
    fake_python = fake_tool(tmp_path / "bin", "fakepython",
                            'echo "out: $*"\necho "err: failing" >&2\nexit 7\n') / "fakepython"
    logs = tmp_path / "logs"
    env = clean_env(PYTHON=str(fake_python), LOG_DIR=str(logs), NNODES="2", NODE_RANK="1", MASTER_ADDR="h")
    proc = launch(TINY, "a.b=1", env=env)
    assert proc.returncode == 7  # torchrun's exit code is the launcher's
    first = proc.stdout.splitlines()[0]
    assert str(logs / "node1.log") in first
    log = (logs / "node1.log").read_text()
    assert "out: -m torch.distributed.run --nnodes=2 --node-rank=1" in log and "a.b=1" in log
    assert "err: failing" in log and "err: failing" in proc.stdout  # stderr too, to both
    assert "export NCCL_IB_TIMEOUT=19" in log and command_line(log).startswith(f"+ {fake_python} -m")
    assert "# ranks: 2 ranks (2 node(s) x 1); the recipe was not checked here" in log
    # A second run appends to the node's log.
    assert launch(TINY, env=env).returncode == 7
    assert (logs / "node1.log").read_text().count("err: failing") == 2


@pytest.mark.distributed
def test_two_process_cpu_run(tiny_cpu_launch):
    """The launcher's real run: 2 processes on this machine (tests/launched.py), its output to the
    terminal and to LOG_DIR's node0.log."""
    proc, steps = tiny_cpu_launch.proc, tiny_cpu_launch.steps
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(tiny_cpu_launch.run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    log = tiny_cpu_launch.log
    assert all(f"step {step}/{steps} " in log for step in range(1, steps + 1)) and "metrics: " in log
    assert f"step {steps}/{steps} " in proc.stdout
