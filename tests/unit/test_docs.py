"""docs/: the generated configuration reference is current, no recipe key is added without a
description, every command of a ```bash block in README.md and docs/*.md is exercised by a test,
and every relative link of those pages resolves.

"Exercised" is one of two things, and every command must be one of them (a command that is
neither fails `test_every_docs_command_is_run_or_mapped`, so a new one cannot slip in untested):

- run here, as written (`test_docs_command_runs`, CPU, seconds each): `megatron-rlcorr plan |
  presets | analyze | import-verl` (through `megatron_rlcorr.cli.main`), the quick tools
  (`QUICK_TOOLS`) and `python examples/<x>.py` (with this interpreter), `bash tools/launch.sh ... --dry-run`, and
  `srun ... bash tools/launch.sh ...` (srun is not here: the launcher runs under the environment
  a SLURM allocation gives it, with --dry-run added, and must print the torchrun line for the
  requested nodes). Files a command names that a user would have (`scored.jsonl`, `runs/my_run`,
  `my_script.sh`, ...) are made by FIXTURES in a scratch directory, which links `recipes/`. The
  command must exit 0, or the code its comment documents (`# exits 1: ...`). A command quoted on
  several pages runs once; its other occurrences assert that run's outcome.
- mapped elsewhere (`ELSEWHERE`): commands that cannot run on a CPU machine in seconds (GPU, vLLM,
  multi-process trainings of minutes, a fresh virtual environment), each mapped to the tests that
  run what it does, or to why no test can. The table is checked too: each named test exists, and
  each entry is still a command of the docs.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _pages() -> list[Path]:
    """The pages whose commands and links are checked: the README and every page of docs/."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


# ---- docs/configuration.md and the generator ----------------------------------------------------

def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_in_sync():
    generated = _generator().render()
    assert (DOCS / "configuration.md").read_text() == generated, (
        "docs/configuration.md is out of date with the settings classes: run `python tools/config_reference.py`")


def test_configuration_reference_covers_every_recipe_section():
    from megatron_rlcorr.recipe.recipe import parse_recipe

    gen = _generator()
    keys = {section.key for section in gen.sections()}
    assert {"model", "model.fp8", "model.moe", "model.recompute", "parallel", "rollout", "rollout.val_kwargs", "data", "algorithm",
            "algorithm.dynamic_sampling", "algorithm.overlong_penalty", "algorithm.kl_loss", "algorithm.kl_in_reward",
            "algorithm.reference", "algorithm.loss", "algorithm.rollout_correction", "optim", "trainer"} == keys
    # Every key the page lists is one the recipe parser accepts (its default, given explicitly).
    tree: dict = {"model": {"architecture": "qwen2.5-1.5b"}}
    for section in gen.sections():
        for fd in section.fields:
            if fd.nested is None and fd.default is not None and not section.key.startswith("model"):
                node = tree
                for part in section.key.split("."):
                    node = node.setdefault(part, {})
                node[fd.name] = None if fd.default == "None" else eval(fd.default)  # noqa: S307
    recipe = parse_recipe(tree)
    assert recipe.trainer.dump_every == 0 and recipe.algorithm.loss.clip_ratio_c == 3.0


@dataclass
class _Documented:
    """A class in the generator's style: every way a field can be documented."""

    LIMITS: ClassVar[dict] = {}          # a class variable: not a field, not listed
    plain: int = 1                       # beside the field
    continued: str = "a"                 # beside the field,
                                         # continued below it
    # above the field,
    # two lines
    above: float | None = None
    bare: tuple[int, ...] = (1, 2)
    made: dict = field(default_factory=dict)
    derived: int = field(default=0, init=False)  # not an init field: not a recipe key


def test_generator_reads_comments_beside_below_and_above_fields():
    docstring, fields = _generator().read_class(_Documented)
    assert docstring == "A class in the generator's style: every way a field can be documented."
    assert [(f.name, f.annotation, f.default, f.comment) for f in fields] == [
        ("plain", "int", "1", "beside the field"),
        ("continued", "str", '"a"', "beside the field, continued below it"),
        ("above", "float | None", "None", "above the field, two lines"),
        ("bare", "tuple[int, ...]", "(1, 2)", ""),
        ("made", "dict", "{}", ""),
    ]


def test_generator_check_exits_1_on_a_stale_page_and_0_on_a_fresh_one(tmp_path, capsys):
    gen = _generator()
    page = tmp_path / "configuration.md"
    page.write_text("# stale\n")
    assert gen.main(["--check", "--out", str(page)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert gen.main(["--out", str(page)]) == 0
    assert gen.main(["--check", "--out", str(page)]) == 0
    assert page.read_text() == gen.render()


def test_no_recipe_key_is_added_without_a_description():
    missing = sorted(_generator().undocumented())
    assert not missing, (f"recipe keys without a description: {missing}. Add a comment beside each field in its "
                         "settings class (`name: type = default  # what it does`), then run "
                         "`python tools/config_reference.py`")


# ---- every command of the docs ------------------------------------------------------------------

@dataclass(frozen=True)
class DocCommand:
    page: str        # relative to the repository: README.md, docs/<name>.md
    text: str        # the command as written (continuation lines joined), without its comment
    comment: str

    @property
    def key(self) -> str:
        return " ".join(self.text.split())

    @property
    def expected_exit(self) -> int:
        found = re.search(r"\bexits? (?:code )?(\d+)\b", self.comment)
        return int(found.group(1)) if found else 0


def _split_comment(line: str) -> tuple[str, str]:
    """(command, comment): the comment starts at a '#' that opens a word, outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1:].strip()
    return line.strip(), ""


def doc_commands() -> list[DocCommand]:
    commands = []
    for page in _pages():
        for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), re.S | re.M):
            logical, pending = [], ""
            for line in block.splitlines():
                if line.rstrip().endswith("\\"):
                    pending += line.rstrip()[:-1] + " "
                    continue
                logical.append(pending + line)
                pending = ""
            for line in logical:
                text, comment = _split_comment(line)
                if text:
                    commands.append(DocCommand(str(page.relative_to(ROOT)), text, comment))
    return commands


# Commands that cannot run here, each with the tests that run what it does, or why none can.
T_HF_RUNS = "tests/distributed/test_hf_runs.py"
ELSEWHERE: dict[str, tuple[tuple[str, ...], str]] = {
    # coming-from-verl.md
    "megatron-rlcorr train --config my_run.yaml --nproc 8": (
        ("tests/unit/test_import_verl.py::test_written_recipe_loads",
         "tests/distributed/test_trainer.py::test_torchrun_end_to_end_writes_finite_metrics"),
        "8 ranks of the imported 32B/7B model need GPUs; the import's recipe loading and the train launch are "
        "tested on their own"),
    # models-and-data.md
    "python tools/make_tiny_hf.py --out runs/tiny_hf_files": (
        ("tests/unit/test_make_tiny_hf.py::test_files", "tests/unit/test_make_tiny_hf.py::test_second_run_does_nothing"),
        "10-20 s of warm-up training: its tests build it once (--out a temporary directory) and check every file"),
    "torchrun --nproc_per_node=2 -m megatron_rlcorr.train --config recipes/tiny_hf_cpu.yaml": (
        (f"{T_HF_RUNS}::test_dataset_run_resumes_with_the_next_prompts",),
        "a 2-process training run of minutes"),
    "megatron-rlcorr export --model runs/tiny_hf_cpu --out /tmp/tiny_export --dtype float32": (
        (f"{T_HF_RUNS}::test_export_of_a_run_equals_its_save_hf",),
        "needs a trained run directory (the run above)"),
    "megatron-rlcorr score --model runs/tiny_hf_files/model --rollouts rollouts.jsonl --out scored.jsonl "
    "parallel.tp=2": (
        (f"{T_HF_RUNS}::test_score_matches_transformers",),
        "a 2-process torchrun scoring (the test runs tp1, tp2, cp2, pp2 and dp2)"),
    # README.md
    "bash tools/test.sh": (
        ("tests/unit/test_readme.py::test_ci_runs_the_readme_test_command",
         "tests/unit/test_readme.py::test_the_test_command_fails_when_pytest_collects_nothing"),
        "the whole suite, about 10 minutes on 2 cores: CI (.ci/run) runs exactly this command, and the second test "
        "runs it on a selection that collects nothing and checks that it fails"),
    "megatron-rlcorr eval --model runs/my_run --data /data/aime-2024.parquet --out eval/my_run --n 16 "
    "--temperature 1.0": (
        ("tests/distributed/test_eval_run.py::test_greedy_eval_is_transformers_greedy_and_metrics_match_generations",
         "tests/unit/test_eval.py::test_sampling_options_set_val_kwargs_and_max_new_tokens",
         "tests/unit/test_eval.py::test_the_launch_command_line_round_trips"),
        "needs a trained run and the AIME parquet; eval's torchrun run is tested on the tiny checkpoint and data, "
        "its sampling options and launch line in-process"),
    "megatron-rlcorr export --model runs/my_run --out /models/my_run_hf": (
        (f"{T_HF_RUNS}::test_export_of_a_run_equals_its_save_hf",),
        "needs a trained run directory; the test exports a trained tiny run and compares it with its save_hf"),
    # README.md and troubleshooting.md
    "megatron-rlcorr train --config recipes/tiny_cpu.yaml --nproc 2 trainer.dump_every=25": (
        ("tests/distributed/test_dumps.py::test_dumps_hold_the_step_batch_the_same_under_every_layout",
         "tests/distributed/test_dumps.py::test_analyze_reads_a_tiny_cpu_run_and_reproduces_the_trainers_metrics",
         "tests/unit/test_readme.py::test_the_analyze_section_commands_run"),
        "a 2-process training run of minutes; the tests train tiny_cpu with trainer.dump_every and analyze the run"),
    # benchmarks.md
    "python tools/ablate.py --recipe recipes/tiny_hf_cpu.yaml --lag 0 --seeds 1 2 3 --settings none --steps 150 "
    "--out runs/ablation/lag0_lr3e-4 trainer.dump_every=1 optim.lr=3e-4": (
        ("tests/unit/test_readme.py::test_the_ablation_section_shows_the_committed_results",
         "tests/unit/test_ablate.py::test_end_to_end_two_settings_one_seed"),
        "3 training runs of about 45 s on 2 cores; the first test checks that the command, as written, is valid "
        "and is the one that produced the committed docs/ablation/lr3e-4/lag0, the second runs the tool end to end"),
    "python tools/ablate.py --recipe recipes/tiny_hf_cpu.yaml --lag 2 --seeds 1 2 3 --settings none token_is "
    "seq_is_rs dapo ppo_is_bypass --steps 150 --out runs/ablation/lag2_lr3e-4 --reference runs/ablation/lag0_lr3e-4 "
    "trainer.dump_every=1 optim.lr=3e-4": (
        ("tests/unit/test_readme.py::test_the_ablation_section_shows_the_committed_results",
         "tests/unit/test_ablate.py::test_a_reference_ablation_joins_the_table_and_figure",
         "tests/unit/test_ablate.py::test_end_to_end_two_settings_one_seed"),
        "15 training runs of about 45 s on 2 cores; the first test checks the command against the committed "
        "docs/ablation/lr3e-4, the others the reference join and the tool end to end"),
    "python tools/ablate.py --recipe recipes/tiny_hf_cpu.yaml --lag 2 --seeds 1 2 3 --settings none token_is "
    "seq_is_rs dapo dapo_wide dapo_bypass decoupled_seq_is ppo_is_bypass --define dapo_wide dapo "
    "rollout_rs_threshold_lower=0.31 rollout_rs_threshold=1.28 --define dapo_bypass dapo bypass_mode=true --steps 150 "
    "--out runs/ablation/lag2 --reference docs/ablation/lag0 trainer.dump_every=1": (
        ("tests/unit/test_readme.py::test_the_ablation_section_shows_the_committed_results",
         "tests/unit/test_ablate.py::test_define_a_setting_of_your_own",
         "tests/unit/test_ablate.py::test_end_to_end_two_settings_one_seed"),
        "24 training runs of about 45 s on 2 cores; the first test checks the command against the committed "
        "docs/ablation, the others --define and the tool end to end"),
    # models-and-data.md
    "megatron-rlcorr train --config my_run.yaml --nproc 8 parallel.tp=4": (
        ("tests/unit/test_readme.py::test_the_hugging_face_recipe_example_loads",
         "tests/distributed/test_trainer.py::test_torchrun_end_to_end_writes_finite_metrics"),
        "8 ranks of a 7B model need GPUs and the checkpoint; the page's recipe, its paths pointed at the tiny "
        "files, loads and passes the launch checks for 8 processes in the first test"),
    # vllm.md and scaling.md
    "pip install -e .[vllm]": (
        ("tests/unit/test_readme.py::test_the_vllm_rollout_example_is_a_valid_rollout_section",
         "tests/unit/test_readme.py::test_the_cluster_section_commands_run",
         "tests/unit/test_vllm_engine.py::test_the_llm_is_built_for_colocated_external_launcher_ranks"),
        "installs vLLM from the package registry, for GPU machines; the pin is checked against setup.py's extra, "
        "and the adapter is tested against the stand-in of vLLM 0.25.1's surface (the real one where it exists)"),
    # moe.md
    "python tools/make_tiny_hf.py --moe --out runs/tiny_hf_moe_files": (
        ("tests/unit/test_make_tiny_hf.py::test_moe_config_and_weights",
         "tests/unit/test_make_tiny_hf.py::test_moe_shares_the_tokenizer_data_and_warm_up"),
        "about 30 s of warm-up training: its tests build it once (--out a temporary directory) and check every file"),
    "torchrun --nproc_per_node=2 -m megatron_rlcorr.train --config recipes/tiny_hf_moe_cpu.yaml": (
        ("tests/distributed/test_moe_runs.py::test_expert_parallel_run_follows_ep1_and_resumes_exactly",),
        "a 2-process training run of minutes; the test trains the same recipe for 4 steps at ep 1 and ep 2"),
    # parallel.md
    "source tools/_env.sh && ensure_env": (
        ("tests/unit/test_readme.py::test_ci_runs_the_readme_test_command",),
        "tools/test.sh runs exactly these two steps before pytest, so every run of the suite through it does; "
        "run here it could rebuild the virtual environment under the running tests"),
    "python tools/check_parallel_parity.py --layouts tp2,cp2,pp2,dp2,tp2cp2,tp2pp2,cp2pp2,tp2cp2pp2 --steps 3": (
        ("tests/distributed/test_step_parallel.py::test_layout_matches_single_process",
         "tests/unit/test_parity_tool.py::test_tiny_model_fits_every_layout"),
        "8 torchrun launches of up to 8 processes, minutes each; the same comparison (each layout against one "
        "process) is test_step_parallel's, and the tool's layout parsing and model choice are unit-tested"),
    "python tools/check_parallel_parity.py --layouts tp2,cp2,pp2,dp2 --steps 3 --mode bypass --loss pg "
    "--agg seq-mean-token-mean": (
        ("tests/distributed/test_step_parallel.py::test_layout_matches_single_process",
         "tests/unit/test_parity_tool.py::test_bad_layout_names"),
        "as above, bypass policy gradient (test_step_parallel covers both modes, both losses, every aggregation)"),
    # training.md
    "python tools/ablate.py --recipe recipes/tiny_hf_cpu.yaml --lag 2 --seeds 1 2 3 --settings none token_is dapo "
    "--steps 150 --out runs/ablation/lag2 trainer.dump_every=1": (
        ("tests/unit/test_ablate.py::test_end_to_end_two_settings_one_seed",
         "tests/unit/test_ablate.py::test_define_a_setting_of_your_own",
         "tests/unit/test_ablate.py::test_rejection_by_answer_splits_what_rs_rejects_by_reward"),
        "9 training runs of about 45 s on 2 cores; the test trains 2 settings for 2 steps through the same main() "
        "and the report's parts are tested on their own"),
    "torchrun --nproc_per_node=3 -m megatron_rlcorr.train --config recipes/tiny_cpu_async.yaml": (
        ("tests/distributed/test_async_runs.py::test_separate_rollout_rank_repeats_the_colocated_policy_lag",
         "tests/distributed/test_async_runs.py::test_async_recipe_trains_on_most_tokens",
         "tests/unit/test_recipes.py::test_every_shipped_recipe_loads"),
        "a 3-process training run of minutes; the tests launch this recipe on 3 processes, 4 steps, against "
        "the same recipe colocated with policy_lag 1, and check the share of tokens it trains on"),
    "python tools/bench_async.py": (
        ("tests/unit/test_bench_async.py::test_both_runs_pass_the_launch_checks",
         "tests/unit/test_bench_async.py::test_summary_is_over_steps_2_to_n_minus_s_minus_1",
         "tests/distributed/test_async_runs.py::test_separate_rollout_rank_repeats_the_colocated_policy_lag"),
        "two 3-process training runs of minutes; the tool's runs are checked to pass the launch checks, its "
        "figures against hand sums, and the separate placement it times is tested end to end"),
    "bash tools/demo.sh": (
        ("tests/unit/test_make_tiny_hf.py::test_files",
         f"{T_HF_RUNS}::test_dataset_run_resumes_with_the_next_prompts",
         f"{T_HF_RUNS}::test_save_hf_writes_a_checkpoint_transformers_loads"),
        "about 35 s of training on 2 cores; its parts (the tiny files, the tiny_hf_cpu run, the export) are tested, "
        "and this file runs tools/summarize_run.py"),
    "torchrun --nproc_per_node=2 -m megatron_rlcorr.train --config recipes/tiny_cpu.yaml trainer.steps=20": (
        ("tests/distributed/test_trainer.py::test_torchrun_end_to_end_writes_finite_metrics",),
        "a 2-process training run (the test runs the same torchrun line, 3 steps)"),
    "megatron-rlcorr train --config recipes/preset_pg_rs.yaml --nproc 2 trainer.steps=10": (
        ("tests/distributed/test_trainer.py::test_every_preset_recipe_trains",
         "tests/unit/test_recipes.py::test_cli_train_validates_before_launching"),
        "a 2-process training run; every preset recipe trains in the first test, the CLI's launch in the second"),
    # scaling.md
    "megatron-rlcorr train --config recipes/tiny_cpu.yaml --nproc 2 trainer.steps=20": (
        ("tests/unit/test_recipes.py::test_cli_train_validates_before_launching",
         "tests/distributed/test_trainer.py::test_torchrun_end_to_end_writes_finite_metrics"),
        "a 2-process training run: the CLI's validation and launch line, and the run it launches, are tested"),
    "megatron-rlcorr train --config recipes/dapo_qwen2.5_7b_rollout_corr.yaml --nproc 8": (
        ("tests/unit/test_readme.py::test_the_cluster_section_commands_run",
         "tests/unit/test_plan.py::test_cluster_recipes_validate_and_fit"),
        "8 H100s, vLLM and the Qwen2.5-7B checkpoint; here it stops at the placeholder checkpoint path, which "
        "test_readme's cluster test checks, and the layout is validated by plan"),
    # troubleshooting.md
    "megatron-rlcorr train --config recipes/tiny_cpu.yaml --nproc 2 name=my_run trainer.dump_every=10": (
        ("tests/distributed/test_dumps.py::test_dumps_hold_the_step_batch_the_same_under_every_layout",),
        "a 2-process training run; the test trains with trainer.dump_every and reads the dumps"),
    "megatron-rlcorr score --model runs/my_run --rollouts vllm_rollouts.jsonl --out scored.jsonl": (
        (f"{T_HF_RUNS}::test_score_a_run_checkpoint",),
        "a torchrun scoring of a trained run's checkpoint"),
}


# ---- files a documented command names, made in the scratch directory ----

def _records(n: int, seed: int, *, noise: float, step: int | None = None) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(4, 40, (1,), generator=g))
        rollout = -torch.empty(length, dtype=torch.float64).exponential_(1.0, generator=g) * 0.7 - 1e-3
        old = (rollout + noise * torch.randn(length, generator=g, dtype=torch.float64)).clamp(max=0.0)
        record = {"prompt_ids": [1, 5, 7], "response_ids": list(range(3, 3 + length)),
                  "rollout_log_probs": rollout.tolist(), "log_probs": old.tolist()}
        if step is not None:
            record.update(step=step, reward=float(i % 2), finish_reason="eos")
        out.append(record)
    return out


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _scored(path: Path) -> None:
    _jsonl(path, _records(48, 0, noise=0.05))


def _run_dir(path: Path) -> None:
    """A run directory as the trainer writes it: dumps/, metrics.jsonl and the resolved recipe."""
    for i, step in enumerate((10, 20, 30, 40)):
        _jsonl(path / "dumps" / f"step_{step}.jsonl", _records(24, i, noise=0.02 * (i + 1), step=step))
    _jsonl(path / "metrics.jsonl", [{"step": s, "reward_mean": 0.1 + 0.01 * s, "rollout_corr/k3_kl": 1e-3 * (1 + 0.05 * s),
                                     "rollout_corr/kl": 5e-4} for s in range(1, 41)])
    shutil.copy(ROOT / "recipes" / "tiny_cpu.yaml", path / "recipe.yaml")


def _metrics(path: Path) -> None:
    _jsonl(path, [{"step": s, "reward_mean": 0.1 + 0.005 * s, "loss": 0.1, "grad_norm": 1.0,
                   "rollout_corr/k3_kl": 1e-3, "timing/step_s": 0.2} for s in range(1, 31)])


def _imported_32b(path: Path) -> None:
    """verl's 32B DAPO script imported with its architecture, as coming-from-verl.md's commands do."""
    from megatron_rlcorr.recipe.verl import import_verl, write_recipe

    write_recipe(import_verl(ROOT / "tests" / "verl_scripts" / "dapo_qwen2_5_32b_rollout_corr.sh",
                             overrides=["model.architecture=qwen2.5-32b"]), path)


FIXTURES: dict[str, Callable[[Path], None]] = {
    "my_run.yaml": _imported_32b,
    "scored.jsonl": _scored,
    "runs/my_run": _run_dir,
    "runs/tiny_cpu": _run_dir,  # before its metrics.jsonl: a command naming that file gets _metrics' file
    "runs/tiny_cpu/metrics.jsonl": _metrics,
    "run_dapo_qwen2.5_32b_rollout_corr.sh":
        lambda p: shutil.copy(ROOT / "tests" / "verl_scripts" / "dapo_qwen2_5_32b_rollout_corr.sh", p),
    "my_script.sh":  # a script that reads NUM_GPUS, as the documented command's does
        lambda p: shutil.copy(ROOT / "tests" / "verl_scripts" / "grpo_qwen2_5_7b_kl_fsdp.sh", p),
}


def _scratch(tmp_path: Path, words: list[str]) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "recipes").symlink_to(ROOT / "recipes")
    for name, make in FIXTURES.items():
        if any(w == name or w.startswith(name + "/") for w in words):
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            make(work / name)
    return work


# ---- runners ----

IN_PROCESS = ("plan", "presets", "analyze", "import-verl")
QUICK_TOOLS = ("tools/summarize_run.py", "tools/config_reference.py")  # the other tools train or benchmark


def _env_and_words(command: DocCommand) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(command.text)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def runnable(command: DocCommand) -> bool:
    if "&&" in command.text or "|" in command.text.replace("||", ""):
        return False
    _, words = _env_and_words(command)
    if words[:1] == ["megatron-rlcorr"]:
        return len(words) > 1 and words[1] in IN_PROCESS
    if words[:1] == ["python"]:
        return len(words) > 1 and (words[1] in QUICK_TOOLS or re.fullmatch(r"examples/\w+\.py", words[1]) is not None)
    launcher = words[words.index("bash"):] if words[:1] == ["srun"] and "bash" in words else words
    return launcher[:2] == ["bash", "tools/launch.sh"] and (words[0] == "srun" or "--dry-run" in words)


def _launch_env(extra: dict[str, str], path_dir: Path | None = None) -> dict[str, str]:
    """This environment without the launcher's inputs (a SLURM job or NCCL settings of the machine
    running the tests must not change the outcome), plus `extra`."""
    names = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "LOG_DIR",
             "CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_NCCL_AVOID_RECORD_STREAMS", "NCCL_IB_TIMEOUT",
             "NCCL_P2P_NET_CHUNKSIZE", "PYTORCH_CUDA_ALLOC_CONF")
    env = {k: v for k, v in os.environ.items() if k not in names and not k.startswith("SLURM_")}
    env["PYTHON"] = sys.executable
    if path_dir is not None:
        env["PATH"] = f"{path_dir}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def _run_launcher(command: DocCommand, env_extra: dict[str, str], words: list[str], tmp_path: Path) -> None:
    nodes = None
    if words[0] == "srun":  # the environment srun gives each task of a SLURM allocation
        options = words[1:words.index("bash")]
        given = [w.split("=", 1)[1] for w in options if w.startswith("--nodes=")]
        given += [options[i + 1] for i, w in enumerate(options[:-1]) if w == "-N"]
        nodes = int(given[0])
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "scontrol").write_text("#!/bin/sh\n" + "".join(f"echo node{i:03d}\n" for i in range(1, nodes + 1)))
        (fake / "scontrol").chmod(0o755)
        env_extra = {**env_extra, "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NODEID": "0",
                     "SLURM_JOB_NODELIST": f"node[001-{nodes:03d}]", "SLURM_GPUS_ON_NODE": "8"}
        words = [*words[words.index("bash"):], "--dry-run"]
        env = _launch_env(env_extra, fake)
    else:
        env = _launch_env(env_extra)
    out = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == command.expected_exit, out.stderr
    if command.expected_exit == 0:
        torchrun = [line for line in out.stdout.splitlines() if line.startswith("+ ")]
        assert len(torchrun) == 1 and "-m megatron_rlcorr.train --config" in torchrun[0], out.stdout
        if nodes is not None:
            assert f"--nnodes={nodes}" in torchrun[0] and "--nproc-per-node=8" in torchrun[0]


def _run(command: DocCommand, tmp_path: Path, monkeypatch, capsys) -> None:
    env_extra, words = _env_and_words(command)
    if words[0] == "srun" or words[:2] == ["bash", "tools/launch.sh"]:
        _run_launcher(command, env_extra, words, tmp_path)
        return
    work = _scratch(tmp_path, words)
    if words[0] == "python":
        script = ROOT / words[1]
        out = subprocess.run([sys.executable, str(script), *words[2:]], cwd=work, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **env_extra})
        assert out.returncode == command.expected_exit, out.stdout[-2000:] + out.stderr[-3000:]
        return
    from megatron_rlcorr.cli import main

    monkeypatch.chdir(work)
    for key, value in env_extra.items():
        monkeypatch.setenv(key, value)
    code = main(words[1:])
    captured = capsys.readouterr()
    assert code == command.expected_exit, captured.out[-2000:] + captured.err[-3000:]
    if code == 0:
        assert captured.out.strip(), "the command printed nothing"
        for i, word in enumerate(words[:-1]):  # what the command was asked to write is there
            if word == "--out":
                assert (work / words[i + 1]).exists(), words[i + 1]


def _runnable_commands() -> list[DocCommand]:
    return [c for c in doc_commands() if c.key not in ELSEWHERE and runnable(c)]


def _id(command: DocCommand) -> str:
    key = command.key if len(command.key) <= 90 else f"{command.key[:40]}...{command.key[-45:]}"
    return f"{command.page}:{key}"


# A command quoted on several pages (the same text and the same expected exit) runs once per
# session; each other occurrence asserts that run's outcome: None (it passed) or why it failed.
_OUTCOMES: dict[tuple[str, int], str | None] = {}


@pytest.mark.parametrize("command", _runnable_commands(), ids=_id)
def test_docs_command_runs(command, tmp_path, monkeypatch, capsys):
    key = (command.text, command.expected_exit)
    if key not in _OUTCOMES:
        try:
            _run(command, tmp_path, monkeypatch, capsys)
        except Exception as err:
            _OUTCOMES[key] = f"{type(err).__name__}: {err}"
            raise
        _OUTCOMES[key] = None
    assert _OUTCOMES[key] is None, f"this command failed where another page quotes it: {_OUTCOMES[key]}"


def test_every_docs_command_is_run_or_mapped():
    orphans = [f"{c.page}: {c.key}" for c in doc_commands() if c.key not in ELSEWHERE and not runnable(c)]
    assert not orphans, ("commands in docs/*.md that no test runs; make them runnable here (see this file's "
                         "docstring) or add each to ELSEWHERE with the test that covers it:\n" + "\n".join(orphans))


def test_commands_mapped_elsewhere_are_current_and_their_tests_exist():
    keys = {c.key for c in doc_commands()}
    stale = [command for command in ELSEWHERE if command not in keys]
    assert not stale, f"ELSEWHERE lists commands no page has any more: {stale}"
    for command, (tests, why) in ELSEWHERE.items():
        assert why, command
        for ref in tests:
            path, name = ref.split("::")
            assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), f"{command}: no {ref}"


def test_the_docs_have_commands_of_both_kinds():
    """The collection itself works: the pages' blocks are found, comments split off, lines joined."""
    commands = doc_commands()
    pages = {c.page for c in commands}
    assert {"README.md", "docs/scaling.md", "docs/troubleshooting.md", "docs/training.md", "docs/parallel.md",
            "docs/benchmarks.md", "docs/models-and-data.md", "docs/vllm.md"} <= pages
    assert len(_runnable_commands()) >= 15
    assert _split_comment('echo "a # b"  # c') == ('echo "a # b"', "c")
    assert DocCommand("x", "plan", "exits 1: does not fit").expected_exit == 1


_PLAN_HEADER = re.compile(r"plan: (\S+) on (\d+) x (\d+) GPUs \(([\d.]+) GiB each\)\n")
_MEMORY_ROW = re.compile(r"^  (weights|gradients|optimizer|activations|logits|rollout) +([\d.]+)$", re.M)


def _quoted_plans() -> list[tuple[str, str]]:
    """(page, block) for every ```text block of README.md and docs/*.md that quotes plan's output."""
    return [(str(page.relative_to(ROOT)), block) for page in _pages()
            for block in re.findall(r"^```text\n(.*?)^```", page.read_text(), re.S | re.M)
            if "(GiB, estimate)" in block]


def test_quoted_plan_output_is_the_current_output(capsys, monkeypatch):
    """Every plan output the pages quote is what `plan` prints now, whole: from its `plan:` line (which
    names the recipe and the cluster, so the test reruns it) to its last line. So a sample whose total
    is not the sum of its memory rows carries the line of plan's output that says why."""
    from megatron_rlcorr.cli import main

    quoted = _quoted_plans()
    recipes = {_PLAN_HEADER.match(block).group(1) for _, block in quoted if _PLAN_HEADER.match(block)}
    assert {"recipes/dapo_qwen2.5_7b_rollout_corr.yaml", "recipes/dapo_qwen2.5_32b_rollout_corr.yaml",
            "recipes/dapo_qwen3_30b_a3b_rollout_corr.yaml"} <= recipes
    monkeypatch.chdir(ROOT)
    for page, block in quoted:
        header = _PLAN_HEADER.match(block)
        assert header, f"{page}: a quoted plan must be plan's whole output, from its `plan:` line: {block[:80]!r}"
        recipe, nodes, gpus, gib = header.groups()
        command = ["plan", recipe, "--nodes", nodes, "--gpus-per-node", gpus, "--gpu-memory-gib", gib]
        assert main(command) in (0, 1), command
        assert block == capsys.readouterr().out, (
            f"{page}: the quoted output of `megatron-rlcorr {' '.join(command)}` is stale: paste what it prints now")
        rows = sum(float(value) for _, value in _MEMORY_ROW.findall(block))
        total = float(re.search(r"^  total +([\d.]+) ", block, re.M).group(1))
        assert abs(rows - total) < 0.02 or "  (total = " in block or "total = weights" in block, page


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings (lowercase, punctuation dropped, spaces to hyphens)."""
    headings = re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M), re.M)
    return {"".join(c for c in h.strip().lower() if c.isalnum() or c in "-_ ").replace(" ", "-") for h in headings}


def test_links_between_pages_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists, and a `#anchor` a
    heading of it."""
    broken = []
    pages = _pages()
    assert pages[0].name == "README.md" and len(pages) > 10
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path) if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken
