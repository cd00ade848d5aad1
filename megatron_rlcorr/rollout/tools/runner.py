"""Running a batch's tool calls: concurrently, each contained, each measured.

`ToolRunner.run` takes every call of a generation turn (all trajectories together) and runs them on
a bounded thread pool (`rollout.multi_turn.tool_workers`), so one slow tool does not serialise the
batch. Whatever a call does, it comes back as a `ToolOutput` the model reads, never as an exception:
- an unknown tool name, or arguments that fail the tool's JSON Schema (`parameters`): an error
  message naming the problem, without running anything;
- a tool that raises: the exception's type and message;
- a tool that runs past its `timeout_s` (+ a grace second): a timeout error. A thread cannot be
  killed, so an in-process tool that hangs keeps its thread; the runner then starts a fresh pool so
  the next calls do not queue behind it. The built-in `python` tool enforces its own limit by
  killing its process, and never gets here;
- a response longer than `max_tool_response_length` characters: cut on the configured side.
Each call's wall time and outcome are kept for the tool/* metrics (`CallRecord`).
"""
from __future__ import annotations

import concurrent.futures as futures
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .base import Tool, ToolOutput
from .parsers import ToolCall
from .settings import MultiTurnConfig

GRACE_S = 1.0
TRUNCATION_MARK = "...(truncated)..."


@dataclass(frozen=True)
class CallRecord:
    tool: str
    latency_s: float
    error: bool
    timeout: bool


def truncate(text: str, limit: int, side: str) -> str:
    """`text` cut to at most `limit` characters plus the mark: the left, middle or right part goes."""
    if len(text) <= limit:
        return text
    if side == "left":
        return TRUNCATION_MARK + text[len(text) - limit:]
    if side == "right":
        return text[:limit] + TRUNCATION_MARK
    head = limit // 2
    return text[:head] + TRUNCATION_MARK + text[len(text) - (limit - head):]


class ToolRunner:
    """The run's tools by name, a thread pool, and the per-trajectory lifecycle (module docstring)."""

    def __init__(self, tools: Sequence[Tool], settings: MultiTurnConfig) -> None:
        import jsonschema

        self.tools = {tool.name: tool for tool in tools}
        self.settings = settings
        self._validators = {tool.name: jsonschema.Draft202012Validator(
            tool.schema["function"].get("parameters", {"type": "object"})) for tool in tools}
        self._pool = futures.ThreadPoolExecutor(settings.tool_workers, thread_name_prefix="rlcorr-tool")

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """What the chat template's `tools=` argument receives."""
        return [tool.schema for tool in self.tools.values()]

    def create(self, instance_id: str, tools_kwargs: Mapping[str, Any] | None = None) -> None:
        """A trajectory starts: every tool's create(), with its `create_kwargs` from the data row
        (verl's extra_info.tools_kwargs[<tool>]["create_kwargs"])."""
        for name, tool in self.tools.items():
            kwargs = ((tools_kwargs or {}).get(name) or {}).get("create_kwargs") or {}
            tool.create(instance_id, **kwargs)

    def finish(self, instance_id: str) -> dict[str, float]:
        """A trajectory ends: each tool's reward for it, then release()."""
        rewards = {name: float(tool.reward(instance_id)) for name, tool in self.tools.items()}
        for tool in self.tools.values():
            tool.release(instance_id)
        return rewards

    def run(self, jobs: Sequence[tuple[str, ToolCall]]) -> list[tuple[ToolOutput, CallRecord]]:
        """The outputs of (instance id, call) jobs, in order (module docstring)."""
        started = [(self._submit(instance, call), time.monotonic()) for instance, call in jobs]
        results, stuck = [], False
        for (instance, call), (job, start) in zip(jobs, started):
            if isinstance(job, ToolOutput):  # refused before running
                output = job
            else:
                limit = self.tools[call.name].timeout_s + GRACE_S
                try:
                    output = job.result(timeout=max(0.0, start + limit - time.monotonic()))
                except futures.TimeoutError:
                    stuck = True
                    output = ToolOutput(f"error: {call.name} ran past its {limit - GRACE_S:g} s limit", error=True,
                                        timeout=True)
            text = truncate(output.text, self.settings.max_tool_response_length,
                            self.settings.tool_response_truncate_side)
            output = ToolOutput(text, output.error, output.timeout)
            results.append((output, CallRecord(call.name, time.monotonic() - start, output.error, output.timeout)))
        if stuck:  # the hung threads keep their slots: new calls get a pool of their own
            self._pool.shutdown(wait=False)
            self._pool = futures.ThreadPoolExecutor(self.settings.tool_workers, thread_name_prefix="rlcorr-tool")
        return results

    def _submit(self, instance: str, call: ToolCall) -> futures.Future | ToolOutput:
        if call.error is not None:
            return ToolOutput(f"error: {call.error}", error=True)
        if call.name not in self.tools:
            return ToolOutput(f"error: there is no tool named {call.name!r}; the tools are: "
                              f"{', '.join(self.tools)}", error=True)
        problem = next(iter(self._validators[call.name].iter_errors(call.arguments)), None)
        if problem is not None:
            where = "/".join(map(str, problem.absolute_path)) or "arguments"
            return ToolOutput(f"error: bad arguments for {call.name} ({where}): {problem.message}", error=True)
        return self._pool.submit(_execute, self.tools[call.name], instance, call.arguments)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _execute(tool: Tool, instance: str, arguments: dict[str, Any]) -> ToolOutput:
    try:
        output = tool.execute(instance, arguments)
    except Exception as err:  # a tool's failure is the model's tool error, never the trainer's crash
        return ToolOutput(f"error: {tool.name} raised {type(err).__name__}: {err}", error=True)
    if not isinstance(output, ToolOutput):
        return ToolOutput(f"error: {tool.name} returned {type(output).__name__}, not a ToolOutput", error=True)
    return output
