"""Verifiable tasks: prompts with a known answer and a reward for a sampled response.

Every task, built-in or a dataset, has the same interface (`Task`): `sample_prompts(n, generator)`
draws prompts reproducibly from a torch.Generator, and `reward(prompt, response_ids)` scores the
response ids as the engine returned them (a final EOS included when the engine stopped on it).

Built-in tasks are small enough for a char-level model of a few layers to learn by RL from a
random initialisation on a CPU:
- "digit_sum": "a+b=" -> a+b written with a fixed width of digits+1 (zero padded), e.g. "7+5=" -> "12",
  "3+4=" -> "07".
- "copy" / "reverse": "3719=" -> "3719" / "9173".
Their reward, with partial_credit (the default), is the fraction of the target positions
(answer characters, then EOS) that the response matches at the same position: 1.0 for the exact
answer followed by EOS, and a random model already earns some credit, so the reward is
informative from the first step. Without partial_credit it is 1.0 for an exact match and 0.0
otherwise.

A recipe's `data:` section (`DataSettings`) picks a built-in task, or prompt files in verl's
schema (`train_files`, read by datasets.PromptDataset with a Hugging Face tokenizer and a reward
from rewards.py); `build_task` turns it into the run's task. Datasets additionally walk their rows
epoch by epoch from a position kept in the checkpoint (`take`).
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..config import did_you_mean
from ..settings import check_choice
from .datasets import PromptDataset, check_data_file
from .prompt import OnLongPrompt, Prompt, Task, Tokenizer
from .rewards import check_reward_spec
from .tokenizer import ARITHMETIC_ALPHABET, DEFAULT_ALPHABET, EOS_ID, CharTokenizer


def aligned_credit(target_ids: Sequence[int], response_ids: Sequence[int]) -> float:
    """Fraction of target positions whose token the response matches at the same position."""
    hits = sum(t == r for t, r in zip(target_ids, response_ids))
    return hits / len(target_ids)


def _until_eos(response_ids: Sequence[int]) -> list[int]:
    """The response through its first EOS (the engine stops there; other producers may not)."""
    ids = list(response_ids)
    return ids[: ids.index(EOS_ID) + 1] if EOS_ID in ids else ids


class _AnswerTask:
    """Shared reward of the built-in tasks: the answer's characters then EOS, position by position."""

    tokenizer: CharTokenizer

    def __init__(self, partial_credit: bool) -> None:
        self.partial_credit = partial_credit
        self.tokenizer = CharTokenizer(ARITHMETIC_ALPHABET)

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        target = self.tokenizer.encode(prompt.answer, eos=True)
        response = _until_eos(response_ids)
        if self.partial_credit:
            return aligned_credit(target, response)
        return float(response == target)

    def _prompt(self, text: str, answer: str) -> Prompt:
        return Prompt(ids=self.tokenizer.encode(text, bos=True), answer=answer, text=text)


class DigitSumTask(_AnswerTask):
    """'a+b=' -> the sum, zero padded to digits+1 characters; operands uniform in [0, 10**digits)."""

    def __init__(self, digits: int = 1, partial_credit: bool = True) -> None:
        if not 1 <= digits <= 6:
            raise ValueError(f"digit_sum: digits must be in 1..6, got {digits}")
        super().__init__(partial_credit)
        self.digits = digits

    def sample_prompts(self, n: int, generator: torch.Generator | None = None) -> list[Prompt]:
        operands = torch.randint(0, 10**self.digits, (n, 2), generator=generator).tolist()
        return [self._prompt(f"{a}+{b}=", f"{a + b:0{self.digits + 1}d}") for a, b in operands]


class CopyTask(_AnswerTask):
    """'<digits>=' -> the same digits; the string length is uniform in [min_len, max_len]."""

    reverse = False

    def __init__(self, min_len: int = 2, max_len: int = 4, partial_credit: bool = True) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        super().__init__(partial_credit)
        self.min_len, self.max_len = min_len, max_len

    def sample_prompts(self, n: int, generator: torch.Generator | None = None) -> list[Prompt]:
        lengths = torch.randint(self.min_len, self.max_len + 1, (n,), generator=generator).tolist()
        digits = torch.randint(0, 10, (n, self.max_len), generator=generator).tolist()
        prompts = []
        for length, row in zip(lengths, digits):
            text = "".join(map(str, row[:length]))
            prompts.append(self._prompt(text + "=", text[::-1] if self.reverse else text))
        return prompts


class ReverseTask(CopyTask):
    """'<digits>=' -> the digits in reverse order."""

    reverse = True


class JsonlPromptDataset:
    """Prompts and answers from a JSONL file ({"prompt": ..., "answer": ...} per line); exact-match reward.

    The reward is 1.0 when the decoded response (up to its first EOS, surrounding whitespace
    stripped) equals the answer (stripped), else 0.0. `sample_prompts` draws without replacement
    within a call (a fresh permutation of the file per pass), so it needs no state besides the
    generator.
    """

    def __init__(self, path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
                 alphabet: str = DEFAULT_ALPHABET) -> None:
        self.tokenizer = CharTokenizer(alphabet)
        self.prompts = _read_jsonl(Path(path), prompt_key, answer_key, self.tokenizer)

    def __len__(self) -> int:
        return len(self.prompts)

    def sample_prompts(self, n: int, generator: torch.Generator | None = None) -> list[Prompt]:
        passes = -(-n // len(self.prompts))
        order = torch.cat([torch.randperm(len(self.prompts), generator=generator) for _ in range(passes)])
        return [self.prompts[i] for i in order[:n].tolist()]

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        return float(self.tokenizer.decode(response_ids).strip() == prompt.answer.strip())


def _read_jsonl(path: Path, prompt_key: str, answer_key: str, tokenizer: CharTokenizer) -> list[Prompt]:
    if not path.is_file():
        raise ValueError(f"jsonl task: file {path} not found")
    prompts = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text, answer = record[prompt_key], str(record[answer_key])
            prompts.append(Prompt(ids=tokenizer.encode(text, bos=True), answer=answer, text=text))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}:{line_no}: need a JSON object with string {prompt_key!r} and {answer_key!r} "
                             f"whose characters the tokenizer knows ({type(err).__name__}: {err})") from None
    if not prompts:
        raise ValueError(f"jsonl task: {path} holds no prompts")
    return prompts


@dataclass(frozen=True)
class DataSettings:
    """The recipe's `data:` section: a built-in task or prompt files, and how many prompts per step.

    With `train_files` the run reads a prompt dataset (verl's keys: datasets.py); otherwise it runs
    the built-in `task` ("digit_sum" when unset) built with `task_args`.
    """

    task: str | None = None  # a built-in task (digit_sum, copy, reverse, jsonl); None: digit_sum unless train_files
    task_args: dict = field(default_factory=dict)  # the built-in task's arguments (digit_sum: {digits: 2})
    prompts_per_step: int = 32  # global, over all data-parallel ranks
    train_files: list[str] = field(default_factory=list)  # parquet / JSONL, read in this order
    val_files: list[str] = field(default_factory=list)  # validation prompts, the training schema and keys
    prompt_key: str = "prompt"  # dotted keys reach nested fields
    answer_key: str = "reward_model.ground_truth"  # the (dotted) key of a row's ground truth, given to the reward
    max_prompt_length: int | None = None  # tokens after the chat template; None: no limit
    on_long_prompt: OnLongPrompt = "drop"  # a prompt over max_prompt_length: drop (skip it, counted) or error (stop)
    skip_bad_rows: bool = False  # skip rows with a missing key or a malformed prompt (counted); false: stop the run
    shuffle: bool = True  # a new row order each epoch, drawn from trainer.seed; false: the files' order
    tokenizer: str | None = None  # a tokenizer directory; default: the model's Hugging Face checkpoint
    # a built-in reward or "package.module:function"; or {data_source: reward}: each row scored by its data_source's
    reward: str | dict[str, str] = "dapo_math"

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        check_choice("on_long_prompt", self.on_long_prompt, OnLongPrompt)
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 (or null for no limit), got {self.max_prompt_length}")
        check_reward_spec(self.reward)  # a misspelled built-in fails at load; get_reward_fn imports at launch
        for name in ("prompt_key", "answer_key"):
            if not all(getattr(self, name).split(".")):
                raise ValueError(f"{name} must be a key or a dotted path of keys like 'reward_model.ground_truth', "
                                 f"got {getattr(self, name)!r}")
        if not self.train_files:
            if self.val_files:
                raise ValueError("val_files are read like train_files (the same keys, tokenizer and reward): set "
                                 "train_files too; a built-in task has no validation files")
            if self.tokenizer is not None:
                raise ValueError(f"tokenizer={self.tokenizer!r} is only read with train_files; set train_files "
                                 "or remove tokenizer")
            return
        if self.task is not None:
            raise ValueError(f"set either task ({self.task!r}, a built-in task) or train_files (a prompt dataset), "
                             "not both")
        if self.task_args:
            raise ValueError(f"task_args ({', '.join(self.task_args)}) configure a built-in task; with train_files "
                             "use the dataset keys (prompt_key, answer_key, max_prompt_length, ...) instead")
        for name in ("train_files", "val_files"):
            for i, path in enumerate(getattr(self, name)):
                try:
                    check_data_file(path)
                except ValueError as err:
                    raise ValueError(f"{name}[{i}]: {err}") from None


TASKS: dict[str, type] = {
    "digit_sum": DigitSumTask,
    "copy": CopyTask,
    "reverse": ReverseTask,
    "jsonl": JsonlPromptDataset,
}


def get_task(name: str, **kwargs) -> Task:
    """The registered task `name`, built with `kwargs` (a recipe's data.task_args)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}{did_you_mean(name, list(TASKS))}; available: {', '.join(TASKS)}")
    params = inspect.signature(TASKS[name]).parameters
    for key in kwargs:
        if key not in params:
            raise ValueError(f"task {name!r} has no argument {key!r}{did_you_mean(key, list(params))}; "
                             f"allowed: {', '.join(params)}")
    required = [p for p, spec in params.items() if spec.default is inspect.Parameter.empty and p not in kwargs]
    if required:
        raise ValueError(f"task {name!r} needs {', '.join(required)} (set data.task_args)")
    return TASKS[name](**kwargs)


def build_task(data: DataSettings, *, tokenizer_dir: str | None, seed: int) -> Task:
    """The task of a recipe's `data:` section: a PromptDataset with train_files, else a built-in task.

    `tokenizer_dir` is the model's Hugging Face checkpoint directory: a dataset's tokenizer unless
    data.tokenizer names another. `seed` fixes a dataset's epoch orders.
    """
    if not data.train_files:
        return get_task(data.task or "digit_sum", **data.task_args)
    path = data.tokenizer or tokenizer_dir
    if path is None:
        raise ValueError("data.train_files needs a tokenizer: set data.tokenizer or model.hf_checkpoint")
    from .hf_tokenizer import HFTokenizer
    from .rewards import get_reward_fn

    reward_fn = get_reward_fn(data.reward)  # before reading the files: a typo fails fast
    return PromptDataset(data.train_files, tokenizer=HFTokenizer(path), reward_fn=reward_fn,
                         prompt_key=data.prompt_key, answer_key=data.answer_key,
                         max_prompt_length=data.max_prompt_length, on_long_prompt=data.on_long_prompt,
                         skip_bad_rows=data.skip_bad_rows, shuffle=data.shuffle, seed=seed)
