"""The real path end to end on gloo: a Hugging Face checkpoint and a parquet dataset in, RL, a Hugging
Face checkpoint out; `megatron-rlcorr score` and `export` launched from the CLI (score once, on two
ranks under tp2: the command's contract; under the other layouts and on the run's checkpoints through
its entry point in the process pool, tests/runs.py `entry_point`).

The run uses tools/make_tiny_hf.py's files (conftest.py: `tiny_hf`); `score` on a checkpoint of
tests/hf_models.py is compared with transformers' own float32 log-probs.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rlcorr.correction import compute_rollout_correction
from megatron_rlcorr.score import DAPO_CORRECTION
from tests.dist import run_distributed
from tests.hf_models import hf_log_probs, hf_logits, make_checkpoint, safetensors_tensors
from tests.runs import deterministic, entry_point, read_metrics, train_runs

pytestmark = [
    pytest.mark.distributed,
]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_hf_cpu.yaml"
# Validation is tested in test_validation.py: off here.
SMALL = ["data.prompts_per_step=4", "rollout.n=4", "trainer.micro_batch_size=4", "trainer.logger=[console]",
         "algorithm.dynamic_sampling.enabled=true", "data.val_files=[]", "trainer.test_freq=0"]
TEMPERATURE = 0.7


def _files(tiny_hf):
    return [f"model.hf_checkpoint={tiny_hf / 'model'}", f"data.train_files=[{tiny_hf / 'data' / 'train.parquet'}]"]


def _cli(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "megatron_rlcorr.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


# ---- training from a checkpoint and a dataset ----------------------------------------------------

def test_dataset_run_resumes_with_the_next_prompts(tiny_hf, tmp_path):
    """A run stopped after 1 of 2 steps and resumed equals the uninterrupted run, and reads the
    dataset from where it stopped (step 2's prompts are the 4 after step 1's). The other checks are
    bounds that hold for any trajectory: a few steps of this tiny model learn or collapse depending
    on the machine's float rounding (on a fresh 2-core machine every reward was -1 by step 4), so no
    check depends on learning."""
    common = [*SMALL, *_files(tiny_hf), f"trainer.output_dir={tmp_path}", "trainer.save_hf=false"]
    runs = [(RECIPE, [*common, "name=whole", "trainer.steps=2"]),
            (RECIPE, [*common, "name=exit", "trainer.steps=2", "trainer.exit_interval=1"]),
            (RECIPE, [*common, "name=exit", "trainer.steps=2", "trainer.exit_interval=1"])]
    whole, first_half, resumed = run_distributed(train_runs, 2, runs)[0]
    assert [r["step"] for r in first_half] == [1] and [r["step"] for r in resumed] == [1, 2]
    assert resumed[:1] == first_half
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in whole]
    # 4 prompts a step from an 80-row file, read in order: the position is in the checkpoint
    assert [r["data/epoch"] for r in whole] == pytest.approx([0.05, 0.1])
    max_new_tokens, samples = 8, 4 * 4  # the recipe's rollout.max_new_tokens; round 0: prompts x rollout.n
    for record in whole:
        assert record["data/round0_dropped_long_prompts"] == 0  # every prompt of the file fits
        # dapo_math scores +1 (right) or -1, and acc is its right answers: a whole number of them
        right = record["reward/acc_mean"] * samples
        assert right == pytest.approx(round(right)) and 0 <= round(right) <= samples
        assert record["reward_mean"] == pytest.approx(2 * record["reward/acc_mean"] - 1)
        assert 1 <= record["dynamic_sampling/num_gen_batches"] <= 3  # algorithm.dynamic_sampling.max_num_gen_batches
        assert 0 <= record["dynamic_sampling/filler_fraction"] <= 1
        # what was generated (the fillers, when dynamic sampling found no informative group): never
        # an empty mean's 0 tokens, all truncated
        assert 1 <= record["response_length_mean"] <= record["response_length_max"] <= max_new_tokens
        assert record["response_length_max"] == int(record["response_length_max"])
        assert 0 <= record["response/clip_fraction"] <= 1
        assert record["response/clip_fraction"] < 1 or record["response_length_mean"] == max_new_tokens
        assert 0 <= record["rollout_corr/k3_kl"] < float("inf")
    assert whole[0]["rollout_corr/k3_kl"] > 0  # bf16 rollouts against fp32 training: a real mismatch


@pytest.fixture(scope="module")
def trained_run(tiny_hf, tmp_path_factory):
    """Two steps of the tiny HF recipe on 2 ranks, with the Hugging Face export at the end: train's
    entry point on the pool's processes, under torchrun's environment (tests/runs.py)."""
    out = tmp_path_factory.mktemp("runs")
    argv = ["--config", str(RECIPE), *SMALL, *_files(tiny_hf), f"trainer.output_dir={out}", "trainer.steps=2"]
    (code0, printed), (code1, _) = run_distributed(entry_point, 2, "train", argv)
    assert code0 == code1 == 0, printed[-3000:]
    assert "hugging face checkpoint:" in printed
    return out / "tiny_hf_cpu"


def test_save_hf_writes_a_checkpoint_transformers_loads(trained_run, tiny_hf):
    from transformers import AutoTokenizer

    hf = trained_run / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in hf.iterdir()}
    assert json.loads((hf / "config.json").read_text())["model_type"] == "qwen2"
    tokens = torch.randint(0, 133, (2, 10), generator=torch.Generator().manual_seed(0))
    trained, start = hf_logits(hf, tokens), hf_logits(tiny_hf / "model", tokens)
    assert not torch.allclose(trained, start)  # two RL steps moved the weights
    assert AutoTokenizer.from_pretrained(hf, local_files_only=True).eos_token == "<|im_end|>"
    assert len(read_metrics(trained_run)) == 2


def test_export_of_a_run_equals_its_save_hf(trained_run, tmp_path):
    proc = _cli("export", "--model", trained_run, "--out", tmp_path / "out", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--nproc_per_node=2" in proc.stdout  # the layout that wrote the checkpoint
    exported, saved = safetensors_tensors(tmp_path / "out"), safetensors_tensors(trained_run / "hf")
    assert sorted(exported) == sorted(saved)
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (trained_run / "hf" / "tokenizer.json").read_bytes()


def test_score_a_run_checkpoint(trained_run, tmp_path):
    tokens = torch.randint(0, 133, (3, 12), generator=torch.Generator().manual_seed(1))
    rollouts = tmp_path / "in.jsonl"
    rollouts.write_text("".join(json.dumps({"prompt_ids": t[:5].tolist(), "response_ids": t[5:].tolist()}) + "\n"
                                for t in tokens))
    step_dir = trained_run / "checkpoints" / "step_000002"
    expected = hf_log_probs(trained_run / "hf", tokens, TEMPERATURE)[:, 4:]
    # The checkpoint was written by dp=2; a distributed checkpoint loads under any layout. The dp2
    # layout scores the step's folder, tp2 and pp2 the run folder (its latest checkpoint), each with
    # score's entry point on 2 processes of the pool (the CLI launch is test_score_matches_transformers').
    for name, layout in {"dp2": [], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}.items():
        out = tmp_path / f"{name}.jsonl"
        args = ["--model", str(step_dir if name == "dp2" else trained_run), "--rollouts", str(rollouts),
                "--out", str(out), f"rollout.temperature={TEMPERATURE}", *layout]
        assert [code for code, _ in run_distributed(entry_point, 2, "score", args)] == [0, 0], name
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == len(tokens)
        for record, want in zip(records, expected):
            torch.testing.assert_close(torch.tensor(record["log_probs"]), want, atol=1e-4, rtol=0, msg=name)


# ---- score on a Hugging Face checkpoint under several layouts -----------------------------------

@pytest.fixture(scope="module")
def scoring(tmp_path_factory):
    """A Qwen2 checkpoint and a rollout file: varied lengths, an empty response, a pass-through
    field, and rollout log-probs (transformers' own, shifted by a known amount) on all but one."""
    root = tmp_path_factory.mktemp("score")
    checkpoint = make_checkpoint(root / "qwen2", "qwen2", seed=5, sharded=True)
    gen = torch.Generator().manual_seed(2)
    records, expected = [], []
    for i, (p, r) in enumerate([(3, 9), (1, 4), (7, 0), (2, 12), (5, 5), (4, 1), (6, 8)]):
        tokens = torch.randint(0, 100, (1, p + r), generator=gen)
        want = hf_log_probs(checkpoint, tokens, TEMPERATURE)[0, p - 1:] if r else torch.zeros(0)
        record = {"id": f"seq{i}", "prompt_ids": tokens[0, :p].tolist(), "response_ids": tokens[0, p:].tolist()}
        if i != 3:
            record["rollout_log_probs"] = (want - 0.05 * (i % 3)).tolist()
        records.append(record)
        expected.append(want)
    rollouts = root / "rollouts.jsonl"
    rollouts.write_text("".join(json.dumps(r) + "\n" for r in records))
    return checkpoint, rollouts, records, expected


# (processes, overrides) per layout.
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["parallel.tp=2"]), "cp2": (2, ["parallel.cp=2"]),
           "pp2": (2, ["parallel.pp=2", "trainer.micro_batch_size=1"]), "dp2": (2, ["trainer.micro_batch_size=2"])}
# Launched from the CLI (torchrun, new processes): the command's contract, on two ranks, its launch
# size taken from the layout. The other layouts run score's entry point in the session's pool of
# their size: the same code under torchrun's environment, without a launch's start-up
# (tests/dist_pool.py).
CLI_LAYOUT = "tp2"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_score_matches_transformers(scoring, tmp_path, layout):
    checkpoint, rollouts, records, expected = scoring
    out = tmp_path / "out.jsonl"
    args = ["--model", str(checkpoint), "--rollouts", str(rollouts), "--out", str(out),
            f"rollout.temperature={TEMPERATURE}"]
    nproc, overrides = LAYOUTS[layout]
    if layout == CLI_LAYOUT:
        proc = _cli("score", *args, *overrides)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"--nproc_per_node={nproc}" in proc.stdout  # tp*pp*cp of the layout
    else:
        codes = [code for code, _ in run_distributed(entry_point, nproc, "score", [*args, *overrides])]
        assert codes == [0] * nproc
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in scored] == [r["id"] for r in records]  # order and pass-through fields kept
    for record, got, want in zip(records, scored, expected):
        assert {k: v for k, v in got.items() if k != "log_probs"} == record
        torch.testing.assert_close(torch.tensor(got["log_probs"]).reshape(-1), want, atol=1e-4, rtol=0)
    # the DAPO correction's metrics over the records with rollout log-probs, as one whole batch
    metrics = json.loads(Path(f"{out}.metrics.json").read_text())["metrics"]
    rows = [i for i, r in enumerate(records) if "rollout_log_probs" in r]
    width = max(len(records[i]["response_ids"]) for i in rows)
    old, rollout, mask = (torch.zeros(len(rows), width) for _ in range(3))
    for b, i in enumerate(rows):
        n = len(records[i]["response_ids"])
        old[b, :n], rollout[b, :n], mask[b, :n] = expected[i], torch.tensor(records[i]["rollout_log_probs"]), 1
    want = compute_rollout_correction(old, rollout, mask, DAPO_CORRECTION).metrics
    assert metrics["num_sequences"] == len(rows) and metrics["num_tokens"] == mask.sum().item()
    for name in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_rs_masked_fraction",
                 "rollout_corr/rollout_is_mean"):
        assert metrics[name] == pytest.approx(float(want[name]), rel=1e-3, abs=1e-6), name
    # rollout log-probs lowered by 0.05 (0.1) on a third of the rows each: kl = mean(rollout - old)
    assert -0.07 < metrics["rollout_corr/kl"] < -0.02
