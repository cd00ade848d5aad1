"""The rollout engine interface: what the trainer needs from vLLM or from the embedded engine.

An engine receives the trainer's full weights after every optimizer step (`load_weights`, from a
stream of (name, tensor) pairs) and samples `n` responses per prompt (`sample_groups`), reporting
the log-probability its own numerics assign to every sampled token. Those log-probs are
`rollout_log_prob` in the rollout correction. Each prompt comes with its own seed, and an engine
must make a prompt's samples depend on that seed only (not on the other prompts of the call):
that is what makes rollouts identical under every parallel layout (rl/rollout_world.py).
Engines that hold accelerator memory give it back while the trainer runs (`sleep`, `wake_up`).

Log-prob convention (`RolloutConfig.logprobs`):
- "tempered" (default): log_softmax(logits / temperature) of the sampled token, BEFORE top-k and
  top-p truncation, computed from the engine's logits cast to float32. This is the distribution the
  trainer recomputes (it divides its logits by the same temperature and never truncates), so the
  ratio between the two measures numerical mismatch only. It equals vLLM's "processed_logprobs"
  whenever top_p == 1 and top-k is off. With temperature 0 (greedy) the untempered
  log_softmax(logits) is reported, and top-k and top-p are ignored (as vLLM resets them).
- "processed": the log-probability under the distribution actually sampled from: tempered, then
  truncated to the top_k most likely tokens, then to the top-p nucleus of what is left, and
  renormalised over the kept tokens (vLLM's "processed_logprobs", and its order: top-k first, top-p
  on the renormalised top-k distribution). Under this convention the truncation itself shows up as
  off-policy mass in the correction.
Top-k keeps exactly k tokens (fewer only when the vocabulary is smaller; k = 0 or -1: off): a tie
at the k-th largest logit goes to the lower token ids, so top_k = 1 is greedy (argmax's first
maximum). vLLM's batched Triton kernel breaks ties the same way; its sort-based path (CPU, or
batches under 8 requests) keeps every tied token, which only differs on exactly equal logits.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from ..settings import check_choice

EngineName = Literal["embedded", "vllm"]
Precision = Literal["fp32", "bf16", "fp8"]
LogprobsMode = Literal["tempered", "processed"]
FinishReason = Literal["eos", "length"]
Placement = Literal["colocated", "separate"]

ENGINES: tuple[str, ...] = ("embedded", "vllm")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp8")
LOGPROBS_MODES: tuple[str, ...] = ("tempered", "processed")
PLACEMENTS: tuple[str, ...] = ("colocated", "separate")
VLLM_MIN_TEMPERATURE = 0.01  # vLLM samples a temperature in (0, 0.01) at 0.01 (SamplingParams, with a warning only)


def check_sampling(prefix: str, temperature: float, top_p: float, top_k: int) -> None:
    """The checks every sampling setting passes (rollout.*, rollout.val_kwargs.*)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{prefix}temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"{prefix}top_p must be in (0, 1] (1 = no nucleus truncation), got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ValueError(f"{prefix}top_k must be an integer >= -1 (0 or -1 = off: every token), got {top_k!r}")


@dataclass(frozen=True)
class ValSampling:
    """The recipe's `rollout.val_kwargs` (verl's `actor_rollout_ref.rollout.val_kwargs`): how
    validation and `eval` sample. do_sample false is greedy whatever the temperature (verl's
    meaning); the defaults are verl's: one greedy sample per prompt."""

    n: int = 1                 # samples per validation prompt (mean@n, best@k, maj@k, pass@k for k <= n)
    temperature: float = 0.0   # used only with do_sample (then 0 is greedy too)
    top_p: float = 1.0         # nucleus sampling (1 = off)
    top_k: int = 0             # the k likeliest tokens only, before top_p (0 or -1 = off)
    do_sample: bool = False    # false: greedy (temperature 0), as verl

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n (samples per validation prompt) must be >= 1, got {self.n}")
        check_sampling("", self.temperature, self.top_p, self.top_k)

    @property
    def sampling_temperature(self) -> float:
        """The temperature generation runs at: 0 (greedy) unless do_sample."""
        return self.temperature if self.do_sample else 0.0


@dataclass(frozen=True)
class RolloutConfig:
    """The `rollout` section of a recipe.

    `n` is the number of samples per prompt (the group size of GRPO/RLOO). Every rank generates:
    the world is cut into rollout groups of `tensor_parallel_size` consecutive ranks, each runs one
    engine (1 for the embedded engine, which holds the whole model on its rank). The vLLM engine
    also reads `gpu_memory_utilization`, `sleep_level` (0: stay resident; 1: weights to host
    memory during training; 2: drop them, they are re-synced anyway), `max_model_len` (None:
    the prompt limit plus `max_new_tokens`) and `enforce_eager` (vLLM's own switch: true runs
    the model eagerly, capturing no CUDA graphs; the embedded engine ignores it).

    `policy_lag` K (embedded engine only) emulates asynchronous RL: the engine samples, and reports
    log-probs, with the weights of K steps ago (embedded.EmbeddedEngine), so the rollout
    correction sees off-policy mismatch on top of the numerical one. 0: the latest weights.

    `placement: separate` is the real thing (rl/async_rollout.py): the last `num_ranks` ranks of the
    launch only generate, the others only train, and the rollout ranks generate the batch of step
    k + `max_staleness` while the trainer trains step k, with weights no older than step k's.
    Rollout groups of `tensor_parallel_size` ranks are then cut from the rollout ranks alone.
    """

    engine: EngineName = "embedded"   # embedded (in-process, CPU or GPU, emulates the precision) | vllm (GPU)
    precision: Precision = "bf16"     # the engine's weights and math: fp32 | bf16 | fp8 (the mismatch source)
    temperature: float = 1.0          # sampling temperature (0 = greedy; vLLM: 0 or >= 0.01); the trainer divides by it too
    top_p: float = 1.0                # nucleus sampling (1 = off); with vLLM, < 1 needs logprobs: processed
    top_k: int = 0                    # the k likeliest tokens only (0/-1 = off); vLLM: >= 1 needs logprobs: processed
    max_new_tokens: int = 16          # response length limit; longer responses end with finish_reason "length"
    n: int = 8                        # samples per prompt: the group of GRPO/RLOO advantages
    logprobs: LogprobsMode = "tempered"  # tempered: before top-k/top-p, as the trainer computes it | processed: after
    weight_sync_bucket_mb: int = 512  # the weight stream to the engine moves this much at a time
    tensor_parallel_size: int = 1     # ranks per rollout group (one engine each)
    gpu_memory_utilization: float = 0.6  # vLLM: share of GPU memory for its weights and KV cache
    sleep_level: int = 2              # vLLM during training: 0 stay resident, 1 weights to host, 2 drop them
    max_model_len: int | None = None  # vLLM: context length (null: the prompt limit + max_new_tokens)
    enforce_eager: bool = False       # vLLM: true runs the model eagerly, no CUDA graphs (false: vLLM's default)
    policy_lag: int = 0               # steps the embedded engine's weights lag the trainer's
    placement: Placement = "colocated"  # colocated: every rank generates, then trains | separate: rollout ranks apart
    num_ranks: int | None = None      # separate: the last num_ranks ranks of the launch generate and never train
    max_staleness: int | None = None  # separate: step k + S trains on rollouts of step k's weights (null: 1)
    # MoE models (model.moe): the trainer routes every token the engine generated from to the experts the
    # engine routed it to (rollout routing replay, R3), in every forward of the step (pi_old, the update,
    # recomputation); the router's weights still get gradients. The engine's routing is recorded either way
    # (moe/routing_mismatch_fraction is measured with and without replay).
    routing_replay: bool = False
    val_kwargs: ValSampling = field(default_factory=lambda: ValSampling())  # validation's sampling (verl's keys)

    def __post_init__(self) -> None:
        check_choice("engine", self.engine, ENGINES)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("logprobs", self.logprobs, LOGPROBS_MODES)
        # vLLM only: the embedded engine samples at the configured temperature, as the trainer divides by it.
        if self.engine == "vllm" and 0 < self.temperature < VLLM_MIN_TEMPERATURE:
            raise ValueError(f"rollout.temperature={self.temperature}: vLLM samples any temperature below "
                             f"{VLLM_MIN_TEMPERATURE} at {VLLM_MIN_TEMPERATURE} while the trainer divides its logits "
                             f"by {self.temperature}, so the two log-probs would disagree; use 0 (greedy) or at least "
                             f"{VLLM_MIN_TEMPERATURE}, or rollout.engine: embedded")
        check_sampling("", self.temperature, self.top_p, self.top_k)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")
        if self.weight_sync_bucket_mb < 1:
            raise ValueError(f"weight_sync_bucket_mb must be >= 1 (MiB per bucket of the weight stream), "
                             f"got {self.weight_sync_bucket_mb}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1 (ranks per rollout engine), got "
                             f"{self.tensor_parallel_size}")
        if self.engine == "embedded" and self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: the embedded engine runs the whole "
                             "model on each rank; use tensor_parallel_size: 1, or engine: vllm for tensor parallelism")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (the share of GPU memory vLLM may take), got "
                             f"{self.gpu_memory_utilization}")
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level must be 0 (stay resident), 1 (weights to host memory) or 2 (drop the "
                             f"weights) while training, got {self.sleep_level}")
        self._check_policy_lag()
        self._check_placement()
        if self.max_model_len is not None and self.max_model_len < self.max_new_tokens + 1:
            raise ValueError(f"max_model_len={self.max_model_len} leaves no room for a prompt and max_new_tokens="
                             f"{self.max_new_tokens}; raise it or leave it null (derived from the prompt limit)")

    def _check_policy_lag(self) -> None:
        if isinstance(self.policy_lag, bool) or not isinstance(self.policy_lag, int) or self.policy_lag < 0:
            raise ValueError(f"rollout.policy_lag must be an integer >= 0 (0: sample with the latest weights; K: "
                             f"with the weights of K steps ago), got {self.policy_lag!r}")
        if self.policy_lag and self.engine != "embedded":
            raise ValueError(f"rollout.policy_lag={self.policy_lag} is emulated by the embedded engine only, not "
                             f"rollout.engine={self.engine!r}: use rollout.engine: embedded, or rollout.policy_lag: 0")

    def _check_placement(self) -> None:
        check_choice("placement", self.placement, PLACEMENTS)
        for name in ("num_ranks", "max_staleness"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"rollout.{name} must be an integer, got {value!r}")
        if self.placement == "colocated":
            given = [name for name in ("num_ranks", "max_staleness") if getattr(self, name) is not None]
            if given:
                raise ValueError(f"rollout.{given[0]} is a setting of rollout.placement: separate, and placement is "
                                 f"colocated (every rank generates, then trains): set rollout.placement: separate, "
                                 f"or remove rollout.{given[0]}")
            return
        engine = self.tensor_parallel_size  # the ranks of one rollout engine: the fewest rollout ranks
        if self.num_ranks is None:
            raise ValueError(f"rollout.placement: separate needs rollout.num_ranks, the ranks at the end of the launch "
                             f"that generate and never train, and it is not set: set rollout.num_ranks: {engine} (one "
                             "rollout engine) or more, and launch that many ranks beyond the trainer's")
        if self.num_ranks < 1:
            raise ValueError(f"rollout.num_ranks={self.num_ranks}: rollout.placement: separate needs at least one "
                             f"rollout rank (the last num_ranks ranks of the launch generate): set rollout.num_ranks: "
                             f"{engine} or more, or rollout.placement: colocated")
        if self.num_ranks % self.tensor_parallel_size:
            raise ValueError(f"rollout.num_ranks={self.num_ranks} must be a multiple of rollout.tensor_parallel_size="
                             f"{self.tensor_parallel_size} (the rollout ranks form engines of that many ranks)")
        if self.max_staleness is not None and self.max_staleness < 1:
            raise ValueError(f"rollout.max_staleness={self.max_staleness}: with placement: separate the rollout ranks "
                             "generate ahead of the trainer, so batches are at least 1 step stale; use 1 (one step "
                             "off-policy, verl's) or more")
        if self.policy_lag:
            raise ValueError(f"rollout.policy_lag={self.policy_lag} emulates staleness on colocated ranks, and "
                             "rollout.placement is separate (real staleness, rollout.max_staleness): set "
                             "rollout.policy_lag: 0")

    @property
    def separate(self) -> bool:
        """The rollout ranks are apart from the trainer's (placement: separate)."""
        return self.placement == "separate"

    @property
    def staleness(self) -> int:
        """How many steps a batch may lag the trainer: max_staleness (1 when unset) when separate,
        policy_lag when colocated."""
        return (self.max_staleness or 1) if self.separate else self.policy_lag

    def trainer_world(self, launch_world: int) -> int:
        """The ranks that train in a launch of `launch_world` ranks: all of them when colocated,
        all but the last num_ranks when separate (ValueError when none would be left)."""
        if not self.separate:
            return launch_world
        if self.num_ranks >= launch_world:
            raise ValueError(f"rollout.num_ranks={self.num_ranks} leaves no trainer in a launch of {launch_world} "
                             f"ranks: launch more ranks (trainer ranks + {self.num_ranks}), or lower rollout.num_ranks")
        return launch_world - self.num_ranks

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the weights travel in to the engine (every rank of the stream's collectives
        uses it): vLLM's model dtype, bf16; the embedded engine's `weight_dtype(precision)`."""
        return torch.bfloat16 if self.engine == "vllm" else weight_dtype(self.precision)


def engine_max_model_len(cfg: RolloutConfig, max_prompt_length: int | None, max_positions: int) -> int:
    """The longest prompt + response an engine must hold: `rollout.max_model_len`, else the
    prompt limit plus `max_new_tokens`, else the model's positions. ValueError, naming the
    settings, when the model cannot hold it."""
    if max_prompt_length is not None and cfg.max_model_len is not None:
        if max_prompt_length + cfg.max_new_tokens > cfg.max_model_len:
            raise ValueError(f"rollout.max_model_len={cfg.max_model_len} is shorter than data.max_prompt_length "
                             f"{max_prompt_length} + rollout.max_new_tokens {cfg.max_new_tokens}: raise it, or "
                             "leave it null (derived from those two)")
    length = cfg.max_model_len or (max_prompt_length + cfg.max_new_tokens if max_prompt_length is not None
                                   else max_positions)
    if length > max_positions:
        raise ValueError(f"the rollout engine must hold {length} tokens (rollout.max_model_len, or "
                         f"data.max_prompt_length + rollout.max_new_tokens) but the model has "
                         f"max_position_embeddings={max_positions}: shorten data.max_prompt_length or "
                         "rollout.max_new_tokens")
    return length


def weight_dtype(precision: Precision) -> torch.dtype:
    """The dtype an engine of `precision` takes its weights in: its compute dtype, except that
    FP8 emulation quantises from float32 (a bf16 copy first would round twice)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def routed_experts_dtype(num_experts: int) -> torch.dtype:
    """The integer dtype recorded routing is kept in: uint8 for up to 256 experts, else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class RolloutBatch:
    """Sampled responses, one per input prompt, in input order.

    response_ids[i] includes the final EOS token when finish_reasons[i] == "eos" (the trainer
    trains on it); logprobs[i] is a float32 tensor with one entry per response token, under the
    convention of `RolloutConfig.logprobs` (see the module docstring).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[torch.Tensor]
    finish_reasons: list[FinishReason]
    # MoE models: the experts the engine routed to, per sample [len(response), MoE layers, top-k] (uint8 for
    # <= 256 experts, else int16; experts in descending router order). Row j is the forward whose output gave
    # response token j: input position len(prompt) - 1 + j (the last prompt token, then response tokens
    # 0..len - 2), which is where the trainer's log-prob of token j comes from. None: a dense model, or an
    # engine that does not record.
    routed_experts: list[torch.Tensor] | None = None
    # The same for the prompt's other positions 0..len(prompt) - 2 ([len(prompt) - 1, MoE layers, top-k]),
    # where the engine recorded them (prefill); None: prompt tokens are routed freely by the trainer.
    prompt_routed_experts: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        sizes = {len(self.prompt_ids), len(self.response_ids), len(self.logprobs), len(self.finish_reasons)}
        sizes |= {len(x) for x in (self.routed_experts, self.prompt_routed_experts) if x is not None}
        assert len(sizes) == 1, f"RolloutBatch fields disagree on the number of samples: {sizes}"

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]


@runtime_checkable
class RolloutEngine(Protocol):
    """A sampler of the trainer's policy with its own numerics (precision, kernels)."""

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the trainer should send the weights in."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace all weights from a mapping or a stream of (name, tensor) pairs, consumed once:
        full, unsharded float tensors with the neutral names of `model.weights.neutral_weight_shapes`
        (embed.weight, layers.{i}.q.weight, ..., lm_head.weight; a tied model's lm_head may be left out)."""
        ...

    def sample_groups(self, prompts: Sequence[Sequence[int]], *, n: int, seeds: Sequence[int], max_new_tokens: int,
                      temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> RolloutBatch:
        """`n` sampled responses per prompt, prompt-major (prompt i's sample j at row i * n + j); a
        sequence stops at EOS or after max_new_tokens. top_k: the k most likely tokens only (0 or
        -1: off), applied before top_p (module docstring). Prompt i's samples are a function of the
        weights, the prompt and seeds[i] alone: never of the other prompts of the call, so that
        however the prompts are spread over engines the same samples come back."""
        ...

    def sleep(self) -> None:
        """Free the accelerator memory generation holds while the trainer runs (a no-op where
        nothing is held)."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take back what `sleep` freed: "weights" (before `load_weights`), then "kv_cache"
        (before generating); None: both."""
        ...
