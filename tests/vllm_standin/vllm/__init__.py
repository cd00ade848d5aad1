"""A stand-in for the part of vLLM 0.25.1's offline API that megatron_rlcorr.rollout.vllm_engine uses.

vLLM cannot be installed on the CPU machines (it pins a CUDA torch), so the adapter's unit tests
put this package first on sys.path (with its dist-info, so importlib.metadata reports 0.25.1).
It keeps the real surface, written from vLLM's source (entrypoints/llm.py, sampling_params.py,
outputs.py, v1/core/sched/utils.py check_stop, v1/engine/parallel_sampling.py,
v1/worker/worker_base.py): the same constructor and method names and keywords, the same output
objects, the same stop rule (the length cap is checked before EOS), seed + j for sample j of a
request, the worker extension mixed into the worker class, sleep levels and wake-up tags, and
online fp8's processed weights with the layerwise reload (model_executor/model_loader/reload).

Its "model" is a bigram language model made of the loaded Hugging Face weights
(logits = embed[last token] @ lm_head.T, in float32), so a test can recompute every log-prob;
it checks the loaded names, shapes and dtypes against the checkpoint's safetensors. Every call is
appended to `CALLS` as (method, details).
"""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__version__ = "0.25.1"
CALLS: list[tuple[str, Any]] = []
_LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class SamplingParams:
    def __init__(self, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 max_tokens: int | None = 16, logprobs: int | None = None, seed: int | None = None,
                 stop_token_ids: list[int] | None = None, detokenize: bool = True, ignore_eos: bool = False) -> None:
        if n < 1 or temperature < 0 or not 0 < top_p <= 1 or (logprobs is not None and logprobs < 0):
            raise ValueError("invalid sampling parameters")
        if top_k not in (0, -1):
            raise NotImplementedError("the stand-in samples without top-k")
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.max_tokens, self.logprobs, self.seed = max_tokens, logprobs, seed
        self.stop_token_ids, self.detokenize, self.ignore_eos = list(stop_token_ids or []), detokenize, ignore_eos


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


class _Model:
    """model_runner.model: load_weights(iterable of (HF name, tensor)) and compute_logits.

    With quantization="fp8", as vLLM's online fp8: after loading, every linear weight (`*_proj.weight`)
    is replaced by its transposed float8_e4m3fn values and a per-tensor scale (`fp8`); loading a
    checkpoint tensor into one then fails unless a layerwise reload is active, and
    `finish_reload` quantises what the reload brought (every linear weight must have come)."""

    def __init__(self, checkpoint: Path, quantization: str | None = None) -> None:
        from safetensors import safe_open

        config = json.loads((checkpoint / "config.json").read_text())
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.expected: dict[str, tuple[int, ...]] = {}
        with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
            for name in f.keys():
                self.expected[name] = tuple(f.get_slice(name).get_shape())
        self.weights = {name: torch.randn(shape) for name, shape in self.expected.items()}  # load_format="dummy"
        self.loaded: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self.quantized = quantization == "fp8"
        self.fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.reloading: set[str] | None = None
        if self.quantized:
            self._quantize(self._linear_names())

    def _linear_names(self) -> list[str]:
        return [name for name in self.expected if name.endswith("_proj.weight")]

    def _quantize(self, names) -> None:
        for name in names:
            weight = self.weights.pop(name)
            scale = weight.abs().max().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            self.fp8[name] = ((weight / scale).to(torch.float8_e4m3fn).t(), scale)

    def dequantized(self, name: str) -> torch.Tensor:
        values, scale = self.fp8[name]
        return values.t().float() * scale

    def begin_reload(self) -> None:
        self.reloading = set()

    def finish_reload(self) -> None:
        assert self.reloading is not None, "finalize_layerwise_reload without initialize_layerwise_reload"
        linear = self._linear_names()
        missing = sorted(set(linear) - self.reloading)
        assert not missing, f"layerwise reload finalized before these weights came: {missing}"
        self._quantize(linear)
        self.reloading = None

    def load_weights(self, weights) -> set[str]:
        names = set()
        for name, tensor in weights:
            if name not in self.expected or tuple(tensor.shape) != self.expected[name]:
                raise KeyError(f"stand-in vLLM model: unexpected weight {name} {tuple(tensor.shape)}")
            if name in self.fp8 and self.reloading is None:
                raise RuntimeError(f"stand-in vLLM model: a checkpoint tensor for the processed fp8 parameter {name}"
                                   " (reload it between initialize_layerwise_reload and finalize_layerwise_reload)")
            self.weights[name] = tensor.detach().float().clone()
            if self.reloading is not None:
                self.reloading.add(name)
            self.loaded.append((name, tuple(tensor.shape), tensor.dtype))
            names.add(name)
        return names

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        head = self.weights["model.embed_tokens.weight" if self.tied else "lm_head.weight"]
        return hidden_states.float() @ head.T

    def hidden(self, token: int) -> torch.Tensor:
        return self.weights["model.embed_tokens.weight"][token][None]


class _Worker:
    """gpu_worker.Worker's attributes the extension reads: device, model_config, model_runner.{model,
    vllm_config}."""

    def __init__(self, model: _Model, kwargs: dict) -> None:
        self.device = torch.device("cpu")
        self.model_config = type("ModelConfig", (), dict(model=kwargs["model"], dtype=kwargs["dtype"]))()
        self.model_runner = type("ModelRunner", (), {})()
        self.model_runner.model = model
        self.model_runner.vllm_config = type("VllmConfig", (), dict(model_config=self.model_config))()


def _resolve(qualname: str) -> type:
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


class LLM:
    def __init__(self, model: str, *, tokenizer: str | None = None, dtype: str = "auto", quantization: str | None = None,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                 seed: int = 0, enable_sleep_mode: bool = False, distributed_executor_backend: str | None = None,
                 logprobs_mode: str = "raw_logprobs", load_format: str = "auto", worker_extension_cls: str = "",
                 enable_prefix_caching: bool | None = None) -> None:
        if logprobs_mode not in _LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {logprobs_mode}")
        if distributed_executor_backend == "external_launcher":
            assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", \
                "To get deterministic execution, please set VLLM_ENABLE_V1_MULTIPROCESSING=0"
            int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])  # noqa: B018 - env:// needs them
        self.kwargs = dict(model=model, tokenizer=tokenizer, dtype=dtype, quantization=quantization,
                           tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                           max_model_len=max_model_len, seed=seed, enable_sleep_mode=enable_sleep_mode,
                           distributed_executor_backend=distributed_executor_backend, logprobs_mode=logprobs_mode,
                           load_format=load_format, worker_extension_cls=worker_extension_cls,
                           enable_prefix_caching=enable_prefix_caching)
        CALLS.append(("LLM", self.kwargs))
        bases = (_Worker, _resolve(worker_extension_cls)) if worker_extension_cls else (_Worker,)
        self.worker = type("Worker", bases, {})(_Model(Path(model), quantization), self.kwargs)
        self.asleep: set[str] = set()

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        CALLS.append(("collective_rpc", (method, args)))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self) -> bool:
        CALLS.append(("reset_prefix_cache", None))
        return True

    def sleep(self, level: int = 1) -> None:
        if not self.kwargs["enable_sleep_mode"]:
            raise ValueError("Sleep mode is not enabled")
        CALLS.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}
        if level == 2:  # the weights are dropped: whatever is read before a reload is garbage
            model = self.worker.model_runner.model
            model.weights = {k: torch.full_like(v, float("nan")) for k, v in model.weights.items()}
            model.fp8 = {k: (v, torch.full_like(scale, float("nan"))) for k, (v, scale) in model.fp8.items()}

    def wake_up(self, tags: list[str] | None = None) -> None:
        CALLS.append(("wake_up", list(tags or [])))
        self.asleep -= set(tags or ("weights", "kv_cache"))

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True, **unused) -> list[RequestOutput]:
        if self.asleep:
            raise RuntimeError(f"generate() while {sorted(self.asleep)} sleep")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        CALLS.append(("generate", [(list(p["prompt_token_ids"]), sp) for p, sp in zip(prompts, params)]))
        return [RequestOutput(str(i), None, list(p["prompt_token_ids"]),
                              [self._sample(list(p["prompt_token_ids"]), sp, j) for j in range(sp.n)])
                for i, (p, sp) in enumerate(zip(prompts, params))]

    def _sample(self, prompt: list[int], sp: SamplingParams, index: int) -> CompletionOutput:
        model = self.worker.model_runner.model
        generator = torch.Generator().manual_seed(sp.seed + index)  # parallel_sampling: child seed = seed + index
        tokens, logprobs, last = [], [], prompt[-1]
        finish, stop_reason = None, None
        while finish is None:
            raw = model.compute_logits(model.hidden(last))[0]
            logp = torch.log_softmax(raw / sp.temperature if sp.temperature > 0 else raw, dim=-1)
            if sp.top_p < 1:
                order = logp.argsort(descending=True)
                mass_before = logp[order].exp().cumsum(0) - logp[order].exp()
                logp = torch.log_softmax(logp.index_fill(0, order[mass_before >= sp.top_p], float("-inf")), dim=-1)
            last = int(logp.argmax()) if sp.temperature == 0 else int(torch.multinomial(logp.exp(), 1,
                                                                                            generator=generator))
            tokens.append(last)
            reported = logp if self.kwargs["logprobs_mode"] == "processed_logprobs" else torch.log_softmax(raw, -1)
            logprobs.append({last: Logprob(float(reported[last]))})
            if len(tokens) >= sp.max_tokens:  # check_stop: the length cap first
                finish = "length"
            elif last in sp.stop_token_ids and not sp.ignore_eos:
                finish, stop_reason = "stop", last
        return CompletionOutput(index, "", tokens, None, logprobs if sp.logprobs is not None else None, finish,
                                stop_reason)
