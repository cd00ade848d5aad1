"""Hugging Face checkpoints: tensor names, sliced reads, streamed writes.

config.json <-> the architecture is hf_config.py's (the families, what is refused); this module
maps the tensors, so it comes after weights.py (the neutral names and shapes, the Megatron
layouts): architecture.py -> hf_config.py -> presets.py -> config.py -> weights.py -> hf.py.

Names: a Hugging Face name is the neutral name (weights.py) with the family's prefixes
(`model.layers.{i}.self_attn.q_proj.weight` <-> `layers.{i}.q.weight`); `HF_TO_NEUTRAL` is the
whole map (`{i}` a layer, `{e}` a routed expert). MoE layers (qwen3_moe, qwen2_moe): the router
`mlp.gate.weight` <-> `router.weight`, expert e's `mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`
<-> `experts.{e}.gate|up|down.weight`, Qwen2-MoE's shared expert `mlp.shared_expert.*_proj.weight`
<-> `shared.gate|up|down.weight` and its gate `mlp.shared_expert_gate.weight` <-> `shared_gate.weight`.
Tied checkpoints carry no `lm_head.weight` (one there is ignored).

Reading (`HFCheckpoint`): safetensors files (one `model.safetensors`, or the shards named by
`model.safetensors.index.json`) are opened with `safetensors.safe_open`, which maps the file and
returns just the requested slice of a tensor, so a rank reads only the rows/columns of its
tensor-parallel shard of the tensors its pipeline chunks hold, and of the routed experts only its
expert-parallel rank's experts (their expert-tensor-parallel slice). `bytes_read` counts them.

Writing (`export_hf`, `ShardedWriter`): safetensors' own writer needs every tensor of a file in
memory at once, so this module writes the same format itself: the shard plan (names, dtypes,
shapes, offsets) is known from the architecture before any weight is gathered, each file's header
is written first, and each tensor is written at its offset as it arrives, in any order. Peak
extra memory is one tensor. Files are read back by safetensors and transformers in the tests.
"""
from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .hf_config import export_config, read_config, write_config
from .weights import iter_full_weights, neutral_weight_shapes, takes_part_in_export

# The tokenizer's files and the generation config: what travels with an exported checkpoint.
SIDE_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
    "generation_config.json",
)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "final_norm.weight",
                 "lm_head.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "q.weight", "self_attn.q_proj.bias": "q.bias",
    "self_attn.k_proj.weight": "k.weight", "self_attn.k_proj.bias": "k.bias",
    "self_attn.v_proj.weight": "v.weight", "self_attn.v_proj.bias": "v.bias",
    "self_attn.q_norm.weight": "q_norm.weight", "self_attn.k_norm.weight": "k_norm.weight",
    "self_attn.o_proj.weight": "o.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "gate.weight", "mlp.up_proj.weight": "up.weight", "mlp.down_proj.weight": "down.weight",
    "mlp.gate.weight": "router.weight",
    "mlp.experts.{e}.gate_proj.weight": "experts.{e}.gate.weight",
    "mlp.experts.{e}.up_proj.weight": "experts.{e}.up.weight",
    "mlp.experts.{e}.down_proj.weight": "experts.{e}.down.weight",
    "mlp.shared_expert.gate_proj.weight": "shared.gate.weight",
    "mlp.shared_expert.up_proj.weight": "shared.up.weight",
    "mlp.shared_expert.down_proj.weight": "shared.down.weight",
    "mlp.shared_expert_gate.weight": "shared_gate.weight",
}
HF_TO_NEUTRAL = {**_GLOBAL_NAMES, **{f"model.layers.{{i}}.{k}": f"layers.{{i}}.{v}" for k, v in _LAYER_NAMES.items()}}
_NEUTRAL_TO_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_NEUTRAL_TO_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_NEUTRAL_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(.+)")
_NEUTRAL_EXPERT = re.compile(r"experts\.(\d+)\.(.+)")
# Tensors some checkpoints carry that the model does not use.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# A qwen2_moe checkpoint with shared_expert_intermediate_size 0 has zero-width shared experts and
# their gates: they add nothing, and the model has no shared expert.
_ZERO_SHARED = re.compile(r"model\.layers\.\d+\.mlp\.shared_expert(\.\w+|_gate)\.weight")

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


# ---- names ---------------------------------------------------------------------------------------

def hf_name(neutral: str) -> str:
    """The Hugging Face name of a neutral weight name."""
    match = _NEUTRAL_LAYER.fullmatch(neutral)
    if not match:
        return _NEUTRAL_TO_GLOBAL[neutral]
    expert = _NEUTRAL_EXPERT.fullmatch(match[2])
    if expert:
        tail = _NEUTRAL_TO_LAYER["experts.{e}." + expert[2]].replace("{e}", expert[1])
    else:
        tail = _NEUTRAL_TO_LAYER[match[2]]
    return f"model.layers.{match[1]}.{tail}"


def neutral_name(hf: str) -> str | None:
    """The neutral name of a Hugging Face tensor name, or None when it has none."""
    match = _HF_LAYER.fullmatch(hf)
    if not match:
        return _GLOBAL_NAMES.get(hf)
    expert = _HF_EXPERT.fullmatch(match[2])
    if expert:
        tail = _LAYER_NAMES.get("mlp.experts.{e}." + expert[2])
        tail = tail and tail.replace("{e}", expert[1])
    else:
        tail = _LAYER_NAMES.get(match[2])
    return f"layers.{match[1]}.{tail}" if tail else None


# ---- reading -------------------------------------------------------------------------------------

class HFCheckpoint:
    """A Hugging Face checkpoint as a weight source: full neutral tensors read by slices.

    `read(name, dim, start, stop)` returns rows/columns [start, stop) along `dim` of the neutral
    tensor `name` in its stored dtype, reading only those bytes. `check(expected_shapes, tied)`
    compares the checkpoint's inventory (from the files' headers, no tensor data) with what the
    model expects and raises ValueError naming every missing, unexpected or misshapen tensor.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.config = read_config(self.directory)
        self._file_of = _tensor_files(self.directory)
        self._handles: dict[Path, Any] = {}
        self.bytes_read = 0
        config = self.config
        zero_shared = config.get("model_type") == "qwen2_moe" and not config.get("shared_expert_intermediate_size")
        self._ignored = [_IGNORED] + ([_ZERO_SHARED] if zero_shared else [])

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the Hugging Face tensors, from the files' headers."""
        return {name: tuple(self._open(path).get_slice(name).get_shape()) for name, path in self._file_of.items()}

    def check(self, expected: Mapping[str, tuple[int, ...]], tied: bool) -> None:
        found = self.shapes()
        wanted = {hf_name(n): s for n, s in expected.items() if not (tied and n == "lm_head.weight")}
        missing = [n for n in wanted if n not in found]
        unexpected = [n for n in found if n not in wanted and not any(p.fullmatch(n) for p in self._ignored)
                      and not (tied and n == "lm_head.weight")]
        misshapen = [f"{n} {found[n]} (the model needs {wanted[n]})" for n in wanted
                     if n in found and found[n] != wanted[n]]
        problems = [f"{label}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                    for label, names in (("missing", missing), ("unexpected", unexpected), ("shape", misshapen))
                    if names]
        if problems:
            raise ValueError(f"Hugging Face checkpoint {self.directory} does not fit the model "
                             f"({'; '.join(problems)}); check that config.json matches the weights")

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of neutral tensor `name`, from the file header."""
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        tensor_slice = self._slice(name)
        if start is None:
            tensor = tensor_slice[:]
        else:
            index = (slice(None),) * dim + (slice(start, stop),)
            tensor = tensor_slice[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _slice(self, name: str):
        hf = hf_name(name)
        if hf not in self._file_of:
            raise ValueError(f"Hugging Face checkpoint {self.directory} has no tensor {hf} ({name})")
        return self._open(self._file_of[hf]).get_slice(hf)

    def _open(self, path: Path):
        if path not in self._handles:
            from safetensors import safe_open

            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]


def _tensor_files(directory: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with 'weight_map'): {err}") from None
        files = {name: directory / file for name, file in weight_map.items()}
        absent = sorted({str(p) for p in files.values() if not p.is_file()})
        if absent:
            raise ValueError(f"{index} names shard files that do not exist: {', '.join(absent)}")
        return files
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise ValueError(f"Hugging Face checkpoint {directory} has neither {SINGLE_FILE} nor {INDEX_FILE} "
                         "(only safetensors checkpoints are read; convert .bin files with transformers first)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}


# ---- writing -------------------------------------------------------------------------------------

def plan_shards(entries: Iterable[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors in order, cut into files of at most max_shard_bytes (a larger tensor gets its own)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in entries:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


class ShardedWriter:
    """Writes planned safetensors files tensor by tensor (module docstring); `close()` checks that
    every planned tensor was written once and writes the index for more than one file."""

    def __init__(self, directory: Path, shards: list[list[tuple[str, tuple[int, ...]]]], dtype: torch.dtype) -> None:
        self.directory, self.dtype = directory, dtype
        count = len(shards)
        self.file_names = [SINGLE_FILE] if count == 1 else [
            f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self._where: dict[str, tuple[Path, int, tuple[int, ...]]] = {}
        self._written: set[str] = set()
        self.total_bytes = 0
        directory.mkdir(parents=True, exist_ok=True)
        for file_name, entries in zip(self.file_names, shards):
            self._start_file(directory / file_name, entries)

    def _start_file(self, path: Path, entries: list[tuple[str, tuple[int, ...]]]) -> None:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in entries:
            nbytes = math.prod(shape) * itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[self.dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        data_start = 8 + len(text)
        with path.open("wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            f.truncate(data_start + offset)
        for name, shape in entries:
            self._where[name] = (path, data_start + header[name]["data_offsets"][0], shape)
        self.total_bytes += offset

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._where:
            raise ValueError(f"{name} is not in the export plan")
        if name in self._written:
            raise ValueError(f"{name} was written twice")
        path, offset, shape = self._where[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the plan says {shape}")
        data = tensor.detach().to("cpu", self.dtype).contiguous().view(torch.uint8).numpy()
        with path.open("r+b") as f:
            f.seek(offset)
            f.write(data.data)  # the tensor's own bytes, no copy
        self._written.add(name)

    def close(self) -> None:
        missing = [n for n in self._where if n not in self._written]
        if missing:
            raise ValueError(f"export incomplete: {len(missing)} tensors never arrived, e.g. {missing[:4]}")
        if len(self.file_names) > 1:
            weight_map = {name: path.name for name, (path, _, _) in self._where.items()}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def copy_files(directory: Path, files: Iterable[Path]) -> list[str]:
    """Copy tokenizer (and generation config) files into the export; returns their names."""
    names = []
    for path in files:
        shutil.copyfile(path, directory / path.name)
        names.append(path.name)
    return names


def export_hf(model_chunks: list[Any], groups, out_dir: str | Path, cfg, *, dtype: torch.dtype = torch.bfloat16,
              tokenizer_dir: str | Path | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path | None:
    """Write the model of ModelConfig `cfg` as a Hugging Face checkpoint: config.json
    (export_config), safetensors, and the SIDE_FILES of `tokenizer_dir` (default: the checkpoint
    the model came from). Returns the directory on global rank 0, None elsewhere.

    Collective: every rank calls it; the ranks weights.takes_part_in_export names (the first
    data/context-parallel replica; every rank when experts are split over expert parallelism,
    which spans the data-parallel ranks) gather the weights one tensor at a time
    (weights.iter_full_weights) and global rank 0 writes each as it arrives. A tied model's
    lm_head.weight is not written (tie_word_embeddings says so).
    """
    out, tied = Path(out_dir), cfg.tie_embeddings
    writes = dist.get_rank() == 0
    if writes:
        _clear_weights(out)
        entries = [(hf_name(n), s) for n, s in neutral_weight_shapes(cfg).items() if not (tied and n == "lm_head.weight")]
        writer = ShardedWriter(out, plan_shards(entries, dtype, max_shard_bytes), dtype)
    if takes_part_in_export(groups):
        for name, tensor in iter_full_weights(model_chunks, groups, dtype):
            if writes and not (tied and name == "lm_head.weight"):
                writer.write(hf_name(name), tensor)
    if writes:
        writer.close()
        write_config(out, export_config(cfg, dtype))
        side = tokenizer_dir or cfg.hf_checkpoint
        copy_files(out, side_files(side) if side else [])
    dist.barrier()
    return out if writes else None


def side_files(directory: str | Path) -> list[Path]:
    """The SIDE_FILES present in `directory`."""
    return [Path(directory) / name for name in SIDE_FILES if (Path(directory) / name).is_file()]


def _clear_weights(directory: Path) -> None:
    """Remove a previous export's weight files, so no stale shard or index survives."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in directory.glob("model*.safetensors"):
        path.unlink()
    (directory / INDEX_FILE).unlink(missing_ok=True)
