"""Padded vocabulary rows: one notion of the rows that can get probability, used everywhere.

A checkpoint may pad its vocabulary beyond its tokenizer (Qwen2.5: 152,064 rows, 151,665 tokens).
`model.token_vocab_size` (set from the tokenizer when the recipe is composed) is where the rows
that never get probability begin: the embedded engine never samples or normalises over them
(here), and the trainer's output layer masks them (tests/distributed/test_vocab_mask_parallel.py).
The weights here make the padded rows take most of the probability, so that an engine that
samples them does so visibly.
"""
from pathlib import Path

import pytest
import torch

from megatron_rlcorr.model.architecture import DecoderShape
from megatron_rlcorr.model.config import ModelConfig
from megatron_rlcorr.model.reference import reference_forward
from megatron_rlcorr.recipe import load_recipe
from megatron_rlcorr.recipe.recipe import parse_recipe
from megatron_rlcorr.rollout import EmbeddedEngine, RolloutConfig, make_engine, random_weights

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
# The tiny model: 133 tokenizer rows padded to 160 in the checkpoint.
TOKENS, ROWS = 133, 160
SHAPE = DecoderShape(vocab_size=ROWS, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=48, add_qkv_bias=True)


def padded_rows_dominate(shape: DecoderShape, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights whose rows from `tokens` on take most of the probability at every position:
    every embedding has a large component 0, which survives to the final norm, and only the
    padded rows of the output layer read it."""
    weights = random_weights(shape, generator=torch.Generator().manual_seed(seed))
    weights["embed.weight"][:, 0] = 1.0
    weights["lm_head.weight"][tokens:, 0] = 0.5
    return weights


def padded_mass(weights, shape, tokens_BT, tokens: int) -> torch.Tensor:
    """The probability the unmasked model gives the rows from `tokens` on, per position."""
    probs = reference_forward(weights, shape, tokens_BT).softmax(-1)
    return probs[..., tokens:].sum(-1)


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 7, (n,), generator=gen).tolist()
    return [torch.randint(0, TOKENS, (k,), generator=gen).tolist() for k in lengths]


def _engine(weights, token_vocab_size, precision="fp32"):
    engine = EmbeddedEngine(SHAPE, precision=precision, token_vocab_size=token_vocab_size)
    engine.load_weights(weights)
    return engine


def test_padded_rows_would_dominate():
    weights = padded_rows_dominate(SHAPE, TOKENS)
    mass = padded_mass(weights, SHAPE, torch.tensor(_prompts(1, 0)), TOKENS)
    assert mass.min() > 0.5  # the setting below tests something


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_embedded_engine_never_samples_a_row_beyond_the_tokenizer(precision):
    weights = padded_rows_dominate(SHAPE, TOKENS)
    prompts = _prompts(64, 1)
    kwargs = dict(max_new_tokens=32, temperature=1.0)
    masked = _engine(weights, TOKENS, precision).generate(prompts, generator=torch.Generator().manual_seed(2), **kwargs)
    sampled = torch.cat([torch.tensor(r) for r in masked.response_ids])
    assert sampled.numel() == 64 * 32
    assert int(sampled.max()) < TOKENS
    # All rows: the same engine without the tokenizer's size samples the padded rows most of the time.
    unmasked = _engine(weights, None, precision).generate(prompts, generator=torch.Generator().manual_seed(2), **kwargs)
    beyond = sum(int((torch.tensor(r) >= TOKENS).sum()) for r in unmasked.response_ids)
    assert beyond > 0.5 * 64 * 32


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.6)])
def test_embedded_engine_normalises_over_the_tokenizer_rows(temperature, top_p):
    """Log-probs reported while sampling, and by score(), are the reference forward's
    log-softmax over the tokenizer's rows only."""
    weights = padded_rows_dominate(SHAPE, TOKENS)
    engine = _engine(weights, TOKENS)
    prompts = _prompts(6, 3)
    out = engine.generate(prompts, max_new_tokens=8, temperature=temperature, top_p=top_p,
                          generator=torch.Generator().manual_seed(4))
    scored = engine.score(prompts, out.response_ids, temperature=temperature)
    for prompt, response, reported, rescored in zip(prompts, out.response_ids, out.logprobs, scored):
        seq = torch.tensor([prompt + response])
        logits = reference_forward(weights, SHAPE, seq)[0, len(prompt) - 1:-1, :TOKENS]
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(reported, expected, atol=2e-5, rtol=0)
        torch.testing.assert_close(rescored, expected, atol=2e-5, rtol=0)
        assert float(expected.max()) > -10  # no padded-row-sized values


def test_embedded_engine_score_refuses_a_padded_row_and_bad_sizes():
    engine = _engine(padded_rows_dominate(SHAPE, TOKENS), TOKENS)
    with pytest.raises(ValueError, match=f"token {TOKENS}, outside the {TOKENS} rows"):
        engine.score([[1, 2]], [[3, TOKENS]])
    for bad in (0, ROWS + 1):
        with pytest.raises(ValueError, match="token_vocab_size"):
            EmbeddedEngine(SHAPE, token_vocab_size=bad)


def test_make_engine_takes_the_rows_from_the_model_config():
    model = ModelConfig(vocab_size=ROWS, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=48, add_qkv_bias=True, token_vocab_size=TOKENS)
    engine = make_engine(RolloutConfig(), model, eos_token_id=None)
    assert engine.sampled_vocab_size == TOKENS
    engine.load_weights(padded_rows_dominate(SHAPE, TOKENS))
    out = engine.generate(_prompts(16, 5), max_new_tokens=16, generator=torch.Generator().manual_seed(6))
    assert max(max(r) for r in out.response_ids) < TOKENS


# ---- the recipe decides the rows once ------------------------------------------------------------

def test_recipe_takes_the_rows_from_the_built_in_tasks_tokenizer():
    recipe = load_recipe(TINY, ["model.vocab_size=32"])  # the arithmetic tokenizer has 15 ids
    assert recipe.model.token_vocab_size == 15 and recipe.model.sampled_vocab_size == 15
    assert load_recipe(TINY).model.token_vocab_size == 15
    assert ModelConfig(vocab_size=32, hidden_size=8, num_layers=1, num_attention_heads=2,
                       ffn_hidden_size=16).sampled_vocab_size == 32


def test_recipe_refuses_rows_that_disagree_with_the_tokenizer():
    with pytest.raises(ValueError, match=r"model.token_vocab_size=12 but task 'digit_sum''s tokenizer has 15 tokens"):
        load_recipe(TINY, ["model.vocab_size=32", "model.token_vocab_size=12"])
    with pytest.raises(ValueError, match=r"token_vocab_size=40 must be in \[1, vocab_size=32\]"):
        load_recipe(TINY, ["model.vocab_size=32", "model.token_vocab_size=40"])


@pytest.fixture(scope="module")
def padded_checkpoint(tmp_path_factory):
    """A Qwen2 checkpoint of 352 rows beside a 320-token tokenizer in the same directory."""
    from tests.hf_fixtures import VOCAB_SIZE, make_tokenizer

    directory = tmp_path_factory.mktemp("padded")
    make_padded_hf_checkpoint(directory, rows=VOCAB_SIZE + 32)
    make_tokenizer(directory)
    return directory


def make_padded_hf_checkpoint(directory: Path, rows: int, tokens: int | None = None, seed: int = 0) -> Path:
    """tests/hf_models.py's Qwen2 family with `rows` vocabulary rows; with `tokens`, the rows from
    it on are made to take a good share of the probability."""
    import transformers

    from tests.hf_models import hf_config

    config = hf_config("qwen2")
    config.vocab_size = rows
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = (1.0, 0.2) if name.endswith("norm.weight") else (0.0, 0.2)
            param.copy_(scale[0] + scale[1] * torch.randn(param.shape, generator=gen))
        if tokens is not None:
            model.lm_head.weight[tokens:] *= 2
    model.save_pretrained(directory)
    return directory


def test_recipe_takes_the_rows_from_the_checkpoints_tokenizer(padded_checkpoint):
    from tests.hf_fixtures import VOCAB_SIZE

    recipe = parse_recipe({"model": {"hf_checkpoint": str(padded_checkpoint)}})
    assert recipe.model.vocab_size == VOCAB_SIZE + 32
    assert recipe.model.token_vocab_size == VOCAB_SIZE


def test_score_of_a_hf_source_takes_its_tokenizer_not_a_lent_configs(padded_checkpoint, tmp_path):
    """A recipe written for another model lends its settings, never its tokenizer's rows."""
    from megatron_rlcorr.recipe.source import resolve_source, source_recipe
    from tests.hf_fixtures import VOCAB_SIZE

    config = tmp_path / "other.yaml"
    config.write_text(f"base: {TINY}\nmodel: {{vocab_size: 15, token_vocab_size: 15}}\n")
    recipe = source_recipe(resolve_source(padded_checkpoint), str(config), [])
    assert recipe.model.token_vocab_size == VOCAB_SIZE


def test_score_refuses_a_response_token_beyond_the_tokenizer(padded_checkpoint, tmp_path):
    import json

    from megatron_rlcorr import score
    from tests.hf_fixtures import VOCAB_SIZE

    rollouts = tmp_path / "in.jsonl"
    records = [{"prompt_ids": [1, 2], "response_ids": [3, VOCAB_SIZE - 1]},
               {"prompt_ids": [1, 2], "response_ids": [3, VOCAB_SIZE]}]
    rollouts.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = score.parse_args(["--model", str(padded_checkpoint), "--rollouts", str(rollouts),
                             "--out", str(tmp_path / "out.jsonl")])
    with pytest.raises(ValueError, match=f"record 2 .*token id {VOCAB_SIZE}, a padded vocabulary row beyond the "
                                         f"tokenizer's {VOCAB_SIZE} tokens"):
        score.prepare(args, 1)
    rollouts.write_text(json.dumps(records[0]) + "\n")
    assert len(score.prepare(args, 1)[2]) == 1


def test_score_help_says_padded_rows_are_masked(capsys):
    from megatron_rlcorr import cli

    with pytest.raises(SystemExit):
        cli.main(["score", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Padded vocabulary rows are masked" in text
    assert "transformers does not mask them" in text and "log(1 - p_padded)" in text
