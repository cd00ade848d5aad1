"""`megatron-rlcorr eval` launched from the CLI on 2 gloo processes, on the tiny Hugging Face checkpoint
(tools/make_tiny_hf.py, conftest.py: `tiny_hf`): greedy evaluation is transformers' greedy generation,
token for token, and metrics.json agrees with generations.jsonl, per data source, with a reward
per data source (`data.reward` as a mapping).

This is eval's CLI test, a real launch (the CLI process, torchrun and its workers; test_validation.py
runs eval's entry point in the pool). The test computes transformers' generations while the launch
runs, on the core it leaves idle while the CLI process checks the arguments and torchrun starts, one
process at a time."""
import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from megatron_rlcorr.data.rewards import dapo_math, extract_answer, normalize_answer

pytestmark = [
    pytest.mark.distributed,
]

ROOT = Path(__file__).resolve().parents[2]
MAX_NEW_TOKENS = 8
OTHER = "aime_like"  # the second file's data source, scored by `graded`


def graded(response: str, ground_truth, extra: dict) -> dict:
    """A reward in verl's mapping form: score, acc and the extracted answer (a field of its own)."""
    score = dapo_math(response, str(ground_truth))
    return {"score": score, "acc": score > 0, "pred": extract_answer(response)}


@contextmanager
def _cli_started(log_dir: Path, *args):
    """`python -m megatron_rlcorr.cli ARGS` started, not awaited (its stdout and stderr go to files in
    `log_dir`, as a full pipe would stall it while the test works); ended if the block leaves before
    it did: SIGTERM to the CLI and torchrun (a session of their own), on which torchrun ends its
    workers (each in its own session)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    with (log_dir / "stdout").open("w") as stdout, (log_dir / "stderr").open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_rlcorr.cli", *map(str, args)], stdout=stdout,
                                stderr=stderr, env=env, cwd=ROOT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()


def _transformers_greedy(model_dir: Path, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) per row: the chat template with the generation prompt, then
    transformers' greedy generation in float32, stopping at the generation config's EOS ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos_ids = GenerationConfig.from_pretrained(model_dir).eos_token_id
    out = []
    with torch.no_grad():
        for row in rows:
            ids = list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"])
            generated = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                       eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
            out.append((ids, generated[0, len(ids):].tolist()))
    return out


def test_greedy_eval_is_transformers_greedy_and_metrics_match_generations(tiny_hf, tmp_path):
    import pyarrow.parquet as pq

    val = tiny_hf / "data" / "val.parquet"
    rows = pq.read_table(val).to_pylist()
    others = [{**row, "data_source": OTHER} for row in rows[:6]]
    other_file = tmp_path / "other.jsonl"
    other_file.write_text("".join(json.dumps(row) + "\n" for row in others))
    out = tmp_path / "eval"
    every_row = rows + others
    with _cli_started(tmp_path, "eval", "--model", tiny_hf / "model", "--data", val, other_file, "--out", out,
                      "--temperature", "0", "--max-new-tokens", MAX_NEW_TOKENS, "--nproc", "2", "model.bf16=false",
                      "rollout.precision=fp32",
                      f"data.reward={{math_dapo: dapo_math, {OTHER}: tests.distributed.test_eval_run:graded}}") as proc:
        greedy = _transformers_greedy(tiny_hf / "model", every_row)
        returncode = proc.wait(timeout=300)
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert returncode == 0, stderr[-3000:]
    records = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    metrics = json.loads((out / "metrics.json").read_text())

    # one record per prompt (n = 1), in file order, with transformers' prompt and greedy response
    assert len(records) == len(every_row)
    for record, row, (prompt_ids, response_ids) in zip(records, every_row, greedy):
        assert record["prompt_ids"] == prompt_ids
        assert record["response_ids"] == response_ids, (row["prompt"], record["response"])
        assert record["data_source"] == row["data_source"]
        assert record["ground_truth"] == row["reward_model"]["ground_truth"]
        reward = dapo_math(record["response"], record["ground_truth"])  # both rewards score as dapo_math
        assert record["score"] == reward
        if record["data_source"] == OTHER:  # the mapping reward's own fields are in its records
            assert record["acc"] == (reward > 0) and record["pred"] == extract_answer(record["response"])
        else:  # dapo_math returns verl's fields: acc and the normalised prediction
            assert record["acc"] == float(reward > 0)
            assert record["pred"] == normalize_answer(extract_answer(record["response"]))
    assert any(r["score"] > 0 for r in records) and any(r["score"] < 0 for r in records)  # both outcomes occur

    # metrics.json: one flat object of numbers whose per-source means are the records' means
    assert all(isinstance(v, (int, float)) for v in metrics.values())
    assert {name.split("/")[1] for name in metrics} == {"math_dapo", OTHER}
    for source in ("math_dapo", OTHER):
        mine = [r for r in records if r["data_source"] == source]
        right, mean_score = sum(r["score"] >= 1 for r in mine) / len(mine), sum(r["score"] for r in mine) / len(mine)
        assert metrics[f"val-core/{source}/acc/pass@1"] == pytest.approx(right)
        # both rewards give acc: the core variable
        assert metrics[f"val-core/{source}/acc/mean@1"] == pytest.approx(sum(r["acc"] for r in mine) / len(mine))
        assert metrics[f"val-aux/{source}/reward/mean@1"] == pytest.approx(mean_score)
    assert f"evaluated {len(every_row)} prompts x 1 samples (greedy" in stdout
