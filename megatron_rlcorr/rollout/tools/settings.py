"""The settings of multi-turn rollouts with tool calls (verl's `multi_turn` key names, so that
import-verl can map them). Not yet a recipe key: the loop (rollout/tools/loop.py) and the batch's
masks (rl/batch.py) are built and tested, the trainer does not call them yet (docs/multi-turn.md).

Off by default: a rollout is then one turn, as it always was. With `enable`, the engine writes a
turn, the turn's tool calls (in `format`'s syntax) run, their responses are appended through the
chat template's tool role, and the engine writes the next turn, until a turn calls no tool,
`max_assistant_turns` turns are written, `max_user_turns` tool rounds have run, or
`rollout.max_new_tokens` (every token after the prompt, tool tokens included, verl's response
length) is used up. rollout/tools/loop.py is the loop; docs/multi-turn.md the whole story.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...settings import check_choice

TruncateSide = Literal["left", "middle", "right"]
TRUNCATE_SIDES: tuple[str, ...] = ("left", "middle", "right")


@dataclass(frozen=True)
class MultiTurnConfig:
    """The recipe's `rollout.multi_turn` (verl's `actor_rollout_ref.rollout.multi_turn`)."""

    enable: bool = False                   # multi-turn rollouts with tools; false: one turn per sample
    max_assistant_turns: int | None = None  # turns the model writes at most (null: until the token budget ends)
    max_user_turns: int | None = None      # tool-response rounds at most (null: no limit but the budget)
    max_parallel_calls: int = 1            # tool calls of one turn that run; the rest get an error message
    max_tool_response_length: int = 256    # characters of one tool response kept (verl's unit)
    tool_response_truncate_side: TruncateSide = "middle"  # which part goes: left | middle | right
    tool_config_path: str | None = None    # YAML in verl's form: tools: [{class_name, config, tool_schema}]
    format: str = "hermes"                 # the tool-call syntax (rollout/tools/parsers.py's registry)
    tool_workers: int = 8                  # tool calls of a batch that run at once (a bounded thread pool)

    def __post_init__(self) -> None:
        check_choice("multi_turn.tool_response_truncate_side", self.tool_response_truncate_side, TRUNCATE_SIDES)
        for name in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"multi_turn.{name} must be an integer >= 1, or null (no limit but "
                                 f"rollout.max_new_tokens), got {value!r}")
        for name in ("max_parallel_calls", "max_tool_response_length", "tool_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"multi_turn.{name} must be an integer >= 1, got {value!r}")
        from .parsers import PARSERS  # the registry: no torch, no engine

        if self.format not in PARSERS:
            raise ValueError(f"multi_turn.format={self.format!r} is not a tool-call syntax this package parses; "
                             f"choose one of: {', '.join(sorted(PARSERS))} (rollout/tools/parsers.py's registry)")
        if self.enable and not self.tool_config_path:
            raise ValueError("multi_turn.enable is true but multi_turn.tool_config_path is not set: name a tool "
                             "config YAML (tools: [{class_name, config, tool_schema}], docs/multi-turn.md)")
