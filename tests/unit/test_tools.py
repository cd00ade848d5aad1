"""The tool layer of multi-turn rollouts (rollout/tools/): the hermes parser, the settings, the tool
config file's checks, the runner's containment of bad calls, and the built-in tools' limits."""
import threading
import time

import pytest

from megatron_rlcorr.rollout.tools.base import Tool, ToolOutput, load_tools
from megatron_rlcorr.rollout.tools.builtin import Calculator, Python, evaluate
from megatron_rlcorr.rollout.tools.parsers import ToolCall, parse_hermes
from megatron_rlcorr.rollout.tools.runner import TRUNCATION_MARK, ToolRunner, truncate
from megatron_rlcorr.rollout.tools.settings import MultiTurnConfig

CALC_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
PY_SCHEMA = {"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


def schema(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


# ---- the parser ---------------------------------------------------------------------------------

def test_hermes_reads_every_call_in_order():
    text = ('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert parse_hermes(text) == [ToolCall("calculator", {"expression": "12*34"}), ToolCall("python", {"code": "print(1)"})]
    assert parse_hermes("Answer: 408") == []


@pytest.mark.parametrize("body, error", [
    ("{not json}", "not valid JSON"),
    ('{"arguments": {}}', "with a tool name"),
    ('["calculator"]', "with a tool name"),
    ('{"name": "calculator", "arguments": [1, 2]}', "must be a JSON object, got list"),
])
def test_hermes_turns_unreadable_calls_into_errors(body, error):
    (call,) = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert call.error is not None and error in call.error


def test_an_unclosed_call_is_an_error():
    (call,) = parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expr')
    assert "not closed" in call.error


# ---- settings -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, named", [
    (dict(format="json_tags"), "multi_turn.format='json_tags'"),
    (dict(enable=True), "tool_config_path is not set"),
    (dict(max_assistant_turns=0), "multi_turn.max_assistant_turns"),
    (dict(max_parallel_calls=0), "multi_turn.max_parallel_calls"),
    (dict(tool_response_truncate_side="top"), "tool_response_truncate_side"),
])
def test_settings_refuse_bad_values_naming_the_key(kwargs, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")):
        MultiTurnConfig(**kwargs)


# ---- the tool config file -----------------------------------------------------------------------

def write_config(tmp_path, body: str):
    path = tmp_path / "tools.yaml"
    path.write_text(body)
    return path


GOOD = """tools:
  - class_name: megatron_rlcorr.rollout.tools.builtin.Calculator
    config: {timeout_s: 5}
    tool_schema:
      type: function
      function:
        name: calculator
        description: arithmetic
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
  - class_name: megatron_rlcorr.rollout.tools.builtin.Python
    config: {}
    tool_schema: {type: function, function: {name: python, parameters: {type: object}}}
"""


def test_a_config_in_verls_form_loads_its_tools(tmp_path):
    tools = load_tools(write_config(tmp_path, GOOD))
    assert [type(t).__name__ for t in tools] == ["Calculator", "Python"]
    assert [t.name for t in tools] == ["calculator", "python"] and tools[0].timeout_s == 5


@pytest.mark.parametrize("edit, named", [
    (("builtin.Calculator", "builtin.Calculater"), "tools[0].class_name megatron_rlcorr.rollout.tools.builtin.Calculater does not import"),
    (("megatron_rlcorr.rollout.tools.builtin.Calculator", "no_such_module.Tool"), "tools[0].class_name no_such_module.Tool does not import"),
    (("megatron_rlcorr.rollout.tools.builtin.Python", "megatron_rlcorr.rollout.tools.runner.ToolRunner"), "tools[1].class_name megatron_rlcorr.rollout.tools.runner.ToolRunner is not a subclass"),
    (("{type: string}}", "{type: strang}}"), "tools[0].tool_schema.function.parameters is not valid JSON Schema"),
    (("name: python", "name: calculator"), "calculator appear more than once"),
    (("    config: {}\n", "    confg: {}\n"), "tools[1]: unknown key(s) confg"),
])
def test_a_bad_config_is_refused_naming_the_file_and_entry(tmp_path, edit, named):
    path = write_config(tmp_path, GOOD.replace(*edit))
    with pytest.raises(ValueError) as err:
        load_tools(path)
    assert str(path) in str(err.value) and named in str(err.value)


def test_a_missing_or_empty_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        load_tools(tmp_path / "none.yaml")
    with pytest.raises(ValueError, match="non-empty list"):
        load_tools(write_config(tmp_path, "tools: []\n"))


# ---- the runner ---------------------------------------------------------------------------------

class Raising(Tool):
    def execute(self, instance_id, arguments):
        raise RuntimeError("the tool broke")


class Sleeping(Tool):
    """Sleeps `seconds`, recording when it ran."""
    intervals: list = []
    lock = threading.Lock()

    def execute(self, instance_id, arguments):
        start = time.monotonic()
        time.sleep(arguments["seconds"])
        with self.lock:
            Sleeping.intervals.append((start, time.monotonic()))
        return ToolOutput(f"slept {arguments['seconds']}")


def runner(*tools, **settings) -> ToolRunner:
    return ToolRunner(list(tools), MultiTurnConfig(**settings))


def test_bad_calls_become_tool_errors_and_the_rest_run():
    calc = Calculator({}, CALC_SCHEMA)
    run = runner(calc, Raising({}, schema("raising")))
    jobs = [("a", ToolCall("calculator", {"expression": "12*34"})),
            ("a", ToolCall("search", {"q": "x"})),                       # unknown tool
            ("b", ToolCall("calculator", {"expression": 5})),             # wrong argument type
            ("b", ToolCall("calculator", {})),                            # missing argument
            ("c", ToolCall("raising", {})),                               # raises
            ("c", ToolCall("", error="the tool call is not valid JSON"))]  # unreadable
    outs = [out for out, _ in run.run(jobs)]
    assert outs[0] == ToolOutput("408")
    assert all(o.error and not o.timeout for o in outs[1:])
    assert "no tool named 'search'" in outs[1].text and "calculator, raising" in outs[1].text
    assert "bad arguments for calculator (expression)" in outs[2].text and "is not of type 'string'" in outs[2].text
    assert "'expression' is a required property" in outs[3].text
    assert "raised RuntimeError: the tool broke" in outs[4].text
    assert "not valid JSON" in outs[5].text
    run.close()


def test_calls_run_concurrently_and_a_hang_is_a_timeout():
    Sleeping.intervals.clear()
    run = runner(Sleeping({"timeout_s": 0.5}, schema("sleep")), tool_workers=4)
    outs = run.run([(str(i), ToolCall("sleep", {"seconds": 0.3})) for i in range(4)])
    assert [o.text for o, _ in outs] == ["slept 0.3"] * 4
    starts, ends = zip(*Sleeping.intervals)
    assert max(starts) < min(ends)  # all four were running at once
    start = time.monotonic()
    (hung, record), = run.run([("x", ToolCall("sleep", {"seconds": 2.5}))])
    assert hung.timeout and hung.error and "0.5 s limit" in hung.text and record.timeout
    assert time.monotonic() - start < 2.5  # the runner did not wait for it
    (after, _), = run.run([("y", ToolCall("sleep", {"seconds": 0.0}))])  # a fresh pool: not queued behind it
    assert after.text == "slept 0.0"
    run.close()


def test_truncation_keeps_the_limit_on_each_side():
    text = "".join(str(i % 10) for i in range(100))
    assert truncate(text, 100, "middle") == text
    assert truncate(text, 10, "left") == TRUNCATION_MARK + text[-10:]
    assert truncate(text, 10, "right") == text[:10] + TRUNCATION_MARK
    assert truncate(text, 10, "middle") == text[:5] + TRUNCATION_MARK + text[-5:]
    run = runner(Calculator({}, CALC_SCHEMA), max_tool_response_length=4, tool_response_truncate_side="right")
    (out, _), = run.run([("a", ToolCall("calculator", {"expression": "10**9"}))])
    assert out.text == "1000" + TRUNCATION_MARK
    run.close()


# ---- the built-in tools -------------------------------------------------------------------------

def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert (evaluate("12*34"), evaluate("-(2+3)**2"), evaluate("7/2"), evaluate("7//2"), evaluate("7%4")) == \
        (408, -25, 3.5, 3, 3)
    for bad, why in [("9**9**9", "exponents above"), ("__import__('os')", "not Call"), ("a+1", "not Name"),
                     ("1/0", "division by zero"), ("2*", "not an arithmetic expression"), ("1" * 600, "longer than")]:
        with pytest.raises(ValueError, match=why):
            evaluate(bad)
    assert Calculator({}, CALC_SCHEMA).execute("i", {"expression": "6/3"}) == ToolOutput("2")


def test_the_python_tool_runs_code_in_an_empty_sandbox(monkeypatch):
    monkeypatch.setenv("RLCORR_SECRET_TOKEN", "hunter2")
    tool = Python({"timeout_s": 5}, PY_SCHEMA)
    out = tool.execute("i", {"code": "import os\nprint(12*34, sorted(os.listdir('.')), 'RLCORR_SECRET_TOKEN' in os.environ)"})
    assert out == ToolOutput("408 [] False\n")
    out = tool.execute("i", {"code": "raise SystemExit(3)"})
    assert out.error and "[exit code 3]" in out.text
    assert tool.execute("i", {"code": 5}).error


def test_the_python_tools_limits_time_memory_and_output():
    start = time.monotonic()
    out = Python({"timeout_s": 1}, PY_SCHEMA).execute("i", {"code": "while True: pass"})
    assert out.timeout and out.error and "1 s limit" in out.text
    assert time.monotonic() - start < 1 + 2  # stopped at its limit (a second of grace for the process start)
    out = Python({"memory_mb": 128}, PY_SCHEMA).execute("i", {"code": "x = bytearray(512 * 1024 * 1024)"})
    assert out.error and "MemoryError" in out.text
    out = Python({"output_bytes": 1000}, PY_SCHEMA).execute("i", {"code": "print('a' * 10**7)"})
    assert out.error and out.text == "a" * 1000 + "\n[output truncated at 1000 bytes]"
