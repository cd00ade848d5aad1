"""Hugging Face checkpoints: config.json <-> the architecture, tensor names, sliced reads, streamed writes.

Supported families (transformers' `model_type`): `qwen2` (Qwen2, Qwen2.5: q/k/v bias), `qwen3`
(Qwen3 dense: RMSNorm of each query and key head, explicit head_dim) and `llama` (LLaMA,
LLaMA-3, LLaMA-3.1 with its rope scaling). Both config.json styles are read: transformers 4
(top-level `rope_theta`, `rope_scaling`, `torch_dtype`) and transformers 5 (`rope_parameters`,
`dtype`). Anything the Megatron model cannot represent (MoE, sliding-window attention, biases
other than Qwen2's q/k/v, other activations or rope types) is refused with the feature named.

Names: a Hugging Face name is the neutral name (weights.py) with the family's prefixes
(`model.layers.{i}.self_attn.q_proj.weight` <-> `layers.{i}.q.weight`); `HF_TO_NEUTRAL` is the
whole map. Tied checkpoints carry no `lm_head.weight` (one there is ignored).

Reading (`HFCheckpoint`): safetensors files (one `model.safetensors`, or the shards named by
`model.safetensors.index.json`) are opened with `safetensors.safe_open`, which maps the file and
returns just the requested slice of a tensor, so a rank reads only the rows/columns of its
tensor-parallel shard of the tensors its pipeline chunks hold. `bytes_read` counts them.

Writing (`write_hf_checkpoint`): safetensors' own writer needs every tensor of a file in memory
at once, so this module writes the same format itself: the shard plan (names, dtypes, shapes,
offsets) is known from the architecture before any weight is gathered, each file's header is
written first, and each tensor is written at its offset as it arrives, in any order. Peak extra
memory is one tensor. Files are read back by safetensors and transformers in the tests.
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

from .architecture import LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT, DecoderShape

SUPPORTED_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
_SUPPORTED_TEXT = "qwen2 (Qwen2, Qwen2.5), qwen3 (Qwen3 dense), llama (LLaMA, LLaMA-3, LLaMA-3.1)"

CONFIG_FILE = "config.json"
# The tokenizer's files and the generation config: what travels with an exported checkpoint.
SIDE_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
    "generation_config.json",
)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

# Where each architecture field comes from in config.json (for messages).
_CONFIG_KEY = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads", "num_query_groups": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size", "kv_channels": "head_dim",
    "max_position_embeddings": "max_position_embeddings", "rotary_base": "rope_theta",
    "add_qkv_bias": "model_type", "qk_layernorm": "model_type", "tie_embeddings": "tie_word_embeddings",
    "norm_epsilon": "rms_norm_eps", "rope_scaling": "rope_scaling.rope_type",
    "rope_scaling_factor": "rope_scaling.factor",
}

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
}
HF_TO_NEUTRAL = {**_GLOBAL_NAMES, **{f"model.layers.{{i}}.{k}": f"layers.{{i}}.{v}" for k, v in _LAYER_NAMES.items()}}
_NEUTRAL_TO_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_NEUTRAL_TO_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_NEUTRAL_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Tensors some checkpoints carry that the model does not use.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


# ---- config.json ---------------------------------------------------------------------------------

def read_config(directory: str | Path) -> dict[str, Any]:
    """config.json of a Hugging Face checkpoint directory, with errors that name the path."""
    path = Path(directory) / CONFIG_FILE
    if not Path(directory).is_dir():
        raise ValueError(f"Hugging Face checkpoint {directory} is not a directory")
    if not path.is_file():
        raise ValueError(f"Hugging Face checkpoint {directory} has no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def read_architecture(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig's architecture fields from a config.json mapping; ValueError naming any
    model_type or feature the Megatron model cannot represent (`where` names the file)."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; supported: {_SUPPORTED_TEXT}")
    _check_features(config, model_type, where)
    rope_theta, rope = _rope(config, where)
    heads = _required(config, "num_attention_heads", where)
    return {
        "vocab_size": _required(config, "vocab_size", where),
        "hidden_size": _required(config, "hidden_size", where),
        "num_layers": _required(config, "num_hidden_layers", where),
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "ffn_hidden_size": _required(config, "intermediate_size", where),
        "kv_channels": config.get("head_dim"),
        "max_position_embeddings": config.get("max_position_embeddings", 4096),
        "rotary_base": float(rope_theta),
        "add_qkv_bias": model_type == "qwen2",
        "qk_layernorm": model_type == "qwen3",
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "norm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "rope_scaling": rope is not None,
        "rope_scaling_factor": float(rope["factor"]) if rope is not None else 8.0,
    }


def _required(config: Mapping[str, Any], key: str, where: str) -> Any:
    if config.get(key) is None:
        raise ValueError(f"{where}: config.json has no {key!r}")
    return config[key]


def _check_features(config: Mapping[str, Any], model_type: str, where: str) -> None:
    unsupported = []
    if any(config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        unsupported.append("mixture of experts (num_experts)")
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        unsupported.append("sliding-window attention (use_sliding_window / layer_types)")
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={config['hidden_act']!r} (only silu, SwiGLU)")
    if model_type != "qwen2" and config.get("attention_bias"):
        unsupported.append("attention_bias=true (biases on every attention projection, o_proj included)")
    if config.get("mlp_bias"):
        unsupported.append("mlp_bias=true")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        unsupported.append(f"partial_rotary_factor={config['partial_rotary_factor']}")
    if unsupported:
        raise ValueError(f"{where}: {model_type} with {'; '.join(unsupported)} is not supported by the Megatron "
                         f"model (supported: {_SUPPORTED_TEXT} dense decoders with RMSNorm, SwiGLU and RoPE)")


def _rope(config: Mapping[str, Any], where: str) -> tuple[float, dict | None]:
    """(rope_theta, LLaMA-3 scaling parameters or None) from either config.json style."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or params)
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"{where}: rope type {rope_type!r} is not supported (supported: default, llama3)")
    fixed = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
             "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
    differ = {k: scaling.get(k) for k, v in fixed.items() if scaling.get(k, v) != v}
    if differ or "factor" not in scaling:
        raise ValueError(f"{where}: llama3 rope scaling needs a factor and Megatron-Core's fixed "
                         f"{fixed}; this checkpoint has {differ or 'no factor'}")
    return theta, scaling


def merge_architecture(mapping: Mapping[str, Any], directory: str) -> dict[str, Any]:
    """A recipe's `model:` mapping with the architecture of the checkpoint at `directory` filled
    in; a key given in both must agree (ValueError naming both values)."""
    where = f"model.hf_checkpoint={directory}"
    arch = read_architecture(read_config(directory), where)
    for key, value in arch.items():
        if key in mapping and not _agrees(key, mapping[key], value, arch):
            raise ValueError(f"model.{key}={mapping[key]!r} disagrees with {Path(directory) / CONFIG_FILE} "
                             f"({_CONFIG_KEY[key]} gives {value!r}); remove model.{key} from the recipe "
                             "(the checkpoint's config.json decides the architecture) or use another checkpoint")
    return {**mapping, **arch}


def checkpoint_agrees_with_preset(directory: str, preset: Mapping[str, Any], name: str) -> None:
    """ValueError naming every architecture field where the checkpoint's config.json differs from
    the preset `name` (`model.architecture`), with both values."""
    config_path = Path(directory) / CONFIG_FILE
    arch = read_architecture(read_config(directory), f"model.hf_checkpoint={directory}")
    differing = [f"{key} ({_CONFIG_KEY[key]}): checkpoint {arch[key]!r}, preset {value!r}"
                 for key, value in preset.items() if not _agrees(key, arch[key], value, preset)]
    if differing:
        raise ValueError(f"model.architecture: {name} disagrees with {config_path} in {'; '.join(differing)}: "
                         "use the preset of this checkpoint (an Instruct checkpoint has its own: "
                         f"{name.lower().removesuffix('-instruct')}-instruct), or remove model.architecture (the "
                         "checkpoint's config.json then decides)")


def merge_preset(mapping: Mapping[str, Any], preset: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A recipe's `model:` mapping with the preset's architecture filled in; a key given in both
    must agree."""
    for key, value in preset.items():
        if key in mapping and not _agrees(key, mapping[key], value, preset):
            raise ValueError(f"model.{key}={mapping[key]!r} disagrees with model.architecture: {name} ({value!r}); "
                             f"remove model.{key} (the preset decides) or remove model.architecture")
    return {**mapping, **preset}


def _agrees(key: str, given: Any, expected: Any, arch: Mapping[str, Any]) -> bool:
    if key == "kv_channels":  # None means hidden_size / heads
        default = arch["hidden_size"] // arch["num_attention_heads"]
        return (given or default) == (expected or default)
    if isinstance(expected, float) and not isinstance(given, bool):
        try:
            return math.isclose(float(given), expected, rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return given == expected


def export_config(cfg, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for exporting a model of ModelConfig `cfg`: its Hugging Face source's own (the
    architecture came from it) or a new one (config_for)."""
    source = read_config(cfg.hf_checkpoint) if cfg.hf_checkpoint else None
    return config_for(cfg.decoder_shape, cfg.max_position_embeddings, dtype, source)


def config_for(shape: DecoderShape, max_position_embeddings: int, dtype: torch.dtype,
               source: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """config.json for an export: the source checkpoint's own with its dtype updated, or a new one
    of the family that represents `shape` (qwen3 with q/k norms, qwen2 with q/k/v bias, else llama)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if source is not None:
        config = dict(source)
        config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = dtype_name
        return config
    if shape.qk_layernorm and shape.add_qkv_bias:
        raise ValueError("a model with both q/k norms and q/k/v biases has no Hugging Face family to export to")
    model_type = "qwen3" if shape.qk_layernorm else "qwen2" if shape.add_qkv_bias else "llama"
    config = {
        "architectures": [SUPPORTED_MODEL_TYPES[model_type]], "model_type": model_type,
        "vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size, "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups, "head_dim": shape.head_dim, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": shape.norm_epsilon,
        "tie_word_embeddings": shape.tie_embeddings, "rope_theta": shape.rotary_base, "dtype": dtype_name,
    }
    if model_type != "qwen2":
        config.update(attention_bias=False, mlp_bias=False)
    if shape.rope_scaling:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": shape.rope_scaling_factor,
                                  "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
                                  "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                                  "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
    return config


# ---- names ---------------------------------------------------------------------------------------

def hf_name(neutral: str) -> str:
    """The Hugging Face name of a neutral weight name."""
    match = _NEUTRAL_LAYER.fullmatch(neutral)
    if match:
        return f"model.layers.{match[1]}.{_NEUTRAL_TO_LAYER[match[2]]}"
    return _NEUTRAL_TO_GLOBAL[neutral]


def neutral_name(hf: str) -> str | None:
    """The neutral name of a Hugging Face tensor name, or None when it has none."""
    match = _HF_LAYER.fullmatch(hf)
    if match:
        tail = _LAYER_NAMES.get(match[2])
        return f"layers.{match[1]}.{tail}" if tail else None
    return _GLOBAL_NAMES.get(hf)


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

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the Hugging Face tensors, from the files' headers."""
        return {name: tuple(self._open(path).get_slice(name).get_shape()) for name, path in self._file_of.items()}

    def check(self, expected: Mapping[str, tuple[int, ...]], tied: bool) -> None:
        found = self.shapes()
        wanted = {hf_name(n): s for n, s in expected.items() if not (tied and n == "lm_head.weight")}
        missing = [n for n in wanted if n not in found]
        unexpected = [n for n in found if n not in wanted and not _IGNORED.fullmatch(n)
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


def write_config(directory: Path, config: Mapping[str, Any]) -> None:
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


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

    Collective: every rank calls it; the ranks of the first data/context-parallel replica gather
    the weights one tensor at a time (weights.iter_full_weights) and global rank 0 writes each as
    it arrives. A tied model's lm_head.weight is not written (tie_word_embeddings says so).
    """
    import torch.distributed as dist

    from .weights import iter_full_weights, neutral_weight_shapes

    out, tied = Path(out_dir), cfg.tie_embeddings
    writes = dist.get_rank() == 0
    if writes:
        _clear_weights(out)
        entries = [(hf_name(n), s) for n, s in neutral_weight_shapes(cfg).items() if not (tied and n == "lm_head.weight")]
        writer = ShardedWriter(out, plan_shards(entries, dtype, max_shard_bytes), dtype)
    if groups.dp_rank == 0 and groups.cp_rank == 0:
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
