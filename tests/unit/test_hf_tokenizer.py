"""HFTokenizer: a local Hugging Face tokenizer's prompt encoding, EOS / pad ids, decoding, files and errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer

from megatron_rlcorr.data import EOS_ID, CharTokenizer, HFTokenizer
from tests.hf_fixtures import ENDOFTEXT, IM_END, IM_START, VOCAB_SIZE, make_tokenizer

ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2  # SPECIAL_TOKENS order in hf_fixtures


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """Qwen-Instruct style: eos <|endoftext|> in the tokenizer, generation_config adds <|im_end|>."""
    return make_tokenizer(tmp_path_factory.mktemp("chat"), eos_in_generation_config=[IM_END, ENDOFTEXT])


@pytest.fixture(scope="module")
def chat(chat_dir):
    return HFTokenizer(chat_dir)


def raw_ids(directory, text: str) -> list[int]:
    """`text` encoded by the `tokenizers` library alone (no transformers, no post-processor)."""
    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_chat_prompt_is_the_template_text_with_the_generation_prompt(chat, chat_dir):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 2+3?"}]
    ids = chat.encode_prompt(messages)
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert ids == raw_ids(chat_dir, text)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids.count(IM_START_ID) == 3 and ids.count(IM_END_ID) == 2
    assert ids[-len(raw_ids(chat_dir, "assistant\n")) - 1:] == [IM_START_ID] + raw_ids(chat_dir, "assistant\n")
    assert chat.encode_prompt(tuple(messages)) == ids


def test_plain_string_prompt(chat, chat_dir, tmp_path):
    assert chat.encode_prompt("What is 2+3? Answer:") == raw_ids(chat_dir, "What is 2+3? Answer:")
    with_bos = HFTokenizer(make_tokenizer(tmp_path, bos_token=IM_START, add_bos=True))
    assert with_bos.bos_id == IM_START_ID
    assert with_bos.encode_prompt("What is 2+3?") == [IM_START_ID] + raw_ids(chat_dir, "What is 2+3?")
    # The chat template writes its own special tokens: no BOS added in front of them.
    assert with_bos.encode_prompt([{"role": "user", "content": "hi"}]) == raw_ids(
        chat_dir, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_ids_and_sizes(chat):
    assert chat.vocab_size == VOCAB_SIZE
    assert chat.eos_ids == (ENDOFTEXT_ID, IM_END_ID) and chat.eos_id == ENDOFTEXT_ID
    assert chat.pad_id == ENDOFTEXT_ID  # no pad anywhere: the first EOS
    assert chat.bos_id is None


@pytest.mark.parametrize("tokenizer_eos, generation_eos, expected", [
    (ENDOFTEXT, IM_END, (ENDOFTEXT_ID, IM_END_ID)),              # an int in generation_config
    (IM_END, [ENDOFTEXT, IM_END], (IM_END_ID, ENDOFTEXT_ID)),    # a list, deduplicated, tokenizer's first
    (None, [IM_END, ENDOFTEXT], (IM_END_ID, ENDOFTEXT_ID)),      # only generation_config
    (IM_END, None, (IM_END_ID,)),                                # no generation_config.json
])
def test_eos_ids_merge_the_generation_config(tmp_path, tokenizer_eos, generation_eos, expected):
    tok = HFTokenizer(make_tokenizer(tmp_path, eos_token=tokenizer_eos, eos_in_generation_config=generation_eos))
    assert tok.eos_ids == expected and tok.eos_id == expected[0]
    assert (tmp_path / "generation_config.json").exists() == (generation_eos is not None)


def test_pad_id_fallbacks(tmp_path):
    own = HFTokenizer(make_tokenizer(tmp_path / "own", pad_token=IM_START, generation_config={"pad_token_id": 2}))
    assert own.pad_id == IM_START_ID
    generation = HFTokenizer(make_tokenizer(tmp_path / "gen", generation_config={"pad_token_id": IM_END_ID}))
    assert generation.pad_id == IM_END_ID
    eos = HFTokenizer(make_tokenizer(tmp_path / "eos", eos_token=IM_END, eos_in_generation_config=ENDOFTEXT))
    assert eos.pad_id == IM_END_ID


def test_decode_stops_at_any_eos_and_skips_specials(chat, chat_dir):
    answer = raw_ids(chat_dir, "Answer: 5")
    assert chat.decode(answer) == "Answer: 5"
    assert chat.decode(answer + [IM_END_ID] + raw_ids(chat_dir, " junk")) == "Answer: 5"
    assert chat.decode(answer + [ENDOFTEXT_ID, IM_END_ID]) == "Answer: 5"
    assert chat.decode([IM_START_ID] + answer) == "Answer: 5"  # a special token that is not an EOS is skipped
    assert chat.decode(torch.tensor(answer + [IM_END_ID])) == "Answer: 5"
    assert chat.decode([IM_END_ID] + answer) == ""
    assert chat.decode([]) == ""


def test_decode_shows_ids_beyond_the_vocabulary(chat, chat_dir):
    """A model's padded vocabulary rows: U+FFFD, never silently dropped (so "5" + pad row != "5")."""
    five, six = raw_ids(chat_dir, "5"), raw_ids(chat_dir, "6")
    assert chat.decode(five + [VOCAB_SIZE] + six + [VOCAB_SIZE + 100, IM_END_ID]) == "5\ufffd6\ufffd"


def test_files_lists_the_tokenizer_files_present(chat, chat_dir, tmp_path):
    assert [p.name for p in chat.files()] == ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                             "generation_config.json"]
    assert all(p.parent == chat_dir for p in chat.files())
    copy = tmp_path / "copy"
    shutil.copytree(chat_dir, copy)
    for extra in ("merges.txt", "special_tokens_map.json", "model.safetensors", "config.json"):
        (copy / extra).write_text("{}")
    assert [p.name for p in HFTokenizer(copy).files()] == [
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "merges.txt",
        "generation_config.json"]


def test_char_tokenizer_has_the_same_eos_interface():
    tok = CharTokenizer()
    assert tok.eos_ids == (EOS_ID,) and tok.eos_id == EOS_ID


# ---- errors ----------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match=rf"tokenizer directory {tmp_path / 'nope'} does not exist.*tokenizer\.json"):
        HFTokenizer(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        HFTokenizer(tmp_path / "file")


def test_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"{tmp_path} holds no tokenizer: expected tokenizer\.json and/or "
                                         r"tokenizer_config\.json \(found: config\.json\)"):
        HFTokenizer(tmp_path)


def test_unloadable_tokenizer(tmp_path):
    make_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match=rf"cannot load the tokenizer in {tmp_path} \(.*Error"):
        HFTokenizer(tmp_path)


def test_no_eos_anywhere(tmp_path):
    with pytest.raises(ValueError, match=rf"the tokenizer in {tmp_path} has no end-of-sequence token.*needs one to "
                                         "stop: set eos_token"):
        HFTokenizer(make_tokenizer(tmp_path, eos_token=None))


@pytest.mark.parametrize("content, message", [
    ("{not json", r"cannot read .*generation_config\.json: .*fix or remove the file"),
    ("[1, 2]", r"generation_config\.json must hold a JSON object, got list"),
    ('{"eos_token_id": "</s>"}',
     r"generation_config\.json: eos_token_id must be a token id or a list of token ids, got '</s>'"),
    ('{"pad_token_id": [true]}', r"pad_token_id must be a token id or a list of token ids, got \[True\]"),
])
def test_bad_generation_config(tmp_path, content, message):
    make_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        HFTokenizer(tmp_path)


def test_messages_without_a_chat_template(tmp_path):
    tok = HFTokenizer(make_tokenizer(tmp_path, chat_template=False))
    assert not tok.has_chat_template
    assert tok.encode_prompt("2+3=") == raw_ids(tmp_path, "2+3=")
    with pytest.raises(ValueError, match=rf"the tokenizer in {tmp_path} has no chat template.*give prompts as plain "
                                         "strings, or use a tokenizer with a chat template"):
        tok.encode_prompt([{"role": "user", "content": "2+3="}])


@pytest.mark.parametrize("prompt, message", [
    (7, r"a prompt is a string or a non-empty list of chat messages.*got a int"),
    ({"role": "user", "content": "x"}, r"a prompt is a string or .*got a dict"),
    ([], r"the prompt is an empty list; a prompt is a string or a non-empty list of chat messages"),
    (["hi"], (r"message 0 is a str; expected a non-empty list of chat messages, each a mapping with string "
              r"\"role\" and \"content\"")),
    ([{"role": "user", "content": "a"}, {"role": "user"}], r"message 1 has content=None \(keys: role\); expected"),
    ([{"role": "user", "content": ["a"]}], r"message 0 has content=\['a'\] \(keys: role, content\)"),
    ([{"content": "a"}], r"message 0 has role=None"),
])
def test_bad_prompt_shapes(chat, prompt, message):
    with pytest.raises(ValueError, match=message):
        chat.encode_prompt(prompt)


def test_repr_and_generation_config_file(chat, chat_dir):
    assert repr(chat) == f"HFTokenizer({str(chat_dir)!r}, vocab_size={VOCAB_SIZE}, eos_ids=(0, 2))"
    assert json.loads((chat_dir / "generation_config.json").read_text()) == {"eos_token_id": [IM_END_ID, ENDOFTEXT_ID]}
