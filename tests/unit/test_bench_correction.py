"""tools/bench_correction.py: its baseline agrees with the library, its size argument parses, and
its kernel counter (tools/op_count.py) counts; the correction stays within its kernel budget; its
--compile columns run."""
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
        tokens, kernels, base_ms, ours_ms, speedup, floor_ms, ratio = cells[1:]
        assert int(tokens) == 8192 and int(kernels) > 0
        assert float(base_ms) > 0 and float(ours_ms) > 0 and float(floor_ms) > 0
        assert speedup.endswith("x") and ratio.endswith("x")


def test_table_with_the_compiled_call(capsys):
    """--compile: the compiled call's columns, after its outputs were checked against eager's
    (aot_eager: the CPU cannot afford Inductor's C++ compilation in a unit test)."""
    import torch._dynamo  # seconds to import: only this test needs it

    from tests.unit.test_correction_compiled import TRACE_CONFIG

    torch._dynamo.reset()  # the variants other tests compiled do not count against the recompile limit
    with torch._dynamo.config.patch(**TRACE_CONFIG):
        bench.main(["--sizes", "8K", "--repeats", "1", "--device", "cpu", "--compile", "--compile-backend",
                    "aot_eager"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-7:] == ["first", "call", "s", "compiled", "ms", "vs", "ours"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == set(bench.SETTINGS)
    for cells in rows.values():
        first_s, compiled_ms, ratio = cells[-3:]
        assert float(first_s) >= 0 and float(compiled_ms) > 0 and ratio.endswith("x")


# ---- kernel counts (tools/op_count.py) --------------------------------------------------------

def test_counter_counts_the_leaves_that_do_work():
    """Views, allocations and no-op casts launch nothing; a cast that converts, an arithmetic op
    and each op inside a composite do."""
    x, y = torch.rand(4, 8), torch.rand(4, 8)
    mask = x > 0.5

    def known():
        z = torch.mul(x, y).view(32).unsqueeze(0).expand(2, 32)   # mul
        torch.empty(3), torch.empty_like(x), x.to(torch.float32), x.t(), x.detach()  # nothing
        z = torch.add(z, z)                                        # add
        torch.where(mask, x, 0.0)                                  # scalar_tensor + where
        return z.to(torch.float64)                                 # copy_

    counts = bench.op_count.count_ops(known)
    assert counts == {"aten::mul": 1, "aten::add": 1, "aten::scalar_tensor": 1, "aten::where": 1, "aten::copy_": 1}


@pytest.mark.parametrize("setting, limit, metrics", [("token_is", 32, 29), ("dapo", 48, 46)])
def test_kernels_per_call(setting, limit, metrics):
    """One call with every metric launches at most `limit` kernels (issue 31: 274 and 449 before,
    by this counter)."""
    cfg = bench.SETTINGS[setting]
    old, rollout, mask = bench.make_inputs(2 * bench.SEQ_LEN, torch.device("cpu"))
    assert len(bench.compute_rollout_correction(old, rollout, mask, cfg).metrics) == metrics
    assert sum(bench.count_correction_ops(cfg).values()) <= limit


def test_count_ops_option_prints_every_call(capsys):
    bench.main(["--count-ops"])
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:36].strip(): int(line[36:44]) for line in lines[2:]}
    assert set(rows) == ({f"correction {name}" for name in bench.SETTINGS}
                         | {f"loss {mode}" + extra for mode in bench.LOSS_AGG_MODES for extra in ("", " +backward")})
    assert all(count > 0 for count in rows.values())
    assert rows["correction token_is"] <= 32 and rows["correction dapo"] <= 48
