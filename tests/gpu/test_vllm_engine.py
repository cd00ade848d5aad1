"""The vLLM engine with the real vLLM (the "vllm" extra) on a GPU; skipped where either is missing.

One torchrun-like rank (RANK/LOCAL_RANK 0, world 1, tensor_parallel_size 1) on the tiny Qwen2
checkpoint: the trainer's conventions hold against vLLM itself, not only against the stand-in
(tests/unit/test_vllm_engine.py): weights from a stream replace the dummy ones, processed log-probs
equal the float32 log-softmax of the Hugging Face model's tempered logits to bf16 accuracy, a
prompt's samples are those of its seed, responses end on EOS or at the cap, and a sleep/wake/load
cycle gives the same samples again. With rollout.precision fp8 (vLLM's online fp8) every sync goes
through vLLM's layerwise reload: the log-probs then follow the Hugging Face model's to fp8 accuracy
(far from the dummy weights' random ones), and a level-2 sleep and reload reproduces the samples.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


@pytest.fixture(params=["bf16", "fp8"])
def vllm_engine(tiny_hf, monkeypatch, request):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron_rlcorr.data.hf_tokenizer import HFTokenizer
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.rollout import RolloutConfig, make_engine

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29531").items():
        monkeypatch.setenv(key, value)
    tok = HFTokenizer(str(tiny_hf / "model"))
    model = ModelConfig.from_dict({"hf_checkpoint": str(tiny_hf / "model")})
    cfg = RolloutConfig(engine="vllm", precision=request.param, gpu_memory_utilization=0.3, sleep_level=2)
    engine = make_engine(cfg, model,
                         eos_token_id=tok.eos_ids, device="cuda", token_vocab_size=tok.vocab_size, max_model_len=72,
                         seed=0)
    return engine, tok


def test_real_vllm_follows_the_trainer_conventions(vllm_engine, tiny_hf):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    engine, tok = vllm_engine
    weights = load_file(str(tiny_hf / "model" / "model.safetensors"))
    engine.load_weights((k, v.to(torch.bfloat16)) for k, v in weights.items())
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
    if engine.cfg.precision == "bf16":
        assert errors.max() < 0.05, errors  # bf16 vs fp32
    else:  # fp8 weights and activations: looser, but random (dummy) weights would be off by whole nats
        assert errors.mean() < 0.15 and errors.max() < 0.6, errors
    engine.sleep()
    engine.wake_up(["weights"])
    engine.load_weights((k, v.to(torch.bfloat16)) for k, v in weights.items())
    engine.wake_up(["kv_cache"])
    again = engine.sample_groups(prompts, n=4, seeds=[3, 4], max_new_tokens=8, temperature=0.8)
    assert again.response_ids == out.response_ids
