"""The weight stream (model/weight_stream.py) under TP and PP: the same tensors as the whole-model
export, in buckets of the asked size, and the extra memory of one bucket and the tensor in flight
(measured with torch's CPU memory profiler) instead of the whole model."""
import pytest
import torch

from tests.dist import run_distributed

pytestmark = pytest.mark.distributed

# ~49 MB in float32: 3 layers of hidden 512, a 4096-token vocabulary, tied embeddings.
CFG = dict(vocab_size=4096, hidden_size=512, num_layers=4, num_attention_heads=8, num_query_groups=4,
           ffn_hidden_size=1536, tie_embeddings=True, add_qkv_bias=True, max_position_embeddings=64)
BUCKET_MB = 2


def _peak_mib(fn):
    """Peak resident memory while fn runs, above the resident memory at its start, sampled every
    0.2 ms from /proc/self/statm. The workers allocate every block above 64 KiB with mmap
    (`_mmap_above_64_kib`), so a freed tensor leaves the resident set at once.
    (torch's CPU memory profiler does not see the frees of gloo's all-gather buffers.)"""
    import os
    import threading
    import time

    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base, peak, done = resident(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident() - base)
            time.sleep(0.0002)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak[0], resident() - base) / 2**20


def _worker(rank, world, tp, pp):
    from megatron_rlcorr.model.build import build_model_chunks
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.hf import hf_name
    from megatron_rlcorr.model.weight_stream import MiB, drain, flatten, weight_buckets
    from megatron_rlcorr.model.weights import export_full_weights
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.rollout.embedded import EmbeddedEngine

    enable_cpu_megatron()
    groups = build_parallel_groups(tp, pp, 1)
    cfg = ModelConfig(**CFG)
    chunks = build_model_chunks(cfg, groups, seed=3)
    full = export_full_weights(chunks, groups)
    buckets = list(weight_buckets(chunks, groups, dtype=torch.bfloat16, bucket_bytes=BUCKET_MB * MiB))
    hf = [name for bucket in weight_buckets(chunks, groups, dtype=torch.float32, bucket_bytes=BUCKET_MB * MiB,
                                            hf_names=True) for name, _ in bucket]
    stream_peak = _peak_mib(lambda: drain(weight_buckets(chunks, groups, dtype=torch.float32,
                                                         bucket_bytes=BUCKET_MB * MiB)))
    export_peak = _peak_mib(lambda: export_full_weights(chunks, groups))
    engines = {}
    for how in ("stream", "dict"):
        engine = EmbeddedEngine(cfg.decoder_shape, precision="bf16")
        engine.load_weights(flatten(weight_buckets(chunks, groups, dtype=engine.weight_dtype, bucket_bytes=MiB))
                            if how == "stream" else full)
        engines[how] = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=6, temperature=1.0,
                                       generator=torch.Generator().manual_seed(0))
    return dict(full=full, buckets=buckets, hf=hf, hf_expected=[hf_name(n) for n in full if n != "lm_head.weight"],
                stream_peak=stream_peak, export_peak=export_peak, engines=engines)


LAYOUTS = [(2, 1), (1, 2)]


def _mmap_above_64_kib() -> None:
    """glibc malloc's mmap threshold at 64 KiB for this process (`mallopt(M_MMAP_THRESHOLD)`, what
    MALLOC_MMAP_THRESHOLD_ sets at a process's start), so that a freed tensor leaves the resident set
    at once. No tear-down undoes it: the pool's workers are replaced after the case."""
    import ctypes

    from tests.dist_pool import retire_after_case

    m_mmap_threshold = -3  # malloc.h
    assert ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 64 * 1024) == 1
    retire_after_case("malloc's mmap threshold set (test_weight_stream.py)")


def _layouts_worker(rank, world, layouts):
    """_worker on each (tp, pp) in turn, in the same processes (their groups torn down in between),
    with every block above 64 KiB allocated by mmap (`_mmap_above_64_kib`)."""
    from megatron_rlcorr.parallel.groups import destroy_parallel_groups

    _mmap_above_64_kib()
    out = {}
    for tp, pp in layouts:
        out[tp, pp] = _worker(rank, world, tp, pp)
        destroy_parallel_groups()
    return out


@pytest.fixture(scope="module")
def streamed():
    """Every layout's results, per rank: one call of the pool's processes for both layouts."""
    return run_distributed(_layouts_worker, 2, LAYOUTS)


@pytest.mark.parametrize("tp, pp", LAYOUTS)
def test_stream_equals_the_export_in_small_buckets(tp, pp, streamed):
    for rank, result in enumerate(by_layout[tp, pp] for by_layout in streamed):
        full, buckets = result["full"], result["buckets"]
        streamed = {name: tensor for bucket in buckets for name, tensor in bucket}
        assert len(streamed) == sum(len(b) for b in buckets)  # each name once
        assert set(streamed) == set(full) - {"lm_head.weight"}  # tied: lm_head is not sent
        for name, tensor in streamed.items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, full[name].to(torch.bfloat16)), name
        sizes = [sum(t.numel() * t.element_size() for _, t in bucket) for bucket in buckets]
        assert all(size <= BUCKET_MB * 2**20 or len(bucket) == 1 for size, bucket in zip(sizes, buckets))
        assert len(buckets) > 5
        assert sorted(result["hf"]) == sorted(result["hf_expected"]) and result["hf"][0] == "model.embed_tokens.weight"
        # extra memory: one bucket and the tensor in flight, not the model
        largest = max(t.numel() * 4 for t in full.values()) / 2**20
        model = sum(t.numel() * 4 for n, t in full.items() if n != "lm_head.weight") / 2**20
        print(f"tp{tp} pp{pp} rank {rank}: model {model:.1f} MiB, largest tensor {largest:.1f} MiB, bucket "
              f"{BUCKET_MB} MiB; peak extra memory: stream {result['stream_peak']:.1f} MiB, whole-model export "
              f"{result['export_peak']:.1f} MiB")
        assert result["stream_peak"] <= BUCKET_MB + 3 * largest, (rank, result["stream_peak"], largest)
        assert result["export_peak"] >= 0.9 * model, (rank, result["export_peak"], model)
        first, second = result["engines"]["stream"], result["engines"]["dict"]
        assert first.response_ids == second.response_ids
        for a, b in zip(first.logprobs, second.logprobs):
            assert torch.equal(a, b)
