"""A stand-in for the part of vLLM 0.25.1's offline API that megatron_rlcorr.rollout.vllm_engine uses.

vLLM cannot be installed on the CPU machines (it pins a CUDA torch), so the adapter's unit tests
put this package first on sys.path (with its dist-info, so importlib.metadata reports 0.25.1).
It keeps the real surface and the behaviours the adapter depends on, each written from the 0.25.1
source (named at each class or method below; nothing of it is copied): the constructor and method
names and keywords, the output objects, SamplingParams' validation, the default (V2) model
runner's sampling and the scheduler's stop rule, seed + j for sample j of a request, the worker
extension mixed into the worker class, the reseeding of the process's RNGs while the engine starts,
one sleep-mode engine per process, sleep levels and wake-up tags, and online fp8's processed
weights with the layerwise reload (model_executor/model_loader/reload).

Its "model" is a bigram language model made of the loaded Hugging Face weights
(logits = embed[last token] @ lm_head.T, in float32), so a test can recompute every log-prob;
it checks the loaded names, shapes and dtypes against the checkpoint's safetensors. Every call is
appended to `CALLS` as (method, details); vLLM's warnings go to the `logging` logger "vllm".

Routed experts (`enable_return_routed_experts=True`): as vLLM's scheduler (`_get_routed_experts`:
the request's num_tokens - 1 KV slots) and routed_experts_capturer.py (an int32 buffer [tokens,
hf num_hidden_layers, num_experts_per_tok], zero-initialised, each MoE layer written at its decoder
layer index), a finished CompletionOutput's `routed_experts` is an int32 numpy array [prompt +
response - 1, num_hidden_layers, num_experts_per_tok]; its rows are `routing_row(token, position)`
(a stand-in rule, since the bigram model has no router), and zero in config.json's mlp_only_layers.
"""
from __future__ import annotations

import importlib
import json
import logging
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__version__ = "0.25.1"
CALLS: list[tuple[str, Any]] = []
_LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
_MAX_TEMP = 1e-2       # sampling_params.py: the smallest temperature vLLM samples with
_SAMPLING_EPS = 1e-5   # sampling_params.py: below it a request is greedy
logger = logging.getLogger("vllm")
_sleep_pool_in_use = False  # device_allocator/cumem.py's allocator: one per process


class SamplingParams:
    """sampling_params.py SamplingParams: `__post_init__` raises a temperature in (0, 0.01) to 0.01
    (a warning, no error), then `_verify_args` checks the ranges (temperature in [0, 2], top_p in
    (0, 1], top_k 0 or -1 (off) or >= 1, ...), then a greedy request (temperature < 1e-5) has top-p
    and top-k reset and must have n == 1 (`_verify_greedy_sampling`). `ignore_eos` concerns the
    tokenizer's own EOS, which the engine adds (not modelled here: the adapter passes every end id
    in stop_token_ids, which stop a response whatever ignore_eos says)."""

    def __init__(self, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 max_tokens: int | None = 16, logprobs: int | None = None, seed: int | None = None,
                 stop_token_ids: list[int] | None = None, detokenize: bool = True, ignore_eos: bool = False) -> None:
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.max_tokens, self.logprobs, self.seed = max_tokens, logprobs, seed
        self.stop_token_ids, self.detokenize, self.ignore_eos = list(stop_token_ids or []), detokenize, ignore_eos
        if 0 < self.temperature < _MAX_TEMP:
            logger.warning("temperature %s is less than %s, which may cause numerical errors nan or inf in "
                           "tensors. We have maxed it out to %s.", self.temperature, _MAX_TEMP, _MAX_TEMP)
            self.temperature = _MAX_TEMP
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            self.top_p, self.top_k = 1.0, 0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    def _verify_args(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """outputs.py CompletionOutput (its field order: routed_experts after logprobs)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: Any = None  # np.ndarray | None, [seq_len, layer_num, topk]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def routing_row(token: int, position: int, num_layers: int, topk: int, num_experts: int,
                dense_layers: list[int]) -> list[list[int]]:
    """The stand-in's routed experts of one position ([layers][topk], distinct per layer; zero rows
    for dense layers): a function of the token and its position only."""
    return [[0] * topk if layer in dense_layers else
            [(token * 3 + position * 5 + layer * 7 + slot) % num_experts for slot in range(topk)]
            for layer in range(num_layers)]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


class _Model:
    """The vLLM model (what `model_runner.get_model()` returns): `load_weights(iterable of (HF name,
    tensor))` returning the names it loaded, `named_parameters()` and `compute_logits`.

    With quantization="fp8", as vLLM's online fp8 (model_executor/layers/quantization/online/fp8.py):
    after loading, every linear weight (`*_proj.weight`) is replaced by its transposed float8_e4m3fn
    values and a per-tensor `weight_scale`; loading a checkpoint tensor into one then fails unless a
    layerwise reload is active. The attention layers also carry KV-cache scale parameters
    (`KVCacheScaleParameter`, no checkpoint tensor: layers/attention/attention.py,
    quantization/kv_cache.py). `finish_reload` quantises what the reload brought; a weight that did
    not come keeps its old values with a warning, as reload/layerwise.py's
    `finalize_layerwise_processing` ("Failed to load weights") does: nothing raises."""

    def __init__(self, checkpoint: Path, quantization: str | None = None) -> None:
        from safetensors import safe_open

        from .model_executor.layers.quantization.kv_cache import KVCacheScaleParameter

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
        self.kv_scales: dict[str, torch.nn.Parameter] = {}
        self.reloading: set[str] | None = None
        if self.quantized:
            self.kv_scales = {f"model.layers.{i}.self_attn.attn.{kind}_scale": KVCacheScaleParameter()
                              for i in range(config["num_hidden_layers"]) for kind in ("q", "k", "v", "prob")}
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

    def named_parameters(self):
        """The model's parameters: while a layerwise reload is open, in checkpoint format (on the
        meta device, as reload/meta.py's `restore_layer_on_meta` leaves them); a tied head is the
        embedding's tensor, listed once."""
        for name, shape in self.expected.items():
            if self.tied and name == "lm_head.weight":
                continue
            if self.reloading is not None and name in self.fp8:
                yield name, torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
            elif name in self.fp8:
                values, scale = self.fp8[name]
                yield name, torch.nn.Parameter(values, requires_grad=False)
                yield name.removesuffix("weight") + "weight_scale", torch.nn.Parameter(scale, requires_grad=False)
            else:
                yield name, torch.nn.Parameter(self.weights[name], requires_grad=False)
        yield from self.kv_scales.items()

    def begin_reload(self) -> None:
        self.reloading = set()

    def finish_reload(self) -> None:
        assert self.reloading is not None, "finalize_layerwise_reload without initialize_layerwise_reload"
        for name in self.expected:
            if name not in self.reloading and not (self.tied and name == "lm_head.weight"):
                logger.warning("%s: Failed to load weights", name)  # the old tensors stay
        self._quantize([name for name in self._linear_names() if name in self.reloading])
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


class _GraphWrapped:
    """What a model runner may hold as `model`: the model inside a CUDA-graph wrapper (the V1 runner's
    CUDAGraphWrapper / UBatchWrapper, compilation/cuda_graph.py), which `get_model()` unwraps
    (v1/worker/gpu_model_runner.py GPUModelRunner.get_model). Stricter than vLLM's wrapper, which
    passes attribute reads on to the model: here anything that reaches past get_model() fails."""

    def __init__(self, model: _Model) -> None:
        self._runnable = model

    def unwrap(self) -> _Model:
        return self._runnable


class _ModelRunner:
    def __init__(self, model: _Model, vllm_config: Any) -> None:
        self.model = _GraphWrapped(model)
        self.vllm_config = vllm_config

    def get_model(self) -> _Model:
        return self.model.unwrap()


class _Worker:
    """gpu_worker.Worker's attributes the extension reads: device, model_config, model_runner.{get_model(),
    vllm_config}."""

    def __init__(self, model: _Model, kwargs: dict) -> None:
        self.device = torch.device("cpu")
        self.model_config = type("ModelConfig", (), dict(model=kwargs["model"], dtype=kwargs["dtype"]))()
        vllm_config = type("VllmConfig", (), dict(model_config=self.model_config))()
        self.model_runner = _ModelRunner(model, vllm_config)


def _resolve(qualname: str) -> type:
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _set_random_seed(seed: int | None) -> None:
    """utils/torch_utils.py set_random_seed, which the GPU worker calls with the engine's seed while
    the engine starts (v1/worker/gpu_worker.py: init_device and compile_or_warm_up_model): python,
    numpy, torch and every CUDA device, the same seed on every rank."""
    if seed is None:
        return
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


class LLM:
    def __init__(self, model: str, *, tokenizer: str | None = None, dtype: str = "auto", quantization: str | None = None,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                 seed: int = 0, enable_sleep_mode: bool = False, distributed_executor_backend: str | None = None,
                 logprobs_mode: str = "raw_logprobs", load_format: str = "auto", worker_extension_cls: str = "",
                 enable_prefix_caching: bool | None = None, enable_return_routed_experts: bool = False,
                 enforce_eager: bool = False) -> None:
        global _sleep_pool_in_use
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
                           enable_prefix_caching=enable_prefix_caching,
                           enable_return_routed_experts=enable_return_routed_experts, enforce_eager=enforce_eager)
        CALLS.append(("LLM", self.kwargs))
        # What vllm.envs reads while the engine builds its sampler (v1/sample/ops/topk_topp_sampler.py).
        self.flashinfer_sampler_env = os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")
        if enable_sleep_mode:
            # Sleep mode allocates through one process-wide pool (config/model.py turns on the cumem
            # allocator); a second engine's weights find it in use (v1/worker/gpu_worker.py
            # _maybe_get_memory_pool_context).
            assert not _sleep_pool_in_use, "CuMem allocator can only be used for one instance per process."
            _sleep_pool_in_use = True
        _set_random_seed(seed)
        bases = (_Worker, _resolve(worker_extension_cls)) if worker_extension_cls else (_Worker,)
        self.worker = type("Worker", bases, {})(_Model(Path(model), quantization), self.kwargs)
        self.asleep: set[str] = set()
        self.routing: dict | None = None
        if enable_return_routed_experts:  # the capturer's buffer reads these (AttributeError on a dense config)
            config = json.loads((Path(model) / "config.json").read_text())
            self.routing = dict(num_layers=config["num_hidden_layers"], topk=config["num_experts_per_tok"],
                                num_experts=config.get("num_experts") or config["num_local_experts"],
                                dense_layers=list(config.get("mlp_only_layers") or []))

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        CALLS.append(("collective_rpc", (method, args)))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self) -> bool:
        CALLS.append(("reset_prefix_cache", None))
        return True

    def sleep(self, level: int = 1) -> None:
        """v1/executor/abstract.py Executor.sleep: a second sleep is ignored with a warning."""
        if not self.kwargs["enable_sleep_mode"]:
            raise ValueError("Sleep mode is not enabled")
        CALLS.append(("sleep", level))
        if self.asleep:
            logger.warning("Executor is already sleeping.")
            return
        self.asleep = {"weights", "kv_cache"}
        if level == 2:  # the weights are dropped: whatever is read before a reload is garbage
            model = self.worker.model_runner.get_model()
            model.weights = {k: torch.full_like(v, float("nan")) for k, v in model.weights.items()}
            model.fp8 = {k: (v, torch.full_like(scale, float("nan"))) for k, (v, scale) in model.fp8.items()}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """v1/executor/abstract.py Executor.wake_up: not sleeping, or any named tag not asleep, and
        the whole call is ignored with a warning (the tags that are asleep stay asleep)."""
        CALLS.append(("wake_up", list(tags or [])))
        if not self.asleep:
            logger.warning("Executor is not sleeping.")
            return
        for tag in tags or ():
            if tag not in self.asleep:
                logger.warning("Tag %s is not in sleeping tags %s", tag, self.asleep)
                return
        self.asleep -= set(tags or self.asleep)

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True, **unused) -> list[RequestOutput]:
        if self.asleep:
            raise RuntimeError(f"generate() while {sorted(self.asleep)} sleep")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        CALLS.append(("generate", [(list(p["prompt_token_ids"]), sp) for p, sp in zip(prompts, params)]))
        return [RequestOutput(str(i), None, list(p["prompt_token_ids"]),
                              [self._sample(list(p["prompt_token_ids"]), sp, j) for j in range(sp.n)])
                for i, (p, sp) in enumerate(zip(prompts, params))]

    def _sample(self, prompt: list[int], sp: SamplingParams, index: int) -> CompletionOutput:
        """One sample, a token at a time: the default (V2) runner's sampler (v1/worker/gpu/sample/
        sampler.py: temperature, then top-k and top-p on the tempered logits; processed log-probs are
        those of the result; a tie at the k-th logit keeps every tied token, as apply_top_k_top_p's
        sort-based PyTorch path does, where the Triton kernel of batches >= 8 keeps the lowest ids), the child seed of parallel sampling (v1/engine/parallel_sampling.py),
        and the scheduler's stop rule (v1/core/sched/utils.py check_stop: a stop token first, then
        the length cap, so a response capped on an end token has finish_reason "stop")."""
        model = self.worker.model_runner.get_model()
        generator = torch.Generator().manual_seed(sp.seed + index)
        max_model_len = self.kwargs["max_model_len"]
        tokens, logprobs, last = [], [], prompt[-1]
        finish, stop_reason = None, None
        while finish is None:
            raw = model.compute_logits(model.hidden(last))[0]
            tempered = raw / sp.temperature if sp.temperature > 0 else raw
            if 0 < sp.top_k < tempered.numel():
                tempered = tempered.masked_fill(tempered < tempered.topk(sp.top_k).values[-1], float("-inf"))
            logp = torch.log_softmax(tempered, dim=-1)
            if sp.top_p < 1:
                order = logp.argsort(descending=True)
                mass_before = logp[order].exp().cumsum(0) - logp[order].exp()
                logp = torch.log_softmax(logp.index_fill(0, order[mass_before >= sp.top_p], float("-inf")), dim=-1)
            last = int(logp.argmax()) if sp.temperature == 0 else int(torch.multinomial(logp.exp(), 1,
                                                                                            generator=generator))
            tokens.append(last)
            reported = logp if self.kwargs["logprobs_mode"] == "processed_logprobs" else torch.log_softmax(raw, -1)
            logprobs.append({last: Logprob(float(reported[last]))})
            if last in sp.stop_token_ids:
                finish, stop_reason = "stop", last
            elif len(tokens) >= sp.max_tokens or (max_model_len is not None
                                                  and len(prompt) + len(tokens) >= max_model_len):
                finish = "length"
        routed = None
        if self.routing is not None:  # every position but the last: prompt + response - 1 rows
            import numpy as np

            sequence = prompt + tokens
            routed = np.array([routing_row(t, p, **self.routing) for p, t in enumerate(sequence[:-1])], dtype=np.int32)
        return CompletionOutput(index, "", tokens, None, logprobs if sp.logprobs is not None else None,
                                routed_experts=routed, finish_reason=finish, stop_reason=stop_reason)
