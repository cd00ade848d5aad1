"""The vLLM engine with the real vLLM (the "vllm" extra) on a GPU; skipped where either is missing.

One torchrun-like rank (RANK/LOCAL_RANK 0, world 1, tensor_parallel_size 1) on the tiny Qwen2
checkpoint: the trainer's conventions hold against vLLM itself, not only against the stand-in
(tests/unit/test_vllm_engine.py): weights from a stream replace the dummy ones, processed log-probs
equal the float32 log-softmax of the Hugging Face model's tempered logits to bf16 accuracy, a
prompt's samples are those of its seed, responses end on EOS or at the cap, with top_k (bf16) the
samples stay among the k most likely and the log-probs renormalise over them, and a sleep/wake/load
cycle gives the same samples again. Building the engine leaves the process's RNG states as they
were, and a sync that leaves a weight out raises naming it (vLLM's own names), after which a
complete one is accepted. With rollout.precision fp8 (vLLM's online fp8) every sync goes through
vLLM's layerwise reload: the log-probs then follow the Hugging Face model's to fp8 accuracy (far
from the dummy weights' random ones), and a level-2 sleep and reload reproduces the samples.

vLLM's sleep mode allocates through one pool per process, which allows one `LLM` per process: each
precision runs in its own child process (this file run as a script).
"""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_real_vllm_follows_the_trainer_conventions(tiny_hf, precision):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (pip install 'megatron-rlcorr[vllm]')")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get(
               "PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__, str(tiny_hf), precision], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, f"the {precision} engine's process failed:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-8000:]}"
    assert f"vllm {precision} ok" in proc.stdout


def _rng_states():
    import random

    import numpy as np

    return random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.cuda.get_rng_state_all()


def _same_rng(a, b) -> bool:
    return (a[0] == b[0] and all((x == y).all() if hasattr(x, "all") else x == y for x, y in zip(a[1], b[1]))
            and torch.equal(a[2], b[2]) and all(torch.equal(x, y) for x, y in zip(a[3], b[3])))


def _run(tiny_hf: Path, precision: str) -> None:
    """One engine, in this process: every check of the module docstring."""
    import random

    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_rlcorr.data.hf_tokenizer import HFTokenizer
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.rollout import RolloutConfig, make_engine

    tok = HFTokenizer(str(tiny_hf / "model"))
    model = ModelConfig.from_dict({"hf_checkpoint": str(tiny_hf / "model")})
    cfg = RolloutConfig(engine="vllm", precision=precision, gpu_memory_utilization=0.3, sleep_level=2)
    random.seed(1234), np.random.seed(1234), torch.manual_seed(1234), torch.cuda.manual_seed_all(1234)
    before = _rng_states()
    engine = make_engine(cfg, model, eos_token_id=tok.eos_ids, device="cuda", token_vocab_size=tok.vocab_size,
                         max_model_len=72, seed=0)
    assert _same_rng(before, _rng_states()), "building the vLLM engine changed the process's RNG states"

    weights = {k: v.to(torch.bfloat16) for k, v in load_file(str(tiny_hf / "model" / "model.safetensors")).items()}
    left_out = "model.layers.0.mlp.down_proj.weight"
    try:
        engine.load_weights((k, v) for k, v in weights.items() if k != left_out)
    except RuntimeError as error:
        assert f"left 1 of the model's parameters without a tensor: {left_out}." in str(error), error
    else:
        raise AssertionError("a sync without one weight was accepted")
    engine.load_weights(iter(weights.items()))
    prompts = [[1, 5, 9, 12], [1, 7, 3]]
    out = engine.sample_groups(prompts, n=4, seeds=[3, 4], max_new_tokens=8, temperature=0.8)
    alone = engine.sample_groups(prompts[1:], n=4, seeds=[4], max_new_tokens=8, temperature=0.8)
    assert alone.response_ids == out.response_ids[4:]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_hf / "model"), torch_dtype=torch.float32).cuda().eval()
    errors = []
    for prompt, ids, logprobs, finish in zip(out.prompt_ids, out.response_ids, out.logprobs, out.finish_reasons):
        assert 1 <= len(ids) <= 8 and finish == ("eos" if ids[-1] in tok.eos_ids else "length")
        assert finish == "eos" or len(ids) == 8
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ids], device="cuda")).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits / 0.8, dim=-1)[torch.arange(len(ids)), torch.tensor(ids)]
        errors.append((logprobs - expected.cpu()).abs())
    errors = torch.cat(errors)
    if precision == "bf16":
        assert errors.max() < 0.05, errors  # bf16 vs fp32
    else:  # fp8 weights and activations: looser, but random (dummy) weights would be off by whole nats
        assert errors.mean() < 0.15 and errors.max() < 0.6, errors
    if precision == "bf16":  # top-k: vLLM's processed log-probs renormalise over the k kept tokens
        top = engine.sample_groups(prompts, n=4, seeds=[5, 6], max_new_tokens=8, temperature=0.8, top_k=3)
        for prompt, ids, logprobs in zip(top.prompt_ids, top.response_ids, top.logprobs):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + ids], device="cuda")).logits[0, len(prompt) - 1:-1].float()
            logp = torch.log_softmax(logits / 0.8, dim=-1)
            third = logp.topk(3, dim=-1).values[:, -1]
            chosen = logp[torch.arange(len(ids)), torch.tensor(ids)]
            assert (chosen >= third - 0.05).all(), "a token outside the 3 most likely (beyond bf16 near-ties)"
            kept = logp.topk(3, dim=-1).values.logsumexp(-1)
            assert ((logprobs - (chosen - kept).cpu()).abs() < 0.05).all(), (logprobs, chosen - kept)
    engine.sleep()
    engine.wake_up(["weights"])
    engine.load_weights(iter(weights.items()))
    engine.wake_up(["kv_cache"])
    again = engine.sample_groups(prompts, n=4, seeds=[3, 4], max_new_tokens=8, temperature=0.8)
    assert again.response_ids == out.response_ids
    print(f"vllm {precision} ok")


if __name__ == "__main__":
    _run(Path(sys.argv[1]), sys.argv[2])
