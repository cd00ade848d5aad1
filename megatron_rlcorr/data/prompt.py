"""What every task and dataset hands the trainer: a `Prompt`, the `Task` interface, the `Tokenizer` it reads.

Kept apart from tasks.py (the built-in tasks and the `data:` settings) and datasets.py (prompt
files) so that both import it and neither imports the other's module at load time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Protocol, Sequence, runtime_checkable

import torch

OnLongPrompt = Literal["drop", "error"]  # a prompt longer than max_prompt_length: skip it (counted), or stop


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # token ids fed to the engine (BOS first for the built-in tasks)
    answer: Any     # the ground truth the reward checks against (a str, or a dataset's JSON number)
    text: str = ""  # the prompt as text, for logs (a chat prompt: its last user message)
    extra: Mapping[str, Any] = field(default_factory=dict)  # a dataset's whole row, passed to its reward


class Tokenizer(Protocol):
    """What the trainer and engines read of a task's tokenizer (CharTokenizer and HFTokenizer have it)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def eos_ids(self) -> tuple[int, ...]: ...

    @property
    def pad_id(self) -> int: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class Task(Protocol):
    tokenizer: Tokenizer

    def sample_prompts(self, n: int, generator: torch.Generator | None = None) -> list[Prompt]:
        ...

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float | Mapping[str, float]:
        """The response's score, or a mapping with "score" and optionally "acc" (right or not)."""
        ...
