"""What `score` and `export` check before any process starts: the rollout file, what --model names,
the recipe built for it, and the CLI's messages (no torchrun is launched on bad input)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_rlcorr import cli
from megatron_rlcorr.data.rollout_file import read_rollouts, write_rollouts
from megatron_rlcorr.recipe.source import check_source_layout, resolve_source, source_recipe
from tests.hf_models import make_checkpoint

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3", "qwen3")


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


# ---- the rollout file ----------------------------------------------------------------------------

def test_records_keep_every_field_and_round_trip(tmp_path):
    lines = [{"prompt_ids": [1, 2], "response_ids": [3], "rollout_log_probs": [-0.5], "meta": {"k": [1]}},
             {"prompt_ids": [4], "response_ids": [], "step": 3}]
    records = read_rollouts(_write(tmp_path / "in.jsonl", [lines[0], "", lines[1]]), vocab_size=10)
    assert [r.line for r in records] == [1, 3]  # blank lines are not records, line numbers are the file's
    assert records[0].rollout_log_probs == [-0.5] and records[1].rollout_log_probs is None
    write_rollouts(tmp_path / "out.jsonl", (r.fields for r in records))
    assert [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()] == lines


@pytest.mark.parametrize("line, message", [
    ("{not json", "in.jsonl:1: not valid JSON"),
    ("[1, 2]", "in.jsonl:1: each line must be a JSON object, got list"),
    ({"response_ids": [1]}, "in.jsonl:1: missing 'prompt_ids'"),
    ({"prompt_ids": [], "response_ids": [1]}, "prompt_ids is empty"),
    ({"prompt_ids": [1, "a"], "response_ids": []}, "prompt_ids must be a list of integer token ids"),
    ({"prompt_ids": [1], "response_ids": [True]}, "response_ids must be a list of integer token ids"),
    ({"prompt_ids": [1], "response_ids": [10]}, "response_ids holds token id 10 outside the model's vocabulary [0, 10)"),
    ({"prompt_ids": [-1], "response_ids": []}, "token id -1 outside"),
    ({"prompt_ids": [1], "response_ids": [2, 3], "rollout_log_probs": [-1.0]},
     "rollout_log_probs has 1 values for 2 response tokens"),
    ({"prompt_ids": [1], "response_ids": [2], "rollout_log_probs": ["x"]}, "rollout_log_probs must be a list of numbers"),
])
def test_bad_records_name_file_line_and_field(tmp_path, line, message):
    path = _write(tmp_path / "in.jsonl", [line])
    with pytest.raises(ValueError) as err:
        read_rollouts(path, vocab_size=10)
    assert message in str(err.value)


def test_missing_or_empty_rollout_files(tmp_path):
    with pytest.raises(ValueError, match="rollout file .* not found"):
        read_rollouts(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="holds no records"):
        read_rollouts(_write(tmp_path / "empty.jsonl", [""]))


# ---- --model SRC ---------------------------------------------------------------------------------

def _fake_run(tmp_path, layout=None, latest=2, legacy=True):
    run = tmp_path / "run"
    step = run / "checkpoints" / f"step_{latest:06d}"
    step.mkdir(parents=True)
    (step / ("rank_00000.pt" if legacy else "metadata.json")).write_text("")
    (run / "checkpoints" / "latest").write_text(f"{latest}\n")
    if layout is not None:
        (step / "layout.json").write_text(json.dumps(layout))
    tiny = yaml.safe_load(TINY.read_text())
    (run / "recipe.yaml").write_text(yaml.safe_dump({**tiny, "parallel": {"tp": 2}}))
    return run


def test_what_model_names(checkpoint, tmp_path):
    assert resolve_source(checkpoint).kind == "hf"
    run = _fake_run(tmp_path)
    assert (resolve_source(run).kind, resolve_source(run).step) == ("checkpoint", 2)
    step_dir = run / "checkpoints" / "step_000002"
    assert (resolve_source(step_dir).path, resolve_source(step_dir).step) == (run, 2)
    with pytest.raises(ValueError, match="no such directory; expected a Hugging Face checkpoint directory"):
        resolve_source(tmp_path / "nope")
    with pytest.raises(ValueError, match="not a model directory"):
        resolve_source(tmp_path)
    (run / "checkpoints" / "latest").unlink()
    with pytest.raises(ValueError, match="the run has no finished checkpoint yet"):
        resolve_source(run)


def test_recipe_for_a_hugging_face_model_keeps_the_other_settings(checkpoint):
    # tiny_cpu.yaml describes another model: its architecture keys give way to the checkpoint's
    recipe = source_recipe(resolve_source(checkpoint), str(TINY), ["rollout.temperature=0.5"])
    assert recipe.model.hf_checkpoint == str(checkpoint) and recipe.model.vocab_size == 100
    assert recipe.model.qk_layernorm and recipe.model.make_vocab_size_divisible_by == 1  # kept from tiny_cpu
    assert recipe.rollout.temperature == 0.5 and recipe.algorithm.rollout_correction.rollout_rs == "geometric"
    with pytest.raises(ValueError, match="model.num_layers=2 disagrees"):
        source_recipe(resolve_source(checkpoint), None, ["model.num_layers=2"])


def test_a_distributed_run_checkpoint_loads_on_any_layout(tmp_path):
    layout = {"world_size": 2, "tp": 2, "pp": 1, "cp": 1, "vpp": None}
    source = resolve_source(_fake_run(tmp_path, layout, legacy=False))
    recipe = source_recipe(source, None, [])
    for world_size in (2, 4):
        check_source_layout(source, recipe, world_size)


def test_a_per_rank_run_checkpoint_loads_on_its_own_layout(tmp_path):
    layout = {"world_size": 2, "tp": 2, "pp": 1, "cp": 1, "vpp": None}
    source = resolve_source(_fake_run(tmp_path, layout))
    recipe = source_recipe(source, None, [])
    assert recipe.parallel.tp == 2  # the run's own parallel section
    check_source_layout(source, recipe, 2)
    with pytest.raises(ValueError, match="written by the layout world_size=2 tp=2 .* launch with --nproc 2"):
        check_source_layout(source, recipe, 4)
    with pytest.raises(ValueError, match="has no recipe.yaml"):
        (source.path / "recipe.yaml").unlink()
        source_recipe(source, None, [])


# ---- the CLI refuses before launching -------------------------------------------------------------

@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: pytest.fail("launched torchrun on bad input"))


@pytest.mark.parametrize("argv, message", [
    (["score", "--model", "/nonexistent", "--rollouts", "x", "--out", "y"], "score --model /nonexistent: --model"),
    (["export", "--model", "/nonexistent", "--out", "y"], "no such directory"),
    (["score", "--model", "{ckpt}", "--rollouts", "{tmp}/in.jsonl", "--out", "{tmp}/in.jsonl"], "is the input file"),
    (["score", "--model", "{ckpt}", "--rollouts", "{tmp}/bad.jsonl", "--out", "{tmp}/o.jsonl"], "bad.jsonl:1: missing"),
    (["score", "--model", "{ckpt}", "--rollouts", "{tmp}/in.jsonl", "--out", "{tmp}/o.jsonl", "parallel.tp=3"],
     "world size 3 is not divisible|model heads (4) and query groups (2) must be divisible by parallel.tp=3"),
    (["export", "--model", "{ckpt}", "--out", "{ckpt}"], "is the source checkpoint itself"),
    (["export", "--model", "{ckpt}", "--out", "{tmp}/in.jsonl"], "exists and is not a directory"),
    (["export", "--model", "{ckpt}", "--out", "{tmp}/o", "--nproc", "0"], "--nproc must be >= 1"),
    (["export", "--model", "{ckpt}", "--out", "{tmp}/o", "parallel.pp=3"], "num_layers=4 must be divisible by"),
])
def test_cli_bad_input_exits_2_with_the_message(checkpoint, tmp_path, capsys, no_launch, argv, message):
    _write(tmp_path / "in.jsonl", [{"prompt_ids": [1], "response_ids": [2]}])
    _write(tmp_path / "bad.jsonl", [{"prompt_ids": [1]}])
    argv = [a.format(ckpt=checkpoint, tmp=tmp_path) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {argv[0]} --model") and any(m in err for m in message.split("|")), err


def test_cli_launches_torchrun_with_the_arguments(checkpoint, tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: launched.append(cmd) or 0)
    # overrides may come before and after options
    assert cli.main(["export", "--model", str(checkpoint), "parallel.tp=2", "--out", str(tmp_path / "o"),
                     "--dtype", "float32", "model.bf16=false"]) == 0
    cmd = launched[0]
    assert "--nproc_per_node=2" in cmd and cmd[cmd.index("-m", 3) + 1] == "megatron_rlcorr.export"
    assert cmd[-2:] == ["parallel.tp=2", "model.bf16=false"] and "--nproc" not in cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32" and cmd[cmd.index("--model") + 1] == str(checkpoint)
