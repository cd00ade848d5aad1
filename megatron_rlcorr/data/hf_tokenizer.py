"""A Hugging Face tokenizer read from a local directory, with the ids and prompt encoding RL needs.

`HFTokenizer` wraps `transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)`:
the hub is never contacted, so a run reads exactly the tokenizer files it was pointed at (a
model's checkpoint directory, or a tokenizer directory of its own).

What it adds to the transformers object:
- End of sequence: `eos_ids` merges the tokenizer's eos_token_id with generation_config.json's
  `eos_token_id` (an int or a list), as generation in transformers and vLLM does. Chat models
  stop on more than one token (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>); a response that
  ends on any of them has ended. `pad_id` falls back to generation_config.json, then to eos_id.
- Prompts: a list of chat messages goes through the chat template with the generation prompt
  appended (what verl does for the RL prompt datasets); a plain string is encoded as text, with
  whatever special tokens the tokenizer adds itself (a BOS for Llama-style tokenizers).
- `decode` reads a response up to its first EOS, special tokens skipped. Ids the tokenizer does
  not know (a model's padded vocabulary rows, which a random policy can sample) decode as U+FFFD,
  so they never match an answer; transformers would silently drop them.

transformers is imported inside the constructor: `import megatron_rlcorr.data` stays cheap.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..model.hf import side_files

# At least one of these marks a directory as holding a tokenizer.
REQUIRED_ANY: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json")
UNKNOWN_TEXT = "\ufffd"
MESSAGES_SHAPE = ('a non-empty list of chat messages, each a mapping with string "role" and "content", '
                  'e.g. [{"role": "user", "content": "What is 2+3?"}]')


def prompt_problem(prompt: Any) -> str | None:
    """What is wrong with `prompt` as a prompt (a str, or a list of chat messages); None when nothing is."""
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, (list, tuple)):
        return f"a prompt is a string or {MESSAGES_SHAPE}; got a {type(prompt).__name__}"
    if not prompt:
        return f"the prompt is an empty list; a prompt is a string or {MESSAGES_SHAPE}"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"message {i} is a {type(message).__name__}; expected {MESSAGES_SHAPE}"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return (f"message {i} has {key}={message.get(key)!r} (keys: {', '.join(map(str, message))}); "
                        f"expected {MESSAGES_SHAPE}")
    return None


def _ids_of(encoded: Any) -> list[int]:
    """A flat list of ints from what apply_chat_template returns (a list, or a dict / BatchEncoding)."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):  # a batch of one conversation
        assert len(encoded) == 1, f"one conversation encoded as {len(encoded)}"
        encoded = encoded[0]
    return [int(i) for i in encoded]


def _token_ids(value: Any, source: str) -> list[int]:
    """generation_config.json's eos/pad entry (an int, a list of ints, or null) as a list."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{source} must be a token id or a list of token ids, got {value!r}")
    return values


def _read_generation_config(path: Path) -> dict:
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {file}: {err}; fix or remove the file") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    return config


class HFTokenizer:
    """The tokenizer in the local directory `path` (AutoTokenizer), with RL's eos/pad ids and prompt encoding."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"tokenizer directory {self.path} does not exist (or is not a directory); expected a "
                             f"directory holding {' and/or '.join(REQUIRED_ANY)}")
        if not any((self.path / name).is_file() for name in REQUIRED_ANY):
            present = sorted(p.name for p in self.path.iterdir())[:10]
            raise ValueError(f"{self.path} holds no tokenizer: expected {' and/or '.join(REQUIRED_ANY)} "
                             f"(found: {', '.join(present) or 'nothing'})")
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as err:  # transformers raises many kinds for a broken directory
            raise ValueError(f"cannot load the tokenizer in {self.path} ({type(err).__name__}: {err})") from None
        generation = _read_generation_config(self.path)
        gen_file = self.path / "generation_config.json"
        own_eos = [] if self._tokenizer.eos_token_id is None else [self._tokenizer.eos_token_id]
        merged = own_eos + _token_ids(generation.get("eos_token_id"), f"{gen_file}: eos_token_id")
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(merged))
        if not self.eos_ids:
            raise ValueError(f"the tokenizer in {self.path} has no end-of-sequence token (no eos_token in its "
                             "tokenizer_config.json, no eos_token_id in generation_config.json); a model needs one "
                             "to stop: set eos_token in tokenizer_config.json")
        gen_pad = _token_ids(generation.get("pad_token_id"), f"{gen_file}: pad_token_id")
        pad = self._tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else gen_pad[0] if gen_pad else self.eos_ids[0]
        self.bos_id: int | None = self._tokenizer.bos_token_id
        self.vocab_size: int = len(self._tokenizer)

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    def has_chat_template(self) -> bool:
        return self._tokenizer.chat_template is not None

    def encode_prompt(self, prompt: str | Sequence[dict]) -> list[int]:
        """Ids of a prompt: messages through the chat template (generation prompt added), a str as text."""
        problem = prompt_problem(prompt)
        if problem is not None:
            raise ValueError(problem)
        if isinstance(prompt, str):
            return list(self._tokenizer(prompt)["input_ids"])
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer in {self.path} has no chat template, so it cannot encode a prompt given "
                             "as chat messages; give prompts as plain strings, or use a tokenizer with a chat template "
                             "(chat_template.jinja, or chat_template in tokenizer_config.json)")
        encoded = self._tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
        return _ids_of(encoded)

    def chat_ids(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                 add_generation_prompt: bool) -> list[int]:
        """Ids of a whole conversation through the chat template, with the tool schemas passed as the
        template's `tools=` (multi-turn rollouts, rollout/tools/loop.py)."""
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer in {self.path} has no chat template, and multi-turn rollouts render "
                             "every turn through one: use a tokenizer with a chat template")
        encoded = self._tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                      add_generation_prompt=add_generation_prompt, tokenize=True,
                                                      return_dict=False)
        return _ids_of(encoded)

    def decode(self, response_ids: Sequence[int]) -> str:
        """Text of a response up to (not including) its first EOS; special tokens skipped, unknown ids as U+FFFD."""
        ids = [int(i) for i in response_ids]
        end = next((i for i, token in enumerate(ids) if token in self.eos_ids), len(ids))
        texts, known = [], []
        for token in ids[:end]:
            if 0 <= token < self.vocab_size:
                known.append(token)
            else:
                texts += [self._tokenizer.decode(known, skip_special_tokens=True), UNKNOWN_TEXT]
                known = []
        texts.append(self._tokenizer.decode(known, skip_special_tokens=True))
        return "".join(texts)

    def files(self) -> list[Path]:
        """The tokenizer files in the directory that an exported checkpoint should carry (those of
        model.hf.SIDE_FILES present: the tokenizer's and generation_config.json)."""
        return side_files(self.path)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids})"
