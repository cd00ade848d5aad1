"""Validation inside a run (rl/validation.py, rl/trainer.py) on gloo with the tiny Hugging Face
checkpoint: the metrics and records do not depend on the parallel layout (one process, dp2, tp2,
pp2; greedy and sampled), a run stopped and resumed validates at the same steps with the same
numbers as the uninterrupted one, val_only validates only, log_val_generations writes N records,
and `megatron-rlcorr eval` of a run checkpoint repeats the run's validation at that step (eval's entry
point on the process pool, tests/runs.py `entry_point`; its CLI launch is test_eval_run.py's).

The validation file holds 6 rows of the tiny dataset under two data sources; the reward is dapo_math
wrapped to return verl's mapping (score, acc, pred), so acc is the core variable and maj@k is computed.
"""
import json
from pathlib import Path

import pytest

from megatron_rlcorr.data.rewards import dapo_math, extract_answer
from tests.dist import run_distributed
from tests.runs import deterministic, entry_point_printing, train_runs

pytestmark = [pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_hf_cpu.yaml"
SOURCES = ("add_a", "add_b")
VAL_ROWS = 6
SMALL = ["data.prompts_per_step=4", "rollout.n=4", "trainer.micro_batch_size=4", "trainer.logger=[console]",
         "trainer.save_hf=false", f"data.reward={__name__}:reward_with_pred"]


def reward_with_pred(response: str, ground_truth, extra: dict) -> dict:
    """dapo_math as verl's reward returns it: score, acc and the extracted answer (maj@k votes on it)."""
    score = dapo_math(response, ground_truth)
    return {"score": score, "acc": score > 0, "pred": extract_answer(response)}


def _val_file(tiny_hf, out: Path) -> Path:
    """VAL_ROWS rows of the tiny dataset as JSONL, the first half under one data source, the rest another."""
    import pyarrow.parquet as pq

    rows = pq.read_table(tiny_hf / "data" / "train.parquet").to_pylist()[:VAL_ROWS]
    path = out / "val.jsonl"
    with path.open("w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({**row, "data_source": SOURCES[i * len(SOURCES) // VAL_ROWS]}) + "\n")
    return path


def _common(tiny_hf, out: Path) -> list[str]:
    return [*SMALL, f"model.hf_checkpoint={tiny_hf / 'model'}", f"trainer.output_dir={out}",
            f"data.train_files=[{tiny_hf / 'data' / 'train.parquet'}]", f"data.val_files=[{_val_file(tiny_hf, out)}]"]


# ---- the same numbers under every layout ---------------------------------------------------------

OFFLOAD = ["model.offload_params=true", "model.offload_grads=true", "optim.offload_optimizer=true"]
GREEDY = {"n": 2}  # do_sample false: one generation per prompt, copied
SAMPLED = {"n": 4, "temperature": 1.0, "do_sample": True}


def _layout_validations(rank, world_size, common, layouts):
    """For each layout: the trainer's first weights validated greedily and sampled (metrics on every
    rank, rank 0's records)."""
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups
    from megatron_rlcorr.recipe import load_recipe
    from megatron_rlcorr.rl.trainer import Trainer
    from megatron_rlcorr.rl.validation import validate
    from megatron_rlcorr.rollout.base import ValSampling

    enable_cpu_megatron()
    out = []
    for overrides in layouts:
        recipe = load_recipe(RECIPE, [*common, *overrides])
        p = recipe.parallel
        groups = build_parallel_groups(p.tp, p.pp, p.cp, p.vpp, rollout_tp=recipe.rollout.tensor_parallel_size)
        try:
            trainer = Trainer(recipe, groups)
            trainer._push_weights()
            results = {}
            for name, kwargs in (("greedy", GREEDY), ("sampled", SAMPLED)):
                result = validate(trainer.engine, trainer.val_task, trainer.val_prompts, ValSampling(**kwargs),
                                  max_new_tokens=recipe.rollout.max_new_tokens, groups=groups,
                                  seed=recipe.trainer.seed, step=0, device=trainer.device)
                results[name] = (result.metrics, result.records)
        finally:
            destroy_parallel_groups()
        out.append(results)
    return out


def _world(rank, world_size, common, layouts, runs):
    """Layout validations, then whole runs (tests/runs.py), in one world: one start-up."""
    return _layout_validations(rank, world_size, common, layouts), train_runs(rank, world_size, runs)


@pytest.fixture(scope="module")
def worlds(tiny_hf, tmp_path_factory):
    """Two gloo worlds (process start-up is most of the time, so everything shares them):
    - one process: the reference validations, and a val_only run;
    - two processes: the validations under dp2, tp2 and pp2, then a run of 3 steps validating at 0,
      2 and 3 (test_freq 2 and the last step), logged at those steps only (log_every 3), and the
      same run with trainer offload stopped after step 2 (exit_interval) and resumed."""
    out = tmp_path_factory.mktemp("val_runs")
    common = _common(tiny_hf, out)
    run = [*common, "trainer.steps=3", "trainer.test_freq=2", "trainer.log_every=3", "trainer.log_val_generations=5",
           f"rollout.val_kwargs.n={SAMPLED['n']}", "rollout.val_kwargs.temperature=1.0",
           "rollout.val_kwargs.do_sample=true"]
    [single], [val_only] = run_distributed(_world, 1, common, [[]],
                                           [(RECIPE, [*run, "name=val_only", "trainer.val_only=true"])])[0]
    layouts = [[], ["parallel.tp=2"], ["parallel.pp=2"]]  # dp2, tp2, pp2
    # with trainer offload: validation leaves the trainer's states and the engine as it found them
    exiting = (RECIPE, [*run, "name=exit", "trainer.exit_interval=2", *OFFLOAD])
    ranks = run_distributed(_world, 2, common, layouts, [(RECIPE, [*run, "name=whole"]), exiting, exiting])
    whole, first_half, resumed = ranks[0][1]
    return {"out": out, "single": single, "layouts": [r[0] for r in ranks], "val_only": val_only, "whole": whole,
            "first_half": first_half, "resumed": resumed}


def test_validation_is_the_same_under_every_layout(worlds):
    single, (rank0, rank1) = worlds["single"], worlds["layouts"]
    for name in ("greedy", "sampled"):
        metrics, records = single[name]
        n = GREEDY["n"] if name == "greedy" else SAMPLED["n"]
        assert len(records) == VAL_ROWS * n
        assert [r["data_source"] for r in records] == [s for s in SOURCES for _ in range(VAL_ROWS // 2 * n)]
        assert {"prompt_ids", "response_ids", "response", "ground_truth", "score", "acc", "pred"} <= records[0].keys()
        for source in SOURCES:
            assert f"val-core/{source}/acc/mean@{n}" in metrics and f"val-core/{source}/acc/maj@{n}/mean" in metrics
            assert f"val-core/{source}/acc/pass@{n}" in metrics
            right = [r["acc"] for r in records if r["data_source"] == source]
            assert metrics[f"val-core/{source}/acc/mean@{n}"] == pytest.approx(sum(right) / len(right))
        for layout, first, second in zip(["dp2", "tp2", "pp2"], rank0, rank1):
            assert first[name] == (metrics, records), (layout, name)  # rank 0: metrics and records
            assert second[name] == (metrics, []), (layout, name)  # metrics on every rank, records on rank 0
    greedy, _ = single["greedy"]
    for source in SOURCES:  # n greedy samples are one: no spread, best = worst = mean
        assert greedy[f"val-aux/{source}/acc/std@2"] == 0.0
        assert greedy[f"val-core/{source}/acc/best@2/mean"] == greedy[f"val-core/{source}/acc/mean@2"]
    sampled_records = single["sampled"][1]
    assert len({tuple(r["response_ids"]) for r in sampled_records}) > VAL_ROWS  # sampling varies within a prompt


# ---- in the trainer: the steps it validates at, resume, val_only, generations files --------------

def _validated_steps(records):
    return [r["step"] for r in records if any(k.startswith("val-core/") for k in r)]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_run_validates_before_training_every_test_freq_steps_and_at_the_last(worlds):
    out, whole = worlds["out"], worlds["whole"]
    assert [r["step"] for r in whole] == [0, 2, 3]  # log_every 3: step 2 is logged because it validates
    assert _validated_steps(whole) == [0, 2, 3]
    assert all(k == "step" or k.startswith("val-") for k in deterministic(whole[0]))  # step 0: validation only
    assert "loss" in whole[1] and "val-core/add_a/acc/mean@4" in whole[1]  # with the step's metrics
    assert sorted(p.name for p in (out / "whole" / "val_generations").iterdir()) == [
        "step_0.jsonl", "step_2.jsonl", "step_3.jsonl"]
    records = _lines(out / "whole" / "val_generations" / "step_2.jsonl")
    assert len(records) == 5  # trainer.log_val_generations
    assert [r["data_source"] for r in records] == ["add_a"] * 5  # the first ones: prompt order, then sample order


def test_a_resumed_run_validates_like_the_uninterrupted_one(worlds):
    out, whole, first_half, resumed = worlds["out"], worlds["whole"], worlds["first_half"], worlds["resumed"]
    assert [r["step"] for r in first_half] == [0, 2]
    # step 0 not again (its record is the first launch's), the same numbers (trainer offload or not)
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in whole]
    for step in (0, 2, 3):
        assert _lines(out / "exit" / "val_generations" / f"step_{step}.jsonl") == \
            _lines(out / "whole" / "val_generations" / f"step_{step}.jsonl")


def test_val_only_validates_and_stops(worlds):
    """One process's val_only run logs what the dp2 run logged at step 0, and nothing else."""
    out, whole, val_only = worlds["out"], worlds["whole"], worlds["val_only"]
    assert [r["step"] for r in val_only] == [0]
    assert deterministic(val_only[0]) == deterministic(whole[0])  # the same weights, seed and step
    assert not (out / "val_only" / "checkpoints").exists()
    assert [p.name for p in (out / "val_only" / "val_generations").iterdir()] == ["step_0.jsonl"]


@pytest.mark.timeout(600)  # alone, it also starts the module's worlds
def test_eval_of_a_checkpoint_repeats_the_runs_validation_at_its_step(worlds, tmp_path):
    """`megatron-rlcorr eval --nproc 1` of the dp2 run's last checkpoint (step 3) with the run's own
    recipe (sampled: val_kwargs n 4 at temperature 1), as eval's entry point on a 1-process pool (what
    the CLI launches with torchrun): the metrics the run logged at step 3 and the same first records,
    as eval seeds like validation at the checkpoint's step (not 0)."""
    out, whole = worlds["out"], worlds["whole"]
    argv = ["--model", str(out / "whole"), "--data", str(out / "val.jsonl"), "--out", str(tmp_path / "eval")]
    [(code, stdout, stderr)] = run_distributed(entry_point_printing, 1, "eval", argv)
    assert code == 0, stderr[-3000:]
    assert "seeded as validation at step 3" in stdout and "warning:" not in stderr
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics == {k: v for k, v in whole[-1].items() if k.startswith("val-")}
    records = _lines(tmp_path / "eval" / "generations.jsonl")
    assert len(records) == VAL_ROWS * SAMPLED["n"]
    assert records[:5] == _lines(out / "whole" / "val_generations" / "step_3.jsonl")  # log_val_generations
