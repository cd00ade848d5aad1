"""A character-level tokenizer with a small fixed vocabulary, for the built-in tasks and tiny models.

Ids: PAD = 0, BOS = 1, EOS = 2, then one id per alphabet character in alphabet order. The
default alphabet (digits, lowercase letters, a few symbols; 45 tokens) serves JSONL datasets; the
built-in tasks use the 15-token ARITHMETIC_ALPHABET. A model needs vocab_size >=
tokenizer.vocab_size; ids beyond it (padded vocab rows) decode as U+FFFD.
"""
from __future__ import annotations

from typing import Sequence

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-=:, "
# The built-in tasks only need digits, "+" and "=": a 15-token vocabulary, so that a random model
# already hits the right token with probability ~1/15 and RL has signal from the first step.
ARITHMETIC_ALPHABET = "0123456789+="
_SPECIALS = 3
UNKNOWN_CHAR = "\ufffd"


class CharTokenizer:
    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self._ids = {ch: _SPECIALS + i for i, ch in enumerate(alphabet)}

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids a response stops on (one here; HFTokenizer may have several)."""
        return (EOS_ID,)

    @property
    def vocab_size(self) -> int:
        return _SPECIALS + len(self.alphabet)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        unknown = sorted({ch for ch in text if ch not in self._ids})
        if unknown:
            raise ValueError(f"characters {unknown} of {text!r} are not in the tokenizer alphabet {self.alphabet!r}")
        ids = [self._ids[ch] for ch in text]
        return [BOS_ID] * bos + ids + [EOS_ID] * eos

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        """Text of `ids`: PAD and BOS dropped, everything from the first EOS on dropped (by default), and
        ids outside the vocabulary (a model's padded vocab rows) shown as U+FFFD so they never match."""
        chars = []
        for token in ids:
            if token == EOS_ID:
                if stop_at_eos:
                    break
            elif _SPECIALS <= token < self.vocab_size:
                chars.append(self.alphabet[token - _SPECIALS])
            elif token not in (PAD_ID, BOS_ID):
                chars.append(UNKNOWN_CHAR)
        return "".join(chars)
