"""The vLLM rollout engine (`rollout.engine: vllm`): our engine interface over an in-process `vllm.LLM`.

Written against vLLM 0.25.1 (`VLLM_VERSION`, pinned by the "vllm" extra); vLLM is imported here
only, when the engine is built. Nothing of it runs on the CPU machines: tests/vllm_standin is a
stand-in package with the same surface that the unit tests check this adapter against, and
tests/gpu/test_vllm_engine.py runs the real one where vLLM and a GPU exist.

Layout. One vLLM worker inside every torchrun rank (`distributed_executor_backend=
"external_launcher"`, which needs VLLM_ENABLE_V1_MULTIPROCESSING=0): vLLM groups consecutive
ranks into tensor-parallel engines of `rollout.tensor_parallel_size`, exactly our rollout groups
(rl/rollout_world.py), and every rank of a group is given the same prompts and returns the same
samples. No Ray, no extra processes; each rank's weights arrive from its own trainer process.
`rollout.enforce_eager` is passed on as vLLM's `enforce_eager` (true: no CUDA graphs captured).
Where flashinfer is not installed and VLLM_USE_FLASHINFER_SAMPLER is unset, the adapter sets it
to 0 before building the engine (`_native_sampler_without_flashinfer`).

Colocation. `enable_sleep_mode`: after generation `sleep(level)` frees the KV cache and, with
level 1, moves the weights to host memory, with level 2 drops them (they are re-sent after every
step anyway); before the next weight sync `wake_up(["weights"])`, after it `wake_up(["kv_cache"])`.
vLLM's sleep mode needs its own CUDA allocator pool: `expandable_segments:True` in
PYTORCH_CUDA_ALLOC_CONF is refused with sleep on. That pool serves one engine per process: a
second `LLM` with sleep mode in the same process fails.

Weights. The trainer's stream (model/weight_stream.py, Hugging Face names, bf16, also for fp8)
goes tensor by tensor to the model's `load_weights` through `collective_rpc` and the worker
extension below (in process: the tensors are not copied); then the prefix cache is reset, since
cached KV of the old weights is stale. The model is the runner's `get_model()`: a runner may hold
it inside a CUDA-graph wrapper (the V1 runner's, which vLLM falls back to where its default V2
runner does not apply). A sync is bracketed by `begin_weight_sync` and `end_weight_sync`, and is
checked complete: the names `load_weights` reports loaded over the whole sync must cover the
model's parameters (those a checkpoint carries: not the KV-cache scales a quantized model's
attention registers), or the sync raises naming the missing ones. vLLM's own reload does the same
comparison but only warns, and not at all with quantization; an fp8 layer that receives nothing
keeps its old tensors with a warning. The check is by parameter name: a stacked parameter
(qkv_proj, gate_up_proj) counts as loaded once any of its shards has come, and the stream sends
every shard. Until a sync has completed (and after a level-2 sleep) the engine refuses to
generate, so a run never samples from dummy, dropped or half-loaded weights.
- bf16: `load_weights` copies each tensor into its parameter in place (vLLM's loaders stack
  q/k/v and gate/up and take this rank's TP slice).
- fp8 (`quantization="fp8"`, vLLM's online quantization): after loading, vLLM replaces each
  linear weight by a transposed fp8 tensor and a scale, which a plain `load_weights` of bf16
  checkpoint tensors would write into. The sync therefore runs vLLM's layerwise reload:
  `initialize_layerwise_reload` puts the checkpoint-format parameters back (on the meta
  device), `load_weights` buffers each layer's tensors until the layer is complete, then
  quantises it and copies the result into the original storage (CUDA graphs stay valid), and
  `finalize_layerwise_reload` processes what is left. These run under vLLM's current config and
  with this GPU as the default device, as vLLM's own weight-update path does. Extra memory: up
  to one decoder layer's bf16 tensors held by vLLM (about 1 GB for Qwen2.5-32B).

Seeding. While `LLM(...)` starts, vLLM's worker seeds python's `random`, numpy, torch and every
CUDA device with the engine seed, the same on every rank; the engine is built with the process's
RNG states saved and put back, so the trainer's own streams go on as if it had not run. vLLM's
sampling does not read them: every request carries its seed.

Sampling, under our conventions (rollout/base.py), as vLLM 0.25.1's default (V2) model runner does it:
- `logprobs_mode="processed_logprobs"` with `SamplingParams(logprobs=0)`: the sampled token's
  log-prob after temperature (and top-k, top-p), what the trainer recomputes when neither
  truncates. With top_p < 1 or top_k on (`top_k` >= 1; 0 and -1 are off, both passed as 0) that
  is the truncated distribution (top-k first, then top-p, renormalised), so `rollout.logprobs:
  processed` is required then. `rollout.val_kwargs` is not held to this: validation reads no
  log-probs.
- temperatures: vLLM samples any temperature in (0, 0.01) at 0.01 (with a warning only), while the
  trainer divides by the configured one: RolloutConfig refuses them for this engine, and so does
  `sample_groups`. Above 2 and greedy with n > 1 vLLM refuses (check_vllm_settings says so first).
- a per-prompt `seed` (vLLM gives sample j seed + j): a prompt's samples do not depend on which
  engine ran it, though vLLM's kernels are not batch-invariant, so they are equal in
  distribution, not bit for bit, across layouts (the embedded engine is bit for bit).
- `stop_token_ids` = the tokenizer's end ids; a response ends with its EOS token included, and
  is "eos" exactly when its last token is one (vLLM's scheduler checks the stop tokens before the
  length cap, so it agrees: a response that reaches max_tokens on an EOS is "stop" there).
- a padded vocabulary (Qwen2.5: 152064 rows for 151665 tokens): logits of the rows beyond the
  tokenizer get -inf in the model's `compute_logits`, so they are never sampled.

Routed experts (MoE models, `model.moe`): the LLM is built with `enable_return_routed_experts=True`
(an `LLM`/EngineArgs keyword, ModelConfig's field), and each finished `CompletionOutput` carries
`routed_experts`, a numpy array [prompt + response - 1, num_hidden_layers, num_experts_per_tok]: the
scheduler reads the routing of the request's KV slots of every position but the last (which no
forward consumed), and the capturer writes each MoE layer at its decoder-layer index, so a dense
layer's rows (Qwen3-MoE's mlp_only_layers) hold no routing. `split_routed_experts` keeps the MoE
layers (DecoderShape.moe_layers), casts to base.routed_experts_dtype, and splits the rows as
RolloutBatch wants them: the last len(response) rows are the response's (row j = position
len(prompt) - 1 + j), the first len(prompt) - 1 the prompt's.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .base import VLLM_MIN_TEMPERATURE, RolloutBatch, RolloutConfig, routed_experts_dtype

if TYPE_CHECKING:
    from ..model.architecture import DecoderShape
    from ..model.config import ModelConfig

VLLM_VERSION = "0.25.1"
_EXTENSION = f"{__name__}.WeightStreamExtension"


def check_vllm_settings(cfg: RolloutConfig, model: ModelConfig, *, here: bool = True) -> None:
    """ValueError, naming the setting and the fix, for what this engine cannot run (called by
    the recipe check, before any process group exists). here=False (`plan`): the settings only,
    not this machine's installation and allocator settings."""
    if here:
        _check_vllm_here(cfg)
    if cfg.precision not in ("bf16", "fp8"):
        raise ValueError(f"rollout.precision: {cfg.precision} is not a vLLM precision here: use bf16, or fp8 "
                         "(vLLM's online fp8 quantization); fp32 rollouts need rollout.engine: embedded")
    if model.hf_checkpoint is None:
        raise ValueError("rollout.engine: vllm builds its model from a Hugging Face checkpoint directory (config "
                         "and tokenizer): set model.hf_checkpoint")
    if cfg.top_p < 1 and cfg.logprobs != "processed":
        raise ValueError(f"rollout.top_p={cfg.top_p} with vLLM: its processed log-probs are those of the top-p "
                         "truncated distribution; set rollout.logprobs: processed (the correction then counts the "
                         "truncation as off-policy mass), or top_p: 1")
    if cfg.top_k > 0 and cfg.logprobs != "processed":
        raise ValueError(f"rollout.top_k={cfg.top_k} with vLLM: its processed log-probs are those of the top-k "
                         "truncated distribution; set rollout.logprobs: processed (the correction then counts the "
                         "truncation as off-policy mass), or top_k: 0 (off)")
    if cfg.temperature == 0 and cfg.n > 1:
        raise ValueError(f"rollout.temperature: 0 (greedy) with rollout.n={cfg.n}: vLLM refuses n > 1 for greedy "
                         "sampling, and n greedy samples would be identical; use a temperature > 0")
    if cfg.temperature > 2:
        raise ValueError(f"rollout.temperature={cfg.temperature}: vLLM accepts temperatures in [0, 2]")


def _check_vllm_here(cfg: RolloutConfig) -> None:
    """vLLM installed at the pinned version, and an allocator setting its sleep mode works with."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"rollout.engine: vllm needs vLLM, which is not installed here: pip install "
                         f"'megatron-rlcorr[vllm]' (vllm=={VLLM_VERSION}, on a GPU machine; it pins its own torch), "
                         "or use rollout.engine: embedded")
    found = importlib.metadata.version("vllm")
    if found != VLLM_VERSION:
        raise ValueError(f"rollout.engine: vllm is written against vLLM {VLLM_VERSION} but {found} is installed "
                         f"(its internals change between versions): pip install vllm=={VLLM_VERSION}")
    if cfg.sleep_level and "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise ValueError("rollout.sleep_level > 0 (vLLM's sleep mode) does not work with "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: unset it, or set rollout.sleep_level: 0")


def engine_arguments(cfg: RolloutConfig, model: ModelConfig, *, max_model_len: int, seed: int) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM` for this run (MoE models: also enable_return_routed_experts)."""
    args = dict(model=model.hf_checkpoint, tokenizer=model.hf_checkpoint, dtype="bfloat16",
                quantization="fp8" if cfg.precision == "fp8" else None,
                tensor_parallel_size=cfg.tensor_parallel_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
                max_model_len=max_model_len, seed=seed, enable_sleep_mode=cfg.sleep_level > 0,
                distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
                load_format="dummy",  # the trainer's weights arrive by load_weights before any generation
                worker_extension_cls=_EXTENSION, enable_prefix_caching=True, enforce_eager=cfg.enforce_eager)
    if model.moe is not None:
        args["enable_return_routed_experts"] = True
    return args


def split_routed_experts(routed: Any, prompt_len: int, response_len: int,
                         shape: DecoderShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(response rows [response_len, MoE layers, k], prompt rows [prompt_len - 1, MoE layers, k]) of
    one sample's `CompletionOutput.routed_experts` ([prompt + response - 1, layers, k], numpy or
    tensor; layers: every decoder layer, or the MoE layers only), in routed_experts_dtype."""
    import numpy as np

    routed_TLK = (routed.detach().cpu().long() if isinstance(routed, torch.Tensor)
                  else torch.from_numpy(np.asarray(routed).astype(np.int64)))
    rows, moe_layers = prompt_len + response_len - 1, list(shape.moe_layers)
    if routed_TLK.ndim != 3 or routed_TLK.shape[0] != rows or routed_TLK.shape[2] != shape.moe.router_topk:
        raise RuntimeError(f"vLLM returned routed experts of shape {tuple(routed_TLK.shape)} for a prompt of "
                           f"{prompt_len} and a response of {response_len} tokens; expected [{rows}, layers, "
                           f"{shape.moe.router_topk}] (prompt + response - 1 positions, model.moe.router_topk)")
    if routed_TLK.shape[1] == shape.num_layers:
        routed_TLK = routed_TLK[:, moe_layers]
    elif routed_TLK.shape[1] != len(moe_layers):
        raise RuntimeError(f"vLLM returned routed experts for {routed_TLK.shape[1]} layers; the model has "
                           f"{shape.num_layers} layers, {len(moe_layers)} of them MoE (model.moe.dense_layers)")
    routed_TLK = routed_TLK.to(routed_experts_dtype(shape.moe.num_experts))
    return routed_TLK[prompt_len - 1:].clone(), routed_TLK[: prompt_len - 1].clone()


class WeightStreamExtension:
    """Methods vLLM adds to its GPU worker (`worker_extension_cls`), reached by `collective_rpc`;
    `self` is the worker, with `model_runner.get_model()` the vLLM model."""

    # Class defaults: this class is mixed into vLLM's worker, with no __init__.
    _layerwise_sync = False
    _sync_expected: frozenset[str] = frozenset()  # the model's checkpoint parameters, at the sync's start
    _sync_loaded: set[str] | None = None          # what load_weights reported loaded so far; None: no sync open

    def begin_weight_sync(self, layerwise: bool) -> None:
        """Start a sync; `layerwise` (quantised models) restores the checkpoint-format parameters."""
        model = self.model_runner.get_model()
        self._layerwise_sync = layerwise
        if layerwise:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            with self._loading():
                initialize_layerwise_reload(model)
        self._sync_expected = _checkpoint_parameter_names(model)
        self._sync_loaded = set()

    def load_weight_pairs(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        assert self._sync_loaded is not None, "begin_weight_sync before load_weight_pairs"
        model = self.model_runner.get_model()
        with self._loading():
            loaded = model.load_weights(weights=pairs)
        if loaded is None:  # vLLM's Qwen2, Qwen3 and Llama report a set; a model that does not cannot be checked
            raise RuntimeError(f"vLLM's {type(model).__name__}.load_weights reports no loaded names, so a weight "
                               "sync cannot be checked complete")
        self._sync_loaded.update(loaded)

    def end_weight_sync(self) -> None:
        """Close the sync (fp8: vLLM processes what the reload brought, keeping the old tensors of
        layers that received nothing), then raise if any parameter received nothing."""
        assert self._sync_loaded is not None, "begin_weight_sync before end_weight_sync"
        missing = sorted(self._sync_expected - self._sync_loaded)
        self._sync_loaded = None
        if self._layerwise_sync:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._layerwise_sync = False
            with self._loading():
                finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)
        if missing:
            shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
            raise RuntimeError(f"the weight sync to vLLM left {len(missing)} of the model's parameters without a "
                               f"tensor: {shown}. The trainer's weight stream (model/weight_stream.py) sent nothing "
                               "for them: the trainer's model and the checkpoint vLLM was built from "
                               "(model.hf_checkpoint) must have the same weights")

    @contextlib.contextmanager
    def _loading(self) -> Iterator[None]:
        """vLLM's config as the current one and this GPU as the default device: what its loaders
        and layerwise processing expect (it enters both around its own weight updates)."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.model_runner.vllm_config), torch.device(self.device):
            yield

    def mask_vocab_rows_from(self, first_padded_row: int) -> None:
        """-inf logits for the rows of a padded vocabulary, from `first_padded_row` on."""
        model = self.model_runner.get_model()
        compute_logits = model.compute_logits

        def masked(*args: Any, **kwargs: Any) -> torch.Tensor | None:
            logits = compute_logits(*args, **kwargs)
            if logits is not None:  # None on ranks that do not gather the vocabulary
                logits[..., first_padded_row:] = float("-inf")
            return logits

        model.compute_logits = masked


def _checkpoint_parameter_names(model: torch.nn.Module) -> frozenset[str]:
    """The model's parameters a checkpoint fills: all but the KV-cache scales that a quantized
    model's attention layers register (no checkpoint of ours has them; vLLM defaults them)."""
    from vllm.model_executor.layers.quantization.kv_cache import KVCacheScaleParameter

    return frozenset(name for name, param in model.named_parameters() if not isinstance(param, KVCacheScaleParameter))


def _native_sampler_without_flashinfer() -> None:
    """VLLM_USE_FLASHINFER_SAMPLER=0 when flashinfer is not installed and the variable is unset; a
    value the user set is kept, whatever it is."""
    # flashinfer is optional for vLLM; where a sampler path reads this variable unset, it looks for
    # FlashInfer's top-k/top-p kernels and falls back with a warning. Which paths read it depends on
    # the vLLM version and the log-prob mode (with processed_logprobs recent samplers may not), so 0
    # is set whenever flashinfer is missing. vllm.envs reads the environment when asked, so setting
    # it before LLM(...) is enough.
    if importlib.util.find_spec("flashinfer") is None and "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ:
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"


@contextlib.contextmanager
def _process_rng_kept() -> Iterator[None]:
    """Put back the process's RNG states (python, numpy, torch, every CUDA device) afterwards: vLLM's
    worker reseeds them all with the engine seed while `LLM(...)` starts (set_random_seed)."""
    import numpy as np

    python, numpy_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class VLLMEngine:
    """The rollout engine interface (rollout/base.py) over `vllm.LLM` (module docstring)."""

    def __init__(self, cfg: RolloutConfig, model: ModelConfig, *, eos_token_id: int | Sequence[int] | None,
                 token_vocab_size: int | None, max_model_len: int | None, seed: int,
                 device: torch.device | str = "cuda") -> None:
        check_vllm_settings(cfg, model)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # external_launcher: the worker in this process
        _native_sampler_without_flashinfer()
        from vllm import LLM

        self.cfg, self.device = cfg, torch.device(device)
        self.shape = model.decoder_shape  # MoE: how to read the routed experts
        self.eos_ids = tuple([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or ())
        if not self.eos_ids:
            raise ValueError("the vLLM engine needs the tokenizer's end-of-sequence ids (eos_token_id)")
        with _process_rng_kept():
            self.llm = LLM(**engine_arguments(cfg, model, max_model_len=max_model_len or model.max_position_embeddings,
                                              seed=seed))
        if token_vocab_size is not None and token_vocab_size < model.vocab_size:
            self.llm.collective_rpc("mask_vocab_rows_from", args=(token_vocab_size,))
        self._asleep: set[str] = set()
        self._weights_current = False  # load_format="dummy": random until the first sync

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.cfg.weight_dtype

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face names (weight_stream's hf_names=True), one tensor at a time, on this rank's GPU."""
        assert "weights" not in self._asleep, "wake_up(['weights']) before load_weights"
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        self._weights_current = False  # until the whole stream is in
        self.llm.collective_rpc("begin_weight_sync", args=(self.cfg.precision == "fp8",))
        for name, tensor in pairs:
            self.llm.collective_rpc("load_weight_pairs", args=([(name, tensor.to(self.device))],))
        self.llm.collective_rpc("end_weight_sync")
        self.llm.reset_prefix_cache()
        self._weights_current = True

    def sample_groups(self, prompts: Sequence[Sequence[int]], *, n: int, seeds: Sequence[int], max_new_tokens: int,
                      temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> RolloutBatch:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(seeds) != len(prompts):
            raise ValueError(f"sample_groups: {len(prompts)} prompts but {len(seeds)} seeds (one per prompt)")
        if 0 < temperature < VLLM_MIN_TEMPERATURE:
            raise ValueError(f"temperature={temperature}: vLLM would sample at {VLLM_MIN_TEMPERATURE} instead; use 0 "
                             f"(greedy) or at least {VLLM_MIN_TEMPERATURE}")
        if not self._weights_current:
            raise RuntimeError("the vLLM engine holds no complete trainer weights (none loaded yet, a sync did not "
                               "finish, or sleep(level=2) dropped them): load_weights before generating")
        self.wake_up()
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                                 max_tokens=max_new_tokens, logprobs=0, seed=seed, stop_token_ids=list(self.eos_ids),
                                 detokenize=False)
                  for seed in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        rows, responses, logprobs, routed, prompt_routed = [], [], [], [], []
        for prompt, output in zip(prompts, outputs, strict=True):
            samples = sorted(output.outputs, key=lambda c: c.index)
            assert len(samples) == n, f"vLLM returned {len(samples)} samples for a prompt, asked for {n}"
            for sample in samples:
                ids = list(sample.token_ids)
                rows.append(list(prompt))
                responses.append(ids)
                logprobs.append(torch.tensor([step[token].logprob for step, token in zip(sample.logprobs, ids)],
                                             dtype=torch.float32))
                if self.shape.moe is not None:
                    if sample.routed_experts is None:
                        raise RuntimeError("vLLM returned no routed experts for a MoE model (built with "
                                           "enable_return_routed_experts=True): is model.hf_checkpoint a MoE "
                                           "checkpoint of model.moe's architecture?")
                    response_rows, prompt_rows = split_routed_experts(sample.routed_experts, len(prompt), len(ids),
                                                                      self.shape)
                    routed.append(response_rows)
                    prompt_routed.append(prompt_rows)
        finish = ["eos" if ids and ids[-1] in self.eos_ids else "length" for ids in responses]
        moe = self.shape.moe is not None
        return RolloutBatch(prompt_ids=rows, response_ids=responses, logprobs=logprobs, finish_reasons=finish,
                            routed_experts=routed if moe else None,
                            prompt_routed_experts=prompt_routed if moe else None)

    def sleep(self) -> None:
        if self.cfg.sleep_level and not self._asleep:
            self.llm.sleep(level=self.cfg.sleep_level)
            self._asleep = {"weights", "kv_cache"}
            self._weights_current = self.cfg.sleep_level == 1  # level 1 keeps them in host memory

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        waking = [t for t in (tags or ("weights", "kv_cache")) if t in self._asleep]
        if waking:
            self.llm.wake_up(tags=waking)
            self._asleep -= set(waking)
