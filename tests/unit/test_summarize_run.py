"""tools/summarize_run.py: first vs last training steps, and the validation metrics by validation step."""
import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "summarize_run.py"
_spec = importlib.util.spec_from_file_location("summarize_run", _PATH)
summarize_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summarize_run)

CORE = "val-core/math_dapo/acc/mean@8"


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_step_0_validation_is_not_a_training_step_and_each_validation_is_a_column(tmp_path):
    records = [{"step": 0, CORE: 0.25, "val-aux/math_dapo/reward/mean@8": -0.5}]
    records += [{"step": s, "reward_mean": s / 10, "timing/step_s": 1.0} for s in range(1, 5)]
    records[2][CORE] = 0.5   # step 2
    records[4][CORE] = 0.75  # step 4, the last
    text = summarize_run.summarize(_write(tmp_path / "m.jsonl", records), window=2)
    assert text.splitlines()[0].endswith("4 steps, 4.0 s in training steps")
    reward = next(line for line in text.splitlines() if line.startswith("reward (round-0 samples)"))
    assert [float(x) for x in reward.split()[-2:]] == pytest.approx([0.15, 0.35])  # steps 1-2, steps 3-4
    header = next(line for line in text.splitlines() if line.startswith("validation"))
    assert header.split()[1:] == ["step", "0", "step", "2", "step", "4"]
    row = next(line for line in text.splitlines() if line.startswith(CORE))
    assert [float(x) for x in row.split()[1:]] == [0.25, 0.5, 0.75]
    assert "val-aux" not in text  # the core metrics only


def test_many_validations_show_the_first_and_last_few(tmp_path):
    records = [{"step": s, "reward_mean": 0.0, CORE: s / 100} for s in range(0, 11)]
    lines = summarize_run.validation_lines(records)
    assert lines[1].split()[2::2] == ["0", "1", "2", "8", "9", "10"]


def test_a_run_without_validation_prints_no_validation_table(tmp_path):
    text = summarize_run.summarize(_write(tmp_path / "m.jsonl", [{"step": 1, "reward_mean": 0.1}]), window=10)
    assert not any(line.startswith("validation") for line in text.splitlines()) and "val-core" not in text
