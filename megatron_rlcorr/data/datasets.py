"""Prompt datasets in verl's RL schema: parquet or JSONL files, read lazily, in a reproducible order.

A row is a JSON-like object; dotted keys reach nested fields. verl's schema (DAPO-Math-17k):
    {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "..."}], "ability": "MATH",
     "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"}, "extra_info": {...}}
with `prompt_key="prompt"` (a list of chat messages, or a plain string) and
`answer_key="reward_model.ground_truth"`. A prompt becomes `Prompt(ids, answer, text, extra)`:
ids from the tokenizer's `encode_prompt`, the ground truth as stored (a str or a JSON number), and
the whole row as `extra`, which the reward function receives.

Position and order. Epoch e visits the rows in the order of torch.randperm(num_rows) drawn from a
generator seeded by (seed, e) (file order with shuffle=False). One int, `position = epoch *
num_rows + index_in_epoch`, counts the raw rows visited, valid or not. `take(position, count)` is
a pure function of its arguments: every data-parallel rank calls it with the same ones and agrees
on the prompts and the next position, and a resumed run that kept the position in its checkpoint
continues with exactly the prompts it would have seen. `in_file_order()` reads every row once in
the files' order instead (a validation set).

Rows that are not used. A "bad row" (its prompt or answer key missing, a prompt that is neither a
string nor a list of {role, content} messages, a JSONL line that is not a JSON object) stops the
run with a message naming the file, the row and the fix, unless skip_bad_rows=True; a prompt
longer than max_prompt_length tokens is dropped (or stops the run with on_long_prompt="error").
Whatever is skipped is counted in the result of `take` / `draw`. Messages name rows as
"<file> row N" (parquet, 1-based within the file) or "<file> line N" (JSONL, the file's 1-based
line number; blank lines are not rows).

Memory. No Python object is built per row up front; a row becomes Python only when it is used.
- parquet: the file is streamed in record batches of `read_batch_rows` rows into a pyarrow Table
  that stays in memory: about the uncompressed size of its columns (a file whose rows repeat is
  small on disk, not in memory; deduplicate it first).
- JSONL: one streaming pass records each line's byte offset and line number (16 bytes a row);
  a row is read from disk and parsed when it is used.
- the order of the last two epochs used: 8 bytes a row each.
pyarrow is imported only when a parquet file is read.
"""
from __future__ import annotations

import hashlib
import json
from array import array
from collections import Counter
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from ..settings import check_choice
from .hf_tokenizer import prompt_problem
from .prompt import OnLongPrompt, Prompt

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".json")
READ_BATCH_ROWS = 4096
_CACHED_EPOCHS = 2  # a take() crosses at most one epoch boundary at a time


class PromptTokenizer(Protocol):
    def encode_prompt(self, prompt: Any) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Taken:
    """`count` valid prompts from `take(position, count)`, and what was passed over to get them."""

    prompts: list[Prompt]
    next_position: int  # where the next take() starts
    dropped_long: int   # rows dropped for a prompt longer than max_prompt_length
    skipped_bad: int    # bad rows skipped (skip_bad_rows=True)


@dataclass(frozen=True)
class Drawn:
    """`n` valid prompts drawn at random by `draw(n, generator)`, and the draws passed over."""

    prompts: list[Prompt]
    dropped_long: int
    skipped_bad: int


def check_data_file(path: str | Path) -> None:
    """ValueError unless the file name has a supported extension (the file itself is not touched)."""
    suffix = Path(path).suffix.lower()
    if suffix not in PARQUET_SUFFIXES + JSONL_SUFFIXES:
        raise ValueError(f"data file {path}: unsupported extension {suffix or '(none)'!r}; use parquet (.parquet) "
                         "or JSON lines (.jsonl / .json, one JSON object per line)")


def data_source_counts(path: str | Path) -> Counter:
    """How many rows of a prompt file hold each `data_source` value (None: rows without one).
    Reads only that column of a parquet file; a JSONL file line by line (lines that are not JSON
    objects are the dataset's bad rows, reported where it reads them, and are not counted here)."""
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        file = pq.ParquetFile(path)
        if "data_source" not in file.schema_arrow.names:
            return Counter({None: file.metadata.num_rows})
        return Counter(file.read(columns=["data_source"]).column("data_source").to_pylist())
    counts: Counter = Counter()
    with path.open() as lines:
        for line in lines:
            try:
                row = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if isinstance(row, dict):
                counts[row.get("data_source")] += 1
    return counts


# ---- files ---------------------------------------------------------------------------------------


class _ParquetRows:
    """A parquet file's rows as a pyarrow Table, streamed in record batches; rows to Python on use."""

    def __init__(self, path: Path, batch_rows: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = path
        try:
            reader = pq.ParquetFile(path)
            try:
                batches = list(reader.iter_batches(batch_size=batch_rows))
                self.table = pa.Table.from_batches(batches, schema=reader.schema_arrow)
            finally:
                reader.close()
        except (OSError, pa.ArrowException) as err:
            raise ValueError(f"cannot read parquet file {path} ({type(err).__name__}: {err}); check that it is a "
                             "complete parquet file") from None

    def __len__(self) -> int:
        return self.table.num_rows

    def where(self, index: int) -> str:
        return f"{self.path} row {index + 1}"

    def row(self, index: int) -> Any:
        return self.table.slice(index, 1).to_pylist()[0]


class _JsonlRows:
    """A JSONL file's line offsets (one streaming pass); a line is read and parsed on use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offsets, self.line_numbers = array("q"), array("q")
        offset = 0
        try:
            with open(path, "rb") as file:
                for line_number, line in enumerate(file, start=1):
                    if line.strip():
                        self.offsets.append(offset)
                        self.line_numbers.append(line_number)
                    offset += len(line)
        except OSError as err:
            raise ValueError(f"cannot read JSONL file {path} ({type(err).__name__}: {err})") from None

    def __len__(self) -> int:
        return len(self.offsets)

    def where(self, index: int) -> str:
        return f"{self.path} line {self.line_numbers[index]}"

    def row(self, index: int) -> Any:
        """The parsed line; ValueError (a JSONDecodeError or UnicodeDecodeError) when it is not JSON."""
        with open(self.path, "rb") as file:
            file.seek(self.offsets[index])
            return json.loads(file.readline())


def _open(path: Path, batch_rows: int, files_key: str) -> _ParquetRows | _JsonlRows:
    check_data_file(path)
    if not path.is_file():
        raise ValueError(f"data file {path} not found ({files_key} entries are paths relative to the "
                         "directory the run starts in, or absolute)")
    rows = _ParquetRows(path, batch_rows) if path.suffix.lower() in PARQUET_SUFFIXES else _JsonlRows(path)
    if not len(rows):
        raise ValueError(f"data file {path} holds no rows; remove it from {files_key}")
    return rows


# ---- rows -> prompts -----------------------------------------------------------------------------


class _MissingKey(Exception):
    pass


def _lookup(row: Mapping[str, Any], dotted_key: str) -> Any:
    """row["a"]["b"] for "a.b"; _MissingKey saying where the path stops (a null value counts as missing)."""
    value: Any = row
    reached: list[str] = []
    for part in dotted_key.split("."):
        name = repr(".".join(reached)) if reached else "the row"
        if not isinstance(value, Mapping):
            raise _MissingKey(f"{name} is a {type(value).__name__}, not a mapping with key {part!r}")
        if value.get(part) is None:
            state = "is null" if part in value else "is missing"
            raise _MissingKey(f"key {part!r} of {name} {state} (its keys: {', '.join(map(str, value)) or 'none'})")
        value = value[part]
        reached.append(part)
    return value


def _text_of(prompt: str | Sequence[Mapping[str, str]]) -> str:
    """The prompt for logs: itself, or the content of the last user message (else of the last message)."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m["role"] == "user"]
    return (users or list(prompt))[-1]["content"]


@dataclass
class _Tally:
    dropped_long: int = 0
    skipped_bad: int = 0
    shortest_long: int | None = None  # tokens of the shortest prompt dropped as too long

    def long(self, length: int) -> None:
        self.dropped_long += 1
        self.shortest_long = length if self.shortest_long is None else min(self.shortest_long, length)


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for (seed, epoch); any ints, negative ones included, map to distinct streams."""
    digest = hashlib.blake2b(f"{seed}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# ---- the dataset ---------------------------------------------------------------------------------


class PromptDataset:
    """Prompts from parquet / JSONL files in verl's schema; `take` walks them epoch by epoch, `draw` at random."""

    def __init__(self, files: Sequence[str | Path] | str | Path, *, tokenizer: PromptTokenizer,
                 reward_fn: Callable[[str, Any, dict], float], prompt_key: str = "prompt",
                 answer_key: str = "reward_model.ground_truth", max_prompt_length: int | None = None,
                 on_long_prompt: OnLongPrompt = "drop", skip_bad_rows: bool = False, shuffle: bool = True,
                 seed: int = 0, read_batch_rows: int = READ_BATCH_ROWS, files_key: str = "data.train_files") -> None:
        check_choice("on_long_prompt", on_long_prompt, OnLongPrompt)
        for name, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
            if not isinstance(key, str) or not all(key.split(".")):
                raise ValueError(f"{name} must be a key or a dotted path of keys like 'reward_model.ground_truth', "
                                 f"got {key!r}")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 (or None for no limit), got {max_prompt_length}")
        if read_batch_rows < 1:
            raise ValueError(f"read_batch_rows must be >= 1, got {read_batch_rows}")
        paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
        if not paths:
            raise ValueError(f"a prompt dataset needs at least one file ({files_key} is empty)")
        self.tokenizer, self.reward_fn = tokenizer, reward_fn
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.max_prompt_length, self.on_long_prompt = max_prompt_length, on_long_prompt
        self.skip_bad_rows, self.shuffle, self.seed = skip_bad_rows, shuffle, seed
        self.files = paths
        self._sources = [_open(path, read_batch_rows, files_key) for path in paths]
        self._starts = [0]  # global index of each file's first row
        for source in self._sources:
            self._starts.append(self._starts[-1] + len(source))
        self._orders: dict[int, torch.Tensor] = {}
        # Fail before the first rollout on what is wrong with every row (a misspelled key, a missing
        # chat template): load each file's first row now.
        for start in self._starts[:-1]:
            self._load(start)

    @property
    def num_rows(self) -> int:
        return self._starts[-1]

    def __len__(self) -> int:
        return self.num_rows

    def epoch(self, position: int) -> int:
        return position // self.num_rows

    # ---- walking the epochs ----------------------------------------------------------------------

    def take(self, position: int, count: int) -> Taken:
        """The next `count` valid prompts from `position` on (across epochs), and the position after them."""
        if position < 0 or count < 0:
            raise ValueError(f"take(position={position}, count={count}): both must be >= 0")
        prompts: list[Prompt] = []
        tally, epoch_tally = _Tally(), _Tally()
        invalid_since = position  # first position of the current run of unusable rows
        while len(prompts) < count:
            if position % self.num_rows == 0:
                epoch_tally = _Tally()
            prompt = self._load(self._row_at(position), tally, epoch_tally)
            position += 1
            if prompt is not None:
                prompts.append(prompt)
                invalid_since = position
            elif position % self.num_rows == 0 and position - self.num_rows >= invalid_since:
                raise self._no_usable_prompt(epoch_tally)  # a whole epoch, so every row, is unusable
        return Taken(prompts, position, tally.dropped_long, tally.skipped_bad)

    def _row_at(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_rows)
        return int(self._order(epoch)[offset]) if self.shuffle else offset

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if len(self._orders) == _CACHED_EPOCHS:
                del self._orders[next(iter(self._orders))]
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._orders[epoch] = torch.randperm(self.num_rows, generator=generator)
        return self._orders[epoch]

    def in_file_order(self) -> Taken:
        """Every usable row once, in the files' order and each file's row order whatever `shuffle`
        says (a validation set); rows skipped as too long or bad are counted, as by `take`."""
        prompts: list[Prompt] = []
        tally = _Tally()
        for index in range(self.num_rows):
            prompt = self._load(index, tally)
            if prompt is not None:
                prompts.append(prompt)
        if not prompts:
            raise self._no_usable_prompt(tally)
        return Taken(prompts, self.num_rows, tally.dropped_long, tally.skipped_bad)

    # ---- random draws ----------------------------------------------------------------------------

    def draw(self, n: int, generator: torch.Generator | None = None) -> Drawn:
        """`n` valid prompts drawn uniformly with replacement using `generator`; unusable draws are redrawn."""
        prompts: list[Prompt] = []
        tally, distinct = _Tally(), _Tally()  # every unusable draw / every unusable row once
        unusable: set[int] = set()
        while len(prompts) < n:
            for index in torch.randint(0, self.num_rows, (n - len(prompts),), generator=generator).tolist():
                prompt = self._load(index, tally, *([] if index in unusable else [distinct]))
                if prompt is None:
                    unusable.add(index)
                else:
                    prompts.append(prompt)
            if len(unusable) == self.num_rows:
                raise self._no_usable_prompt(distinct)
        return Drawn(prompts, tally.dropped_long, tally.skipped_bad)

    def sample_prompts(self, n: int, generator: torch.Generator | None = None) -> list[Prompt]:
        """The `Task` interface: `draw(n, generator).prompts`."""
        return self.draw(n, generator).prompts

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float | Mapping[str, float]:
        """The reward function's result on the decoded response: a float, or a mapping with "score"
        (and optionally "acc"), which is passed on as it is."""
        result = self.reward_fn(self.tokenizer.decode(response_ids), prompt.answer, prompt.extra)
        return result if isinstance(result, Mapping) else float(result)

    # ---- one row ---------------------------------------------------------------------------------

    def _load(self, index: int, *tallies: _Tally) -> Prompt | None:
        """The prompt of global row `index`, or None (counted in each tally) when the row is skipped."""
        file_index = bisect_right(self._starts, index) - 1
        source, local = self._sources[file_index], index - self._starts[file_index]
        where = source.where(local)
        try:
            row = source.row(local)
        except ValueError as err:  # a JSONL line that is not JSON
            return self._bad(tallies, f"{where} is not valid JSON ({err}); JSON lines files hold one JSON "
                                      "object per line (not one array or a pretty-printed object)")
        if not isinstance(row, dict):
            return self._bad(tallies, f"{where} is a JSON {type(row).__name__}, not an object with the prompt "
                                      "and answer")
        try:
            prompt = _lookup(row, self.prompt_key)
        except _MissingKey as err:
            return self._bad(tallies, f"{where} has no prompt at {self.prompt_key!r}: {err}; set "
                                      "data.prompt_key to the (dotted) key that holds the prompt")
        try:
            answer = _lookup(row, self.answer_key)
        except _MissingKey as err:
            return self._bad(tallies, f"{where} has no answer at {self.answer_key!r}: {err}; set "
                                      "data.answer_key to the (dotted) key that holds the ground truth")
        problem = prompt_problem(prompt)
        if problem is not None:
            return self._bad(tallies, f"{where}: {self.prompt_key!r}: {problem}; set data.prompt_key to the key "
                                      "that holds the prompt")
        try:
            ids = self.tokenizer.encode_prompt(prompt)
        except ValueError as err:  # not the row's fault (e.g. no chat template): every row would fail
            raise ValueError(f"{where}: {err}") from None
        if not ids:
            return self._bad(tallies, f"{where}: the prompt encodes to no tokens")
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            if self.on_long_prompt == "error":
                raise ValueError(f"{where}: the prompt is {len(ids)} tokens, longer than data.max_prompt_length="
                                 f"{self.max_prompt_length}; raise data.max_prompt_length, or set "
                                 "data.on_long_prompt: drop to skip such prompts (they are counted)")
            for tally in tallies:
                tally.long(len(ids))
            return None
        return Prompt(ids=ids, answer=answer, text=_text_of(prompt), extra=row)

    def _bad(self, tallies: tuple[_Tally, ...], message: str) -> None:
        if not self.skip_bad_rows:
            raise ValueError(f"{message}; or set data.skip_bad_rows: true to skip such rows (they are counted)")
        for tally in tallies:
            tally.skipped_bad += 1

    def _no_usable_prompt(self, tally: _Tally) -> ValueError:
        """The error for a dataset none of whose rows is usable; `tally` counts each row once."""
        files = ", ".join(map(str, self.files))
        reasons = []
        if tally.dropped_long:
            reasons.append(f"{tally.dropped_long} prompts longer than data.max_prompt_length={self.max_prompt_length} "
                           f"(the shortest has {tally.shortest_long} tokens: raise the limit to at least that)")
        if tally.skipped_bad:
            reasons.append(f"{tally.skipped_bad} bad rows skipped (data.skip_bad_rows: true; set it to false to "
                           "see the first one's error)")
        return ValueError(f"none of the {self.num_rows} rows of {files} holds a usable prompt: {'; '.join(reasons)}")

    def __repr__(self) -> str:
        return (f"PromptDataset({len(self.files)} files, {self.num_rows} rows, prompt_key={self.prompt_key!r}, "
                f"answer_key={self.answer_key!r})")
