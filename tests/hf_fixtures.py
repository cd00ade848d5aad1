"""Test helpers: a small local Hugging Face tokenizer, and prompt files in parquet and JSONL.

`make_tokenizer(directory)` trains a byte-level BPE (the `tokenizers` library, 320 ids) on a few
sentences of arithmetic and chat text, wraps it in transformers' PreTrainedTokenizerFast with
Qwen-style special tokens and chat template, and saves it with save_pretrained: a directory that
`AutoTokenizer.from_pretrained(directory, local_files_only=True)` loads, built in milliseconds and
without network. Its ids: the special tokens first, in SPECIAL_TOKENS order ("<|endoftext|>" = 0,
"<|im_start|>" = 1, "<|im_end|>" = 2), then the 256 byte symbols, then merges. Byte-level BPE
round-trips any text exactly.

transformers, tokenizers and pyarrow are imported inside the helpers, so importing this module is
free; a test file pays for transformers once, when it first builds a tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRAINING_TEXT = (
    "What is 2+3? Answer: 5",
    "Compute 12 * 7 and give the final answer. Answer: 84",
    "Solve the following math problem step by step.",
    "The last line of your response should be of the form Answer: $Answer",
    "user assistant system",
    "You are a helpful assistant. Let's think step by step.",
)
VOCAB_SIZE = 320


def _train_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return tokenizer


def make_tokenizer(directory: str | Path, *, chat_template: bool | str = True, eos_token: str | None = ENDOFTEXT,
                   pad_token: str | None = None, bos_token: str | None = None, add_bos: bool = False,
                   eos_in_generation_config: int | str | Sequence[int | str] | None = None,
                   generation_config: Mapping[str, Any] | None = None) -> Path:
    """Save a small tokenizer into `directory` (created if needed) and return the directory.

    chat_template: True for CHAT_TEMPLATE (Qwen style), a str for another template, False for none.
    eos_token / pad_token / bos_token: the tokenizer's own special tokens (None: unset).
    add_bos: plain-text encoding prepends bos_token (a post-processor, as Llama's tokenizers have);
    chat-template encoding does not (the template writes its own special tokens).
    eos_in_generation_config: the `eos_token_id` written to generation_config.json, as given (an int
    or a list); tokens given as strings are written as their ids. None writes no eos_token_id.
    generation_config: further generation_config.json entries (e.g. {"pad_token_id": 1}).
    generation_config.json is written only when one of the two is given.
    """
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bpe = _train_bpe()
    if add_bos:
        assert bos_token is not None, "add_bos needs a bos_token"
        bpe.post_processor = processors.TemplateProcessing(single=f"{bos_token} $A", pair=f"{bos_token} $A $B",
                                                          special_tokens=[(bos_token, bpe.token_to_id(bos_token))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos_token, pad_token=pad_token,
                                        bos_token=bos_token)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE if chat_template is True else chat_template
    tokenizer.save_pretrained(str(directory))
    config = dict(generation_config or {})
    if eos_in_generation_config is not None:
        def as_id(token: int | str) -> int:
            return tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else token

        eos = eos_in_generation_config
        config["eos_token_id"] = [as_id(t) for t in eos] if isinstance(eos, (list, tuple)) else as_id(eos)
    if config:
        (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def write_jsonl(path: str | Path, rows: Iterable[Any]) -> Path:
    """One JSON value per line; a str row is written verbatim (a broken or blank line for error tests)."""
    path = Path(path)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def write_parquet(path: str | Path, rows: Sequence[Mapping[str, Any]], *, row_group_size: int | None = None) -> Path:
    """The rows (dicts; nested dicts and lists become Arrow structs and lists) as a parquet file.

    A small row_group_size makes a file of several row groups, so a reader streams it in pieces.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    pq.write_table(pa.Table.from_pylist(list(rows)), path, row_group_size=row_group_size)
    return path


def dapo_row(question: str, answer: Any, index: int = 0, **extra_info: Any) -> dict:
    """A row in verl's schema as DAPO-Math-17k has it: chat prompt, reward_model.ground_truth, extra_info."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": question}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": str(index), **extra_info},
    }
