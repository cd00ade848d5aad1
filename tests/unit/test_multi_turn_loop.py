"""The multi-turn loop (rollout/tools/loop.py) on a scripted engine and the tiny checkpoint's real
tokenizer and chat template: the mask, the log-probs, the budget, the turn limits and the
tokenization check."""
import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_rlcorr.data.hf_tokenizer import HFTokenizer
from megatron_rlcorr.rollout.base import RolloutBatch
from megatron_rlcorr.rollout.tools.builtin import Calculator
from megatron_rlcorr.rollout.tools.loop import run_multi_turn, turn_seed
from megatron_rlcorr.rollout.tools.runner import ToolRunner
from megatron_rlcorr.rollout.tools.settings import MultiTurnConfig

ROOT = Path(__file__).resolve().parents[2]
CALC_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                         "required": ["expression"]}}}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
PROMPT = [{"role": "user", "content": "What is 12*34? Reply with Answer: <n>"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tiny_hf", ROOT / "tools" / "make_tiny_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path_factory.mktemp("tokenizer")
    tool.make_tokenizer(out)
    return HFTokenizer(out)


class Scripted:
    """An engine that writes turn t's scripted text (t counted from the assistant headers in its
    prompt) and reports a log-prob per token that encodes (seed, position): the test can tell which
    call sampled which token."""

    def __init__(self, tokenizer, turns):
        self.tok, self.turns, self.calls = tokenizer, turns, []
        self.header = tokenizer._tokenizer.encode("<|im_start|>assistant\n")

    def sample_groups(self, prompts, *, n, seeds, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0):
        self.calls.append((len(prompts), n, list(seeds), max_new_tokens))
        rows = []
        for prompt, seed in zip(prompts, seeds):
            turn = _count(prompt, self.header)
            ids = self.tok._tokenizer.encode(self.turns[turn - 1]) + [self.tok.eos_id]
            rows += [(list(prompt), ids, seed)] * n
        out = [(p, ids[:max_new_tokens], torch.tensor([-((s % 97) + k) / 100 for k in range(len(ids))])[:max_new_tokens],
                "eos" if len(ids) <= max_new_tokens else "length") for p, ids, s in rows]
        return RolloutBatch(*map(list, zip(*out)))


def _lp(seed, count):
    """The scripted engine's float32 log-probs of a turn of `count` tokens sampled with `seed`."""
    return torch.tensor([-((seed % 97) + k) / 100 for k in range(count)]).tolist()


def _count(ids, pattern):
    return sum(ids[i:i + len(pattern)] == pattern for i in range(len(ids)))


def run(tokenizer, turns, *, max_new_tokens=400, n=2, seeds=(5,), **settings):
    engine = Scripted(tokenizer, turns)
    runner = ToolRunner([Calculator({}, CALC_SCHEMA)], MultiTurnConfig(**settings))
    out = run_multi_turn(engine, tokenizer, runner, MultiTurnConfig(**settings), prompts=[PROMPT] * len(seeds),
                         tools_kwargs=[None] * len(seeds), n=n, seeds=list(seeds), max_new_tokens=max_new_tokens)
    runner.close()
    return engine, out


def test_tool_tokens_are_masked_and_turns_equal_the_whole_conversation(tokenizer):
    engine, trajectories = run(tokenizer, [f"Let me compute. {CALL}", "Answer: 408"])
    assert len(trajectories) == 2 and engine.calls[0][:2] == (1, 2) and engine.calls[1][:2] == (2, 1)
    for j, t in enumerate(trajectories):
        assert t.finish_reason == "eos" and t.tokenization_ok and t.assistant_turns == 2 and t.user_turns == 1
        assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant"]
        assert t.messages[2]["content"] == "408" and t.messages[3]["content"] == "Answer: 408"
        # turn by turn = the whole conversation tokenized at once
        assert t.ids == tokenizer.chat_ids(t.messages, add_generation_prompt=False)[:len(t.ids)]
        # mask: 1 on the two sampled turns, 0 on what the template inserted between them
        turn1 = tokenizer._tokenizer.encode(f"Let me compute. {CALL}") + [tokenizer.eos_id]
        turn2 = tokenizer._tokenizer.encode("Answer: 408") + [tokenizer.eos_id]
        inserted = len(t.response_ids) - len(turn1) - len(turn2)
        assert t.response_mask == [1] * len(turn1) + [0] * inserted + [1] * len(turn2) and inserted > 0
        assert t.response_ids[:len(turn1)] == turn1 and t.response_ids[-len(turn2):] == turn2
        # log-probs: the engine's on sampled tokens (turn 2 from its own seed), None on inserted ones
        second = turn_seed(5, j, 2)
        assert t.logprobs == (_lp(5, len(turn1)) + [None] * inserted + _lp(second, len(turn2)))
        assert [c.tool for c in t.calls] == ["calculator"] and not t.calls[0].error


def test_the_budget_counts_inserted_tokens_and_cuts_the_last_turn(tokenizer):
    _, (full,) = run(tokenizer, [f"x {CALL}", "Answer: 408"], n=1)
    budget = len(full.response_ids) - 3
    engine, (t,) = run(tokenizer, [f"x {CALL}", "Answer: 408"], n=1, max_new_tokens=budget)
    assert len(t.response_ids) == budget and t.finish_reason == "length"
    assert t.response_ids == full.response_ids[:budget] and t.response_mask == full.response_mask[:budget]
    last_turn = len(full.response_mask) - full.response_mask[::-1].index(0)  # where turn 2 starts
    assert engine.calls[1][3] == budget - last_turn  # turn 2 was sampled with what was left
    # a budget the trajectory fills exactly: it ended by itself (EOS, no call), not by the budget
    _, (t,) = run(tokenizer, [f"x {CALL}", "Answer: 408"], n=1, max_new_tokens=len(full.response_ids))
    assert t.response_ids == full.response_ids and t.finish_reason == "eos"
    # a turn that calls a tool with nothing left for the response: no tool runs, "length"
    first_turn = full.response_mask.index(0)
    _, (t,) = run(tokenizer, [f"x {CALL}", "Answer: 408"], n=1, max_new_tokens=first_turn)
    assert t.finish_reason == "length" and t.calls == [] and t.response_mask == [1] * first_turn
    # a budget that ends inside the inserted tokens: cut there, no further turn
    engine, (t,) = run(tokenizer, [f"x {CALL}", "Answer: 408"], n=1, max_new_tokens=first_turn + 2)
    assert t.response_mask == [1] * first_turn + [0, 0] and t.finish_reason == "length" and len(engine.calls) == 1


def test_turn_limits_and_a_turn_without_calls_end_the_trajectory(tokenizer):
    _, (t,) = run(tokenizer, [f"x {CALL}", "Answer: 408"], n=1, max_assistant_turns=1)
    assert t.assistant_turns == 1 and t.user_turns == 0 and set(t.response_mask) == {1}
    _, (t,) = run(tokenizer, [f"x {CALL}"] * 5, n=1, max_user_turns=2)
    assert t.user_turns == 2 and t.assistant_turns == 3
    _, (t,) = run(tokenizer, ["Answer: 408"], n=1)  # no call: the single-turn sample, all sampled
    assert t.assistant_turns == 1 and set(t.response_mask) == {1} and None not in t.logprobs


def test_bad_calls_are_answered_with_errors_and_the_trajectory_goes_on(tokenizer):
    turns = ['<tool_call>{"name": "calc"}</tool_call>', "<tool_call>{bad</tool_call>" + CALL, "Answer: 408"]
    _, (t,) = run(tokenizer, turns, n=1, max_new_tokens=2000)  # error messages are long in a per-character vocabulary
    assert t.finish_reason == "eos"
    tool = [m["content"] for m in t.messages if m["role"] == "tool"]
    assert "no tool named 'calc'" in tool[0] and "not valid JSON" in tool[1]
    assert "only 1 tool call(s) run per turn" in tool[2] and t.messages[-1]["content"] == "Answer: 408"
    assert [c.error for c in t.calls] == [True, True, True]


def test_a_template_that_renders_past_turns_differently_is_reported(tokenizer):
    class Stripping(HFTokenizer):  # renders an assistant turn without its leading text
        def chat_ids(self, messages, *, tools=None, add_generation_prompt):
            messages = [dict(m, content=m["content"].removeprefix("x ")) if m["role"] == "assistant" else m
                        for m in messages]
            return super().chat_ids(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    stripping = Stripping(tokenizer.path)
    _, (t,) = run(stripping, [f"x {CALL}", "Answer: 408"], n=1)
    assert not t.tokenization_ok and t.assistant_turns == 1 and set(t.response_mask) == {1}
