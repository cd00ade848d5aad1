"""Rewards for math answers, and the registry that turns a recipe's reward name into a function.

A reward scores one sampled response (text) against the example's ground truth. The built-ins
follow DAPO's convention: +1.0 for a correct answer, -1.0 for anything else (a wrong answer and a
missing one score the same).
- "dapo_math": verl's DAPO verifier, `compute_score` of verl/utils/reward_score/math_dapo.py at verl
  commit b178a3cd, non-strict ("minerva") path, reproduced exactly. Only the last 300 characters of
  the response are read; the prediction is the rest of the line after the last "Answer:" (any case)
  in them, or "[INVALID]" when there is none; prediction and ground truth are both normalised by
  `normalize_answer` and must then be equal as strings. The ground truth is never truncated. Like
  verl's, it returns {"score": +-1.0, "acc": 1.0 or 0.0, "pred": the normalised prediction}
  (`dapo_math_result`), so validation reports acc and maj@k.
- "boxed_math": the content of the last \\boxed{...} (or \\fbox{...}, or "\\boxed " up to the next
  "$") in the whole response, normalised the same way and compared with the normalised ground truth.
- "math_verify": symbolic equivalence by the optional `math-verify` package.

A user's own reward is named "package.module:function" and has the signature of `RewardFn`:
(response, ground_truth, extra) -> float, where extra holds the example's other fields. It may
also return a mapping with "score" and "acc" (whether the answer is right), as verl's reward
functions do; a plain float's acc is `score >= 1` (full marks).

A recipe's `data.reward` is one name for every row, or a mapping {data_source: name} that scores
each row by the reward of its `data_source` field (verl's default_compute_score routes rows the
same way; a mix of DAPO-Math and AIME files can then use a reward each). `get_reward_fn(spec)`
returns one RewardFn either way; a row whose data source the mapping lacks stops with a
ValueError naming the source and the fix. Names are checked twice before the first rollout: a
built-in's spelling and a mapping's shape when the recipe loads (`check_reward_spec`, no import),
every name resolved, user modules imported, by `get_reward_fn` in the launch checks, so a typo
or a missing package never fails in the middle of a run.
"""
from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Mapping, Union

from ..config import did_you_mean

RewardFn = Callable[[str, Any, dict], "float | dict[str, float]"]
RewardSpec = Union[str, Mapping[str, str]]  # data.reward: one reward name, or {data_source: reward name}
DATA_SOURCE_KEY = "data_source"  # the row field a mapping spec dispatches on (verl's schema)

# Plain str.replace pairs, applied in this order (verl's SUBSTITUTIONS). "an " and "a " go wherever
# they occur, inside words too ("Jordan 5" -> "Jord5"); then every remaining space goes.
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Substrings deleted wherever they occur, in this order (verl's REMOVED_EXPRESSIONS): unit words,
# ellipses, ordinal and degree marks, LaTeX spacing. They are plain substrings, removed from inside
# words too ("9km2" -> "92").
REMOVED_TOKENS: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)

# Regex rewrites after the plain ones, in this order. None of them crosses a newline except
# through "[^{]", exactly as verl's patterns.
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # a line holding $...$ keeps only its first math span
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),  # greedy: up to the last "}" of the line
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}, \frac123 -> \frac{1}{2}3
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrt2 -> \sqrt{2}, \sqrt23 -> \sqrt{2}3
)

ANSWER_WINDOW = 300  # characters of the response dapo_math reads, counted from its end
NO_ANSWER = "[INVALID]"
_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
_BOX_OPENERS = ("\\boxed{", "\\fbox{", "\\boxed ")
_MATH_VERIFY_MISSING = ("the math_verify reward needs the optional math-verify package: "
                        "pip install 'megatron-rlcorr[math]' (or pip install math-verify)")


def normalize_answer(answer: str) -> str:
    """verl's normalize_final_answer (Minerva's rules): the canonical string two answers are compared by."""
    answer = answer.split("=")[-1]
    for old, new in SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for token in REMOVED_TOKENS:
        answer = answer.replace(token, "")
    for pattern, template in _REWRITES:
        answer = pattern.sub(template, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():  # str.isdigit: also true for e.g. "²"; false for "" and "-1"
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer(response: str) -> str:
    """The text after the last "Answer:" in the response's last 300 characters; "[INVALID]" if none.

    The cut comes first, so an "Answer:" that starts before the window is not seen even when its
    line ends inside it. "\\s*" after the colon may cross newlines.
    """
    matches = _ANSWER_LINE.findall(response[-ANSWER_WINDOW:])
    return matches[-1] if matches else NO_ANSWER


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (braces balanced) or "\\boxed x" (up to "$").

    None when there is no box or the last one is never closed. The last opener wins whatever its
    kind (verl's math_reward helper prefers any "\\boxed " over a later "\\boxed{").
    """
    start, opener = max((text.rfind(opener), opener) for opener in _BOX_OPENERS)
    if start < 0:
        return None
    body = start + len(opener)
    if opener.endswith(" "):
        return text[body:].split("$")[0]
    return _braced(text, body - 1)


def _braced(text: str, open_index: int) -> str | None:
    """What lies between the "{" at open_index and its matching "}"; None when it is never closed."""
    depth = 0
    for i in range(open_index, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_index + 1:i]
    return None


def _score(correct: bool) -> float:
    return 1.0 if correct else -1.0


def dapo_math(response: str, ground_truth: str) -> float:
    """verl's DAPO math score (compute_score(...)["score"], strict_box_verify=False): +1.0 or -1.0."""
    return _score(normalize_answer(extract_answer(response)) == normalize_answer(ground_truth))


def dapo_math_result(response: str, ground_truth: str) -> dict[str, float | str]:
    """What verl's DAPO compute_score returns: the score, whether the answer is right (acc, 1.0 or
    0.0) and the normalised prediction (pred, which validation's maj@k votes over). The registered
    reward "dapo_math" is this; `dapo_math` is its score."""
    pred = normalize_answer(extract_answer(response))
    correct = pred == normalize_answer(ground_truth)
    return {"score": _score(correct), "acc": float(correct), "pred": pred}


def boxed_math(response: str, ground_truth: str) -> float:
    """+1.0 when the last box of the response normalises to the normalised ground truth, else -1.0."""
    boxed = last_boxed(response)
    return _score(boxed is not None and normalize_answer(boxed) == normalize_answer(ground_truth))


def _math_verify_api() -> tuple[Callable, Callable]:
    """math_verify's (parse, verify); ImportError naming the install command when it is absent."""
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError(_MATH_VERIFY_MISSING) from err
    return parse, verify


def math_verify(response: str, ground_truth: str) -> float:
    """+1.0 when math-verify finds the response's answer equivalent to the ground truth, else -1.0.

    As in verl, the ground truth is wrapped in \\boxed{} so a bare "1/2" or "\\frac{1}{2}" is
    extracted as a whole. Any failure inside math-verify (its own timeout included) scores as wrong:
    one unparsable response must not stop a training step.
    """
    parse, verify = _math_verify_api()
    try:
        correct = verify(parse(f"\\boxed{{{ground_truth}}}"), parse(response))
    except Exception:
        return -1.0
    return _score(bool(correct))


_BUILTINS: dict[str, Callable[[str, str], "float | dict[str, float | str]"]] = {
    "dapo_math": dapo_math_result,
    "boxed_math": boxed_math,
    "math_verify": math_verify,
}
REWARDS: tuple[str, ...] = tuple(_BUILTINS)


def _with_extra(name: str, fn: Callable[[str, str], "float | dict[str, float | str]"]) -> RewardFn:
    """A built-in under the user signature; extra is ignored and a non-str ground truth (a JSON number) is str()-ed."""
    def reward(response: str, ground_truth: Any, extra: dict) -> "float | dict[str, float | str]":
        return fn(response, str(ground_truth))

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = fn.__doc__
    return reward


def _builtin(name: str) -> RewardFn:
    if name not in _BUILTINS:
        raise ValueError(f"unknown reward {name!r}{did_you_mean(name, REWARDS)}; built-in rewards: "
                         f"{', '.join(REWARDS)}, or your own function as 'package.module:function'")
    if name == "math_verify":
        try:
            _math_verify_api()
        except ImportError as err:
            raise ValueError(f"reward 'math_verify': {err}") from err
    return _with_extra(name, _BUILTINS[name])


def _user_function(name: str) -> RewardFn:
    """The function named "package.module:function", imported with importlib."""
    module_name, _, attr = name.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"reward {name!r}: a custom reward is named 'package.module:function' "
                         "(one ':' between a module and a function name)")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the user's module may fail with anything while it runs
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r} ({type(err).__name__}: {err}); "
                         "check the spelling and that its package is installed or on PYTHONPATH") from err
    if not hasattr(module, attr):
        public = [key for key in vars(module) if not key.startswith("_")]
        raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}"
                         f"{did_you_mean(attr, public)}; define {attr}(response, ground_truth, extra) there")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {module_name}.{attr} is a {type(fn).__name__}, not a function; "
                         "it must be callable as (response, ground_truth, extra) -> float")
    return fn


def _resolve(name: str) -> RewardFn:
    """The reward named `name`: a built-in from REWARDS, or a user's "package.module:function"."""
    return _user_function(name) if ":" in name else _builtin(name)


def check_reward_spec(spec: Any) -> None:
    """What can be checked of `data.reward` without importing anything: its shape (a name, or a
    non-empty mapping of data source -> name) and the spelling of built-in names. ValueError
    naming the entry and the fix."""
    if isinstance(spec, str):
        _check_name(spec, "")
        return
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(f"reward must be a reward name or a mapping {{data_source: reward name}} with at least one "
                         f"entry, got {spec!r}")
    for source, name in spec.items():
        if not isinstance(source, str) or not isinstance(name, str):
            raise ValueError(f"reward: the entry {source!r}: {name!r} must map a data source (a string; quote a "
                             "number in YAML) to a reward name (a string)")
        _check_name(name, f"[{source!r}]")


def _check_name(name: str, where: str) -> None:
    if ":" not in name and name not in _BUILTINS:
        raise ValueError(f"reward{where}: unknown reward {name!r}{did_you_mean(name, REWARDS)}; built-in rewards: "
                         f"{', '.join(REWARDS)}, or your own function as 'package.module:function'")


def reward_sources(spec: RewardSpec) -> tuple[str, ...] | None:
    """The data sources a mapping spec has a reward for; None for one name (every source has it)."""
    return None if isinstance(spec, str) else tuple(spec)


def missing_source_error(spec: Mapping[str, str], source: Any, where: str = "") -> ValueError:
    """The error for a row whose data source (None: the row has none) has no entry in `spec`;
    `where` names the row ("<file> row N") when the caller knows it."""
    at = f"{where}: " if where else ""
    known = ", ".join(map(repr, spec))
    if source is None:
        return ValueError(f"{at}the row has no {DATA_SOURCE_KEY!r} field, and data.reward picks each row's reward by "
                          f"its {DATA_SOURCE_KEY} (it has rewards for {known}): add a {DATA_SOURCE_KEY} to the rows, "
                          "or set data.reward to one reward name for every row")
    close = did_you_mean(str(source), list(spec))
    return ValueError(f"{at}data.reward has no reward for data_source {source!r}{close} (it has rewards for {known}): "
                      f"add `{source}: <reward name>` to the data.reward mapping, or set data.reward to one reward "
                      "name for every row")


def _by_source(rewards: dict[str, RewardFn], spec: Mapping[str, str]) -> RewardFn:
    """One RewardFn that scores a row by the reward of its data source."""
    def reward(response: str, ground_truth: Any, extra: dict) -> float | dict[str, float]:
        source = extra.get(DATA_SOURCE_KEY) if isinstance(extra, Mapping) else None
        if source not in rewards:
            raise missing_source_error(spec, source)
        return rewards[source](response, ground_truth, extra)

    reward.__name__ = reward.__qualname__ = "by_data_source"
    return reward


def get_reward_fn(spec: RewardSpec) -> RewardFn:
    """The reward `spec` names (data.reward): one name, a built-in from REWARDS or a user's
    "package.module:function"; or a mapping {data_source: name}, each name resolved now, whose
    function dispatches on extra["data_source"] (module docstring)."""
    check_reward_spec(spec)
    if isinstance(spec, str):
        return _resolve(spec)
    rewards = {}
    for source, name in spec.items():
        try:
            rewards[source] = _resolve(name)
        except ValueError as err:
            raise ValueError(f"reward[{source!r}]: {err}") from None
    return _by_source(rewards, dict(spec))
