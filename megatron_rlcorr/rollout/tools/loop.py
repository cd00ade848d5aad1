"""The multi-turn rollout loop: turns of the engine, tool calls between them, one token mask.

For each sample: the engine writes a turn (to EOS or the budget); the turn's text is parsed for
tool calls (`format`'s parser); if it makes none, the trajectory ends. Otherwise the calls run (all
trajectories' calls of the turn together, rollout/tools/runner.py), each response is appended as a
`tool` message, and the chat template renders the conversation again with the generation prompt:
what it adds after the tokens so far (the template's end of the assistant turn, the tool messages,
the next assistant header) are the inserted tokens. Then the engine writes the next turn from the
whole sequence.

What a trajectory holds (`Trajectory`): `response_ids`, every token after the prompt; a
`response_mask` over them, 1 exactly on the tokens the engine sampled; `logprobs` with the engine's
log-prob on those and None on the inserted ones (which the engine never sampled: they have none,
and must never reach the correction, the loss or a length). `rollout.max_new_tokens` bounds the
whole response, inserted tokens included (verl's response length): a turn is sampled with what is
left, and inserted tokens that would pass it are cut and the trajectory ends with "length".

Tokenization check (verl's sanity check): at every re-rendering, the template's tokens of the
conversation so far must begin with exactly the ids the trajectory holds (the prompt, the sampled
ids, the inserted ids). When they do not (a template that renders a past turn differently, or a
model that wrote a token sequence the tokenizer would split otherwise), turn-by-turn ids differ
from tokenizing the whole conversation at once; the trajectory is ended and flagged
(`tokenization_ok` False) for the trainer to report and leave out, never trained on silently.

Reproducibility: turn 1 is `sample_groups(prompts, n, seeds)`, the same call as a single-turn
rollout (a trajectory that calls no tool is the single-turn sample); turn t > 1 of sample j of
prompt i is seeded from (seeds[i], j, t) alone, so a trajectory does not depend on the others of its
batch, nor on how prompts are spread over engines.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .parsers import PARSERS, ToolCall
from .runner import CallRecord, ToolRunner
from .settings import MultiTurnConfig


class ChatRenderer(Protocol):
    """What the loop needs of the tokenizer (data/hf_tokenizer.HFTokenizer has it)."""

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None,
                 add_generation_prompt: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class Trajectory:
    prompt_ids: list[int]
    messages: list[dict[str, Any]]                          # the conversation, the prompt's messages first
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1: the engine sampled it; 0: inserted
    logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str = "eos"
    assistant_turns: int = 0
    user_turns: int = 0                                     # tool-response rounds appended
    calls: list[CallRecord] = field(default_factory=list)
    tool_rewards: dict[str, float] = field(default_factory=dict)
    tokenization_ok: bool = True
    done: bool = False

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def turn_seed(seed: int, sample: int, turn: int) -> int:
    """The seed of turn `turn` (>= 2) of sample `sample` of a prompt seeded `seed`."""
    digest = hashlib.sha256(repr(("multi_turn", seed, sample, turn)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def run_multi_turn(engine, renderer: ChatRenderer, runner: ToolRunner, settings: MultiTurnConfig, *,
                   prompts: Sequence[Sequence[Mapping[str, Any]]], tools_kwargs: Sequence[Mapping | None],
                   n: int, seeds: Sequence[int], max_new_tokens: int, temperature: float = 1.0,
                   top_p: float = 1.0, top_k: int = 0) -> list[Trajectory]:
    """`n` trajectories per prompt (chat messages), prompt-major (module docstring)."""
    prompt_ids = [renderer.chat_ids(list(m), tools=runner.schemas, add_generation_prompt=True) for m in prompts]
    trajectories = [Trajectory(list(prompt_ids[i]), [dict(m) for m in prompts[i]])
                    for i in range(len(prompts)) for _ in range(n)]
    names = [f"{i}/{j}" for i in range(len(prompts)) for j in range(n)]
    for name, i in zip(names, (k // n for k in range(len(trajectories)))):
        runner.create(name, tools_kwargs[i])
    sample = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    first = engine.sample_groups(prompt_ids, n=n, seeds=list(seeds), max_new_tokens=max_new_tokens, **sample)
    _take_turn(trajectories, range(len(trajectories)), first, max_new_tokens, renderer)
    turn = 1
    while True:
        active = [k for k, t in enumerate(trajectories) if not t.done]
        active = _run_tools(trajectories, names, active, runner, settings, renderer, max_new_tokens)
        if not active:
            break
        turn += 1
        budget = max(max_new_tokens - len(trajectories[k].response_ids) for k in active)
        out = engine.sample_groups([trajectories[k].ids for k in active], n=1, max_new_tokens=budget,
                                   seeds=[turn_seed(seeds[k // n], k % n, turn) for k in active], **sample)
        _take_turn(trajectories, active, out, max_new_tokens, renderer)
    for name, trajectory in zip(names, trajectories):
        trajectory.tool_rewards = runner.finish(name)
    return trajectories


def _take_turn(trajectories: list[Trajectory], rows: Sequence[int], out, max_new_tokens: int,
               renderer: ChatRenderer) -> None:
    """Append each row's sampled turn, cut to its trajectory's remaining budget (sampling is causal:
    the tokens kept are those a call with the smaller budget would have drawn); a turn cut short
    ends its trajectory."""
    for row, k in enumerate(rows):
        t = trajectories[k]
        left = max_new_tokens - len(t.response_ids)
        ids, logprobs = list(out.response_ids[row]), [float(x) for x in out.logprobs[row]]
        finish = out.finish_reasons[row]
        if len(ids) > left:
            ids, logprobs, finish = ids[:left], logprobs[:left], "length"
        t.response_ids += ids
        t.response_mask += [1] * len(ids)
        t.logprobs += logprobs
        t.assistant_turns += 1
        t.finish_reason, t.done = finish, finish == "length"
        t.messages.append({"role": "assistant", "content": renderer.decode(ids)})


def _run_tools(trajectories: list[Trajectory], names: list[str], active: list[int], runner: ToolRunner,
               settings: MultiTurnConfig, renderer: ChatRenderer, max_new_tokens: int) -> list[int]:
    """Parse the last turn of each active trajectory, run the calls, append the responses; the
    trajectories that go on. A turn that calls a tool with no budget left ends with "length"."""
    parse = PARSERS[settings.format]
    jobs, owners = [], []
    for k in active:
        t = trajectories[k]
        calls = parse(t.messages[-1]["content"])
        if not calls or _at_limit(t, settings):
            t.done = True
            continue
        if len(t.response_ids) >= max_new_tokens:
            t.finish_reason, t.done = "length", True
            continue
        for c, call in enumerate(calls):
            if c >= settings.max_parallel_calls:
                call = ToolCall(call.name, call.arguments, error=f"only {settings.max_parallel_calls} tool call(s) "
                                                                  "run per turn (rollout.multi_turn.max_parallel_calls)")
            jobs.append((names[k], call))
            owners.append(k)
    outputs = runner.run(jobs) if jobs else []
    responses: dict[int, list[str]] = {}
    for k, (output, record) in zip(owners, outputs):
        trajectories[k].calls.append(record)
        responses.setdefault(k, []).append(output.text)
    going_on = []
    for k, texts in responses.items():
        t = trajectories[k]
        t.messages += [{"role": "tool", "content": text} for text in texts]
        t.user_turns += 1
        if _insert_rendered(t, renderer, runner, max_new_tokens):
            going_on.append(k)
    return sorted(going_on)


def _at_limit(t: Trajectory, settings: MultiTurnConfig) -> bool:
    turns, rounds = settings.max_assistant_turns, settings.max_user_turns
    return (turns is not None and t.assistant_turns >= turns) or (rounds is not None and t.user_turns >= rounds)


def _insert_rendered(t: Trajectory, renderer: ChatRenderer, runner: ToolRunner, max_new_tokens: int) -> bool:
    """Append the template's tokens after the trajectory's (module docstring); whether it goes on."""
    rendered = renderer.chat_ids(_plain(t.messages), tools=runner.schemas, add_generation_prompt=True)
    held = t.ids
    if rendered[:len(held)] != held:
        t.tokenization_ok, t.done = False, True
        return False
    inserted = rendered[len(held):][: max_new_tokens - len(t.response_ids)]
    t.response_ids += inserted
    t.response_mask += [0] * len(inserted)
    t.logprobs += [None] * len(inserted)
    if len(t.response_ids) >= max_new_tokens:
        t.finish_reason, t.done = "length", True
        return False
    return True


def _plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]
