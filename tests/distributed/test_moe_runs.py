"""Whole mixture-of-experts runs on gloo: the tiny Qwen3-MoE checkpoint of tools/make_tiny_hf.py
--moe (conftest.py: `tiny_hf_moe`), bf16 rollouts that record their routing, routing replay in the
fp32 trainer (recipes/tiny_hf_moe_cpu.yaml).

Expert parallelism over the two data-parallel ranks: their micro-batches differ in width (each
rank pads to its own longest sequence), and every MoE forward is a collective of the expert group
(training/step.py agrees the shapes), so an ep 2 run must go through and follow the ep 1 run (at
step 1, which both sample from the checkpoint's weights: the ep 1 run trains that step only); and a
run stopped after 1 of 2 steps and resumed from its checkpoint (experts saved per EP rank) must
equal the uninterrupted one.
"""
from pathlib import Path

import pytest

from tests.dist import run_distributed
from tests.runs import deterministic, train_runs

pytestmark = [pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_hf_moe_cpu.yaml"
SMALL = ["data.prompts_per_step=4", "rollout.n=4", "trainer.micro_batch_size=4", "trainer.logger=[console]",
         "data.val_files=[]", "trainer.test_freq=0", "trainer.save_hf=false"]


@pytest.mark.timeout(600)
def test_expert_parallel_run_follows_ep1_and_resumes_exactly(tiny_hf_moe, tmp_path):
    common = [*SMALL, f"model.hf_checkpoint={tiny_hf_moe / 'model'}",
              f"data.train_files=[{tiny_hf_moe / 'data' / 'train.parquet'}]", f"trainer.output_dir={tmp_path}"]
    runs = [(RECIPE, [*common, "name=ep1", "trainer.steps=1"]),
            (RECIPE, [*common, "name=ep2", "trainer.steps=2", "parallel.ep=2"]),
            (RECIPE, [*common, "name=exit", "trainer.steps=2", "trainer.exit_interval=1", "parallel.ep=2"]),
            (RECIPE, [*common, "name=exit", "trainer.steps=2", "trainer.exit_interval=1", "parallel.ep=2"])]
    ep1, ep2, first_half, resumed = run_distributed(train_runs, 2, runs)[0]

    assert [r["step"] for r in first_half] == [1] and [r["step"] for r in resumed] == [1, 2]
    assert resumed[:1] == first_half
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in ep2]
    # Step 1 samples from the checkpoint's weights on both layouts: the same rollouts, and the same
    # update up to the order in which the expert group sums its experts' outputs.
    for key in ("reward_mean", "response_length_mean", "rollout_corr/k3_kl", "moe/routing_mismatch_fraction"):
        assert ep2[0][key] == pytest.approx(ep1[0][key], rel=1e-6, abs=1e-9), key
    for key in ("actor/pg_loss", "grad_norm"):
        assert ep2[0][key] == pytest.approx(ep1[0][key], rel=1e-4, abs=1e-7), key
    for record in ep1 + ep2:
        assert 0 <= record["moe/routing_mismatch_fraction"] <= 1
        # tokens per expert, max over mean: 1 when balanced, at most the 8 experts / 2 per token
        assert 1 <= record["moe/expert_load_max_over_mean"] <= 4
        assert 0 <= record["rollout_corr/k3_kl"] < float("inf")
