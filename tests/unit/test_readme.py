"""The README and the docs it sends readers to: the quick start is exactly the two commands newcomers
copy and both scripts exist; the README stays a landing page (at most 200 lines) that names every
install extra, recipe and architecture preset; and the examples the README moved into docs/ (the
Hugging Face recipe, vLLM, the cluster path, `analyze`, the ablation, the CI subset) are true."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _section(path: Path, heading: str) -> str:
    """The text of a page from `heading` (a "## ..." line's start) to the next "## " heading."""
    text = path.read_text()
    assert heading in text, f"{path.relative_to(ROOT)} has no {heading!r}"
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_quick_start_has_exactly_demo_and_tests():
    assert _quick_start_commands() == ["bash tools/demo.sh", "bash tools/test.sh"]


def test_ci_runs_the_readme_test_command():
    assert "bash tools/test.sh" in (ROOT / ".ci" / "run").read_text()
    for script in ("tools/demo.sh", "tools/test.sh"):
        assert (ROOT / script).is_file(), script


def test_ci_runs_the_newest_megatron_core_on_the_subset_the_docs_name():
    ci = (ROOT / ".ci" / "run").read_text()
    subset = [t.strip('"') for t in re.search(r"MCORE_LATEST_TESTS=\((.*?)\n\)", ci, re.S).group(1).split()]
    assert 'bash tools/test.sh --mcore-latest "${MCORE_LATEST_TESTS[@]}"' in ci and "set -euo pipefail" in ci
    assert subset
    for test in subset:  # a renamed file or test fails here, not only in CI
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), test
        assert not name or f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), test
    # docs/testing.md (the README's "Tests" links there): the paragraph on what CI runs with
    # --mcore-latest names exactly the subset, in .ci/run's order
    tests = _section(DOCS / "testing.md", "## Two Megatron-Core versions")
    paragraph = next(p for p in tests.split("\n\n") if ".ci/run" in p and "--mcore-latest" in p)
    assert re.findall(r"`(tests/[^`]+)`", paragraph) == subset
    assert "docs/testing.md" in _section(ROOT / "README.md", "## Tests")


def test_the_test_command_fails_when_pytest_collects_nothing():
    """pytest's exit 5 (no test collected: a mistyped path or -k) fails tools/test.sh, and so CI.
    Run in the environment running this test (its stamp is current: nothing is installed)."""
    import os
    import subprocess
    import sys

    venv = Path(sys.prefix)
    if not (venv / ".rlcorr-installed").is_file():
        pytest.skip("not running in an environment that tools/_env.sh built")
    # Not this pytest's own variables (a pytest-xdist worker's included): the command runs as typed in a shell.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, "RLCORR_VENV": str(venv)}
    out = subprocess.run(["bash", "tools/test.sh", "tests/unit/test_readme.py", "-k", "no_test_is_named_this"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 5, out.stdout[-2000:] + out.stderr[-2000:]
    assert "[env] installing" not in out.stdout


def test_the_suite_collects_without_pytest_xdist():
    """The suite's hooks for pytest-xdist are optional: with the plugin off (`-p no:xdist`, or not
    installed) pytest still collects (exit 5 here: the selection is empty), not an internal error (3)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", "tests/unit/test_readme.py", "-k",
                          "no_test_is_named_this"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 5, out.stdout[-2000:] + out.stderr[-2000:]


def test_the_hugging_face_recipe_example_loads(tiny_hf, tmp_path):
    """docs/models-and-data.md's recipe for a Hugging Face checkpoint and a parquet file, with its
    placeholder paths pointed at the tiny files, loads and passes the launch checks for 8 processes."""
    from megatron_rlcorr.recipe import load_recipe

    section = _section(DOCS / "models-and-data.md", "## From a Hugging Face checkpoint")
    example = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    example = (example.replace("recipes/tiny_hf_cpu.yaml", str(ROOT / "recipes" / "tiny_hf_cpu.yaml"))
               .replace("/models/Qwen2.5-7B-Instruct", str(tiny_hf / "model"))
               .replace("/data/dapo-math-17k.parquet", str(tiny_hf / "data" / "train.parquet"))
               .replace("/data/aime-2024.parquet", str(tiny_hf / "data" / "val.parquet")))
    (tmp_path / "my_run.yaml").write_text(example)
    recipe = load_recipe(tmp_path / "my_run.yaml", ["parallel.tp=4", "model.make_vocab_size_divisible_by=1"])
    assert recipe.name == "my_run" and recipe.model.bf16 and recipe.trainer.save_hf
    assert recipe.model.hidden_size == 64 and recipe.data.reward == "dapo_math"
    assert recipe.data.val_files == [str(tiny_hf / "data" / "val.parquet")] and recipe.trainer.test_freq == 5
    with pytest.raises(ValueError, match="heads .* must be divisible by parallel.tp=4"):
        recipe.check_layout(8)  # the tiny model has 4 heads but 2 query groups: the layout check says so
    with pytest.raises(ValueError, match="max_position_embeddings=128"):  # 7B lengths on the 128-token tiny model
        load_recipe(tmp_path / "my_run.yaml", ["parallel.tp=2"]).check_layout(8)
    fits = ["parallel.tp=2", "data.max_prompt_length=64", "rollout.max_new_tokens=32",
            "algorithm.overlong_penalty.buffer=8"]
    assert load_recipe(tmp_path / "my_run.yaml", fits).check_layout(8) == 4


def test_the_vllm_rollout_example_is_a_valid_rollout_section():
    import yaml

    from megatron_rlcorr.rollout import RolloutConfig
    from megatron_rlcorr.settings import from_mapping

    section = (DOCS / "vllm.md").read_text()
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    cfg = from_mapping(RolloutConfig, example["rollout"], "rollout")
    assert (cfg.engine, cfg.tensor_parallel_size, cfg.sleep_level) == ("vllm", 4, 2)
    assert "vllm==0.25.1" in section and "vllm==0.25.1" in (ROOT / "setup.py").read_text()


def _cluster_section() -> str:
    return _section(DOCS / "scaling.md", "## From a laptop to a cluster")


def test_the_cluster_section_commands_run(tmp_path, capsys, monkeypatch):
    """Every command of docs/scaling.md's "From a laptop to a cluster": the plans run and fit, and the
    plan output it quotes is what plan prints; the train command stops at the placeholder checkpoint
    path with the fix; the launches print their torchrun lines (--dry-run; srun's part through a SLURM
    environment); pip is the documented install."""
    import os
    import shlex
    import subprocess
    import sys

    from megatron_rlcorr.cli import main

    monkeypatch.chdir(ROOT)
    commands = [line.strip() for block in re.findall(r"```bash\n(.*?)```", _cluster_section(), re.S)
                for line in block.splitlines() if line.strip()]
    assert len(commands) == 8, commands
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\nprintf 'node001\\nnode002\\n'\n")
    scontrol.chmod(0o755)
    printed = {}
    for command in commands:
        words = shlex.split(command)
        if words[0] == "megatron-rlcorr" and words[1] == "plan":
            assert main(words[1:]) == 0, command
            printed[command] = capsys.readouterr().out
            assert printed[command]
        elif words[0] == "megatron-rlcorr" and words[1] == "train":
            assert main(words[1:]) == 2, command
            assert "model.hf_checkpoint=/path/to/Qwen2.5-7B is not a directory" in capsys.readouterr().err
        elif words[:3] == ["pip", "install", "-e"]:
            assert words[3] == ".[vllm]" and 'extras_require' in (ROOT / "setup.py").read_text()
        else:
            env = {**os.environ, "PYTHON": sys.executable, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
            if words[0] == "srun":
                words = words[words.index("bash"):]
                env.update(SLURM_JOB_NUM_NODES="16", SLURM_NODEID="3", SLURM_JOB_NODELIST="node[001-016]",
                           SLURM_GPUS_PER_NODE="8")
            else:
                while "=" in words[0]:
                    key, value = words.pop(0).split("=", 1)
                    env[key] = value
            assert words[:2] == ["bash", "tools/launch.sh"], command
            out = subprocess.run([*words, *(["--dry-run"] if "--dry-run" not in words else [])], env=env,
                                 capture_output=True, text=True, cwd=ROOT)
            assert out.returncode == 0, out.stderr
            torchrun = [line for line in out.stdout.splitlines() if line.startswith("+ ")]
            assert len(torchrun) == 1 and "--nnodes=16" in torchrun[0] and "--nproc-per-node=8" in torchrun[0]
            assert "-m megatron_rlcorr.train --config recipes/dapo_qwen2.5_32b_rollout_corr.yaml" in torchrun[0]
    quoted = re.search(r"```text\n(.*?)```", _cluster_section(), re.S).group(1)
    assert quoted in printed["megatron-rlcorr plan recipes/dapo_qwen2.5_32b_rollout_corr.yaml --nodes 16 --gpus-per-node 8"]


def test_the_analyze_section_commands_run(tmp_path, monkeypatch, capsys):
    """docs/troubleshooting.md's "Seeing the mismatch": the train command writes dumps (tests/distributed/test_dumps.py trains
    tiny_cpu with dump_every and analyzes the run); the analyze command runs here, as written, on a
    run directory laid out as that run's (dumps, metrics.jsonl, recipe.yaml) with mismatched data."""
    import json
    import shlex
    import shutil

    from megatron_rlcorr.cli import main
    from tests.unit.test_analyze import _records, _write

    section = _section(DOCS / "troubleshooting.md", "## Seeing the mismatch")
    commands = [shlex.split(line) for line in re.search(r"```bash\n(.*?)```", section, re.S).group(1).splitlines()
                if line.strip()]
    assert [c[:2] for c in commands] == [["megatron-rlcorr", "train"], ["megatron-rlcorr", "analyze"]]
    assert "trainer.dump_every=25" in commands[0]
    run = tmp_path / "runs" / "tiny_cpu"
    for step in (25, 50, 75, 100):
        _write(run / "dumps" / f"step_{step}.jsonl",
               _records(40, seed=step, noise=0.05 * step / 25, extra={"step": step, "reward": 1.0,
                                                                        "finish_reason": "eos"}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout_corr/k3_kl": 1e-3 * s}) + "\n"
                                               for s in range(1, 101)))
    shutil.copy(ROOT / "recipes" / "tiny_cpu.yaml", run / "recipe.yaml")
    monkeypatch.chdir(tmp_path)
    assert main(commands[1][1:]) == 0
    summary = json.loads((run / "analysis" / "summary.json").read_text())
    assert summary["num_sequences"] == 160
    assert "kl_rising" in {f["check"] for f in summary["findings"]}
    assert (run / "analysis" / "report.md").is_file()


def test_the_ablation_section_shows_the_committed_results(monkeypatch):
    """docs/benchmarks.md's "What the correction does": each table is a committed ablation's, verbatim,
    each figure is there (linked relative to docs/), and each command, as written, is valid and is the
    one that produced its folder (the recorded command differs only by options at their defaults and
    tensorboard)."""
    import copy
    import json
    import shlex

    from tests.unit.test_ablate import ablate

    section = _section(DOCS / "benchmarks.md", "## What the correction does")
    committed = {"runs/ablation/lag0_lr3e-4": "docs/ablation/lr3e-4/lag0",
                 "runs/ablation/lag2_lr3e-4": "docs/ablation/lr3e-4", "runs/ablation/lag2": "docs/ablation"}
    for folder in ("docs/ablation/lr3e-4", "docs/ablation"):
        assert (ROOT / folder / "ablation_brief.md").read_text() in section, folder
        link = f"{Path(folder).relative_to('docs')}/ablation.png"  # relative to the page, docs/
        assert f"]({link})" in section and (DOCS / link).read_bytes()[:4] == b"\x89PNG"
    commands = [shlex.split(line) for block in re.findall(r"```bash\n(.*?)```", section, re.S)
                for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["python", "tools/ablate.py"]] * 3
    monkeypatch.chdir(ROOT)
    for words in commands:
        written = ablate.parse_args(words[2:])
        checkable = copy.copy(written)
        if checkable.reference and not (ROOT / checkable.reference).exists():
            checkable.reference = None  # the command before it writes it
        ablate.check_args(checkable)
        saved = json.loads((ROOT / committed[written.out] / "ablation.json").read_text())
        recorded = ablate.parse_args(shlex.split(saved["meta"]["command"])[2:])
        for name in ("recipe", "lag", "seeds", "settings", "defines", "steps", "nproc", "reference", "out"):
            assert getattr(written, name) == getattr(recorded, name), (written.out, name)
        # recorded before trainer.logger replaced trainer.tensorboard
        assert set(written.overrides) == set(recorded.overrides) - {"trainer.tensorboard=false"}, written.out
        assert list(saved["summary"]) == written.settings


# ---- the README as a landing page -----------------------------------------------------------------

def test_the_readme_is_a_landing_page_of_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail into docs/ and link it"


def _extras() -> set[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    extras = next(k.value for k in call.keywords if k.arg == "extras_require")
    return {ast.literal_eval(key) for key in extras.keys}


def test_the_install_section_lists_every_extra_of_setup_py():
    section = _section(ROOT / "README.md", "## Install")
    listed = re.findall(r"^\| `\.\[([A-Za-z0-9_-]+)\]` \|", section, re.M)
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == _extras() and "vllm" in listed


def test_the_readme_names_every_recipe_and_architecture_preset():
    """Each recipe of recipes/ (the MoE, asynchronous and cluster ones included) is named, as a whole
    name in backquotes, in the README's recipe table and in docs/scaling.md's ladder; each preset of
    model.architecture (the mixtures of experts included) in the README's model list and
    docs/scaling.md's "Architectures", and each mixture-of-experts preset in docs/moe.md. A new
    recipe or preset that a list leaves out fails here."""
    from megatron_rlcorr.model.presets import ARCHITECTURES

    readme = (ROOT / "README.md").read_text()
    ladder = _section(DOCS / "scaling.md", "## The ladder")
    recipes = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert len(recipes) >= 17
    assert {"tiny_cpu_async", "tiny_hf_moe_cpu", "dapo_qwen3_30b_a3b_rollout_corr",
            "dapo_qwen2.5_32b_rollout_corr"} <= set(recipes)
    assert [r for r in recipes if f"`{r}.yaml`" not in _section(ROOT / "README.md", "## Recipes")] == []
    assert [r for r in recipes if f"`recipes/{r}.yaml`" not in ladder and f"`{r}`" not in ladder] == []
    moe = [name for name, config in ARCHITECTURES.items() if config.get("num_experts")]
    assert {"qwen3-30b-a3b", "qwen3-235b-a22b"} <= set(moe)
    for page, text in (("README.md", readme), ("docs/scaling.md", _section(DOCS / "scaling.md", "## Architectures"))):
        missing = [name for name in ARCHITECTURES
                   if f"`{name}`" not in text
                   and not (name.endswith("-instruct") and f"`{name.removesuffix('-instruct')}`" in text
                            and "`-instruct`" in text)]
        assert not missing, (page, missing)
    assert [name for name in moe if f"`{name}`" not in (DOCS / "moe.md").read_text()] == []


def test_nothing_cites_a_document_outside_the_repository():
    """The correction's contract is described in docs/api.md and docs/math.md, not cited from a SPEC
    the repository does not hold: no page, module, tool, test or recipe names it."""
    sources = [ROOT / "README.md", *DOCS.rglob("*.md"), *ROOT.glob("setup.py")]
    for folder in ("megatron_rlcorr", "tools", "tests", "examples", "recipes", ".ci"):
        sources += [p for p in (ROOT / folder).rglob("*")
                    if p.is_file() and p.suffix in (".py", ".sh", ".md", ".yaml", "")]
    citing = [str(p.relative_to(ROOT)) for p in sources
              if p != Path(__file__).resolve() and re.search(r"\bSPEC\b", p.read_text(errors="replace"))]
    assert len(sources) > 100 and citing == [], f"cite docs/api.md or docs/math.md instead: {citing}"
    assert "](docs/api.md)" in (ROOT / "README.md").read_text()


def test_the_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    assert [p for p in pages if f"]({p})" not in index] == []
    assert "](docs/README.md)" in (ROOT / "README.md").read_text()
