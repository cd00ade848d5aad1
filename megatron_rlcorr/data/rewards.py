"""Rewards for math answers, and the registry that turns a recipe's reward name into a function.

A reward scores one sampled response (text) against the example's ground truth. The built-ins
follow DAPO's convention: +1.0 for a correct answer, -1.0 for anything else (a wrong answer and a
missing one score the same).
- "dapo_math": verl's DAPO verifier, `compute_score` of verl/utils/reward_score/math_dapo.py at verl
  commit b178a3cd, non-strict ("minerva") path, reproduced exactly. Only the last 300 characters of
  the response are read; the prediction is the rest of the line after the last "Answer:" (any case)
  in them, or "[INVALID]" when there is none; prediction and ground truth are both normalised by
  `normalize_answer` and must then be equal as strings. The ground truth is never truncated.
- "boxed_math": the content of the last \\boxed{...} (or \\fbox{...}, or "\\boxed " up to the next
  "$") in the whole response, normalised the same way and compared with the normalised ground truth.
- "math_verify": symbolic equivalence by the optional `math-verify` package.

A user's own reward is named "package.module:function" and has the signature of `RewardFn`:
(response, ground_truth, extra) -> float, where extra holds the example's other fields. It may
also return a mapping with "score" and "acc" (whether the answer is right), as verl's reward
functions do; a plain float's acc is `score >= 1` (full marks). Names are
resolved when a recipe loads (`get_reward_fn`), so a typo or a missing package fails before the
first rollout rather than in the middle of a run.
"""
from __future__ import annotations

import importlib
import re
from typing import Any, Callable

from ..config import did_you_mean

RewardFn = Callable[[str, Any, dict], "float | dict[str, float]"]

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


_BUILTINS: dict[str, Callable[[str, str], float]] = {
    "dapo_math": dapo_math,
    "boxed_math": boxed_math,
    "math_verify": math_verify,
}
REWARDS: tuple[str, ...] = tuple(_BUILTINS)


def _with_extra(fn: Callable[[str, str], float]) -> RewardFn:
    """A built-in under the user signature; extra is ignored and a non-str ground truth (a JSON number) is str()-ed."""
    def reward(response: str, ground_truth: Any, extra: dict) -> float:
        return fn(response, str(ground_truth))

    reward.__name__ = reward.__qualname__ = fn.__name__
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
    return _with_extra(_BUILTINS[name])


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


def get_reward_fn(name: str) -> RewardFn:
    """The reward named `name`: a built-in from REWARDS, or a user's "package.module:function"."""
    return _user_function(name) if ":" in name else _builtin(name)
