"""The correction on a CUDA device: same results as on the CPU, no host sync (sync debug mode
raises on any), and capturable in a CUDA graph (which also rules out host-to-device copies). The
compiled call (correction/compiled.py, Inductor) equals the eager one and never syncs either."""
import pytest
import torch

from megatron_rlcorr.config import RolloutCorrectionConfig
from megatron_rlcorr.correction import compute_rollout_correction

# Each test is a few small tensors on the GPU: seconds (the first one also initialises CUDA).
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]

CONFIGS = {
    "dapo": RolloutCorrectionConfig(rollout_is="sequence", rollout_is_batch_normalize=True, rollout_rs="geometric",
                                    rollout_rs_threshold=1.01, rollout_rs_threshold_lower=0.99,
                                    rollout_token_veto_threshold=1e-4),
    "token": RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold_lower=0.5, rollout_is_batch_normalize=True,
                                     rollout_rs="token", rollout_rs_threshold=3.0),
    "divergence": RolloutCorrectionConfig(rollout_rs="token_k1,seq_max_k3,seq_mean_k2", rollout_rs_threshold="0.5_2.0,1.0,0.01"),
    "token_is_only": RolloutCorrectionConfig(rollout_is="token"),  # no rule can reject: the input mask returns
}


def _inputs(device):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(16, 256, generator=g) * 3
    rollout = (old + 0.05 * torch.randn(16, 256, generator=g)).clamp(max=0)
    mask = (torch.arange(256) < torch.randint(0, 257, (16, 1), generator=g)).float()
    return old.to(device), rollout.to(device), mask.to(device)


def _packed(old, rollout, mask, trailing=7):
    """The valid tokens of each row back to back, then `trailing` tokens of no sequence."""
    keep = mask.bool()
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = mask.sum(-1).cumsum(0)
    pad = old.new_zeros(trailing)
    return (torch.cat([old[keep], pad]), torch.cat([rollout[keep], pad]), torch.cat([mask[keep], pad.fill_(1.0)])), cu


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_matches_cpu_and_never_syncs(name, packed):
    cfg = CONFIGS[name]
    cpu_inputs, gpu_inputs = _inputs("cpu"), _inputs("cuda")
    cpu_cu = gpu_cu = None
    if packed:
        cpu_inputs, cpu_cu = _packed(*cpu_inputs)
        gpu_inputs, gpu_cu = _packed(*gpu_inputs)
    cpu = compute_rollout_correction(*cpu_inputs, cfg, cu_seqlens=cpu_cu)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = compute_rollout_correction(*gpu_inputs, cfg, cu_seqlens=gpu_cu, check_inputs=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gpu.response_mask.cpu(), cpu.response_mask)
    if cpu.is_weights is not None:
        torch.testing.assert_close(gpu.is_weights.cpu(), cpu.is_weights, rtol=1e-5, atol=1e-7)
    for key, value in cpu.metrics.items():
        torch.testing.assert_close(gpu.metrics[key].cpu(), value, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_graph_capture_and_replay(name):
    cfg = CONFIGS[name]
    static = [t.clone() for t in _inputs("cuda")]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as capture requires
        compute_rollout_correction(*static, cfg, check_inputs=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compute_rollout_correction(*static, cfg, check_inputs=False)
    fresh = _inputs("cuda")
    for dst, src in zip(static, fresh):
        dst.copy_(src * 1.0)
    static[1].sub_(0.01).clamp_(max=0)  # new data, replayed through the same graph
    graph.replay()
    torch.cuda.synchronize()
    eager = compute_rollout_correction(*static, cfg)
    assert torch.equal(out.response_mask, eager.response_mask)
    if eager.is_weights is not None:
        torch.testing.assert_close(out.is_weights, eager.is_weights, rtol=1e-6, atol=0)
    for key, value in eager.metrics.items():
        torch.testing.assert_close(out.metrics[key], value, rtol=1e-5, atol=1e-7, msg=key)


# ---- the compiled call (correction/compiled.py) with Inductor ------------------------------------

COMPILED = {  # token IS, sequence IS, DAPO's settings (geometric RS + veto + batch normalisation)
    "token_is": RolloutCorrectionConfig(rollout_is="token"),
    "seq_is": RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold_lower=0.5),
    "dapo": CONFIGS["dapo"],
}


@pytest.mark.timeout(300)  # Inductor compiles each variant at its first call: tens of seconds
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_matches_eager_and_never_syncs(name, packed):
    """Inductor's kernels equal the eager call within compiled.RTOL (identical masks); a batch of
    other sizes reuses the compiled variant and, with check_inputs=False, never syncs."""
    import torch._dynamo
    from torch.utils._triton import has_triton

    from megatron_rlcorr.correction.compiled import RTOL, compute_rollout_correction_compiled

    if not has_triton():
        pytest.skip("Inductor generates Triton kernels on a GPU; Triton is not installed")
    torch._dynamo.reset()  # the variants other tests compiled do not count against the recompile limit
    cfg = COMPILED[name]
    batches = [_inputs("cuda"), [x[:11, :200].contiguous() for x in _inputs("cuda")]]
    for i, inputs in enumerate(batches):
        cu = None
        if packed:
            inputs, cu = _packed(*inputs)
        # the second batch reuses the first one's variant (dynamic shapes); never eager past the recompile limit
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), \
                torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            got = compute_rollout_correction_compiled(*inputs, cfg, cu_seqlens=cu)
        want = compute_rollout_correction(*inputs, cfg, cu_seqlens=cu)
        assert torch.equal(got.response_mask, want.response_mask)
        if want.is_weights is not None:
            torch.testing.assert_close(got.is_weights, want.is_weights, rtol=RTOL, atol=1e-7)
        for key, value in want.metrics.items():
            torch.testing.assert_close(got.metrics[key], value, rtol=RTOL, atol=1e-7, msg=key)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        compute_rollout_correction_compiled(*inputs, cfg, cu_seqlens=cu, check_inputs=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
