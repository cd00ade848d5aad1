"""tools/bench_step.py: one RL step of the tiny CPU shape gives real figures (throughput, the
correction's and the loss's shares, the plan's memory) and really updates the weights; its FLOPs
and peak conventions; bad options are refused with the fix."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from tests.dist import run_distributed

_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench_step.py"
_spec = importlib.util.spec_from_file_location("bench_step", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _one_step(rank, world, argv):
    """The tool's measurement in a pool process (its world of one), with the weights before and after."""
    args = bench.parse_args(argv)
    seen = {}
    build = bench.build_trainer

    def recording_build(*a, **kw):
        chunks, optimizer = build(*a, **kw)
        seen["chunks"], seen["before"] = chunks, [p.detach().clone() for c in chunks for p in c.parameters()]
        return chunks, optimizer

    bench.build_trainer = recording_build
    try:
        figures = bench.run_bench(args)
    finally:
        bench.build_trainer = build
    after = [p.detach() for c in seen["chunks"] for p in c.parameters()]
    changed = sum(not torch.equal(b, a) for b, a in zip(seen["before"], after))
    return dict(figures=figures, table=bench.format_table(figures, args), changed=changed, params=len(after))


def test_one_step_on_the_tiny_cpu_shape():
    out = run_distributed(_one_step, 1, ["--device", "cpu", "--warmup", "1", "--steps", "1"])[0]
    figures = out["figures"]
    assert math.isfinite(figures["tokens_per_s"]) and figures["tokens_per_s"] > 0
    assert 0 < figures["correction_share"] < 1 and 0 < figures["loss_share"] < 1
    assert figures["correction_share"] + figures["loss_share"] < 1
    assert figures["plan_bytes"] > 0 and figures["peak_bytes"] is None and figures["mfu"] is None
    assert int(figures["lengths"].sum()) > 0 and figures["flops_per_step"] > 0
    assert out["changed"] == out["params"] > 0, out  # the optimizer stepped every weight tensor
    lines = out["table"].splitlines()
    header = next(line for line in lines if line.startswith("| device"))
    assert [c.strip() for c in header.strip("|").split("|")] == list(bench.COLUMNS)
    row = lines[lines.index(header) + 2]
    assert row.startswith("| cpu (") and "local float32" in lines[0]
    assert "MFU omitted" in out["table"] and "--peak-tflops" in out["table"]


def test_flops_follow_the_documented_formula():
    from megatron_rlcorr.model.config import ModelConfig

    model = ModelConfig(**bench.TINY_MODEL, num_layers=2)
    lengths = torch.tensor([4, 8])
    layer = 2 * 64 + 64 * (64 + 2 * 32) + (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128  # norms, qkv + bias, o, MLP
    matmul_params = 2 * layer + 256 * 64
    attention = 2 * 2 * 64 * (16 + 64)                                           # 2 s^2 q_dim per layer
    assert bench.step_flops(model, lengths) == 8 * matmul_params * 12 + 4 * attention


@pytest.mark.parametrize("name, flops", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                         ("NVIDIA H200", 989e12), ("NVIDIA H100 NVL", 835e12)])
def test_peak_by_device_name(name, flops):
    assert bench.peak_flops(name, None)[0] == flops
    assert bench.peak_flops(name, 500.0)[0] == 500e12


def test_unknown_device_omits_mfu_with_the_reason():
    peak, note = bench.peak_flops("cpu (2 threads)", None)
    assert peak is None and "MFU omitted" in note and "--peak-tflops" in note


@pytest.mark.parametrize("argv, message", [
    (["--micro-batch-tokens", "16"], "--micro-batch-tokens (16) must hold the longest sequence"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--seq-len", "4", "--micro-batch-tokens", "8"], "--seq-len must be >= 8"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0"),
])
def test_bad_options_are_refused(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        bench.parse_args(["--device", "cpu", *argv])


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--device", "cuda"]) == 2
    assert "torch sees no CUDA GPU" in capsys.readouterr().err
