"""The tool interface, and the tool config file that names a run's tools (verl's form).

A tool is a class with four methods, loaded by its class path from the tool config:

    class MyTool(Tool):
        def create(self, instance_id, **tools_kwargs): ...   # a trajectory starts (per-sample kwargs)
        def execute(self, instance_id, arguments) -> ToolOutput: ...
        def reward(self, instance_id) -> float: ...          # optional: the tool's reward for the trajectory
        def release(self, instance_id): ...                  # the trajectory is done

`execute` runs on a worker thread (rollout/tools/runner.py runs a batch's calls concurrently), so a
tool must not share per-trajectory state between instance ids without a lock. It may raise: the
runner turns any exception into a tool error message for the model. `tools_kwargs` come from a
data row's `extra_info.tools_kwargs[<tool name>]["create_kwargs"]` (verl's), e.g. the ground truth
a tool checks against.

The config file:

    tools:
      - class_name: megatron_rlcorr.rollout.tools.builtin.Calculator
        config: {timeout_s: 5}              # the tool's own settings (timeout_s: the runner's limit)
        tool_schema:                        # OpenAI function schema: what the chat template shows
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, ...}}

`load_tools` checks it all before anything starts: the file reads, each entry's class imports and
is a Tool, the schema names the function and its `parameters` is valid JSON Schema (jsonschema's
metaschema check), and no two tools share a name; a ValueError names the file and the entry.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ToolOutput:
    text: str                  # what the model reads as the tool's response
    error: bool = False        # the call failed (bad arguments, an exception, a timeout): counted in tool/error_rate
    timeout: bool = False      # it ran past its time limit: counted in tool/timeout_rate too


class Tool:
    """A tool of a multi-turn rollout (module docstring). `schema` is its OpenAI function schema."""

    def __init__(self, config: Mapping[str, Any], schema: Mapping[str, Any]) -> None:
        self.config = dict(config)
        self.schema = dict(schema)
        self.timeout_s = float(self.config.get("timeout_s", DEFAULT_TIMEOUT_S))

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def create(self, instance_id: str, **tools_kwargs: Any) -> None:
        """A trajectory that may call this tool starts."""

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement execute(instance_id, arguments)")

    def reward(self, instance_id: str) -> float:
        """The tool's reward for the trajectory (0 unless the tool keeps one)."""
        return 0.0

    def release(self, instance_id: str) -> None:
        """The trajectory is done: free what create() made."""


def load_tools(path: str | Path) -> list[Tool]:
    """The tools of a tool config file, checked (module docstring)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"rollout.multi_turn.tool_config_path: {path} is not a file")
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: a tool config holds `tools:`, a non-empty list of "
                         "{class_name, config, tool_schema} entries")
    tools = [_load_entry(path, i, entry) for i, entry in enumerate(entries)]
    names = [tool.name for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{path}: tool name(s) {', '.join(repeated)} appear more than once; each tool needs its own")
    return tools


def _load_entry(path: Path, index: int, entry: Any) -> Tool:
    where = f"{path}: tools[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping with class_name, config and tool_schema")
    unknown = sorted(set(entry) - {"class_name", "config", "tool_schema"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: class_name, config, tool_schema")
    cls = _import_class(where, entry.get("class_name"))
    schema = entry.get("tool_schema")
    _check_schema(where, schema)
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"{where}.config must be a mapping of the tool's settings, got {type(config).__name__}")
    try:
        return cls(config, schema)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {entry['class_name']} refused its config: {err}") from None


def _import_class(where: str, class_name: Any) -> type[Tool]:
    if not isinstance(class_name, str) or "." not in class_name:
        raise ValueError(f"{where}.class_name must be a class path, module.Class, got {class_name!r}")
    module_name, _, attr = class_name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{where}.class_name {class_name} does not import: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"{where}.class_name {class_name} is not a subclass of "
                         "megatron_rlcorr.rollout.tools.base.Tool")
    return cls


def _check_schema(where: str, schema: Any) -> None:
    import jsonschema

    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}.tool_schema must be an OpenAI function schema: {{type: function, function: "
                         "{name, description, parameters}}}")
    parameters = function.get("parameters", {"type": "object"})
    try:
        jsonschema.Draft202012Validator.check_schema(parameters)
    except jsonschema.SchemaError as err:
        raise ValueError(f"{where}.tool_schema.function.parameters is not valid JSON Schema: {err.message}") from None
