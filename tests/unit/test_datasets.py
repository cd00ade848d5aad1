"""PromptDataset (parquet / JSONL in verl's schema), DataSettings' dataset keys and build_task."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import megatron_rlcorr.data
from megatron_rlcorr.data import (CopyTask, DataSettings, DigitSumTask, HFTokenizer, Prompt, PromptDataset, Taken, Task,
                                  build_task)
from megatron_rlcorr.data.datasets import _epoch_seed
from megatron_rlcorr.settings import from_mapping
from tests.hf_fixtures import IM_END, dapo_row, make_tokenizer, write_jsonl, write_parquet

IM_END_ID = 2


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"), eos_in_generation_config=IM_END)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return HFTokenizer(tok_dir)


def no_reward(response, ground_truth, extra):
    return 0.0


def rows(n: int, start: int = 0) -> list[dict]:
    return [dapo_row(f"What is {i}+{i}?", str(2 * i), i) for i in range(start, start + n)]


def dataset(files, tok, **kwargs) -> PromptDataset:
    return PromptDataset(files, tokenizer=tok, reward_fn=kwargs.pop("reward_fn", no_reward), **kwargs)


def index_of(prompt: Prompt) -> int:
    return int(prompt.extra["extra_info"]["index"])


def indices(taken: Taken) -> list[int]:
    return [index_of(p) for p in taken.prompts]


# ---- reading -------------------------------------------------------------------------------------


def test_parquet_is_streamed_and_rows_become_prompts(tmp_path, tok):
    data = rows(10)
    path = write_parquet(tmp_path / "d.parquet", data, row_group_size=3)
    ds = dataset([path], tok, shuffle=False, read_batch_rows=2)
    assert ds.num_rows == len(ds) == 10
    assert ds._sources[0].table.column("prompt").num_chunks == 5  # 4 row groups, read in batches of 2 rows
    taken = ds.take(0, 10)
    assert taken == Taken(taken.prompts, 10, 0, 0)
    for row, prompt in zip(data, taken.prompts):
        assert prompt.ids == tok.encode_prompt(row["prompt"])
        assert prompt.answer == row["reward_model"]["ground_truth"]
        assert prompt.text == row["prompt"][0]["content"]
        assert prompt.extra == row  # the whole row, nested fields as Python dicts and lists


def test_jsonl_rows_and_blank_lines(tmp_path, tok):
    data = rows(4)
    path = write_jsonl(tmp_path / "d.jsonl", [data[0], "", data[1], "   ", data[2], data[3], ""])
    ds = dataset([path], tok, shuffle=False)
    assert ds.num_rows == 4  # blank lines are not rows
    assert ds._sources[0].where(2) == f"{path} line 5"
    taken = ds.take(0, 4)
    assert [p.extra for p in taken.prompts] == data and taken.next_position == 4
    assert [p.ids for p in taken.prompts] == [tok.encode_prompt(r["prompt"]) for r in data]


def test_ground_truth_keeps_its_json_type(tmp_path, tok):
    data = [dapo_row("What is 17*2?", 34), dapo_row("Half of 1?", 0.5)]
    ds = dataset([write_jsonl(tmp_path / "d.json", data)], tok, shuffle=False)
    assert [p.answer for p in ds.take(0, 2).prompts] == [34, 0.5]
    parquet = dataset([write_parquet(tmp_path / "d.parquet", [dapo_row("a", 34), dapo_row("b", 7)])], tok,
                      shuffle=False)
    assert [p.answer for p in parquet.take(0, 2).prompts] == [34, 7]


def test_nested_keys_and_string_prompts(tmp_path, tok):
    data = [{"q": {"text": f"{i}+1="}, "meta": {"solution": {"final": str(i + 1)}}, "id": i} for i in range(3)]
    for path in (write_jsonl(tmp_path / "d.jsonl", data), write_parquet(tmp_path / "d.parquet", data)):
        ds = dataset([path], tok, prompt_key="q.text", answer_key="meta.solution.final", shuffle=False)
        taken = ds.take(0, 3)
        assert [(p.ids, p.answer, p.text) for p in taken.prompts] == [
            (tok.encode_prompt(f"{i}+1="), str(i + 1), f"{i}+1=") for i in range(3)]
        assert [p.extra for p in taken.prompts] == data


def test_text_is_the_last_user_message(tmp_path, tok):
    row = dapo_row("ignored", "1")
    row["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"},
                     {"role": "assistant", "content": "?"}, {"role": "user", "content": "What is 1*1?"}]
    ds = dataset([write_jsonl(tmp_path / "d.jsonl", [row])], tok)
    prompt = ds.take(0, 1).prompts[0]
    assert prompt.text == "What is 1*1?" and prompt.ids == tok.encode_prompt(row["prompt"])


def test_files_are_concatenated_in_order(tmp_path, tok):
    files = [write_parquet(tmp_path / "a.parquet", rows(3), row_group_size=2),
             write_jsonl(tmp_path / "b.jsonl", rows(2, start=3)),
             write_parquet(tmp_path / "c.parquet", rows(4, start=5))]
    ds = dataset(files, tok, shuffle=False)
    assert ds.num_rows == 9
    assert indices(ds.take(0, 9)) == list(range(9))
    assert indices(ds.take(9, 3)) == [0, 1, 2]  # epoch 1, file order again


# ---- long prompts and bad rows -------------------------------------------------------------------


@pytest.fixture
def mixed_lengths(tmp_path, tok):
    """Plain-string prompts of rising length; returns (path, token lengths)."""
    texts = ["1+1=", "What is 2+3?", "1+1=", "Compute 12 * 7 and give the final answer.", "2+2="]
    data = [{"prompt": t, "answer": str(i), "index": i} for i, t in enumerate(texts)]
    return write_jsonl(tmp_path / "d.jsonl", data), [len(tok.encode_prompt(t)) for t in texts]


def test_long_prompts_are_dropped_and_counted(mixed_lengths, tok):
    path, lengths = mixed_lengths
    limit = sorted(set(lengths))[1]  # keeps the two shortest lengths
    kept = [i for i, n in enumerate(lengths) if n <= limit]
    assert 0 < len(kept) < len(lengths)
    ds = dataset([path], tok, answer_key="answer", max_prompt_length=limit, shuffle=False)
    taken = ds.take(0, len(kept))
    assert [p.extra["index"] for p in taken.prompts] == kept
    assert all(len(p.ids) <= limit for p in taken.prompts)
    assert taken.dropped_long == sum(n > limit for n in lengths[: kept[-1] + 1]) and taken.skipped_bad == 0
    assert taken.next_position == kept[-1] + 1


def test_long_prompt_error_names_file_row_length_and_limit(mixed_lengths, tok):
    path, lengths = mixed_lengths
    ds = dataset([path], tok, answer_key="answer", max_prompt_length=lengths[0], on_long_prompt="error", shuffle=False)
    with pytest.raises(ValueError, match=rf"{path} line 2: the prompt is {lengths[1]} tokens, longer than "
                                         rf"data\.max_prompt_length={lengths[0]}; raise data\.max_prompt_length, or "
                                         r"set data\.on_long_prompt: drop"):
        ds.take(0, 3)


BAD_ROWS = [  # (row, message after "<file> line 2"), for a JSONL file whose line 1 is good
    ({"answer": "1"}, (r" has no prompt at 'prompt': key 'prompt' of the row is missing \(its keys: answer\); "
                       r"set data\.prompt_key to the \(dotted\) key that holds the prompt")),
    ({"prompt": "1+1=", "reward_model": {"style": "x"}},
     (r" has no answer at 'reward_model.ground_truth': key 'ground_truth' of 'reward_model' is missing \(its keys: "
      r"style\); set data\.answer_key to the \(dotted\) key that holds the ground truth")),
    ({"prompt": "1+1=", "reward_model": "2"},
     r" has no answer at 'reward_model.ground_truth': 'reward_model' is a str, not a mapping with key 'ground_truth'"),
    ({"prompt": "1+1=", "reward_model": {"ground_truth": None}},
     r" has no answer at .*'ground_truth' of 'reward_model' is null"),
    ({"prompt": 12, "reward_model": {"ground_truth": "2"}},
     r": 'prompt': a prompt is a string or a non-empty list of chat messages.*got a int; set data\.prompt_key"),
    ({"prompt": [{"role": "user", "text": "hi"}], "reward_model": {"ground_truth": "2"}},
     r": 'prompt': message 0 has content=None \(keys: role, text\)"),
    ("{not json", r" is not valid JSON \(Expecting property name"),
    ('["prompt", "answer"]', r" is a JSON list, not an object with the prompt and answer"),
]


@pytest.mark.parametrize("bad, message", BAD_ROWS)
def test_bad_row_errors_name_file_row_key_and_fix(tmp_path, tok, bad, message):
    path = write_jsonl(tmp_path / "d.jsonl", [dapo_row("1+1=", "2"), bad, dapo_row("2+2=", "4")])
    ds = dataset([path], tok, shuffle=False)  # line 1 is good: the probe at construction passes
    with pytest.raises(ValueError, match=rf"{path} line 2{message}.*; or set data\.skip_bad_rows: true to skip such "
                                         r"rows \(they are counted\)"):
        ds.take(0, 2)
    skipping = dataset([path], tok, shuffle=False, skip_bad_rows=True)
    assert skipping.take(0, 2) == Taken(skipping.take(0, 2).prompts, 3, 0, 1)
    assert [p.answer for p in skipping.take(0, 2).prompts] == ["2", "4"]


def test_bad_parquet_rows_are_named_by_row(tmp_path, tok):
    data = rows(3)
    data[1] = {"prompt": None, "reward_model": {"ground_truth": "2"}, "data_source": "x"}  # a null in a column
    path = write_parquet(tmp_path / "d.parquet", data)
    with pytest.raises(ValueError, match=rf"{path} row 2 has no prompt at 'prompt': key 'prompt' of the row is null"):
        dataset([path], tok, shuffle=False).take(0, 3)
    taken = dataset([path], tok, shuffle=False, skip_bad_rows=True).take(0, 2)
    assert [p.answer for p in taken.prompts] == ["0", "4"] and taken.skipped_bad == 1


def test_a_bad_first_row_fails_at_construction(tmp_path, tok):
    good, bad = write_jsonl(tmp_path / "good.jsonl", rows(2)), write_jsonl(tmp_path / "bad.jsonl", rows(2))
    with pytest.raises(ValueError, match=rf"{good} line 1 has no prompt at 'question'.*set data\.prompt_key"):
        dataset([good], tok, prompt_key="question")
    write_jsonl(bad, [{"prompt": "x"}] + rows(1))
    with pytest.raises(ValueError, match=rf"{bad} line 1 has no answer"):  # every file's first row is checked
        dataset([good, bad], tok)
    assert dataset([good, bad], tok, skip_bad_rows=True).num_rows == 4


def test_chat_prompts_need_a_chat_template(tmp_path):
    plain = HFTokenizer(make_tokenizer(tmp_path / "tok", chat_template=False))
    path = write_jsonl(tmp_path / "d.jsonl", rows(2))
    with pytest.raises(ValueError, match=rf"{path} line 1: the tokenizer in .*tok has no chat template.*give prompts "
                                         "as plain strings"):
        dataset([path], plain, skip_bad_rows=True)  # not a bad row: every row would fail


# ---- files ---------------------------------------------------------------------------------------


def test_file_errors(tmp_path, tok):
    with pytest.raises(ValueError, match=rf"data file {tmp_path / 'd.csv'}: unsupported extension '.csv'; use parquet"):
        dataset([tmp_path / "d.csv"], tok)
    with pytest.raises(ValueError, match=rf"data file {tmp_path / 'missing.parquet'} not found"):
        dataset([tmp_path / "missing.parquet"], tok)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=rf"cannot read parquet file {tmp_path / 'broken.parquet'} \(Arrow"):
        dataset([tmp_path / "broken.parquet"], tok)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=rf"data file {tmp_path / 'empty.jsonl'} holds no rows; remove it"):
        dataset([write_jsonl(tmp_path / "ok.jsonl", rows(1)), tmp_path / "empty.jsonl"], tok)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(ValueError, match="not found"):
        dataset([tmp_path / "dir.jsonl"], tok)
    with pytest.raises(ValueError, match=r"at least one file \(data\.train_files is empty\)"):
        dataset([], tok)


def test_constructor_errors(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", rows(1))
    with pytest.raises(ValueError, match=r"on_long_prompt must be one of 'drop', 'error', got 'skip'"):
        dataset([path], tok, on_long_prompt="skip")
    with pytest.raises(ValueError, match=r"max_prompt_length must be >= 1 \(or None for no limit\), got 0"):
        dataset([path], tok, max_prompt_length=0)
    with pytest.raises(ValueError, match=r"answer_key must be a key or a dotted path.*got 'reward_model\.'"):
        dataset([path], tok, answer_key="reward_model.")
    with pytest.raises(ValueError, match=r"take\(position=-1, count=2\): both must be >= 0"):
        dataset([path], tok).take(-1, 2)
    assert dataset(str(path), tok).num_rows == 1  # a single path is a list of one


# ---- order and position --------------------------------------------------------------------------


@pytest.fixture
def ten(tmp_path):
    return write_parquet(tmp_path / "d.parquet", rows(10), row_group_size=4)


def test_order_is_a_function_of_seed_and_epoch(ten, tok):
    a, b = dataset([ten], tok, seed=3), dataset([ten], tok, seed=3)
    epochs = [indices(a.take(e * 10, 10)) for e in range(3)]
    assert epochs == [indices(b.take(e * 10, 10)) for e in range(3)]  # same seed, same order
    assert [indices(b.take(e * 10, 10)) for e in reversed(range(3))] == epochs[::-1]  # not a function of history
    assert all(sorted(order) == list(range(10)) for order in epochs)  # no row repeated or lost in an epoch
    assert len({tuple(order) for order in epochs}) == 3  # epochs differ
    for e, order in enumerate(epochs):
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(_epoch_seed(3, e))).tolist()
        assert order == expected and a.epoch(e * 10 + 9) == e
    assert indices(dataset([ten], tok, seed=4).take(0, 10)) != epochs[0]
    assert indices(dataset([ten], tok, shuffle=False).take(20, 10)) == list(range(10))


def test_take_crosses_the_epoch_boundary(ten, tok):
    ds = dataset([ten], tok, seed=1)
    first, second = indices(ds.take(0, 10)), indices(ds.take(10, 10))
    taken = ds.take(7, 6)
    assert indices(taken) == first[7:] + second[:3] and taken.next_position == 13
    assert ds.epoch(taken.next_position) == 1
    assert ds.take(5, 0) == Taken([], 5, 0, 0)


def test_resume_continues_with_the_same_prompts(tmp_path, tok):
    """take(p, a) then take(next, b) == take(p, a + b): a checkpoint's position gives the same continuation."""
    data = rows(7)
    data[2] = {"prompt": "no answer"}
    data[5]["prompt"] = [{"role": "user", "content": "Compute 12 * 7 and give the final answer. " * 3}]
    path = write_jsonl(tmp_path / "d.jsonl", data)
    limit = len(tok.encode_prompt(rows(1)[0]["prompt"])) + 2
    ds = dataset([path], tok, seed=5, skip_bad_rows=True, max_prompt_length=limit)
    for start, a, b in [(0, 3, 4), (4, 5, 6), (13, 1, 9)]:
        head, tail = ds.take(start, a), ds.take(ds.take(start, a).next_position, b)
        whole = dataset([path], tok, seed=5, skip_bad_rows=True, max_prompt_length=limit).take(start, a + b)
        assert head.prompts + tail.prompts == whole.prompts
        assert tail.next_position == whole.next_position
        assert (head.dropped_long + tail.dropped_long, head.skipped_bad + tail.skipped_bad) == (
            whole.dropped_long, whole.skipped_bad)
    whole = ds.take(0, 10)  # 5 usable rows an epoch: two epochs, each bad and long row passed once per epoch
    assert (whole.next_position, whole.dropped_long, whole.skipped_bad) == (14, 2, 2)


def test_an_epoch_without_usable_prompts_is_an_error(mixed_lengths, tok):
    path, lengths = mixed_lengths
    ds = dataset([path], tok, answer_key="answer", max_prompt_length=min(lengths) - 1)
    message = (rf"none of the 5 rows of {path} holds a usable prompt: 5 prompts longer than data\.max_prompt_length="
               rf"{min(lengths) - 1} \(the shortest has {min(lengths)} tokens: raise the limit to at least that\)$")
    with pytest.raises(ValueError, match=message):
        ds.take(3, 1)  # the epoch from position 5 to 10 is the first whole one; counted once
    with pytest.raises(ValueError, match=message):  # each row counted once, however often it was drawn
        ds.sample_prompts(2, torch.Generator().manual_seed(0))


def test_all_bad_rows_is_an_error_too(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}] * 3)
    ds = dataset([path], tok, skip_bad_rows=True)
    with pytest.raises(ValueError, match=r"none of the 3 rows of .* holds a usable prompt: 3 bad rows skipped "
                                         r"\(data\.skip_bad_rows: true; set it to false to see the first one's "
                                         r"error\)"):
        ds.take(2, 1)


def test_one_usable_row_is_found_in_every_epoch(tmp_path, tok):
    """A run of unusable rows across an epoch boundary is not a whole epoch: no false alarm."""
    data = [{"prompt": "x"}] * 4 + rows(1)
    ds = dataset([write_jsonl(tmp_path / "d.jsonl", data)], tok, skip_bad_rows=True, seed=2)
    taken = ds.take(0, 6)
    assert indices(taken) == [0] * 6 and taken.skipped_bad == taken.next_position - 6


# ---- random draws and rewards --------------------------------------------------------------------


def test_sample_prompts_is_deterministic_per_generator(tmp_path, tok):
    data = rows(8)
    data[3]["reward_model"]["ground_truth"] = None
    ds = dataset([write_parquet(tmp_path / "d.parquet", data)], tok, skip_bad_rows=True)

    def draw(seed: int) -> list[int]:
        return [index_of(p) for p in ds.sample_prompts(40, torch.Generator().manual_seed(seed))]

    assert draw(0) == draw(0) and draw(0) != draw(1)
    assert len(draw(0)) == 40 and 3 not in draw(0) and set(draw(0)) == set(range(8)) - {3}
    drawn = ds.draw(40, torch.Generator().manual_seed(0))
    assert [index_of(p) for p in drawn.prompts] == draw(0) and drawn.skipped_bad > 0 and drawn.dropped_long == 0
    generator = torch.Generator().manual_seed(7)
    ds.sample_prompts(5, generator)
    state = generator.get_state()
    assert ds.sample_prompts(5, generator) == ds.sample_prompts(5, torch.Generator().set_state(state))


def test_reward_gets_the_decoded_response_the_ground_truth_and_the_row(tmp_path, tok, tok_dir):
    calls = []

    def judge(response, ground_truth, extra):
        calls.append((response, ground_truth, extra))
        return response.endswith(str(ground_truth))

    data = [dapo_row("What is 17*2?", 34, 9, split="train")]
    ds = dataset([write_jsonl(tmp_path / "d.jsonl", data)], tok, reward_fn=judge)
    prompt = ds.take(0, 1).prompts[0]
    response = tok.encode_prompt("Answer: 34") + [IM_END_ID] + tok.encode_prompt(" trailing")
    assert ds.reward(prompt, response) == 1.0 and type(ds.reward(prompt, response)) is float
    assert calls[0] == ("Answer: 34", 34, data[0])
    assert ds.reward(prompt, tok.encode_prompt("Answer: 35")) == 0.0


# ---- DataSettings and build_task ------------------------------------------------------------------


def data_settings(**mapping) -> DataSettings:
    return from_mapping(DataSettings, mapping, "data")


def test_data_settings_defaults_and_dataset_keys():
    default = data_settings()
    assert default.task is None and default.train_files == [] and default.reward == "dapo_math"
    dataset_run = data_settings(train_files=["a.parquet", "b.jsonl"], max_prompt_length=512, on_long_prompt="error",
                                answer_key="answer", skip_bad_rows=True, shuffle=False, tokenizer="/tok")
    assert dataset_run.train_files == ["a.parquet", "b.jsonl"] and dataset_run.max_prompt_length == 512


@pytest.mark.parametrize("mapping, message", [
    ({"task": "digit_sum", "train_files": ["a.parquet"]},
     r"data: set either task \('digit_sum', a built-in task\) or train_files \(a prompt dataset\), not both"),
    ({"train_files": ["a.parquet"], "task_args": {"digits": 2}},
     r"data: task_args \(digits\) configure a built-in task; with train_files use the dataset keys"),
    ({"train_files": ["a.parquet", "b.csv"]},
     r"data: train_files\[1\]: data file b\.csv: unsupported extension '\.csv'"),
    ({"train_files": "a.parquet"}, r"data\.train_files must be a list, got 'a\.parquet'"),
    ({"train_files": ["a.jsonl"], "on_long_prompt": "truncate"},
     r"data\.on_long_prompt must be one of 'drop', 'error'"),
    ({"train_files": ["a.jsonl"], "max_prompt_length": 0}, r"data: max_prompt_length must be >= 1 \(or null"),
    ({"train_files": ["a.jsonl"], "prompt_key": ""}, r"data: prompt_key must be a key or a dotted path"),
    ({"tokenizer": "/tok"}, r"data: tokenizer='/tok' is only read with train_files"),
    ({"prompts_per_step": 0}, r"data: prompts_per_step must be >= 1"),
])
def test_data_settings_errors(mapping, message):
    with pytest.raises(ValueError, match=message):
        data_settings(**mapping)


def test_build_task_without_files_is_a_built_in_task():
    assert isinstance(build_task(data_settings(), tokenizer_dir=None, seed=0), DigitSumTask)
    copy = build_task(data_settings(task="copy", task_args={"min_len": 3, "max_len": 3}), tokenizer_dir="/x", seed=0)
    assert isinstance(copy, CopyTask) and copy.min_len == 3 and copy.tokenizer.eos_ids == (copy.tokenizer.eos_id,)
    with pytest.raises(ValueError, match="unknown task 'digit_summ'"):
        build_task(data_settings(task="digit_summ"), tokenizer_dir=None, seed=0)


def test_build_task_with_files_is_a_dataset(tmp_path, tok_dir):
    path = write_parquet(tmp_path / "d.parquet", rows(6))
    task = build_task(data_settings(train_files=[str(path)]), tokenizer_dir=str(tok_dir), seed=1)
    assert isinstance(task, PromptDataset) and isinstance(task, Task) and isinstance(task.tokenizer, HFTokenizer)
    assert task.tokenizer.path == tok_dir and task.num_rows == 6
    prompt = task.take(0, 1).prompts[0]
    answer = f"Answer: {prompt.answer}"
    assert task.reward(prompt, task.tokenizer.encode_prompt(answer) + [IM_END_ID])["score"] == 1.0  # dapo_math
    assert task.reward(prompt, task.tokenizer.encode_prompt("Answer: 1000"))["score"] == -1.0
    again = build_task(data_settings(train_files=[str(path)], tokenizer=str(tok_dir)), tokenizer_dir=None, seed=1)
    other = build_task(data_settings(train_files=[str(path)]), tokenizer_dir=str(tok_dir), seed=2)
    assert indices(again.take(0, 6)) == indices(task.take(0, 6)) != indices(other.take(0, 6))
    ordered = build_task(data_settings(train_files=[str(path)], shuffle=False, max_prompt_length=10_000,
                                       prompt_key="prompt"), tokenizer_dir=str(tok_dir), seed=1)
    assert indices(ordered.take(0, 6)) == list(range(6))


def test_build_task_errors(tmp_path, tok_dir):
    path = str(write_jsonl(tmp_path / "d.jsonl", rows(2)))
    with pytest.raises(ValueError, match=r"data\.train_files needs a tokenizer: set data\.tokenizer or "
                                         r"model\.hf_checkpoint"):
        build_task(data_settings(train_files=[path]), tokenizer_dir=None, seed=0)
    with pytest.raises(ValueError, match=r"unknown reward 'dapo_mth' \(did you mean \"dapo_math\"\?\)"):
        build_task(data_settings(train_files=[path], reward="dapo_mth"), tokenizer_dir=str(tok_dir), seed=0)
    with pytest.raises(ValueError, match=rf"tokenizer directory {tmp_path / 'none'} does not exist"):
        build_task(data_settings(train_files=[path], tokenizer=str(tmp_path / "none")), tokenizer_dir=None, seed=0)


def imported_at_import_time(tree: ast.Module):
    """Modules a file imports when it is imported: everywhere but inside function bodies."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.module
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack.extend(ast.iter_child_nodes(node))


def test_importing_the_data_package_is_cheap():
    """transformers, pyarrow and tokenizers are imported inside functions only (seconds otherwise)."""
    assert list(imported_at_import_time(ast.parse("import pyarrow.parquet as pq\nclass A:\n    from x import y"))) \
        == ["x", "pyarrow.parquet"]
    for path in sorted(Path(megatron_rlcorr.data.__file__).parent.glob("*.py")):
        roots = {name.split(".")[0] for name in imported_at_import_time(ast.parse(path.read_text()))}
        assert not roots & {"transformers", "pyarrow", "tokenizers"}, f"{path.name} imports {roots} when imported"
