"""What `megatron-rlcorr eval` checks before any process starts: the sampling options as recipe
keys, the data files, their keys and data sources, and the CLI's messages (no torchrun is launched
on bad input: every case here stops in `prepare`). The launch itself: tests/distributed/test_eval_run.py."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from megatron_rlcorr import cli
from megatron_rlcorr import eval as evaluation
from megatron_rlcorr.rollout.base import ValSampling
from tests.hf_fixtures import dapo_row, make_tokenizer, write_jsonl, write_parquet


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Qwen2 config.json with the test tokenizer beside it: all `prepare` reads of a checkpoint."""
    import transformers

    from tests.hf_fixtures import VOCAB_SIZE

    directory = tmp_path_factory.mktemp("hf") / "qwen2"
    config = transformers.Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config.save_pretrained(directory)
    make_tokenizer(directory, eos_token="<|im_end|>")
    return directory


@pytest.fixture(scope="module")
def val_file(tmp_path_factory):
    rows = [dapo_row(f"What is {a}+{a}?", str(2 * a), index=a) for a in range(5)]
    return write_parquet(tmp_path_factory.mktemp("data") / "val.parquet", rows)


def _prepare(argv: list[str], world_size: int = 1):
    parser = argparse.ArgumentParser()
    evaluation.add_arguments(parser)
    args = parser.parse_args(argv)
    return args, evaluation.prepare(args, world_size)


def _cli(capsys, *argv) -> tuple[int, str]:
    code = cli.main(["eval", *map(str, argv)])
    return code, capsys.readouterr().err


def test_sampling_options_set_val_kwargs_and_max_new_tokens(model_dir, val_file):
    _, (_, recipe, task, prompts) = _prepare(["--model", str(model_dir), "--data", str(val_file), "--out", "x",
                                              "--n", "4", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5",
                                              "--max-new-tokens", "6"])
    assert recipe.rollout.val_kwargs == ValSampling(n=4, temperature=0.7, top_p=0.9, top_k=5, do_sample=True)
    assert recipe.rollout.max_new_tokens == 6
    assert len(prompts) == 5 and [p.answer for p in prompts] == ["0", "2", "4", "6", "8"]  # every row, in order
    assert task.reward(prompts[1], task.tokenizer.encode_prompt("Answer: 2"))["score"] == 1.0  # the recipe's dapo_math
    # --temperature 0 is greedy; the options win over the same keys among the overrides
    _, (_, greedy, _, _) = _prepare(["--model", str(model_dir), "--data", str(val_file), "--out", "x",
                                     "--temperature", "0", "rollout.val_kwargs.do_sample=true",
                                     "rollout.val_kwargs.temperature=1.0"])
    assert greedy.rollout.val_kwargs.do_sample is False and greedy.rollout.val_kwargs.sampling_temperature == 0
    # without options: the recipe's val_kwargs (verl's default: one greedy sample)
    _, (_, default, _, _) = _prepare(["--model", str(model_dir), "--data", str(val_file), "--out", "x"])
    assert default.rollout.val_kwargs == ValSampling()


def test_overrides_after_the_data_files_are_overrides(model_dir, tmp_path):
    questions = write_jsonl(tmp_path / "q.jsonl", [{"question": "What is 1+1?", "reward_model": {"ground_truth": "2"}}])
    args, (_, recipe, _, prompts) = _prepare(["--model", str(model_dir), "--out", "x", "--data", str(questions),
                                              "data.prompt_key=question", "rollout.top_k=3"])
    assert args.data == [str(questions)]
    assert args.overrides == ["data.prompt_key=question", "rollout.top_k=3"]
    assert recipe.data.prompt_key == "question" and recipe.rollout.top_k == 3
    assert len(prompts) == 1 and prompts[0].text == "What is 1+1?"


def test_the_launch_command_line_round_trips(model_dir, val_file, monkeypatch, capsys):
    """What `megatron-rlcorr eval` hands torchrun passes torchrun's own parser (which refuses an
    option that abbreviates several of its own, such as --n, wherever it stands) and parses back to
    the same arguments (options with dashes, --data's list, overrides that followed the files)."""
    from torch.distributed.run import get_args_parser

    launched = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: launched.append(cmd) or 0)
    assert cli.main(["eval", "--model", str(model_dir), "--out", "o", "--top-p", "0.5", "--temperature", "0.3",
                     "--n", "3", "--max-new-tokens", "5", "--data", str(val_file), str(val_file),
                     "rollout.top_k=4"]) == 0
    cmd = launched[0]
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    torchrun = get_args_parser().parse_args(cmd[3:])
    assert (torchrun.module, torchrun.training_script, torchrun.nproc_per_node) == (True, "megatron_rlcorr.eval", "1")
    args = evaluation.parse_args(torchrun.training_script_args)
    assert (args.data, args.top_p, args.temperature, args.max_new_tokens, args.samples) == (
        [str(val_file)] * 2, 0.5, 0.3, 5, 3)
    assert args.overrides == ["rollout.top_k=4"]


def test_a_missing_data_file_exits_2_naming_it(model_dir, val_file, tmp_path, capsys):
    code, err = _cli(capsys, "--model", model_dir, "--data", val_file, tmp_path / "nope.parquet",
                     "--out", tmp_path / "o")
    assert code == 2 and f"--data {tmp_path / 'nope.parquet'}: no such file" in err


def test_rows_without_the_prompt_key_exit_2_naming_the_key_and_the_fix(model_dir, tmp_path, capsys):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "What is 1+1?", "reward_model": {"ground_truth": "2"}}])
    code, err = _cli(capsys, "--model", model_dir, "--data", path, "--out", tmp_path / "o")
    assert code == 2
    assert f"--data {path}: {path} line 1 has no prompt at 'prompt'" in err
    assert "key 'prompt' of the row is missing (its keys: question, reward_model)" in err
    assert "set data.prompt_key to the (dotted) key that holds the prompt" in err
    code, err = _cli(capsys, "--model", model_dir, "--data", path, "--out", tmp_path / "o", "data.prompt_key=question",
                     "data.answer_key=answer")
    assert code == 2 and "has no answer at 'answer'" in err and "set data.answer_key" in err


def test_a_data_source_without_a_reward_exits_2_naming_it(model_dir, val_file, tmp_path, capsys):
    other = write_jsonl(tmp_path / "aime.jsonl", [{**dapo_row("What is 2+2?", "4"), "data_source": "aime"}] * 3)
    code, err = _cli(capsys, "--model", model_dir, "--data", val_file, other, "--out", tmp_path / "o",
                     "data.reward={math_dapo: dapo_math}")
    assert code == 2
    assert (f"--data {other} (3 of its 3 prompts): data.reward has no reward for data_source 'aime' (it has rewards "
            "for 'math_dapo'): add `aime: <reward name>` to the data.reward mapping") in err
    # with an entry for it the same files pass
    _, (_, recipe, _, prompts) = _prepare(["--model", str(model_dir), "--data", str(val_file), str(other), "--out",
                                           "x", "data.reward={math_dapo: dapo_math, aime: boxed_math}"])
    assert len(prompts) == 8 and recipe.data.reward == {"math_dapo": "dapo_math", "aime": "boxed_math"}


@pytest.mark.parametrize("argv, message", [
    (["data.reward=dapo_maths"], "data: reward: unknown reward 'dapo_maths' (did you mean \"dapo_math\"?)"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--n", "0"], "n (samples per validation prompt) must be >= 1"),
    (["--max-new-tokens", "300"], "the longest prompt is"),
])
def test_bad_settings_exit_2_naming_them(model_dir, val_file, tmp_path, capsys, argv, message):
    code, err = _cli(capsys, "--model", model_dir, "--data", val_file, "--out", tmp_path / "o", *argv)
    assert code == 2 and message in err, err


def test_out_must_be_a_directory(model_dir, val_file, tmp_path, capsys):
    taken = tmp_path / "file"
    taken.write_text("")
    code, err = _cli(capsys, "--model", model_dir, "--data", val_file, "--out", taken)
    assert code == 2 and f"--out {taken} exists and is not a directory" in err


def test_cli_lists_eval_beside_score():
    usage = cli.__doc__
    assert "megatron-rlcorr eval --model SRC --data FILE [FILE ...] --out DIR" in usage
    assert "train | score | eval | export" in usage.splitlines()[0]
    assert Path(evaluation.__file__).name == "eval.py" and "generations.jsonl" in evaluation.__doc__


def test_a_non_empty_out_needs_overwrite(model_dir, val_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    out.mkdir()
    _prepare(["--model", str(model_dir), "--data", str(val_file), "--out", str(out)])  # empty: fine
    (out / evaluation.METRICS_FILE).write_text("{}")
    code, err = _cli(capsys, "--model", model_dir, "--data", val_file, "--out", out)
    assert code == 2 and (f"--out {out} is not empty (it holds metrics.json): pass --overwrite to replace its "
                          "metrics.json and generations.jsonl, or choose another --out") in err
    launched = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: launched.append(cmd) or 0)
    assert cli.main(["eval", "--model", str(model_dir), "--data", str(val_file), "--out", str(out),
                     "--overwrite"]) == 0
    assert "--overwrite" in launched[0]  # the entry point checks it again on every rank
    assert evaluation.parse_args(["--model", "m", "--data", "d", "--out", str(out), "--overwrite"]).overwrite


def test_eval_seeds_as_validation_at_the_checkpoints_step(tmp_path):
    from megatron_rlcorr.recipe.source import ModelSource

    assert evaluation.seed_step(ModelSource("checkpoint", tmp_path, 30)) == 30  # runs/<name>/checkpoints/step_30
    assert evaluation.seed_step(ModelSource("hf", tmp_path)) == 0  # a Hugging Face checkpoint: before training


def test_greedy_samples_beyond_the_first_are_warned_of(model_dir, val_file):
    def warning(*argv):
        _, (_, recipe, _, _) = _prepare(["--model", str(model_dir), "--data", str(val_file), "--out", "x", *argv])
        return evaluation.greedy_repeats(recipe)

    for greedy in (["--n", "4"], ["--n", "4", "--temperature", "0"],
                   ["--n", "4", "rollout.val_kwargs.temperature=1.0"]):  # do_sample false: greedy
        assert warning(*greedy) == (
            "eval: --n 4 (rollout.val_kwargs.n) with greedy decoding (--temperature 0, or rollout.val_kwargs.do_sample "
            "false) gives the same response 4 times per prompt, so every @4 metric equals its @1; pass --temperature "
            "T > 0 to sample, or --n 1"), greedy
    assert warning("--n", "4", "--temperature", "1.0") is None and warning() is None  # sampled; one greedy sample


def test_max_new_tokens_default_is_the_recipes_with_or_without_config(model_dir, val_file, tmp_path):
    """One rule: --max-new-tokens, else rollout.max_new_tokens of --config (else of a run's own
    recipe), else the recipe default, 16; the same default whether a --config is given or not."""
    def limit(*argv):
        _, (_, recipe, _, _) = _prepare(["--model", str(model_dir), "--data", str(val_file), "--out", "x", *argv])
        return recipe.rollout.max_new_tokens

    silent, sets = tmp_path / "silent.yaml", tmp_path / "sets.yaml"
    silent.write_text("rollout: {temperature: 1.0}\n")
    sets.write_text("rollout: {max_new_tokens: 8}\n")
    assert limit() == limit("--config", str(silent)) == 16
    assert limit("--config", str(sets)) == 8
    assert limit("--config", str(sets), "--max-new-tokens", "6") == limit("--max-new-tokens", "6") == 6
