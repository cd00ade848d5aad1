"""rollout.policy_lag: the embedded engine samples with the weights of K loads ago.

Engine-level: lag 0 is the engine without lag; lag K after L loads generates, scores and reports
log-probs bit-identically to a lag-0 engine that was only given load max(L - K, 1); the precision
emulation is applied as without lag. Settings: the ValueErrors of a negative lag and of a lag on
vLLM, at recipe-load time. Training: a tiny run with lag 2 shows a larger rollout/trainer
mismatch (rollout_corr/k3_kl) than the same run without lag.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlcorr.model.config import ModelConfig
from megatron_rlcorr.recipe import load_recipe
from megatron_rlcorr.rollout import EmbeddedEngine, RolloutConfig, make_engine
from tests.unit.test_rollout import EOS, SHAPE, make_weights, prompts

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
PRECISIONS = ("fp32", "bf16", "fp8")
WEIGHTS = [make_weights(seed) for seed in range(4)]  # the trainer's weights after 0, 1, 2, 3 steps


def loaded(n_loads: int, lag: int, precision: str) -> EmbeddedEngine:
    """An engine of `lag` given WEIGHTS[0..n_loads - 1] in turn (fresh copies, as the stream sends)."""
    eng = EmbeddedEngine(SHAPE, precision=precision, eos_token_id=EOS, policy_lag=lag)
    for weights in WEIGHTS[:n_loads]:
        eng.load_weights({name: t.clone() for name, t in weights.items()})
    return eng


def rollouts(eng: EmbeddedEngine) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Sampled tokens, their reported log-probs and the teacher-forced scores of the same tokens."""
    batch = eng.sample_groups(prompts(3), n=4, seeds=[11, 12, 13], max_new_tokens=6)
    scores = eng.score(batch.prompt_ids, batch.response_ids)
    return batch.response_ids, torch.cat(batch.logprobs), torch.cat(scores)


def assert_identical(a, b) -> None:
    assert a[0] == b[0]
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_lag_0_is_the_engine_without_lag(precision):
    default = EmbeddedEngine(SHAPE, precision=precision, eos_token_id=EOS)
    for weights in WEIGHTS[:3]:
        default.load_weights(weights)
    assert default.policy_lag == 0
    assert_identical(rollouts(loaded(3, 0, precision)), rollouts(default))
    assert_identical(rollouts(loaded(3, 0, precision)), rollouts(_only(2, precision)))  # the latest weights
    assert loaded(3, 0, precision).weights_age == 0


def _only(index: int, precision: str) -> EmbeddedEngine:
    """A lag-0 engine given WEIGHTS[index] alone."""
    eng = EmbeddedEngine(SHAPE, precision=precision, eos_token_id=EOS)
    eng.load_weights(WEIGHTS[index])
    return eng


@pytest.mark.parametrize("precision", PRECISIONS)
def test_lag_1_generates_with_the_previous_weights(precision):
    for n_loads, used in ((1, 0), (2, 0), (3, 1), (4, 2)):
        assert_identical(rollouts(loaded(n_loads, 1, precision)), rollouts(_only(used, precision)))
    # and it really is not the latest: the lagged samples differ from the current policy's
    assert rollouts(loaded(3, 1, precision))[1].tolist() != rollouts(_only(2, precision))[1].tolist()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_lag_2_after_1_3_and_4_loads(precision):
    for n_loads, used, age in ((1, 0, 0), (2, 0, 1), (3, 0, 2), (4, 1, 2)):
        eng = loaded(n_loads, 2, precision)
        assert eng.weights_age == age
        assert_identical(rollouts(eng), rollouts(_only(used, precision)))


def test_a_failed_load_keeps_the_history():
    eng = loaded(2, 1, "bf16")
    bad = {name: t for name, t in WEIGHTS[2].items() if name != "layers.1.up.weight"}
    with pytest.raises(ValueError, match="missing"):
        eng.load_weights(bad)
    assert eng.weights_age == 1
    assert_identical(rollouts(eng), rollouts(_only(0, "bf16")))


def test_make_engine_passes_the_lag():
    model = ModelConfig(vocab_size=SHAPE.vocab_size, hidden_size=SHAPE.hidden_size, num_layers=SHAPE.num_layers,
                        num_attention_heads=SHAPE.num_attention_heads, num_query_groups=SHAPE.num_query_groups,
                        ffn_hidden_size=SHAPE.ffn_hidden_size, make_vocab_size_divisible_by=1)
    eng = make_engine(RolloutConfig(policy_lag=3), model, eos_token_id=EOS)
    assert isinstance(eng, EmbeddedEngine) and eng.policy_lag == 3


@pytest.mark.parametrize("lag", [-1, True, 1.5])
def test_engine_rejects_a_bad_lag(lag):
    with pytest.raises(ValueError, match=r"policy_lag \(rollout.policy_lag\) must be an integer >= 0"):
        EmbeddedEngine(SHAPE, policy_lag=lag)


def test_config_rejects_a_negative_lag_and_a_lag_on_vllm():
    assert RolloutConfig().policy_lag == 0
    with pytest.raises(ValueError, match=r"rollout.policy_lag must be an integer >= 0"):
        RolloutConfig(policy_lag=-1)
    with pytest.raises(ValueError, match=r"rollout.policy_lag=2 is emulated by the embedded engine only, not "
                                         r"rollout.engine='vllm'"):
        RolloutConfig(engine="vllm", policy_lag=2)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.policy_lag=-2"], r"rollout: rollout.policy_lag must be an integer >= 0"),
    (["rollout.policy_lag=1.5"], r"rollout.policy_lag must be an integer, got 1.5"),
    (["rollout.engine=vllm", "rollout.policy_lag=1"], r"use rollout.engine: embedded, or rollout.policy_lag: 0"),
])
def test_recipe_load_names_the_setting(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_recipe(TINY, overrides)
    assert load_recipe(TINY, ["rollout.policy_lag=2"]).rollout.policy_lag == 2


@pytest.mark.distributed
def test_training_with_lag_2_sees_a_larger_mismatch(tmp_path):
    from tests.dist import run_distributed
    from tests.runs import train_runs

    common = ["data.prompts_per_step=4", "rollout.n=4", "trainer.micro_batch_size=4", "trainer.save_every=0",
              "trainer.logger=[console]", "trainer.resume=false", "trainer.steps=6",
              f"trainer.output_dir={tmp_path}", "algorithm.rollout_correction={rollout_is: token}"]
    runs = [(TINY, [*common, "name=lag0", "rollout.policy_lag=0"]),
            (TINY, [*common, "name=lag2", "rollout.policy_lag=2"])]
    lag0, lag2 = run_distributed(train_runs, 1, runs)[0]
    k3 = {name: [r["rollout_corr/k3_kl"] for r in records] for name, records in (("lag0", lag0), ("lag2", lag2))}
    # Step 1 samples with the same initial weights in both runs; from step 3 on, lag 2 samples
    # with the weights of 2 steps before the trainer's.
    assert k3["lag2"][0] == pytest.approx(k3["lag0"][0], rel=1e-6)
    # Measured: ~1e-6 (bf16 vs fp32 alone) against ~3e-2..9e-2 with the lag; 100x leaves margin.
    assert all(b > a for a, b in zip(k3["lag0"][1:], k3["lag2"][1:])), k3
    late0, late2 = sum(k3["lag0"][2:]) / 4, sum(k3["lag2"][2:]) / 4
    assert late2 > 100 * late0, k3
