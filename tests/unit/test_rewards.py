"""Math rewards (dapo_math = verl's DAPO verifier, boxed_math, math_verify) and the reward registry.

The dapo_math expectations follow verl/utils/reward_score/math_dapo.py at commit b178a3cd
(compute_score, non-strict path); the comments marked "by hand" walk through verl's steps.
"""
from __future__ import annotations

import sys
import textwrap

import pytest

from megatron_rlcorr.data import rewards
from megatron_rlcorr.data.rewards import (NO_ANSWER, REMOVED_TOKENS, REWARDS, SUBSTITUTIONS, boxed_math, dapo_math,
                                          extract_answer, get_reward_fn, last_boxed, math_verify, normalize_answer)

FILLER = "x" * 400


# --- extraction: which "Answer:" is read ---------------------------------------------------------

def test_last_answer_line_wins():
    response = "Let me think.\nAnswer: 3\nWait, I made an error.\nAnswer: 5"
    assert extract_answer(response) == "5"
    assert dapo_math(response, "5") == 1.0
    assert dapo_math(response, "3") == -1.0


def test_answer_is_case_insensitive():
    for prefix in ("answer:", "ANSWER:", "AnSwEr :", "Answer   :   "):
        assert dapo_math(f"so {prefix}42", "42") == 1.0, prefix
    # By hand: the pattern is (?i) and Python folds the long s "ſ" to "s", so it matches too.
    assert dapo_math("Anſwer: 5", "5") == 1.0


def test_answer_must_be_followed_by_colon():
    # By hand: "answer is 5" has no "Answer\s*:", so the prediction is "[INVALID]".
    assert extract_answer("The answer is 5") == NO_ANSWER
    assert dapo_math("The answer is 5", "5") == -1.0
    assert dapo_math("The final answer is \\boxed{5}", "5") == -1.0  # a box alone is not read


def test_answer_colon_may_cross_newlines():
    # \s* after the colon matches newlines, so the answer can sit on the next line.
    assert extract_answer("Answer:\n\n 5") == "5"
    assert dapo_math("Answer:\n\n5", "5") == 1.0


def test_second_answer_on_the_same_line_is_part_of_the_first():
    # By hand: findall's matches do not overlap and [^\n]+ runs to the end of the line, so the one
    # match captures "3 Answer: 5", normalised (no "=", spaces dropped) to "3Answer:5" != "5".
    assert extract_answer("Answer: 3 Answer: 5") == "3 Answer: 5"
    assert dapo_math("Answer: 3 Answer: 5", "5") == -1.0


def test_only_the_last_300_characters_are_read():
    answer = "Answer: 7\n"  # 10 characters
    assert dapo_math(answer + "." * 290, "7") == 1.0  # exactly 300: "A" is the first character kept
    # By hand: with 291 characters after it the window starts at "nswer: 7", so no match -> "[INVALID]".
    assert dapo_math(answer + "." * 291, "7") == -1.0
    assert dapo_math(answer + "." * 291, "[INVALID]") == 1.0
    assert dapo_math(answer + FILLER, "7") == -1.0
    # The cut comes before the search: an earlier answer in the window is still found.
    assert dapo_math(FILLER + answer + "." * 200, "7") == 1.0


def test_cut_line_is_not_an_answer_but_a_later_one_is():
    # The window starts inside the first answer's line; only the last one counts anyway.
    response = "Answer: 1" + "." * 295 + "\nAnswer: 2"
    assert dapo_math(response, "2") == 1.0
    assert dapo_math(response, "1") == -1.0


def test_no_answer_is_invalid():
    assert extract_answer("") == NO_ANSWER == "[INVALID]"
    assert dapo_math("", "34") == -1.0
    assert dapo_math("I do not know.", "34") == -1.0
    assert dapo_math("", "") == -1.0  # "[INVALID]" != ""
    # By hand: verl compares the normalised "[INVALID]" placeholder with the normalised ground truth;
    # normalisation leaves "[INVALID]" unchanged, so a ground truth that is literally "[INVALID]"
    # scores +1.0 for a response with no answer at all.
    assert normalize_answer("[INVALID]") == "[INVALID]"
    assert dapo_math("", "[INVALID]") == 1.0
    assert dapo_math("no answer here", "[INVALID]") == 1.0


def test_blank_answer_matches_blank_ground_truth():
    # By hand: "Answer: \n" -- \s* backtracks so [^\n]+ captures the single space; it normalises
    # to "" and so does the ground truth "".
    assert extract_answer("Answer: \n") == " "
    assert dapo_math("Answer: \n", "") == 1.0
    assert dapo_math("Answer:\n", "") == -1.0  # nothing to capture at all -> "[INVALID]"


# --- normalisation, rule by rule ------------------------------------------------------------------

def test_integer_answers_like_dapo():
    assert dapo_math("Step 1 ... Step 9.\nAnswer: 34", "34") == 1.0
    assert dapo_math("Answer: 35", "34") == -1.0
    assert dapo_math("Answer: 034", "34") == -1.0  # strings, not numbers
    assert dapo_math("Answer: 34.0", "34") == -1.0


def test_negative_numbers():
    assert dapo_math("Answer: -7", "-7") == 1.0
    assert dapo_math("Answer: - 7", "-7") == 1.0  # spaces are removed
    assert dapo_math("Answer: 7", "-7") == -1.0
    assert dapo_math("Answer: \u22127", "-7") == -1.0  # a unicode minus is another character


def test_right_of_the_last_equals_sign():
    assert normalize_answer("x = 5") == "5"
    assert dapo_math("Answer: x = 5", "5") == 1.0
    assert dapo_math("Answer: 2 + 3 = 5", "5") == 1.0
    assert dapo_math("Answer: 5", "y=5") == 1.0  # the ground truth is normalised the same way
    assert dapo_math("Answer: 5 = 6", "5") == -1.0


def test_unwraps():
    assert normalize_answer("\\text{5}") == "5"
    assert normalize_answer("\\textbf{7}") == "7"
    assert normalize_answer("\\overline{12}") == "12"
    assert normalize_answer("\\boxed{5}") == "5"
    assert normalize_answer("\\mbox{5}") == "5"  # "mbox" -> "text", then unwrapped
    for wrapped in ("\\text{5}", "\\textbf{5}", "\\overline{5}", "\\boxed{5}", "$\\boxed{5}$"):
        assert dapo_math(f"Answer: {wrapped}", "5") == 1.0, wrapped
    # \boxed{...} is greedy (to the last "}"), so nested braces survive; \text{...} is lazy.
    assert normalize_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    # By hand: "\text{a}b}" -> lazy group "a" -> "ab}".
    assert normalize_answer("\\text{a}b}") == "ab}"


def test_ground_truth_is_normalised_too():
    assert dapo_math("Answer: 34", "\\boxed{34}") == 1.0
    assert dapo_math("Answer: 34", "$34$") == 1.0
    assert dapo_math("Answer: 34", " 34 dollars ") == 1.0


def test_frac_and_sqrt_shorthand():
    assert normalize_answer("\\frac12") == "\\frac{1}{2}"
    assert normalize_answer("\\frac123") == "\\frac{1}{2}3"
    assert normalize_answer("\\sqrt3") == "\\sqrt{3}"
    assert normalize_answer("\\sqrt23") == "\\sqrt{2}3"
    assert dapo_math("Answer: \\frac12", "\\frac{1}{2}") == 1.0
    assert dapo_math("Answer: \\frac{1}{2}", "\\frac12") == 1.0
    assert dapo_math("Answer: 2\\sqrt3", "2\\sqrt{3}") == 1.0
    # By hand: only the literal shorthand is fixed; \dfrac stays \dfrac and 1/2 stays 1/2.
    assert dapo_math("Answer: \\dfrac{1}{2}", "\\frac{1}{2}") == -1.0
    assert dapo_math("Answer: 1/2", "\\frac{1}{2}") == -1.0


def test_dollar_signs():
    assert dapo_math("Answer: $5$", "5") == 1.0
    assert dapo_math("Answer: \\$5", "5") == 1.0  # "\$" is a substitution to ""
    assert dapo_math("Answer: $5.$", "5") == 1.0  # ".$" -> "$"
    # By hand: spaces go first ("thevalueis$5$apples"), then a line holding $...$ keeps only its
    # first span "$5$", then "$" is dropped -> "5".
    assert dapo_math("Answer: the value is $5$ apples", "5") == 1.0
    assert normalize_answer("$5$ or $6$") == "5"


def test_commas_in_numbers():
    assert normalize_answer("1,000") == "1000"
    assert dapo_math("Answer: 1,000", "1000") == 1.0
    assert dapo_math("Answer: 1000", "1,000") == 1.0
    assert dapo_math("Answer: 1{,}000", "1000") == 1.0  # "{,}" is a removed token
    assert dapo_math("Answer: 1,000,000", "1000000") == 1.0
    # By hand: commas go only when the rest is all digits (str.isdigit), so not with a sign or a point.
    assert dapo_math("Answer: -1,000", "-1000") == -1.0
    assert dapo_math("Answer: 1,000.5", "1000.5") == -1.0
    assert normalize_answer("1,2") == "12"  # a list of digits is read as one number
    assert normalize_answer("(1,2)") == "(1,2)"


def test_unit_words_and_marks_removed():
    for unit in ("dollars", "km", "degrees", "units", "cents", "inches", "students", "meters", "hours"):
        assert dapo_math(f"Answer: 12 {unit}", "12") == 1.0, unit
    assert dapo_math("Answer: 45^\\circ", "45") == 1.0
    assert dapo_math("Answer: 45^{\\circ}", "45") == 1.0
    assert dapo_math("Answer: 3\\ldots", "3") == 1.0
    assert dapo_math("Answer: 5\\text{th}", "5th") == 1.0  # only \mathrm{th} is removed
    assert dapo_math("Answer: 5\\mathrm{th}", "5") == 1.0
    # By hand: removal is by substring, so "sue" goes from inside "issues": "12issues" -> "12iss".
    assert normalize_answer("12 issues") == "12iss"
    assert dapo_math("Answer: 12 issues", "12") == -1.0


def test_substitution_and_removal_order():
    assert (len(SUBSTITUTIONS), len(REMOVED_TOKENS)) == (10, 41)
    assert SUBSTITUTIONS[0] == ("an ", "") and SUBSTITUTIONS[-1] == ("\\text{m}", "\\text{}")
    assert REMOVED_TOKENS[0] == "square" and REMOVED_TOKENS[-1] == "\\dots"
    assert REMOVED_TOKENS.index("\\text{}^2") < REMOVED_TOKENS.index("\\text{}")
    # By hand: " " goes -> "5\text{m}^2"; "\text{m}" -> "\text{}" gives "5\text{}^2"; "\text{}^2" is
    # removed before "\text{}", so no "^2" is left behind -> "5".
    assert normalize_answer("5\\text{ m}^2") == "5"
    assert dapo_math("Answer: 5 \\mbox{ cm}", "5") == 1.0


def test_substitutions():
    assert normalize_answer("a triangle") == "triangle"  # "a " dropped
    assert normalize_answer("an octagon") == "octagon"
    assert normalize_answer("Jordan 5") == "Jord5"  # "an " is a substring rule, inside words too
    assert normalize_answer("1 \\text{and} 2") == "12"  # "\text{and}" -> ",", then "1,2" is a number
    assert normalize_answer("3, \\text{and} 4") == "34"
    assert normalize_answer("3\\ 4") == "34"  # "\ " (LaTeX space) removed


def test_whitespace():
    assert dapo_math("Answer:    42   ", "42") == 1.0
    assert dapo_math("Answer: 4 2", "42") == 1.0  # every space goes
    assert dapo_math("Answer: 42\t", "42") == 1.0  # strip() at the end
    assert dapo_math("Answer: 4\t2", "42") == -1.0  # only spaces are removed inside
    assert dapo_math("Answer: 42\r", "42") == 1.0


def test_wrong_answer():
    assert dapo_math("Reasoning...\nAnswer: 17", "34") == -1.0
    assert dapo_math("Answer: \\frac{1}{3}", "\\frac{1}{2}") == -1.0
    assert isinstance(dapo_math("Answer: 34", "34"), float)


# --- boxed_math -----------------------------------------------------------------------------------

def test_boxed_nested_braces():
    assert last_boxed("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert boxed_math("so \\boxed{\\frac{1}{2}} done", "\\frac12") == 1.0
    assert boxed_math("$\\boxed{x^{2}+1}$", "x^{2}+1") == 1.0


def test_boxed_last_box_wins():
    response = "first \\boxed{3}, then corrected: \\boxed{5}"
    assert boxed_math(response, "5") == 1.0
    assert boxed_math(response, "3") == -1.0
    assert last_boxed("\\boxed{1} \\fbox{2}") == "2"
    assert last_boxed("\\boxed 1$ and \\boxed{2}") == "2"


def test_boxed_variants_and_normalisation():
    assert boxed_math("\\fbox{7}", "7") == 1.0
    assert last_boxed("so $\\boxed 5$.") == "5"  # "\boxed " takes the text up to the next "$"
    assert boxed_math("so $\\boxed 5$.", "5") == 1.0
    assert boxed_math("\\boxed{5\\text{ cm}}", "5") == 1.0
    assert boxed_math("\\boxed{1,000}", "1000") == 1.0
    assert boxed_math("\\boxed{x = 5}", "5") == 1.0
    assert boxed_math(FILLER + "\\boxed{9}" + FILLER, "9") == 1.0  # no 300-character window here


def test_boxed_missing_or_unclosed():
    assert last_boxed("Answer: 5") is None
    assert boxed_math("Answer: 5", "5") == -1.0
    assert boxed_math("", "") == -1.0
    assert last_boxed("\\boxed{5} then \\boxed{6") is None  # the last box is never closed
    assert boxed_math("\\boxed{5} then \\boxed{6", "5") == -1.0


# --- math_verify ----------------------------------------------------------------------------------

def test_math_verify_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(ImportError, match=r"pip install 'megatron-rlcorr\[math\]'.*pip install math-verify"):
        math_verify("Answer: 5", "5")
    with pytest.raises(ValueError, match=r"math_verify.*pip install 'megatron-rlcorr\[math\]'"):
        get_reward_fn("math_verify")


class _FakeMathVerify:
    """Stands in for the math_verify module: equal strings verify, "boom" raises."""

    @staticmethod
    def parse(text):
        if "boom" in text:
            raise RuntimeError("parse failed")
        return text.replace("\\boxed{", "").replace("}", "").split()[-1]

    @staticmethod
    def verify(gold, target):
        return gold == target


def test_math_verify_glue(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", _FakeMathVerify)
    assert math_verify("the result is 5", "5") == 1.0
    assert math_verify("the result is 6", "5") == -1.0
    assert math_verify("boom", "5") == -1.0  # a failure inside math-verify scores as wrong
    assert get_reward_fn("math_verify")("the result is 5", 5, {}) == 1.0


def test_math_verify_real_package():
    pytest.importorskip("math_verify")
    assert math_verify("The answer is $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math_verify("The answer is $\\boxed{3}$", "\\frac{1}{2}") == -1.0


# --- registry -------------------------------------------------------------------------------------

def test_builtins_take_three_arguments():
    assert REWARDS == ("dapo_math", "boxed_math", "math_verify")
    dapo = get_reward_fn("dapo_math")  # verl's compute_score result: score, acc and the normalised prediction
    assert dapo("Answer: 34", "34", {"id": 1}) == {"score": 1.0, "acc": 1.0, "pred": "34"}
    assert dapo("Answer: 34", 34, {}) == {"score": 1.0, "acc": 1.0, "pred": "34"}  # a JSON number is str()-ed
    assert dapo("Answer: 35", "34", {}) == {"score": -1.0, "acc": 0.0, "pred": "35"}
    assert dapo("no answer", "34", {})["pred"] == "[INVALID]"
    assert dapo.__name__ == "dapo_math"
    boxed = get_reward_fn("boxed_math")
    assert boxed("\\boxed{2}", "2", {}) == 1.0 and boxed("2", "2", {}) == -1.0


def _write_module(tmp_path, monkeypatch, name, source):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_custom_reward_function(tmp_path, monkeypatch):
    _write_module(tmp_path, monkeypatch, "my_rewards_mod", """
        def length_bonus(response, ground_truth, extra):
            return float(response == ground_truth) + extra.get("bonus", 0.0)

        NOT_A_FUNCTION = 3
    """)
    fn = get_reward_fn("my_rewards_mod:length_bonus")
    assert fn("ok", "ok", {"bonus": 0.5}) == 1.5
    assert fn("no", "ok", {}) == 0.0

    with pytest.raises(ValueError, match=r"module 'my_rewards_mod' has no attribute 'lenght_bonus' "
                                         r"\(did you mean \"length_bonus\"\?\); define lenght_bonus"):
        get_reward_fn("my_rewards_mod:lenght_bonus")
    with pytest.raises(ValueError, match=r"my_rewards_mod.NOT_A_FUNCTION is a int, not a function.*callable"):
        get_reward_fn("my_rewards_mod:NOT_A_FUNCTION")


def test_unknown_builtin_name():
    with pytest.raises(ValueError, match=r"unknown reward 'dapo_maths' \(did you mean \"dapo_math\"\?\); "
                                         r"built-in rewards: dapo_math, boxed_math, math_verify, "
                                         r"or your own function as 'package.module:function'"):
        get_reward_fn("dapo_maths")
    with pytest.raises(ValueError, match=r"unknown reward 'zzz'; built-in"):
        get_reward_fn("zzz")


def test_module_not_importable(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_reward_module' \(ModuleNotFoundError: "
                                         r".*PYTHONPATH"):
        get_reward_fn("no_such_reward_module:score")
    _write_module(tmp_path, monkeypatch, "broken_rewards_mod", "raise RuntimeError('boom at import')\n")
    with pytest.raises(ValueError, match=r"cannot import module 'broken_rewards_mod' \(RuntimeError: boom at import\)"):
        get_reward_fn("broken_rewards_mod:score")


@pytest.mark.parametrize("name", [":score", "my_rewards_mod:", "a:b:c"])
def test_malformed_custom_name(name):
    with pytest.raises(ValueError, match=r"'package.module:function'"):
        get_reward_fn(name)


def test_module_docstring_names_verl_commit():
    assert "b178a3cd" in rewards.__doc__


# --- data.reward per data source ------------------------------------------------------------------

def test_a_mapping_scores_each_row_by_its_data_source(tmp_path, monkeypatch):
    _write_module(tmp_path, monkeypatch, "source_rewards_mod", """
        def graded(response, ground_truth, extra):
            return {"score": 0.5, "acc": response == ground_truth, "source": extra["data_source"]}
    """)
    fn = get_reward_fn({"math_dapo": "dapo_math", "aime": "boxed_math", "custom": "source_rewards_mod:graded"})
    # the same response, scored by the reward of each row's source
    assert fn("Answer: 7", "7", {"data_source": "math_dapo"})["score"] == 1.0
    assert fn("Answer: 7", "7", {"data_source": "aime"}) == -1.0  # no \boxed{}: boxed_math says wrong
    assert fn("\\boxed{7}", "7", {"data_source": "aime"}) == 1.0
    assert fn("7", "7", {"data_source": "custom"}) == {"score": 0.5, "acc": True, "source": "custom"}


def test_a_row_whose_source_has_no_reward_names_it_and_the_fix():
    fn = get_reward_fn({"math_dapo": "dapo_math", "aime": "boxed_math"})
    with pytest.raises(ValueError, match=r"data.reward has no reward for data_source 'math_dap' \(did you mean "
                                         r"\"math_dapo\"\?\) \(it has rewards for 'math_dapo', 'aime'\): add "
                                         r"`math_dap: <reward name>` to the data.reward mapping"):
        fn("Answer: 1", "1", {"data_source": "math_dap"})
    with pytest.raises(ValueError, match=r"the row has no 'data_source' field.*add a data_source to the rows, or "
                                         r"set data.reward to one reward name"):
        fn("Answer: 1", "1", {"prompt": "p"})
    where = rewards.missing_source_error({"a": "dapo_math"}, "b", "val.parquet row 3")
    assert str(where).startswith("val.parquet row 3: data.reward has no reward for data_source 'b'")


def test_a_mapping_resolves_every_name_when_built():
    with pytest.raises(ValueError, match=r"reward\['aime'\]: unknown reward 'boxd_math' \(did you mean \"boxed_math\""):
        get_reward_fn({"math_dapo": "dapo_math", "aime": "boxd_math"})
    with pytest.raises(ValueError, match=r"reward\['x'\]: reward 'no_such_reward_module:f': cannot import module"):
        get_reward_fn({"x": "no_such_reward_module:f"})
    assert rewards.reward_sources({"a": "dapo_math", "b": "boxed_math"}) == ("a", "b")
    assert rewards.reward_sources("dapo_math") is None


def test_data_reward_is_checked_when_the_recipe_loads():
    """data.reward's shape and built-in spelling fail at load (no import: a user module is
    imported by get_reward_fn, in the launch checks)."""
    from megatron_rlcorr.data.tasks import DataSettings
    from megatron_rlcorr.settings import from_mapping

    mapping = {"math_dapo": "dapo_math", "aime": "my_pkg.not_imported_yet:score"}
    assert from_mapping(DataSettings, {"reward": mapping}, "data").reward == mapping
    assert from_mapping(DataSettings, {"reward": "boxed_math"}, "data").reward == "boxed_math"
    for reward, message in [
        ("dapo_maths", r"data: reward: unknown reward 'dapo_maths' \(did you mean \"dapo_math\""),
        ({"aime": "boxd_math"}, r"data: reward\['aime'\]: unknown reward 'boxd_math'"),
        ({}, r"data: reward must be a reward name or a mapping \{data_source: reward name\} with at least one"),
        ({2024: "dapo_math"}, r"the entry 2024: 'dapo_math' must map a data source \(a string; quote a number"),
        ({"aime": 3}, r"the entry 'aime': 3 must map"),
        (["dapo_math"], r"data.reward: \['dapo_math'\] matches none of"),
    ]:
        with pytest.raises(ValueError, match=message):
            from_mapping(DataSettings, {"reward": reward}, "data")
