"""Make the demo's tiny Hugging Face checkpoint and DAPO-format dataset, locally and without a download.

    python tools/make_tiny_hf.py --out DIR [--seed 0] [--force] [--moe]

writes
- DIR/model/: a Qwen2ForCausalLM checkpoint (config.json, model.safetensors, generation_config.json)
  and its tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja), loadable offline by
  AutoModelForCausalLM / AutoTokenizer.from_pretrained(DIR/model);
- DIR/data/train.parquet and DIR/data/val.parquet: verl's RL schema (data_source, prompt, ability,
  reward_model, extra_info) with the 1-digit additions "What is a+b? Reply with Answer: <sum>" in a
  seeded order, split in two: the validation split holds VAL_ROWS (20) sums a+b with a < b, the
  first in that order, and the training split the other 80, the mirror b+a of every held-out sum
  included. The warm-up and RL see only the training split, so a held-out sum is answered right only
  by what the model generalises (the mirror image of a sum it learnt), not by what it memorised;
- DIR/manifest.json, written last: what was made, with which seed, and the warm-up's accuracy.
Run again without --force, it only reports what DIR already holds (well under a second), so
tools/demo.sh can call it every time.

--moe writes a Qwen3-MoE checkpoint instead (Qwen3MoeForCausalLM, MOE_SIZES: layer 0 keeps a dense
MLP (mlp_only_layers), the others have MOE_SIZES' experts of which each token uses 2, weighted by
the softmax over its top-2 router logits (norm_topk_prob)), with the same tokenizer, dataset and
warm-up: the evidence model of rollout routing replay (recipes/tiny_hf_moe_cpu.yaml). Give it its
own DIR (runs/tiny_hf_moe_files); a DIR holding the other kind is refused without --force.

The tokenizer is a small BPE trained here with the `tokenizers` library on the task's chat text,
through Qwen2's own pipeline (NFC, Qwen2's pre-tokenizer regex, byte-level pieces): transformers 5
loads the tokenizer of any qwen2 checkpoint as a Qwen2Tokenizer, which rebuilds that pipeline around
tokenizer.json's vocabulary and merges, so any other pipeline (Metaspace, say) would be replaced
without a word on loading. Its vocabulary: the special tokens "<|endoftext|>" (0), "<|im_start|>"
(1), "<|im_end|>" (2), one token per printable ASCII character, tab, newline and "\\r" (other
characters have no token and are dropped), and every merge the small corpus offers: 133 tokens.
Qwen2's regex cuts every digit on its own (as Digits(individual_digits=True) would), so numbers
are digit sequences: "Answer: 12" is "Answer", ":", "Ġ" (a space), "1", "2". The chat template is
Qwen's: "<|im_start|>{role}\\n{content}<|im_end|>\\n" per message, then "<|im_start|>assistant\\n"
when add_generation_prompt. EOS is <|im_end|>, padding <|endoftext|>, as in Qwen2 instruct models.

The model is Qwen2 in miniature (MODEL_SIZES: GQA, q/k/v biases, untied embeddings, float32).
From a random initialisation it would never write "Answer: 12", and DAPO's reward (+1 for the
right answer on the last "Answer:" line, -1 otherwise) would give RL no signal. So the model gets
a short supervised warm-up that stands in for the pretraining of a real checkpoint: full-batch
AdamW on "Answer: <sum><|im_end|>" responses to the dataset's prompts, stopped at the first step
where the model's probability of writing exactly the right response, averaged over the prompts,
reaches WARMUP_TARGET (about 80 steps, 5 s on one CPU thread). That probability is the expected
accuracy at temperature 1 (up to the rare right answers written some other way), so the model
starts RL clearly above zero and far below perfect whatever the platform's float rounding; about
90% of its samples are well-formed "Answer: <n>" lines. Everything is seeded: the same --seed
writes a byte-identical model.safetensors on the same machine.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import string
import sys
import time
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# What the BPE starts from (printable ASCII, tab, newline); other characters have no token.
ALPHABET = string.printable.replace("\x0b", "").replace("\x0c", "")
VOCAB_LIMIT = 256  # the trainer stops earlier, when every pair of the small corpus is merged
MODEL_SIZES = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 128}
# --moe: Qwen3-MoE in miniature (Qwen3's per-head q/k norms, no q/k/v biases, head_dim explicit): a dense
# first layer of MODEL_SIZES' MLP, then MoE layers of 8 experts of width 64, 2 per token
MOE_SIZES = {**MODEL_SIZES, "num_hidden_layers": 3, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 64, "mlp_only_layers": [0], "decoder_sparse_step": 1, "norm_topk_prob": True}
QUESTION = "What is {a}+{b}? Reply with Answer: <sum>"
# verl's default reward routing sends data_source "math_dapo" to the same DAPO verifier the demo uses.
DATA_SOURCE = "math_dapo"
WARMUP_TARGET = 0.35  # expected accuracy at temperature 1 where the warm-up stops
WARMUP_LR = 3e-3
WARMUP_MAX_STEPS = 2000
MAX_NEW_TOKENS = 8
ACCURACY_SAMPLES = 200

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")
DATA_FILE = "data/train.parquet"
VAL_FILE = "data/val.parquet"
VAL_ROWS = 20  # held out: never in the warm-up or the RL training data
MANIFEST = "manifest.json"


# ----------------------------------------------------------------------------------------------
# Task text
def question(a: int, b: int) -> str:
    return QUESTION.format(a=a, b=b)


def answer(total: int) -> str:
    return f"Answer: {total}"


def problems(seed: int) -> list[tuple[int, int]]:
    """Every 1-digit addition a+b, in an order fixed by the seed."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    return pairs


def render_chat(messages: list[dict]) -> str:
    """What CHAT_TEMPLATE renders (without the generation prompt), in Python."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _chat_corpus() -> list[str]:
    """Every problem and its answer as a chat, cut at the special tokens as the tokenizer cuts it."""
    chats = [render_chat([{"role": "user", "content": question(a, b)},
                          {"role": "assistant", "content": answer(a + b)}]) for a, b in problems(0)]
    split = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))
    return [piece for chat in chats for piece in split.split(chat) if piece]


# ----------------------------------------------------------------------------------------------
# Tokenizer
def _train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a BPE trained on the chat corpus through Qwen2's own pre-tokenization."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    byte_chars = bytes_to_unicode()
    alphabet = [byte_chars[b] for b in ALPHABET.encode()]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_LIMIT, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                  show_progress=False)
    bpe.train_from_iterator(_chat_corpus(), trainer)
    merges = json.loads(bpe.to_str())["model"]["merges"]
    return bpe.get_vocab(), [tuple(pair) for pair in merges]


def make_tokenizer(out_dir: str | Path | None = None):
    """The BPE as a Qwen2Tokenizer (a PreTrainedTokenizerFast) with the chat template; saved to out_dir if given.

    Qwen2Tokenizer, because transformers 5 loads every qwen2 checkpoint's tokenizer as one, with
    Qwen2's normalizer, pre-tokenizer and decoder whatever tokenizer.json says: training through
    that same pipeline makes the tokenizer written here and the one loaded back identical.
    """
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_bpe()
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token=EOS_TOKEN,
                               pad_token=PAD_TOKEN, extra_special_tokens=["<|im_start|>"],
                               clean_up_tokenization_spaces=False,
                               model_max_length=MODEL_SIZES["max_position_embeddings"])
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        tokenizer.save_pretrained(out_dir)
    return tokenizer


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template with the generation prompt, as token ids."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


# ----------------------------------------------------------------------------------------------
# Dataset
def dataset_rows(seed: int) -> list[dict]:
    """verl's RL schema, one row per problem."""
    return [{"data_source": DATA_SOURCE,
             "prompt": [{"role": "user", "content": question(a, b)}],
             "ability": "math",
             "reward_model": {"ground_truth": str(a + b), "style": "rule"},
             "extra_info": {"index": index, "a": a, "b": b}}
            for index, (a, b) in enumerate(problems(seed))]


def split_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out validation rows): the first VAL_ROWS rows a+b with a < b are held out
    (their mirror b+a stays in training). On seed 0 RL on the training split took the held-out accuracy
    at temperature 1 from 30% to 39%; with the first VAL_ROWS rows of any kind held out it stayed at
    26-29%: the model memorises sums it never sees mirrored."""
    train, val = [], []
    for row in rows:
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        (val if a < b and len(val) < VAL_ROWS else train).append(row)
    return train, val


def make_dataset(out: str | Path, seed: int) -> tuple[list[dict], list[dict]]:
    """Write the training and validation splits as parquet under out (DATA_FILE, VAL_FILE); return them."""
    train, val = split_rows(dataset_rows(seed))
    for rows, name in ((train, DATA_FILE), (val, VAL_FILE)):
        write_parquet(rows, Path(out) / name)
    return train, val


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.int64()), ("a", pa.int64()), ("b", pa.int64())])),
    ])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


# ----------------------------------------------------------------------------------------------
# Model
def model_config(tokenizer, moe: bool = False):
    """Qwen2Config of MODEL_SIZES, or with `moe` Qwen3MoeConfig of MOE_SIZES; the rest shared."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    config_class, sizes = (Qwen3MoeConfig, MOE_SIZES) if moe else (Qwen2Config, MODEL_SIZES)
    return config_class(vocab_size=len(tokenizer), **sizes, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        rms_norm_eps=1e-6, hidden_act="silu", dtype="float32",
                        bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)


def generation_config(tokenizer):
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=tokenizer.pad_token_id, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id])


def _warmup_batch(tokenizer, rows: list[dict]):
    """Prompt + "Answer: <sum><|im_end|>" per row, right-padded, with labels only on the response."""
    import torch

    sequences, labels = [], []
    for row in rows:
        prompt = prompt_ids(tokenizer, row["prompt"])
        response = tokenizer.encode(answer(int(row["reward_model"]["ground_truth"])),
                                    add_special_tokens=False) + [tokenizer.eos_token_id]
        sequences.append(prompt + response)
        labels.append([-100] * len(prompt) + response)
    width = max(map(len, sequences))
    input_ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in sequences])
    label_ids = torch.tensor([l + [-100] * (width - len(l)) for l in labels])
    return input_ids, label_ids


def warm_up(model, tokenizer, rows: list[dict]) -> tuple[int, float]:
    """Full-batch AdamW until the mean probability of the exact right response reaches WARMUP_TARGET.

    Returns (optimizer steps taken, that mean probability when it stopped). The probability comes
    from the forward of each step, before its update, so checking it costs nothing.
    """
    import torch

    input_ids, labels = _warmup_batch(tokenizer, rows)
    targets, mask = labels[:, 1:], labels[:, 1:] != -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.0)
    model.train()
    for step in range(WARMUP_MAX_STEPS):
        logits = model(input_ids=input_ids).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        expected = (logp * mask).sum(-1).exp().mean().item()
        if expected >= WARMUP_TARGET:
            break
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise RuntimeError(f"warm-up did not reach {WARMUP_TARGET} in {WARMUP_MAX_STEPS} steps ({expected:.3f})")
    model.eval()
    return step, expected


def make_model(out_dir: str | Path | None, tokenizer, seed: int, rows: list[dict] | None = None,
               moe: bool = False):
    """Random Qwen2 (with `moe`: Qwen3-MoE) from the seed, warmed up on rows (the training split of that
    seed by default); saved when out_dir is given.

    Returns (model, warm-up steps, expected accuracy when the warm-up stopped).
    """
    import torch
    from transformers import Qwen2ForCausalLM, Qwen3MoeForCausalLM

    rows = split_rows(dataset_rows(seed))[0] if rows is None else rows
    threads = torch.get_num_threads()
    # One thread: the float sums, hence the bytes, do not depend on the machine's core count, and
    # tensors this small gain nothing from a second thread on a shared 2-core machine.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = (Qwen3MoeForCausalLM if moe else Qwen2ForCausalLM)(model_config(tokenizer, moe))
            steps, expected = warm_up(model, tokenizer, rows)
    finally:
        torch.set_num_threads(threads)
    model.generation_config = generation_config(tokenizer)
    if out_dir is not None:
        model.save_pretrained(out_dir)
    return model, steps, expected


# ----------------------------------------------------------------------------------------------
# Accuracy at temperature 1
def sample_responses(model, tokenizer, prompts: list[list[int]], seed: int,
                     max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """One response per prompt, sampled at temperature 1 from the full softmax; text up to the first EOS."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    stops = set(model.generation_config.eos_token_id)
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)  # equal lengths batch without padding
    texts = [""] * len(prompts)
    with torch.no_grad():
        for indices in by_length.values():
            ids = torch.tensor([prompts[i] for i in indices])
            start = ids.shape[1]
            for _ in range(max_new_tokens):
                probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), -1)
                ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], 1)
            for i, row in zip(indices, ids[:, start:].tolist()):
                cut = next((k for k, t in enumerate(row) if t in stops), len(row))
                texts[i] = tokenizer.decode(row[:cut], skip_special_tokens=True)
    return texts


def measure_accuracy(model, tokenizer, rows: list[dict], samples: int = ACCURACY_SAMPLES,
                     seed: int = 0) -> float:
    """Fraction of samples that verl's DAPO verifier scores +1; sample i answers row i % len(rows)."""
    from megatron_rlcorr.data.rewards import dapo_math

    picked = [rows[i % len(rows)] for i in range(samples)]
    texts = sample_responses(model, tokenizer, [prompt_ids(tokenizer, r["prompt"]) for r in picked], seed)
    scores = [dapo_math(text, r["reward_model"]["ground_truth"]) for text, r in zip(texts, picked)]
    return sum(s > 0 for s in scores) / samples


# ----------------------------------------------------------------------------------------------
# CLI
def is_complete(out: Path) -> bool:
    return (out / MANIFEST).is_file() and (out / DATA_FILE).is_file() and (out / VAL_FILE).is_file() and all(
        (out / "model" / name).is_file() for name in MODEL_FILES)


def build(out: Path, seed: int, moe: bool = False) -> dict:
    """Write everything under out (model/, data/, then the manifest); return the manifest."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" on stderr for a one-file checkpoint
    start = time.perf_counter()
    for stale in (out / MANIFEST, out / "model", out / "data"):
        if stale.is_dir():
            shutil.rmtree(stale)
        elif stale.exists():
            stale.unlink()
    rows, val_rows = make_dataset(out, seed)
    tokenizer = make_tokenizer(out / "model")
    model, steps, expected = make_model(out / "model", tokenizer, seed, rows, moe)
    accuracy = measure_accuracy(model, tokenizer, rows, ACCURACY_SAMPLES, seed)
    val_accuracy = measure_accuracy(model, tokenizer, val_rows, ACCURACY_SAMPLES, seed)
    manifest = {
        "seed": seed, "model_type": model.config.model_type, "vocab_size": len(tokenizer),
        **(MOE_SIZES if moe else MODEL_SIZES),
        "parameters": sum(p.numel() for p in model.parameters()), "rows": len(rows), "val_rows": len(val_rows),
        "warmup": {"steps": steps, "lr": WARMUP_LR, "target": WARMUP_TARGET, "expected_accuracy": round(expected, 4)},
        "sampled_accuracy": {"samples": ACCURACY_SAMPLES, "temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS,
                             "accuracy": accuracy, "val_accuracy": val_accuracy},
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _model_type(manifest: dict) -> str:
    return manifest.get("model_type", "qwen2")  # manifests written before --moe existed are Qwen2's


def _report(out: Path, manifest: dict) -> str:
    sampled = manifest["sampled_accuracy"]
    experts = (f", {manifest['num_experts']} experts top-{manifest['num_experts_per_tok']} in layers "
               f"{manifest['mlp_only_layers'][-1] + 1}..{manifest['num_hidden_layers'] - 1}"
               if _model_type(manifest) == "qwen3_moe" else "")
    return "\n".join([
        (f"model:    {out / 'model'} ({_model_type(manifest)}, vocab {manifest['vocab_size']}, hidden "
         f"{manifest['hidden_size']}, {manifest['num_hidden_layers']} layers{experts}, {manifest['parameters']:,} "
         "parameters)"),
        f"data:     {out / DATA_FILE} ({manifest['rows']} rows, e.g. {question(7, 5)!r})",
        f"held out: {out / VAL_FILE} ({manifest['val_rows']} rows, the validation split)",
        (f"warm-up:  {manifest['warmup']['steps']} AdamW steps (seed {manifest['seed']}) on the training split; "
         f"accuracy at temperature 1 (dapo_math, {sampled['samples']} samples): {sampled['accuracy']:.1%} on the "
         f"training split, {sampled['val_accuracy']:.1%} held out"),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for model/, data/ and manifest.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rewrite even when --out already holds the files")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE checkpoint (MOE_SIZES) instead of Qwen2")
    args = parser.parse_args(argv)
    if is_complete(args.out) and not args.force:
        manifest = json.loads((args.out / MANIFEST).read_text())
        if manifest["seed"] != args.seed:
            parser.error(f"{args.out} holds the files of seed {manifest['seed']}; add --force to rebuild "
                         f"them with seed {args.seed}")
        wanted = "qwen3_moe" if args.moe else "qwen2"
        if _model_type(manifest) != wanted:
            parser.error(f"{args.out} holds a {_model_type(manifest)} checkpoint; add --force to rebuild it as "
                         f"{wanted}" + ("" if args.moe else " (add --moe for the Qwen3-MoE one)") + ", or give "
                         "each its own --out")
        print(f"{args.out} already holds the tiny checkpoint and dataset (--force rewrites them)")
        print(_report(args.out, manifest))
        return 0
    manifest = build(args.out, args.seed, args.moe)
    print(f"wrote {args.out} in {manifest['seconds']} s")
    print(_report(args.out, manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
