"""The GPU tier: the training step with Transformer Engine layers in BF16 and FP8, padded and
packed, on odd sequence lengths; the same layout on NCCL with sequence parallelism where there
are GPUs for it; and a short real training run with FP8-emulated rollouts.

`bash tools/test.sh -m gpu` runs these (with tests/gpu/test_correction_cuda.py: the correction
captured in a CUDA graph, and tests/unit/test_model.py: the TE model against the reference);
`bash tools/gpu_check.sh` runs them with the GPU benchmarks. On a CUDA machine without Transformer
Engine they fail with the fix (tests/gpu/te.py). FP8 recipes beyond delayed and tensorwise run
where Transformer Engine says this GPU supports them (blockwise: CUDA >= 12.9).
Tolerances are BF16's: the reference is the plain-torch float32 forward of the same weights.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist import nccl_or_skip, run_distributed
from tests.gpu.te import require_transformer_engine

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
# FP8 GEMMs need dims that are multiples of 16; the vocabulary is padded by Megatron.
CFG = dict(vocab_size=1000, hidden_size=128, num_layers=2, num_attention_heads=8, num_query_groups=2,
           ffn_hidden_size=256, add_qkv_bias=True, rotary_base=1e6, max_position_embeddings=256)
SEED, BATCH = 5, 8
VARIANTS = {"bf16": None, "fp8_delayed": {"recipe": "delayed"}, "fp8_tensorwise": {"recipe": "tensorwise"},
            "fp8_blockwise": {"recipe": "blockwise"}}
LAYOUTS = {"padded": dict(micro_batch_size=2), "packed": dict(micro_batch_size=1, max_tokens_per_micro_batch=96)}


def _batch():
    """Odd prompt and response lengths (3..57 tokens in all), right-padded to an odd width."""
    gen = torch.Generator().manual_seed(2)
    width = 61
    tokens = torch.zeros(BATCH, width, dtype=torch.long)
    mask = torch.zeros(BATCH, width)
    for i in range(BATCH):
        prompt, response = 3 + 2 * (i % 3), 1 + (13 * i + 7) % 51
        tokens[i, :prompt + response] = torch.randint(1, CFG["vocab_size"], (prompt + response,), generator=gen)
        mask[i, prompt - 1:prompt - 1 + response] = 1
    targets = torch.cat([tokens[:, 1:], torch.zeros(BATCH, 1, dtype=torch.long)], dim=1)
    return tokens, targets, mask


def _reference_log_probs(tokens, targets):
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.reference import reference_forward
    from megatron_rlcorr.model.weights import init_full_weights

    cfg = ModelConfig(**CFG)
    with torch.no_grad():
        logits = reference_forward(init_full_weights(cfg, SEED), cfg, tokens).double()
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()


def _step_config(layout):
    from megatron_rlcorr.config import RolloutCorrectionConfig
    from megatron_rlcorr.training.losses import LossConfig
    from megatron_rlcorr.training.step import StepConfig

    correction = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_token_veto_threshold=1e-4)
    return StepConfig(loss=LossConfig(entropy_coeff=0.01), correction=correction, **LAYOUTS[layout])


def _step_worker(rank, world, tp, sequence_parallel, variants, layouts, tokens, targets, mask, rollout):
    """Per (variant, layout): a fresh TE model, pi_old, one step; what each pass fed the model."""
    import megatron.core.models.gpt.gpt_model as gpt_model

    from megatron_rlcorr.model.implementation import resolve_transformer_impl
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import export_full_weights
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs, train_minibatch

    assert resolve_transformer_impl(None) == "transformer_engine"
    seen = []
    forward = gpt_model.GPTModel.forward

    def recording_forward(self, input_ids, *args, **kwargs):
        seen.append(input_ids.numel())
        return forward(self, input_ids, *args, **kwargs)

    gpt_model.GPTModel.forward = recording_forward
    groups = build_parallel_groups(tp, 1, 1, sequence_parallel=sequence_parallel)
    advantages = torch.linspace(-1, 1, BATCH)[:, None].expand_as(mask).contiguous()
    batch = StepBatch(tokens, targets, mask, rollout, advantages)
    out = {}
    for variant in variants:
        for layout in layouts:
            cfg = ModelConfig(**CFG, bf16=True, fp8=VARIANTS[variant])
            chunks, optimizer, _ = build_model_and_optimizer(cfg, OptimSettings(lr=1e-3), groups, seed=SEED,
                                                             total_steps=2)
            step_cfg = _step_config(layout)
            seen.clear()
            old = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=step_cfg.micro_batch_size,
                                        temperature=1.0, max_tokens_per_micro_batch=step_cfg.max_tokens_per_micro_batch)
            result = train_minibatch(chunks, optimizer, batch, groups=groups, cfg=step_cfg, old_log_probs=old)
            out[(variant, layout)] = dict(
                old=old.float().cpu(), tokens_seen=list(seen),
                metrics={k: float(v) for k, v in result.metrics.items()},
                weights={k: v.float().cpu() for k, v in export_full_weights(chunks, groups).items()})
    return out


def _variants_here() -> list[str]:
    """The variants this GPU runs: FP8 recipes as Transformer Engine reports them (blockwise needs CUDA >= 12.9)."""
    from megatron_rlcorr.model.implementation import fp8_recipe_unsupported_here

    return [v for v, fp8 in VARIANTS.items() if fp8 is None or fp8_recipe_unsupported_here(fp8["recipe"]) is None]


@pytest.fixture(scope="module")
def single_gpu():
    require_transformer_engine()
    variants = _variants_here()
    tokens, targets, mask = _batch()
    reference = _reference_log_probs(tokens, targets)
    rollout = torch.where(mask > 0, reference + 0.05 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)),
                          torch.zeros_like(reference)).clamp(max=-1e-4)
    results = run_distributed(_step_worker, 1, 1, False, variants, list(LAYOUTS), tokens, targets, mask, rollout,
                              backend=nccl_or_skip(1))[0]
    return dict(results=results, variants=variants, reference=reference, mask=mask > 0, tokens=tokens,
                targets=targets, rollout=rollout)


# The module fixture (one NCCL process: 3-4 variants x 2 layouts of model build, pi_old and a step)
# runs inside whichever of these tests comes first: their timeouts include it.
FIXTURE_TIMEOUT = 300


@pytest.mark.timeout(60)
def test_our_fp8_rules_agree_with_transformer_engine_on_this_gpu():
    """model.build's per-recipe rules (what the recipe check applies on any machine) give the
    answer the installed Transformer Engine's own checks give on this GPU."""
    require_transformer_engine()
    from megatron_rlcorr.model import implementation

    capability = torch.cuda.get_device_capability()
    for recipe in ("delayed", "tensorwise", "blockwise", "mxfp8"):
        ours = implementation.fp8_recipe_unsupported(recipe, capability, torch.version.cuda)
        theirs = implementation._transformer_engine_fp8_check(recipe)
        assert (ours is None) == (theirs is None), (recipe, capability, torch.version.cuda, ours, theirs)


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_bf16_step_matches_the_float32_reference(single_gpu):
    """pi_old in BF16 is the float32 reference's within BF16 rounding, padded and packed alike."""
    mask, ref = single_gpu["mask"], single_gpu["reference"]
    for layout in LAYOUTS:
        old = single_gpu["results"][("bf16", layout)]["old"]
        diff = (old - ref)[mask].abs()
        assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.15, (layout, float(diff.mean()), float(diff.max()))


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_packed_equals_padded(single_gpu):
    """Packing changes the kernels' summation order, not the result: log-probs, loss and the
    updated weights agree within BF16 rounding."""
    mask = single_gpu["mask"]
    for variant in single_gpu["variants"]:
        padded, packed = single_gpu["results"][(variant, "padded")], single_gpu["results"][(variant, "packed")]
        assert float((padded["old"] - packed["old"])[mask].abs().max()) < 0.1, variant
        assert math.isclose(padded["metrics"]["actor/pg_loss"], packed["metrics"]["actor/pg_loss"], rel_tol=0.05,
                            abs_tol=1e-3), variant
        for name, value in padded["weights"].items():
            assert float((packed["weights"][name] - value).abs().max()) < 5e-3, (variant, name)
        assert packed["metrics"]["batch/padding_fraction"] < padded["metrics"]["batch/padding_fraction"]


@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_fp8_step_is_aligned_finite_and_near_bf16(single_gpu):
    """Every FP8 micro-batch reaches the model with a multiple of 16 tokens (odd lengths are
    padded in both passes), and FP8 moves log-probs by the amount measured for FP8 GEMMs."""
    mask = single_gpu["mask"]
    assert {"fp8_delayed", "fp8_tensorwise"} <= set(single_gpu["variants"])  # any FP8 GPU (8.9+) runs these
    for variant in (v for v in single_gpu["variants"] if v.startswith("fp8_")):
        for layout in LAYOUTS:
            result = single_gpu["results"][(variant, layout)]
            assert result["tokens_seen"] and all(n % 16 == 0 for n in result["tokens_seen"]), (variant, layout)
            assert all(math.isfinite(v) for v in result["metrics"].values()), (variant, layout)
            bf16 = single_gpu["results"][("bf16", layout)]["old"]
            assert float((result["old"] - bf16)[mask].abs().mean()) < 0.5, (variant, layout)
    for layout in LAYOUTS:  # BF16 needs no alignment: odd widths stay odd when padded
        assert any(n % 16 for n in single_gpu["results"][("bf16", layout)]["tokens_seen"]), layout


@pytest.mark.timeout(FIXTURE_TIMEOUT + 180)
def test_sequence_parallel_tp2_on_nccl_matches_one_gpu(single_gpu):
    """TP 2 with sequence parallelism (TE norms), padded and packed, on two GPUs: the single GPU's
    log-probs and updated weights within BF16 rounding."""
    backend = nccl_or_skip(2)
    results = run_distributed(_step_worker, 2, 2, True, ["bf16"], list(LAYOUTS), single_gpu["tokens"],
                              single_gpu["targets"], single_gpu["mask"].float(), single_gpu["rollout"], backend=backend)
    mask = single_gpu["mask"]
    for layout in LAYOUTS:
        one = single_gpu["results"][("bf16", layout)]
        for rank_results in results:
            two = rank_results[("bf16", layout)]
            assert float((two["old"] - one["old"])[mask].abs().max()) < 0.1, layout
            for name, value in one["weights"].items():
                assert float((two["weights"][name] - value).abs().max()) < 5e-3, (layout, name)


@pytest.mark.timeout(480)
def test_twenty_step_training_run_with_fp8_rollouts(tmp_path):
    """The tiny recipe on one GPU: BF16 Transformer Engine training, rollouts from an engine with
    FP8-quantised weights (the mismatch the correction handles), packed micro-batches."""
    require_transformer_engine()
    nccl_or_skip(1)
    # The machine's own PYTHONPATH stays (offline GPU machines put Transformer Engine there)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
           "megatron_rlcorr.train", "--config", str(ROOT / "recipes" / "tiny_cpu.yaml"), "name=gpu_fp8_rollouts",
           f"trainer.output_dir={tmp_path}", "trainer.steps=20", "trainer.save_every=0", "model.bf16=true",
           "model.hidden_size=64", "rollout.precision=fp8", "trainer.max_tokens_per_micro_batch=128",
           "trainer.logger=[console]"]
    # Under the test's own timeout, so that a slow run fails with its output
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gpu_fp8_rollouts" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 21))
    for row in rows:
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        assert 0.0 <= row["batch/padding_fraction"] < 1.0
    # FP8 weights in the engine, BF16 in the trainer: a real, measured mismatch
    assert max(row["rollout_corr/k3_kl"] for row in rows) > 0
