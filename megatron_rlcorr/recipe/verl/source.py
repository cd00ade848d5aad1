"""Reading a verl source into dotted keys and values: a run script (resolved in the sandbox of
verl_script.py), a verl YAML config (a nested mapping, or Hydra's list of override strings) or a
text file of `key=value` override lines.

The recorded command lines of a script are searched for the launch (verl_script.find_launches);
its Hydra overrides are the verl keys. What is read but is no verl key (`--config-name`, Hydra's
own settings, `~key` deletions, a second launch) becomes a note: a "not mapped" line of the report.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ..verl_script import ScriptRun, caller_home, find_launches, run_script
from .hydra import OVERRIDE, HydraLoader, flatten, parse_hydra_value


@dataclass
class Source:
    path: Path
    kind: str                                     # "script", "yaml" or "overrides"
    values: dict[str, Any]                        # verl key -> value, in order
    notes: list[tuple[str, str]]                  # keys not mapped for reasons found while reading
    text: str = ""
    launch: list[str] | None = None
    launch_args: int = 0
    home: str = ""

    def where(self, key: str) -> str:
        """' (line N)' for the first line of the source that sets `key`, or ''."""
        pattern = re.compile(rf"(^|[\s'\"+~]){re.escape(key)}\s*=")
        for number, line in enumerate(self.text.splitlines(), 1):
            if pattern.search(line):
                return f" (line {number})"
        return ""

    def module(self) -> str:
        """The launched module (`recipe.dapo.main_dapo`), or the launched .py file, or ''."""
        launch = self.launch or []
        for i, arg in enumerate(launch[:-1]):
            if arg in ("-m", "--module"):
                return launch[i + 1]
        return next((a for a in launch if a.endswith(".py")), "")


def read_source(path: Path, env: Mapping[str, str] | None) -> Source:
    if not path.is_file():
        raise ValueError(f"{path}: no such file (give a verl run script, a verl YAML config or a file of "
                         "key=value overrides)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot be read as text ({err})") from None
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        return _read_yaml(path, text)
    if _looks_like_overrides(text):
        values, notes = _parse_overrides(_override_tokens(text), path)
        return Source(path, "overrides", values, notes, text=text)
    return _read_script(path, text, env)


def _read_yaml(path: Path, text: str) -> Source:
    try:
        data = yaml.load(text, Loader=HydraLoader)
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML: {err}") from None
    if isinstance(data, list) and all(isinstance(item, str) for item in data):
        values, notes = _parse_overrides(data, path)        # Hydra's .hydra/overrides.yaml
        return Source(path, "overrides", values, notes, text="\n".join(data))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a verl config must be a YAML mapping (or a list of key=value overrides), "
                         f"got {type(data).__name__}")
    values: dict[str, Any] = {}
    flatten(data, "", values)
    notes = [(key, reason) for key, reason in (("defaults", "Hydra's defaults list: only this file is read"),
                                               ("hydra", "Hydra's own settings"))
             if any(k == key or k.startswith(key + ".") for k in values)]
    values = {k: v for k, v in values.items() if k.split(".")[0] not in ("defaults", "hydra")}
    return Source(path, "yaml", values, notes)


def _looks_like_overrides(text: str) -> bool:
    try:
        tokens = _override_tokens(text)
    except ValueError:
        return False
    return bool(tokens) and all(OVERRIDE.match(t) and ("=" in t or t.startswith("~")) and "." in t
                                for t in tokens)


def _override_tokens(text: str) -> list[str]:
    tokens: list[str] = []
    for line in text.splitlines():
        line = line.strip().removesuffix("\\")
        tokens += shlex.split(line, comments=True)
    return tokens


def _parse_overrides(args: Sequence[str], path: Path) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """verl keys and values from Hydra command-line arguments; the other arguments as notes."""
    values: dict[str, Any] = {}
    notes: list[tuple[str, str]] = []
    args = list(args)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        option = arg.split("=", 1)[0]
        if option in ("--config-path", "--config-name", "-cp", "-cn", "--config-dir", "-cd"):
            value = arg.split("=", 1)[1] if "=" in arg else (args[i] if i < len(args) else "")
            i += "=" not in arg
            notes.append((f"{option}={value}", "verl's base config is not read: only the overrides are imported, "
                                               "and every key they leave out takes this project's default"))
            continue
        match = OVERRIDE.match(arg)
        if not match or (match.group(1) != "~" and match.group(3) is None):
            notes.append((arg, "not a Hydra override (key=value)"))
            continue
        prefix, key, text = match.group(1), match.group(2), match.group(4)
        if key.split(".")[0] == "hydra":
            notes.append((key, "Hydra's own settings"))
            continue
        if prefix == "~":
            for old in [k for k in values if k == key or k.startswith(key + ".")]:
                del values[old]
            notes.append((f"~{key}", "deletes a key of verl's base config: nothing to import"))
            continue
        try:
            value = parse_hydra_value(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: {key}={text}: not a value Hydra reads ({str(err).splitlines()[0]})") from None
        values.pop(key, None)   # a repeated key: the last one wins, in its own position
        if isinstance(value, Mapping) and value:
            flatten(value, key + ".", values)
        else:
            values[key] = value
    return values, notes


def _read_script(path: Path, text: str, env: Mapping[str, str] | None) -> Source:
    run = run_script(path, env)
    launches = find_launches(run.commands)
    if not launches:
        raise ValueError(_no_launch_message(path, run))
    launch, first = launches[0]
    values, notes = _parse_overrides(launch[first:], path)
    if len(launches) > 1:
        notes.append((f"({len(launches)} launches)", f"the script launches verl {len(launches)} times; only the "
                                                     "first launch is imported"))
    return Source(path, "script", values, notes, text=text, launch=launch, launch_args=first,
                   home=caller_home(env))


def _no_launch_message(path: Path, run: ScriptRun) -> str:
    ran = [shlex.join(cmd[:4]) + (" ..." if len(cmd) > 4 else "") for cmd in run.commands[:5]]
    message = (f"{path}: no verl launch command found (python3 -m verl.trainer.main_ppo or -m "
               "recipe.<name>.main_<name> with key=value overrides); the script ran "
               + ("; ".join(ran) + (f" and {len(run.commands) - 5} more" if len(run.commands) > 5 else "")
                  if ran else "no external command"))
    problems = [line for line in run.stderr.splitlines() if line and not line.startswith("+")]
    refused = [line for line in problems if "restricted: cannot specify" in line]
    if refused:
        message += (f"; commands named by a path are never run nor recorded ({refused[0]}): call the launch by "
                    "name (python3 -m ...)")
    elif problems:
        message += f"; the script said: {problems[-1]}"
    if run.returncode not in (0,) and not refused:
        message += ("; if it reads variables from the environment (e.g. NUM_GPUS), set them when you import "
                    "(NUM_GPUS=8 megatron-rlcorr import-verl ...)")
    return message

