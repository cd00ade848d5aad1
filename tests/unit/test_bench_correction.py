"""tools/bench_correction.py: its baseline agrees with the library, and its size argument parses."""
import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench_correction.py"
_spec = importlib.util.spec_from_file_location("bench_correction", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("setting", sorted(bench.SETTINGS))
def test_baseline_agrees_with_library(setting):
    old, rollout, mask = bench.make_inputs(4 * bench.SEQ_LEN, torch.device("cpu"))
    cfg = bench.SETTINGS[setting]
    bench.check_agreement(old, rollout, mask, cfg)  # raises on any disagreement
    weights, keep, metrics = bench.multipass_correction(old, rollout, mask, cfg)
    assert weights.shape == old.shape and keep.shape == old.shape
    assert {"kl", "k3_kl", "rollout_is_mean", "rollout_is_seq_max"} <= metrics.keys()


def test_check_agreement_catches_a_wrong_weight(monkeypatch):
    old, rollout, mask = bench.make_inputs(2 * bench.SEQ_LEN, torch.device("cpu"))
    original = bench.multipass_correction

    def off_by_a_bit(*args):
        w, keep, metrics = original(*args)
        return w * 1.01, keep, metrics

    monkeypatch.setattr(bench, "multipass_correction", off_by_a_bit)
    with pytest.raises(AssertionError):
        bench.check_agreement(old, rollout, mask, bench.SETTINGS["token_is"])


@pytest.mark.parametrize("text, tokens", [("262144", 262144), ("256K", 262144), ("1M", 1 << 20),
                                          (" 4m", 4 << 20), ("0.5M", 1 << 19)])
def test_parse_size(text, tokens):
    assert bench._parse_size(text) == tokens


def test_parse_size_names_the_option():
    with pytest.raises(SystemExit, match="--sizes"):
        bench._parse_size("1X")


def test_table_with_the_bandwidth_floor(capsys):
    bench.main(["--sizes", "8K", "--repeats", "1", "--device", "cpu", "--floor"])
    lines = capsys.readouterr().out.splitlines()
    assert "floor ms" in lines[1] and "ours/floor" in lines[1]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == set(bench.SETTINGS)
    for cells in rows.values():
        tokens, base_ms, ours_ms, speedup, floor_ms, ratio = cells[1:]
        assert int(tokens) == 8192 and float(base_ms) > 0 and float(ours_ms) > 0 and float(floor_ms) > 0
        assert speedup.endswith("x") and ratio.endswith("x")
