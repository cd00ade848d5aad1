"""Validation's data side (rl/validation.py, data/datasets.py `in_file_order`) and the recipe's
validation checks; the collective `validate` is tested in tests/distributed/test_validation.py."""
import json
from pathlib import Path

import pytest

from megatron_rlcorr.data.datasets import PromptDataset
from megatron_rlcorr.data.prompt import Prompt
from megatron_rlcorr.recipe import load_recipe
from megatron_rlcorr.rl.validation import UNKNOWN_SOURCE, data_source, write_generations

ROOT = Path(__file__).resolve().parents[2]


class WordTokenizer:
    """One id per whitespace-separated word of the prompt's text."""

    def encode_prompt(self, prompt):
        return [len(word) for word in str(prompt).split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_in_file_order_reads_every_usable_row_once_whatever_shuffle_says(tmp_path):
    first = _jsonl(tmp_path / "a.jsonl", [{"prompt": "one two", "answer": 1}, {"prompt": "a b c d e f", "answer": 2},
                                         {"prompt": "three", "answer": 3}])
    second = _jsonl(tmp_path / "b.jsonl", [{"prompt": "four", "answer": 4}, {"answer": 5}])
    dataset = PromptDataset([first, second], tokenizer=WordTokenizer(), reward_fn=lambda *a: 0.0,
                            answer_key="answer", max_prompt_length=3, skip_bad_rows=True, shuffle=True, seed=3)
    read = dataset.in_file_order()
    assert [p.answer for p in read.prompts] == [1, 3, 4]  # the 6-word prompt too long, the last row bad
    assert (read.dropped_long, read.skipped_bad, read.next_position) == (1, 1, 5)
    assert [p.answer for p in dataset.in_file_order().prompts] == [1, 3, 4]  # the same every time


def test_in_file_order_with_no_usable_row_says_why(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"prompt": "a b c d", "answer": 1}])
    dataset = PromptDataset(path, tokenizer=WordTokenizer(), reward_fn=lambda *a: 0.0, answer_key="answer",
                            max_prompt_length=2, files_key="data.val_files")
    with pytest.raises(ValueError, match="none of the 1 rows .* holds a usable prompt"):
        dataset.in_file_order()


def test_messages_name_the_files_setting(tmp_path):
    with pytest.raises(ValueError, match=r"not found \(data.val_files entries"):
        PromptDataset([tmp_path / "missing.jsonl"], tokenizer=WordTokenizer(), reward_fn=lambda *a: 0.0,
                      files_key="data.val_files")


def test_data_source_of_a_row():
    assert data_source(Prompt(ids=[1], answer="1", extra={"data_source": "aime"})) == "aime"
    assert data_source(Prompt(ids=[1], answer="1", extra={"data_source": None})) == UNKNOWN_SOURCE
    assert data_source(Prompt(ids=[1], answer="1")) == UNKNOWN_SOURCE


def test_write_generations_writes_json_lines(tmp_path):
    import numpy as np

    path = write_generations([{"score": 1.0, "pred": "7"}, {"score": np.float32(0.5), "tag": {1, 2}}],
                             tmp_path / "val_generations" / "step_3.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"score": 1.0, "pred": "7"} and lines[1]["score"] == 0.5 and isinstance(lines[1]["tag"], str)
    assert [p.name for p in path.parent.iterdir()] == ["step_3.jsonl"]  # no temporary file left


@pytest.mark.parametrize("key", ["trainer.test_freq=2", "trainer.val_only=true", "trainer.log_val_generations=4"])
def test_validation_keys_without_val_files_are_refused(key):
    recipe = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", [key])
    with pytest.raises(ValueError, match=f"{key.split('=')[0]}=.* validate on data.val_files, which is not set"):
        recipe.check_layout(1)


def test_the_defaults_need_no_val_files():
    recipe = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", ["trainer.val_before_train=true"])
    assert recipe.check_layout(1) == 1


def test_an_unreadable_val_file_is_refused_at_load(tiny_hf, tmp_path):
    overrides = [f"model.hf_checkpoint={tiny_hf / 'model'}", f"data.train_files=[{tiny_hf / 'data' / 'train.parquet'}]",
                 f"data.val_files=[{tmp_path / 'val.jsonl'}]"]
    with pytest.raises(ValueError, match=r"data.val_files: data file .*val.jsonl not found \(data.val_files entries"):
        load_recipe(ROOT / "recipes" / "tiny_hf_cpu.yaml", overrides).check_layout(2)
    _jsonl(tmp_path / "val.jsonl", [{"question": "1+1?", "reward_model": {"ground_truth": "2"}}])
    with pytest.raises(ValueError, match=r"data.val_files: .*val.jsonl line 1 has no prompt at 'prompt'"):
        load_recipe(ROOT / "recipes" / "tiny_hf_cpu.yaml", overrides).check_layout(2)


def test_a_reward_mapping_without_a_files_data_source_is_refused_before_the_launch(tiny_hf, tmp_path):
    """Training checks every data source of the train and val files against a data.reward mapping
    up front (eval does the same for its files), instead of failing at the first such row."""
    from megatron_rlcorr.data.datasets import data_source_counts

    val = _jsonl(tmp_path / "val.jsonl", [{"data_source": "aime", "prompt": "1+1?",
                                           "reward_model": {"ground_truth": "2"}}, {"prompt": "2+2?"}])
    assert data_source_counts(val) == {"aime": 1, None: 1}
    assert data_source_counts(tiny_hf / "data" / "train.parquet") == {"math_dapo": 80}
    files = [f"model.hf_checkpoint={tiny_hf / 'model'}", f"data.train_files=[{tiny_hf / 'data' / 'train.parquet'}]",
             "data.prompts_per_step=4", "trainer.micro_batch_size=4", "rollout.n=4"]
    recipe = load_recipe(ROOT / "recipes" / "tiny_hf_cpu.yaml", [*files, "data.val_files=[]", "trainer.test_freq=0",
                                                                   "data.reward={math_dapo: dapo_math}"])
    assert recipe.check_layout(2) == 2
    recipe = load_recipe(ROOT / "recipes" / "tiny_hf_cpu.yaml", [*files, "data.val_files=[]", "trainer.test_freq=0",
                                                                   "data.reward={aime: dapo_math}"])
    with pytest.raises(ValueError, match=r"data.train_files\[0\] .*train.parquet \(80 of its 80 rows\): data.reward "
                                         r"has no reward for data_source 'math_dapo'"):
        recipe.check_layout(2)
    recipe = load_recipe(ROOT / "recipes" / "tiny_hf_cpu.yaml", [*files, f"data.val_files=[{val}]",
                                                                   "data.reward={math_dapo: dapo_math, aime: dapo_math}"])
    with pytest.raises(ValueError, match=r"data.val_files\[0\] .*val.jsonl \(1 of its 2 rows\): the row has no "
                                         r"'data_source' field"):
        recipe.check_layout(2)
