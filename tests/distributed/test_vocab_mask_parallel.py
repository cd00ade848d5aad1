"""The trainer masks the rows beyond the tokenizer as the engines do (gloo, CPU).

A model of 160 rows whose tokenizer has 133 (tests/unit/test_vocab_mask.py, weights that give the
padded rows most of the probability):
- with fp32 rollouts on the same weights, the trainer's log-probs of the embedded engine's
  sampled tokens equal the engine's (k3 ~ 0), with and without Megatron's own padding beyond;
- under TP 2, where the first masked row falls inside rank 1's vocabulary shard (133) or inside
  rank 0's, leaving rank 1 nothing (70), the log-probs equal the single process's, and the
  update's gradient never reaches a masked row of the output layer;
- the exported weights keep every row;
- `score` of a Hugging Face checkpoint padded beyond its tokenizer normalises over the
  tokenizer's rows: transformers' log-prob = ours + log(1 - p_padded).
"""
import json

import pytest
import torch

from megatron_rlcorr.model.config import ModelConfig
from megatron_rlcorr.rollout import EmbeddedEngine
from tests.dist import hide_gpus, run_distributed
from tests.unit.test_vocab_mask import SHAPE, make_padded_hf_checkpoint, padded_rows_dominate

pytestmark = [pytest.mark.distributed]

ROWS = SHAPE.vocab_size
TEMPERATURE = 0.8
# name: (tokenizer rows, make_vocab_size_divisible_by); 160 rows per model, in two TP shards of 80
# with divisible_by 16, padded by Megatron to 192 with 64 (one process only).
CASES = {"133": (133, 16), "70": (70, 16), "133_megatron_padding": (133, 64)}
TP2_CASES = ("133", "70")


def _model_config(name: str) -> ModelConfig:
    tokens, divisible_by = CASES[name]
    return ModelConfig(vocab_size=ROWS, hidden_size=SHAPE.hidden_size, num_layers=SHAPE.num_layers,
                       num_attention_heads=SHAPE.num_attention_heads, num_query_groups=SHAPE.num_query_groups,
                       ffn_hidden_size=SHAPE.ffn_hidden_size, add_qkv_bias=SHAPE.add_qkv_bias,
                       make_vocab_size_divisible_by=divisible_by, token_vocab_size=tokens)


def _rollouts(tokens: int, seed: int):
    """Prompts, the fp32 embedded engine's samples and their log-probs, and the weights."""
    weights = padded_rows_dominate(SHAPE, tokens, seed=seed)
    engine = EmbeddedEngine(SHAPE, precision="fp32", token_vocab_size=tokens)
    engine.load_weights(weights)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, tokens, (int(k),), generator=gen).tolist() for k in torch.randint(2, 6, (8,), generator=gen)]
    out = engine.generate(prompts, max_new_tokens=10, temperature=TEMPERATURE, generator=gen)
    return dict(weights=weights, prompts=prompts, responses=out.response_ids, logprobs=out.logprobs)


def _trainer_log_probs(name, rollouts, groups):
    """pi_old of the responses (the trainer's forward-only pass), and the output layer's gradient
    rows of one update-like backward pass through the vocab-parallel log-probs."""
    from megatron_rlcorr.model.build import build_gpt_model
    from megatron_rlcorr.model.weights import export_full_weights, load_full_weights
    from megatron_rlcorr.rl.batch import padded_sequences
    from megatron_rlcorr.training.logprobs import token_logprobs_and_entropy
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs

    cfg = _model_config(name)
    model = build_gpt_model(cfg, groups, seed=3)
    load_full_weights([model], rollouts["weights"], groups)
    tokens_BT, targets_BT, response_BT, _ = padded_sequences(rollouts["prompts"], rollouts["responses"])
    zeros_BT = torch.zeros(tokens_BT.shape)
    batch = StepBatch(tokens_BT, targets_BT, response_BT.float(), zeros_BT, zeros_BT)
    old_BT = compute_old_log_probs([model], batch, groups=groups, micro_batch_size=4, temperature=TEMPERATURE)
    logits = model(tokens_BT, None, None)  # this rank's vocabulary shard
    log_probs, _ = token_logprobs_and_entropy(logits, targets_BT, tp_group=groups.tp, temperature=TEMPERATURE)
    (log_probs * response_BT).sum().backward()
    grad = model.output_layer.weight.grad
    first_row = groups.tp_rank * grad.shape[0]
    return dict(old=[old_BT[i][response_BT[i]] for i in range(len(rollouts["prompts"]))],
                grad_rows=(first_row, grad.detach().clone()),
                exported_lm_head=export_full_weights([model], groups)["lm_head.weight"])


def _score(checkpoint, rollouts_path, out_path, groups):
    from megatron_rlcorr import score

    args = score.parse_args(["--model", str(checkpoint), "--rollouts", str(rollouts_path), "--out", str(out_path),
                             f"rollout.temperature={TEMPERATURE}"])
    source, recipe, records = score.prepare(args, 1)
    return dict(token_vocab_size=recipe.model.token_vocab_size,
                log_probs=score.score_records(source, recipe, records, groups))


def _worker(rank, world, cases, score_inputs):
    hide_gpus()
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups

    enable_cpu_megatron()
    groups = build_parallel_groups(world, 1, 1)
    out = {name: _trainer_log_probs(name, rollouts, groups) for name, rollouts in cases.items()}
    if score_inputs is not None:
        out["score"] = _score(*score_inputs, groups)
    return out


@pytest.fixture(scope="module")
def rollouts():
    return {name: _rollouts(tokens, seed=i) for i, (name, (tokens, _)) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def scored_checkpoint(tmp_path_factory):
    """A Qwen2 checkpoint of 352 rows, its 320-token tokenizer, and rollouts of those tokens."""
    from tests.hf_fixtures import VOCAB_SIZE, make_tokenizer

    directory = tmp_path_factory.mktemp("padded_hf")
    make_padded_hf_checkpoint(directory, rows=VOCAB_SIZE + 32, tokens=VOCAB_SIZE)
    make_tokenizer(directory)
    gen = torch.Generator().manual_seed(11)
    records = [{"prompt_ids": torch.randint(0, VOCAB_SIZE, (3,), generator=gen).tolist(),
                "response_ids": torch.randint(0, VOCAB_SIZE, (int(n),), generator=gen).tolist()}
               for n in torch.randint(1, 8, (5,), generator=gen)]
    path = directory.parent / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory, path, records


@pytest.fixture(scope="module")
def single(rollouts, scored_checkpoint, tmp_path_factory):
    checkpoint, path, _ = scored_checkpoint
    score_inputs = (checkpoint, path, tmp_path_factory.mktemp("scored") / "out.jsonl")
    return run_distributed(_worker, 1, rollouts, score_inputs)[0]


@pytest.fixture(scope="module")
def tp2(rollouts):
    return run_distributed(_worker, 2, {name: rollouts[name] for name in TP2_CASES}, None)


@pytest.mark.parametrize("name", list(CASES))
def test_trainer_log_probs_equal_the_fp32_engines(single, rollouts, name):
    for old, engine in zip(single[name]["old"], rollouts[name]["logprobs"]):
        torch.testing.assert_close(old, engine, atol=5e-5, rtol=0)
    log_ratio = torch.cat(single[name]["old"]) - torch.cat(rollouts[name]["logprobs"])
    k3 = (log_ratio.exp() - 1 - log_ratio).mean()
    assert float(k3) < 1e-9


def test_export_keeps_every_row_of_the_checkpoint(single, tp2, rollouts):
    """Masking is the output layer's business: the weights, exported, keep the rows beyond the
    tokenizer (only Megatron's padding is stripped)."""
    for name in CASES:
        assert torch.equal(single[name]["exported_lm_head"], rollouts[name]["weights"]["lm_head.weight"])
    for rank in tp2:
        for name in TP2_CASES:
            assert torch.equal(rank[name]["exported_lm_head"], rollouts[name]["weights"]["lm_head.weight"])


def _masked_and_kept(grad_rows, tokens):
    first_row, grad = grad_rows
    ids = torch.arange(first_row, first_row + grad.shape[0])
    return grad[ids >= tokens], grad[ids < tokens]


@pytest.mark.parametrize("name", TP2_CASES)
def test_tp2_masks_the_rows_in_whichever_shard_they_fall(single, tp2, rollouts, name):
    tokens = CASES[name][0]
    for rank in tp2:  # every TP rank holds the full-vocabulary log-probs: the single process's, the engine's
        for old, reference, engine in zip(rank[name]["old"], single[name]["old"], rollouts[name]["logprobs"]):
            torch.testing.assert_close(old, reference, atol=2e-6, rtol=0)
            torch.testing.assert_close(old, engine, atol=5e-5, rtol=0)
    shards = [_masked_and_kept(rank[name]["grad_rows"], tokens) for rank in tp2]
    assert sum(len(masked) for masked, _ in shards) == ROWS - tokens
    for masked, kept in shards + [_masked_and_kept(single[name]["grad_rows"], tokens)]:
        assert torch.count_nonzero(masked) == 0  # the update never reaches a masked row
        assert len(kept) == 0 or torch.count_nonzero(kept) > 0
    # The shards' gradients, side by side, are the single process's.
    full = torch.cat([rank[name]["grad_rows"][1] for rank in tp2])
    torch.testing.assert_close(full, single[name]["grad_rows"][1], atol=1e-5, rtol=1e-4)


def test_score_normalises_over_the_tokenizers_rows(single, scored_checkpoint):
    from tests.hf_fixtures import VOCAB_SIZE
    from tests.hf_models import hf_logits

    checkpoint, _, records = scored_checkpoint
    assert single["score"]["token_vocab_size"] == VOCAB_SIZE
    shortfall = []
    for record, ours in zip(records, single["score"]["log_probs"]):
        seq = torch.tensor([record["prompt_ids"] + record["response_ids"]])
        start = len(record["prompt_ids"]) - 1
        logits = hf_logits(checkpoint, seq)[0, start:-1].double() / TEMPERATURE
        response = torch.tensor(record["response_ids"])
        theirs = torch.log_softmax(logits, -1).gather(-1, response[:, None])[:, 0]
        # log(1 - p_padded), without the cancellation of 1 - p where p is near 1
        log_kept = logits[:, :VOCAB_SIZE].logsumexp(-1) - logits.logsumexp(-1)
        torch.testing.assert_close(theirs, torch.tensor(ours).double() + log_kept, atol=1e-4, rtol=0)
        shortfall.append(log_kept)
    assert float(torch.cat(shortfall).mean()) < -0.05  # the padded rows had mass to lose
