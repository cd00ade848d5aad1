"""Tokenizer, built-in verifiable tasks, the JSONL dataset and the task registry."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rlcorr.data import (BOS_ID, EOS_ID, PAD_ID, CharTokenizer, CopyTask, DigitSumTask, JsonlPromptDataset,
                                  Prompt, ReverseTask, Task, get_task)
from megatron_rlcorr.data.tokenizer import ARITHMETIC_ALPHABET


def test_tokenizer_round_trip_and_ids():
    tok = CharTokenizer()
    text = "what is 12+30, x: y-z"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID and len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size == 45
    arithmetic = CharTokenizer(ARITHMETIC_ALPHABET)
    assert arithmetic.vocab_size == 15 and arithmetic.encode("09+=") == [3, 12, 13, 14]


def test_tokenizer_decode_rules():
    tok = CharTokenizer("ab")
    assert tok.decode([BOS_ID, 3, PAD_ID, 4, EOS_ID, 3]) == "ab"
    assert tok.decode([3, EOS_ID, 4], stop_at_eos=False) == "ab"
    assert tok.decode([3, 5, 99]) == "a\ufffd\ufffd"  # padded-vocab ids never decode to a real character
    with pytest.raises(ValueError, match=r"\['c'\]"):
        tok.encode("abc")
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("aba")


def test_digit_sum_prompts_and_answers():
    task = DigitSumTask()
    prompts = task.sample_prompts(200, torch.Generator().manual_seed(0))
    for p in prompts:
        a, b = p.text.rstrip("=").split("+")
        assert p.answer == f"{int(a) + int(b):02d}"
        assert p.ids == [BOS_ID] + task.tokenizer.encode(p.text)
    assert len({p.text for p in prompts}) > 50
    again = task.sample_prompts(200, torch.Generator().manual_seed(0))
    assert [p.ids for p in again] == [p.ids for p in prompts]
    two = DigitSumTask(digits=2).sample_prompts(50, torch.Generator().manual_seed(1))
    assert all(len(p.answer) == 3 and int(p.answer) == sum(map(int, p.text[:-1].split("+"))) for p in two)


def test_digit_sum_reward_partial_credit():
    task = DigitSumTask()
    prompt = Prompt(ids=task.tokenizer.encode("7+5=", bos=True), answer="12", text="7+5=")
    enc = task.tokenizer.encode
    assert task.reward(prompt, enc("12", eos=True)) == 1.0
    assert task.reward(prompt, enc("12", eos=True) + enc("99")) == 1.0  # tokens after EOS are ignored
    assert task.reward(prompt, enc("12")) == pytest.approx(2 / 3)        # no EOS: cut at max_new_tokens
    assert task.reward(prompt, enc("13", eos=True)) == pytest.approx(2 / 3)
    assert task.reward(prompt, enc("1", eos=True)) == pytest.approx(1 / 3)
    assert task.reward(prompt, enc("21", eos=True)) == pytest.approx(1 / 3)
    assert task.reward(prompt, [EOS_ID]) == 0.0 and task.reward(prompt, []) == 0.0
    strict = DigitSumTask(partial_credit=False)
    assert strict.reward(prompt, enc("12", eos=True)) == 1.0
    assert strict.reward(prompt, enc("12")) == 0.0 and strict.reward(prompt, enc("13", eos=True)) == 0.0


def test_random_responses_earn_some_reward():
    """The task is informative from step 0: uniform random responses already get partial credit."""
    task = DigitSumTask()
    g = torch.Generator().manual_seed(3)
    prompts = task.sample_prompts(2000, g)
    responses = torch.randint(0, task.tokenizer.vocab_size, (2000, 8), generator=g).tolist()
    mean = sum(task.reward(p, r) for p, r in zip(prompts, responses)) / len(prompts)
    assert 0.03 < mean < 0.15  # about one hit in vocab_size per position


def test_copy_and_reverse():
    g = torch.Generator().manual_seed(4)
    copies = CopyTask(min_len=2, max_len=5).sample_prompts(100, g)
    assert all(p.text == p.answer + "=" and 2 <= len(p.answer) <= 5 for p in copies)
    assert {len(p.answer) for p in copies} == {2, 3, 4, 5}
    reverses = ReverseTask(min_len=3, max_len=3).sample_prompts(20, g)
    assert all(p.answer == p.text[:-1][::-1] for p in reverses)
    task = ReverseTask()
    p = Prompt(ids=[], answer="321", text="123=")
    assert task.reward(p, task.tokenizer.encode("321", eos=True)) == 1.0
    assert task.reward(p, task.tokenizer.encode("123", eos=True)) == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="min_len"):
        CopyTask(min_len=4, max_len=3)


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_jsonl_dataset(tmp_path):
    rows = [{"prompt": f"q{i}=", "answer": i} for i in range(7)]
    ds = JsonlPromptDataset(write_jsonl(tmp_path / "d.jsonl", rows))
    assert len(ds) == 7 and isinstance(ds, Task)
    drawn = ds.sample_prompts(7, torch.Generator().manual_seed(0))
    assert sorted(p.text for p in drawn) == sorted(r["prompt"] for r in rows)  # one pass: no repeats
    assert len(ds.sample_prompts(17, torch.Generator().manual_seed(0))) == 17
    p = next(p for p in drawn if p.text == "q3=")
    assert p.ids == ds.tokenizer.encode("q3=", bos=True) and p.answer == "3"
    assert ds.reward(p, ds.tokenizer.encode(" 3", eos=True)) == 1.0
    assert ds.reward(p, ds.tokenizer.encode("3")) == 1.0
    assert ds.reward(p, ds.tokenizer.encode("33", eos=True)) == 0.0
    assert ds.reward(p, ds.tokenizer.encode("3") + [40]) == 0.0  # an id past the vocabulary is not ignored


def test_jsonl_errors_name_the_line(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a=", "answer": "1"}, {"question": "b="}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'prompt'"):
        JsonlPromptDataset(bad)
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"prompt": "A?", "answer": "1"}])
    with pytest.raises(ValueError, match=r"odd.jsonl:1: .*\['\?', 'A'\]"):
        JsonlPromptDataset(odd)
    with pytest.raises(ValueError, match="not found"):
        JsonlPromptDataset(tmp_path / "missing.jsonl")


def test_registry(tmp_path):
    assert isinstance(get_task("digit_sum"), DigitSumTask)
    assert get_task("copy", min_len=3, max_len=3).min_len == 3
    assert isinstance(get_task("reverse"), ReverseTask)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": "y"}])
    assert len(get_task("jsonl", path=str(path))) == 1
    with pytest.raises(ValueError, match='unknown task .*did you mean "digit_sum"'):
        get_task("digit_summ")
    with pytest.raises(ValueError, match='no argument .*did you mean "digits"'):
        get_task("digit_sum", digit=2)
    with pytest.raises(ValueError, match="needs path"):
        get_task("jsonl")
    with pytest.raises(ValueError, match="digits"):
        get_task("digit_sum", digits=0)
