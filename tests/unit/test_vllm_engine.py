"""The vLLM engine adapter against tests/vllm_standin, a stand-in with vLLM 0.25.1's surface: the
engine arguments, the sampling parameters, the weight names/shapes/dtypes the trainer streams,
the sleep/wake order, the log-prob, EOS, truncation and padded-vocabulary rules, every sync checked
complete, the process's RNG states kept, the model reached through get_model(); and the stand-in's
own behaviours that follow vLLM's default runner."""
from __future__ import annotations

import importlib.metadata
import logging
import random
import sys
from pathlib import Path

import pytest
import torch

from megatron_rlcorr.model.config import ModelConfig
from megatron_rlcorr.rollout import RolloutConfig, make_engine
from megatron_rlcorr.rollout.vllm_engine import VLLMEngine, check_vllm_settings

STANDIN = Path(__file__).resolve().parents[1] / "vllm_standin"
TOKENS = 120  # the tiny checkpoint has 133 rows: call the last 13 a padded vocabulary, as Qwen2.5's 399


@pytest.fixture
def vllm(monkeypatch):
    """The stand-in as `vllm`, on this process's path (and a spawned child's), with a torchrun env."""
    monkeypatch.syspath_prepend(str(STANDIN))
    _forget_vllm()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    # set, then removed: the adapter's own setting of it is undone after the test too
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "")
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER")
    import vllm as standin

    standin.CALLS.clear()
    yield standin
    _forget_vllm()


def _forget_vllm() -> None:
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def _model(tiny_hf) -> ModelConfig:
    return ModelConfig.from_dict({"hf_checkpoint": str(tiny_hf / "model")})


def _checkpoint(tiny_hf) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(tiny_hf / "model" / "model.safetensors"))


def _engine(tiny_hf, **rollout):
    from megatron_rlcorr.data.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(str(tiny_hf / "model"))
    cfg = RolloutConfig(engine="vllm", **rollout)
    engine = make_engine(cfg, _model(tiny_hf), eos_token_id=tok.eos_ids, device="cpu", token_vocab_size=TOKENS,
                         max_model_len=72, seed=5)
    return engine, tok


def test_the_llm_is_built_for_colocated_external_launcher_ranks(vllm, tiny_hf):
    engine, tok = _engine(tiny_hf, precision="fp8", tensor_parallel_size=2, gpu_memory_utilization=0.45)
    assert isinstance(engine, VLLMEngine)
    (name, kwargs), *rest = vllm.CALLS
    assert name == "LLM"
    assert kwargs == dict(model=str(tiny_hf / "model"), tokenizer=str(tiny_hf / "model"), dtype="bfloat16",
                          quantization="fp8", tensor_parallel_size=2, gpu_memory_utilization=0.45, max_model_len=72,
                          seed=5, enable_sleep_mode=True, distributed_executor_backend="external_launcher",
                          logprobs_mode="processed_logprobs", load_format="dummy",
                          worker_extension_cls="megatron_rlcorr.rollout.vllm_engine.WeightStreamExtension",
                          enable_prefix_caching=True, enable_return_routed_experts=False,  # dense: not asked for
                          enforce_eager=False)  # vLLM's default: CUDA graphs captured
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert TOKENS < _model(tiny_hf).vocab_size
    assert rest == [("collective_rpc", ("mask_vocab_rows_from", (TOKENS,)))]
    assert engine.weight_dtype == torch.bfloat16


def test_enforce_eager_reaches_the_llm_and_is_a_recipe_setting(vllm, tiny_hf, tmp_path):
    from megatron_rlcorr.recipe import load_recipe

    _engine(tiny_hf, enforce_eager=True)
    (name, kwargs), *_ = vllm.CALLS
    assert name == "LLM" and kwargs["enforce_eager"] is True
    recipe_file = Path(__file__).resolve().parents[2] / "recipes" / "tiny_hf_cpu.yaml"
    base = _recipe_overrides(tiny_hf, tmp_path)
    assert load_recipe(recipe_file, base).rollout.enforce_eager is False
    assert load_recipe(recipe_file, [*base, "rollout.enforce_eager=true"]).rollout.enforce_eager is True
    with pytest.raises(ValueError, match="rollout.enforce_eager must be true or false, got 'always'"):
        load_recipe(recipe_file, [*base, "rollout.enforce_eager=always"])


def _flashinfer_installed(monkeypatch, installed: bool) -> None:
    """importlib.util.find_spec as it would answer with flashinfer installed or not (other names as they are)."""
    import importlib.machinery
    import importlib.util

    find_spec = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        if name == "flashinfer":
            return importlib.machinery.ModuleSpec("flashinfer", None) if installed else None
        return find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)


def test_no_flashinfer_sets_the_native_sampler_before_the_llm_is_built(vllm, tiny_hf, monkeypatch):
    import os

    _flashinfer_installed(monkeypatch, installed=False)
    engine, _ = _engine(tiny_hf)
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert engine.llm.flashinfer_sampler_env == "0"  # what vLLM reads while LLM(...) builds its sampler


@pytest.mark.parametrize("users", ["1", "0"])
def test_a_users_flashinfer_sampler_setting_is_kept(vllm, tiny_hf, monkeypatch, users):
    import os

    _flashinfer_installed(monkeypatch, installed=False)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", users)
    engine, _ = _engine(tiny_hf)
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == users and engine.llm.flashinfer_sampler_env == users


def test_with_flashinfer_installed_the_sampler_is_left_to_vllm(vllm, tiny_hf, monkeypatch):
    import os

    _flashinfer_installed(monkeypatch, installed=True)
    engine, _ = _engine(tiny_hf)
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ and engine.llm.flashinfer_sampler_env is None


def _moe_checkpoint(tiny_hf, tmp_path):
    """The tiny checkpoint with a Qwen3-MoE-like config.json (4 layers, layer 1 dense, 6 experts, top-2)
    for the stand-in, and the matching ModelConfig."""
    import dataclasses
    import json
    import shutil

    from megatron_rlcorr.model.config import MoeConfig

    directory = tmp_path / "moe"
    shutil.copytree(tiny_hf / "model", directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], num_hidden_layers=4)
    (directory / "config.json").write_text(json.dumps(config))
    dense = _model(tiny_hf)
    moe = MoeConfig(num_experts=6, router_topk=2, ffn_hidden_size=8, dense_layers=(1,))
    return directory, dataclasses.replace(dense, hf_checkpoint=str(directory), num_layers=4, moe=moe)


def test_moe_models_ask_for_routed_experts_and_get_them_row_aligned(vllm, tiny_hf, tmp_path):
    from megatron_rlcorr.data.hf_tokenizer import HFTokenizer
    from megatron_rlcorr.rollout.vllm_engine import split_routed_experts

    directory, model = _moe_checkpoint(tiny_hf, tmp_path)
    tok = HFTokenizer(str(tiny_hf / "model"))
    engine = make_engine(RolloutConfig(engine="vllm", temperature=0.9), model, eos_token_id=tok.eos_ids, device="cpu",
                         token_vocab_size=TOKENS, max_model_len=72, seed=5)
    (name, kwargs), *_ = vllm.CALLS
    assert kwargs["enable_return_routed_experts"] is True
    engine.load_weights({k: v.to(torch.bfloat16) for k, v in _checkpoint(tiny_hf).items()})
    prompts = [[1, 5, 9, 4], [1, 7]]
    out = engine.sample_groups(prompts, n=3, seeds=[11, 12], max_new_tokens=5, temperature=0.9)
    assert len(out.routed_experts) == len(out.prompt_routed_experts) == 6
    for prompt, ids, routed, prompt_routed in zip(out.prompt_ids, out.response_ids, out.routed_experts,
                                                  out.prompt_routed_experts):
        sequence = prompt + ids

        def expected(position: int) -> list[list[int]]:  # the stand-in's rule, MoE layers 0, 2, 3 kept
            rows = vllm.routing_row(sequence[position], position, 4, 2, 6, [1])
            return [rows[layer] for layer in (0, 2, 3)]

        assert routed.dtype == torch.uint8 and routed.shape == (len(ids), 3, 2)
        assert prompt_routed.dtype == torch.uint8 and prompt_routed.shape == (len(prompt) - 1, 3, 2)
        # Response row j: position len(prompt) - 1 + j, the forward whose output gave token j.
        assert routed.tolist() == [expected(len(prompt) - 1 + j) for j in range(len(ids))]
        assert prompt_routed.tolist() == [expected(p) for p in range(len(prompt) - 1)]
    # The conversion alone: rows of the MoE layers only, or of every layer (the dense ones dropped); others refused.
    shape = model.decoder_shape
    moe_only = torch.arange(6 * 3 * 2).reshape(6, 3, 2) % 6
    want = (moe_only[3:].to(torch.uint8), moe_only[:3].to(torch.uint8))
    assert all(map(torch.equal, split_routed_experts(moe_only.numpy(), 4, 3, shape), want))
    with pytest.raises(RuntimeError, match=r"expected \[6, layers, 2\]"):
        split_routed_experts(moe_only[:5].numpy(), 4, 3, shape)
    every_layer = torch.stack([moe_only[:, 0], moe_only[:, 0] + 1, moe_only[:, 1], moe_only[:, 2]], dim=1)
    assert all(map(torch.equal, split_routed_experts(every_layer, 4, 3, shape), want))  # dense layer 1 dropped
    with pytest.raises(RuntimeError, match="5 layers; the model has 4 layers, 3 of them MoE"):
        split_routed_experts(torch.zeros(6, 5, 2, dtype=torch.int32), 4, 3, shape)
    # A dense model records nothing.
    dense = make_engine(RolloutConfig(engine="vllm", sleep_level=0), _model(tiny_hf), eos_token_id=tok.eos_ids,
                        device="cpu", token_vocab_size=TOKENS, max_model_len=72, seed=5)
    dense.load_weights({k: v.to(torch.bfloat16) for k, v in _checkpoint(tiny_hf).items()})
    plain = dense.sample_groups(prompts, n=1, seeds=[1, 2], max_new_tokens=2)
    assert plain.routed_experts is None and plain.prompt_routed_experts is None


def test_sampling_params_logprob_readout_eos_and_padded_rows(vllm, tiny_hf):
    engine, tok = _engine(tiny_hf, temperature=0.7)
    weights = _checkpoint(tiny_hf)
    head = weights["lm_head.weight"]
    head[TOKENS:] = head[: head.shape[0] - TOKENS] + 50.0  # padded rows would win every draw
    mean = weights["model.embed_tokens.weight"].mean(0)
    head[tok.eos_ids[0]] += 3 * mean / mean.norm() ** 2  # and EOS likely enough to end some responses early
    engine.load_weights({k: v.to(torch.bfloat16) for k, v in weights.items()})
    prompts = [[1, 5, 9], [1, 7]]
    out = engine.sample_groups(prompts, n=4, seeds=[11, 12], max_new_tokens=5, temperature=0.7)
    (name, requests), = [c for c in vllm.CALLS if c[0] == "generate"]
    assert [r[0] for r in requests] == prompts
    for (_, params), seed in zip(requests, [11, 12]):
        assert (params.n, params.seed, params.temperature, params.top_p, params.top_k, params.max_tokens,
                params.logprobs, params.detokenize) == (4, seed, 0.7, 1.0, 0, 5, 0, False)
        assert params.stop_token_ids == list(tok.eos_ids)
    assert out.prompt_ids == [prompts[0]] * 4 + [prompts[1]] * 4
    # Independent recomputation: log_softmax(embed[last] @ head.T / T) over the real vocabulary.
    embed = weights["model.embed_tokens.weight"].to(torch.bfloat16).float()
    real_head = head.to(torch.bfloat16).float()[:TOKENS]
    reasons = set()
    for prompt, ids, logprobs, finish in zip(out.prompt_ids, out.response_ids, out.logprobs, out.finish_reasons):
        assert max(ids) < TOKENS and 1 <= len(ids) <= 5
        assert logprobs.dtype == torch.float32 and len(logprobs) == len(ids)
        previous = [prompt[-1], *ids[:-1]]
        expected = torch.log_softmax(embed[previous] @ real_head.T / 0.7, dim=-1)[torch.arange(len(ids)), ids]
        torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)
        assert finish == ("eos" if ids[-1] in tok.eos_ids else "length")
        assert all(t not in tok.eos_ids for t in ids[:-1])  # nothing after an EOS
        assert finish == "eos" or len(ids) == 5
        reasons.add(finish)
    assert reasons == {"eos", "length"}
    again = engine.sample_groups(prompts[1:], n=4, seeds=[12], max_new_tokens=5, temperature=0.7)
    assert again.response_ids == out.response_ids[4:]  # a prompt's samples: its seed's, whatever else ran


def test_top_k_reaches_sampling_params_and_processed_log_probs_renormalise_over_the_kept_tokens(vllm, tiny_hf):
    engine, tok = _engine(tiny_hf, temperature=0.8, top_k=4, top_p=0.9, logprobs="processed")
    weights = _checkpoint(tiny_hf)
    engine.load_weights({k: v.to(torch.bfloat16) for k, v in weights.items()})
    prompts = [[1, 5, 9], [1, 7]]
    out = engine.sample_groups(prompts, n=4, seeds=[11, 12], max_new_tokens=5, temperature=0.8, top_p=0.9, top_k=4)
    again = engine.sample_groups(prompts, n=4, seeds=[11, 12], max_new_tokens=5, temperature=0.8, top_p=0.9, top_k=4)
    assert out.response_ids == again.response_ids  # the same seeds, the same samples
    engine.sample_groups(prompts[:1], n=1, seeds=[0], max_new_tokens=1, top_k=-1)  # -1: off, as vLLM's 0
    requests = [r for name, reqs in vllm.CALLS if name == "generate" for r in reqs]
    assert [(sp.top_k, sp.top_p) for _, sp in requests] == [(4, 0.9)] * 4 + [(0, 1.0)]
    # Independent recomputation: top-k of the tempered logits over the real vocabulary, then top-p of
    # the renormalised top-k distribution; the processed log-prob is over what is left.
    embed = weights["model.embed_tokens.weight"].to(torch.bfloat16).float()
    real_head = weights["lm_head.weight"].to(torch.bfloat16).float()[:TOKENS]
    for prompt, ids, logprobs in zip(out.prompt_ids, out.response_ids, out.logprobs):
        for previous, token, logprob in zip([prompt[-1], *ids[:-1]], ids, logprobs.tolist()):
            logp = torch.log_softmax(embed[previous] @ real_head.T / 0.8, dim=-1)
            top = logp.topk(4).indices
            top_logp = torch.log_softmax(logp[top], dim=-1)  # sorted, most likely first
            nucleus = (top_logp.exp().cumsum(0) - top_logp.exp()) < 0.9
            assert token in top[nucleus].tolist()
            expected = torch.log_softmax(top_logp[nucleus], dim=-1)[top.tolist().index(token)]
            assert logprob == pytest.approx(float(expected), abs=1e-5)


def test_a_response_capped_on_an_eos_token_ended_by_eos(vllm, tiny_hf):
    """vLLM checks the stop tokens before the length cap ("stop"); the embedded engine and we say "eos"."""
    engine, tok = _engine(tiny_hf, temperature=0.0, n=1)  # greedy: vLLM allows n = 1 only
    weights = _checkpoint(tiny_hf)
    weights["lm_head.weight"][tok.eos_ids[0]] += 1e4  # greedy picks EOS at once
    engine.load_weights(weights)
    out = engine.sample_groups([[1, 5]], n=1, seeds=[0], max_new_tokens=1, temperature=0.0)
    assert out.response_ids == [[tok.eos_ids[0]]] and out.finish_reasons == ["eos"]
    from vllm import SamplingParams

    sample, = engine.llm.generate([{"prompt_token_ids": [1, 5]}], SamplingParams(
        temperature=0.0, max_tokens=1, seed=0, stop_token_ids=list(tok.eos_ids)))[0].outputs
    assert (sample.finish_reason, sample.stop_reason) == ("stop", tok.eos_ids[0])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_trainer_streams_hf_weights_and_sleeps_between_steps(vllm, tiny_hf, tmp_path, precision):
    from tests.dist import run_distributed

    overrides = [*_recipe_overrides(tiny_hf, tmp_path), f"rollout.precision={precision}"]
    (calls, loaded, expected, records), = run_distributed(_train_with_standin, 1, overrides)
    assert [r["step"] for r in records] == [1, 2]
    names = [c[0] if c[0] != "collective_rpc" else c[1][0] for c in calls]
    assert [c[1][1] for c in calls if c[0] == "collective_rpc" and c[1][0] == "begin_weight_sync"] == \
        [(precision == "fp8",)] * 3
    # built; first sync (awake); then per step: generate, sleep, wake the weights, sync, wake the KV cache.
    # A sync: begin, one tensor per call, end (fp8: they open and close vLLM's layerwise reload), reset the
    # prefix cache.
    reload = ("initialize_layerwise_reload", "finalize_layerwise_reload") if precision == "fp8" else ()
    sync = ["begin_weight_sync", *reload[:1], *["load_weight_pairs"] * len(expected), "end_weight_sync",
            *reload[1:], "reset_prefix_cache"]
    step = ["generate", "sleep", "wake_up", *sync, "wake_up"]
    assert names == ["LLM", *sync, *step, *step], names
    assert [c[1] for c in calls if c[0] in ("sleep", "wake_up")] == [2, ["weights"], ["kv_cache"]] * 2
    # Every weight of the checkpoint, Hugging Face names and shapes, bf16 (the tied head is not sent).
    first_sync = loaded[: len(expected)]
    assert {name: shape for name, shape, _ in first_sync} == expected
    assert {dtype for _, _, dtype in loaded} == {torch.bfloat16}


def _recipe_overrides(tiny_hf, tmp_path):
    return ["rollout.engine=vllm", f"model.hf_checkpoint={tiny_hf / 'model'}",
            f"data.train_files=[{tiny_hf / 'data' / 'train.parquet'}]", "data.prompts_per_step=2", "rollout.n=2",
            "trainer.micro_batch_size=4", "trainer.steps=2", "trainer.save_hf=false", "trainer.save_every=0",
            "trainer.logger=[console]", f"trainer.output_dir={tmp_path}", "algorithm.dynamic_sampling.enabled=false",
            "data.val_files=[]", "trainer.test_freq=0"]


def _train_with_standin(rank, world_size, overrides):
    import vllm as standin

    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups
    from megatron_rlcorr.recipe import load_recipe
    from megatron_rlcorr.rl.trainer import Trainer
    from tests.runs import read_metrics

    enable_cpu_megatron()
    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny_hf_cpu.yaml", overrides)
    recipe.check_layout(world_size)
    groups = build_parallel_groups(1, 1, 1)
    try:
        trainer = Trainer(recipe, groups)
        run_dir = trainer.run()
        model = trainer.engine.llm.worker.model_runner.get_model()
        expected = {k: v for k, v in model.expected.items() if not (model.tied and k == "lm_head.weight")}
        return list(standin.CALLS), model.loaded, expected, read_metrics(run_dir)
    finally:
        destroy_parallel_groups()


def test_settings_the_engine_cannot_run_are_refused_with_the_fix(vllm, tiny_hf, monkeypatch):
    model = _model(tiny_hf)
    check_vllm_settings(RolloutConfig(engine="vllm"), model)  # the stand-in reports the pinned version
    with pytest.raises(ValueError, match="rollout.precision: fp32 .* rollout.engine: embedded"):
        check_vllm_settings(RolloutConfig(engine="vllm", precision="fp32"), model)
    with pytest.raises(ValueError, match="rollout.top_p=0.9 .* rollout.logprobs: processed"):
        check_vllm_settings(RolloutConfig(engine="vllm", top_p=0.9), model)
    check_vllm_settings(RolloutConfig(engine="vllm", top_p=0.9, logprobs="processed"), model)
    with pytest.raises(ValueError, match="rollout.top_k=20 .* rollout.logprobs: processed .* top_k: 0"):
        check_vllm_settings(RolloutConfig(engine="vllm", top_k=20), model)
    check_vllm_settings(RolloutConfig(engine="vllm", top_k=20, logprobs="processed"), model)
    check_vllm_settings(RolloutConfig(engine="vllm", top_k=-1), model)  # off: the tempered log-probs hold
    with pytest.raises(ValueError, match="vLLM refuses n > 1 for greedy"):
        check_vllm_settings(RolloutConfig(engine="vllm", temperature=0.0, n=4), model)
    with pytest.raises(ValueError, match=r"temperatures in \[0, 2\]"):
        check_vllm_settings(RolloutConfig(engine="vllm", temperature=2.5), model)
    with pytest.raises(ValueError, match="set model.hf_checkpoint"):
        check_vllm_settings(RolloutConfig(engine="vllm"), ModelConfig(vocab_size=32, hidden_size=16, num_layers=1,
                                                                      num_attention_heads=2, ffn_hidden_size=32))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments.*rollout.sleep_level: 0"):
        check_vllm_settings(RolloutConfig(engine="vllm"), model)
    check_vllm_settings(RolloutConfig(engine="vllm", sleep_level=0), model)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.11.0")
    with pytest.raises(ValueError, match="written against vLLM 0.25.1 but 0.11.0 is installed"):
        check_vllm_settings(RolloutConfig(engine="vllm"), model)


def test_no_vllm_installed_is_a_recipe_error_before_any_process_group(tiny_hf, tmp_path):
    from megatron_rlcorr.recipe import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny_hf_cpu.yaml",
                         _recipe_overrides(tiny_hf, tmp_path))
    try:
        importlib.metadata.version("vllm")
        pytest.skip("vLLM is installed here")
    except importlib.metadata.PackageNotFoundError:
        pass
    with pytest.raises(ValueError, match=r"rollout.engine: vllm needs vLLM.*pip install 'megatron-rlcorr\[vllm\]'"):
        recipe.check_layout(2)


def test_rollout_tensor_parallel_size_must_divide_the_world(vllm, tiny_hf, tmp_path):
    from megatron_rlcorr.recipe import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny_hf_cpu.yaml",
                         [*_recipe_overrides(tiny_hf, tmp_path), "rollout.tensor_parallel_size=4",
                          "data.prompts_per_step=4", "trainer.micro_batch_size=2"])
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=4 must divide the world size 2"):
        recipe.check_layout(2)
    assert recipe.check_layout(4) == 4


def test_the_engine_refuses_to_generate_without_complete_weights(vllm, tiny_hf):
    """Never from dummy weights, a sync that failed half-way, or weights dropped by sleep(level=2)."""
    engine, _ = _engine(tiny_hf)
    sample = dict(n=1, seeds=[0], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="none loaded yet.*load_weights before generating"):
        engine.sample_groups([[1, 2]], **sample)
    checkpoint = _checkpoint(tiny_hf)
    broken = {**checkpoint, "model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(KeyError, match="unexpected weight model.layers.0.self_attn.q_proj.weight"):
        engine.load_weights(broken)
    with pytest.raises(RuntimeError, match="a sync did not finish"):
        engine.sample_groups([[1, 2]], **sample)
    engine.load_weights(checkpoint)
    engine.sleep()
    with pytest.raises(RuntimeError, match=r"sleep\(level=2\) dropped them"):
        engine.sample_groups([[1, 2]], **sample)
    engine.wake_up(["weights"])
    engine.load_weights(checkpoint)
    engine.wake_up(["kv_cache"])
    assert len(engine.sample_groups([[1, 2]], **sample)) == 1


def test_fp8_weights_are_reloaded_through_the_layerwise_reload(vllm, tiny_hf):
    """Online fp8 keeps processed (transposed fp8 + scale) linear weights: each sync must go through
    vLLM's layerwise reload, under its current config, so the new values are what gets quantised."""
    engine, _ = _engine(tiny_hf, precision="fp8", sleep_level=2)
    model = engine.llm.worker.model_runner.get_model()
    linear = [name for name in model.expected if name.endswith("_proj.weight")]
    assert linear and set(model.fp8) == set(linear)
    checkpoint = {k: v.to(torch.bfloat16) for k, v in _checkpoint(tiny_hf).items()}
    engine.llm.collective_rpc("begin_weight_sync", args=(False,))  # a plain (not layerwise) sync
    with pytest.raises(RuntimeError, match="processed fp8 parameter"):  # the stand-in does check: a plain load fails
        engine.llm.collective_rpc("load_weight_pairs", args=([(linear[0], checkpoint[linear[0]])],))
    for values in (checkpoint, {k: -v for k, v in checkpoint.items()}):  # a second sync replaces the first
        engine.sleep()
        engine.wake_up(["weights"])
        engine.load_weights(values)
        engine.wake_up(["kv_cache"])
        for name in linear:
            torch.testing.assert_close(model.dequantized(name), values[name].float(), rtol=0.07, atol=1e-6)
        assert len(engine.sample_groups([[1, 2]], n=2, seeds=[0], max_new_tokens=3)) == 2


# --- every sync checked complete --------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_sync_that_misses_weights_raises_naming_them(vllm, tiny_hf, caplog, precision):
    """vLLM itself keeps the old (here: dropped, NaN) tensors of what a sync did not bring, with a
    warning at most; the adapter compares the names load_weights reported over the whole sync (one
    call per tensor here) with the model's parameters."""
    engine, _ = _engine(tiny_hf, precision=precision, sleep_level=2)
    checkpoint = {k: v.to(torch.bfloat16) for k, v in _checkpoint(tiny_hf).items()}
    engine.load_weights(checkpoint)  # complete, over one rpc per tensor
    left_out = ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"]
    engine.sleep()
    engine.wake_up(["weights"])
    with caplog.at_level(logging.WARNING, logger="vllm"):
        with pytest.raises(RuntimeError, match=r"left 2 of the model's parameters without a tensor: "
                                               r"model\.layers\.1\.mlp\.down_proj\.weight, model\.norm\.weight\."):
            engine.load_weights({k: v for k, v in checkpoint.items() if k not in left_out})
    if precision == "fp8":  # vLLM's reload only warns: without our check the run would go on
        assert "model.layers.1.mlp.down_proj.weight: Failed to load weights" in caplog.text
    engine.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="a sync did not finish"):
        engine.sample_groups([[1, 2]], n=1, seeds=[0], max_new_tokens=2)
    engine.load_weights(checkpoint)  # the next complete sync is accepted
    out = engine.sample_groups([[1, 2]], n=2, seeds=[0], max_new_tokens=3)
    assert all(torch.isfinite(lp).all() for lp in out.logprobs)


def test_the_completeness_check_ignores_kv_cache_scales_and_a_tied_head(vllm, tiny_hf):
    """fp8 attention registers KV-cache scale parameters no checkpoint has; a tied head is the embedding."""
    from megatron_rlcorr.rollout.vllm_engine import _checkpoint_parameter_names

    engine, _ = _engine(tiny_hf, precision="fp8")
    model = engine.llm.worker.model_runner.get_model()
    assert model.kv_scales and set(model.kv_scales) <= {name for name, _ in model.named_parameters()}
    assert _checkpoint_parameter_names(model) == set(model.expected) | {
        name.removesuffix("weight") + "weight_scale" for name in model.fp8}  # outside a reload: processed
    model.tied = True
    assert "lm_head.weight" not in _checkpoint_parameter_names(model)


# --- the process's RNG states, get_model(), the temperature floor ------------------------------------


def _rng_states():
    import numpy as np

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _assert_same_rng(a, b):
    assert a[0] == b[0]
    assert all((x == y).all() if hasattr(x, "all") else x == y for x, y in zip(a[1], b[1]))
    assert torch.equal(a[2], b[2])


def test_building_the_engine_leaves_the_process_rng_states_as_they_were(vllm, tiny_hf):
    import numpy as np

    random.seed(1234), np.random.seed(1234), torch.manual_seed(1234)
    before = _rng_states()
    vllm.LLM(str(tiny_hf / "model"), seed=5)  # vLLM itself reseeds them all with its seed
    with pytest.raises(AssertionError):
        _assert_same_rng(before, _rng_states())
    random.seed(1234), np.random.seed(1234), torch.manual_seed(1234)
    _engine(tiny_hf)
    _assert_same_rng(before, _rng_states())


def test_the_adapter_reaches_the_model_through_get_model(vllm, tiny_hf):
    """The stand-in's runner holds the model inside a CUDA-graph wrapper, as vLLM's V1 runner can."""
    engine, _ = _engine(tiny_hf)
    runner = engine.llm.worker.model_runner
    assert not hasattr(runner.model, "load_weights") and runner.get_model() is runner.model.unwrap()
    engine.load_weights(_checkpoint(tiny_hf))
    out = engine.sample_groups([[1, 2]], n=4, seeds=[0], max_new_tokens=4)
    assert max(max(ids) for ids in out.response_ids) < TOKENS  # the padded rows masked on the model itself


def test_a_temperature_vllm_would_raise_is_refused_at_recipe_load(vllm, tiny_hf, tmp_path):
    from megatron_rlcorr.recipe import load_recipe

    recipe_file = Path(__file__).resolve().parents[2] / "recipes" / "tiny_hf_cpu.yaml"
    base = _recipe_overrides(tiny_hf, tmp_path)
    with pytest.raises(ValueError, match=r"rollout.temperature=0.005: vLLM samples any temperature below 0.01 at "
                                         r"0.01 while the trainer divides its logits by 0.005"):
        load_recipe(recipe_file, [*base, "rollout.temperature=0.005"])
    for ok in ("0.01", "0.0"):
        assert load_recipe(recipe_file, [*base, f"rollout.temperature={ok}"]).rollout.temperature == float(ok)
    embedded = [o for o in base if o != "rollout.engine=vllm"]
    assert load_recipe(recipe_file, [*embedded, "rollout.temperature=0.005"]).rollout.temperature == 0.005
    engine, _ = _engine(tiny_hf)
    engine.load_weights(_checkpoint(tiny_hf))
    with pytest.raises(ValueError, match="vLLM would sample at 0.01"):
        engine.sample_groups([[1, 2]], n=1, seeds=[0], max_new_tokens=2, temperature=0.005)


# --- the stand-in follows vLLM 0.25.1's default runner ------------------------------------------------


def test_standin_sampling_params_validate_as_vllm(vllm, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert vllm.SamplingParams(temperature=0.004).temperature == 0.01  # raised, not refused
    assert "maxed it out to 0.01" in caplog.text
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
        vllm.SamplingParams(temperature=2.5)
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
        vllm.SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        vllm.SamplingParams(n=2, temperature=0.0)
    assert vllm.SamplingParams(top_k=5).top_k == 5
    with pytest.raises(ValueError, match="top_k must be 0"):
        vllm.SamplingParams(top_k=-2)
    greedy = vllm.SamplingParams(temperature=0.0, top_k=5, top_p=0.5)
    assert (greedy.top_k, greedy.top_p) == (0, 1.0)


def test_standin_samples_within_top_k_and_reports_processed_logprobs(vllm, tiny_hf):
    llm = vllm.LLM(str(tiny_hf / "model"), logprobs_mode="processed_logprobs")
    model = llm.worker.model_runner.get_model()
    params = vllm.SamplingParams(n=8, temperature=0.7, top_k=3, max_tokens=4, logprobs=0, seed=3)
    out, = llm.generate([{"prompt_token_ids": [1, 5]}], params)
    for sample in out.outputs:
        for previous, token, step in zip([5, *sample.token_ids[:-1]], sample.token_ids, sample.logprobs):
            logits = model.compute_logits(model.hidden(previous))[0] / 0.7
            top = logits.topk(3).indices
            assert token in top.tolist()
            expected = torch.log_softmax(logits[top], dim=-1)[top.tolist().index(token)]
            assert step[token].logprob == pytest.approx(float(expected), abs=1e-5)


def test_standin_wake_up_with_a_tag_not_asleep_is_ignored_whole(vllm, tiny_hf, caplog):
    llm = vllm.LLM(str(tiny_hf / "model"), enable_sleep_mode=True)
    llm.sleep(level=1)
    llm.wake_up(["weights"])
    with caplog.at_level(logging.WARNING, logger="vllm"):
        llm.wake_up(["weights", "kv_cache"])
    assert "Tag weights is not in sleeping tags" in caplog.text and llm.asleep == {"kv_cache"}
    with pytest.raises(RuntimeError, match="kv_cache"):
        llm.generate([{"prompt_token_ids": [1]}], vllm.SamplingParams(seed=0))


def test_standin_allows_one_sleep_mode_engine_per_process(vllm, tiny_hf):
    vllm.LLM(str(tiny_hf / "model"), enable_sleep_mode=True)
    with pytest.raises(AssertionError, match="one instance per process"):
        vllm.LLM(str(tiny_hf / "model"), enable_sleep_mode=True)


def test_standin_incomplete_fp8_reload_warns_and_keeps_the_old_tensors(vllm, tiny_hf, caplog):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    llm = vllm.LLM(str(tiny_hf / "model"), quantization="fp8")
    model = llm.worker.model_runner.get_model()
    checkpoint = _checkpoint(tiny_hf)
    skipped = "model.layers.0.mlp.up_proj.weight"
    old = model.dequantized(skipped)
    with set_current_vllm_config(llm.worker.model_runner.vllm_config), caplog.at_level(logging.WARNING, "vllm"):
        initialize_layerwise_reload(model)
        model.load_weights((k, v) for k, v in checkpoint.items() if k != skipped)
        finalize_layerwise_reload(model, llm.worker.model_config)
    assert f"{skipped}: Failed to load weights" in caplog.text
    torch.testing.assert_close(model.dequantized(skipped), old)
    name = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(model.dequantized(name), checkpoint[name], rtol=0.07, atol=1e-6)
