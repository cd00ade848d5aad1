"""The built-in tools: `Calculator` (arithmetic, no eval) and `Python` (code in a sandboxed process).

Calculator: numbers, + - * / // % **, unary signs and parentheses, read with Python's own parser
(`ast`) and evaluated node by node; anything else (a name, a call, an attribute) is refused. Powers
are capped (|exponent| <= 64, a result of at most 4,000 digits), so `9**9**9` is an error, not a hang.

Python: the code runs in a new interpreter (`python -I -S`: no user site, no PYTHON* variables),
in an empty temporary working directory removed afterwards, with an empty environment (nothing of
the trainer's: no tokens, no keys), its own session (the whole process group is killed on timeout),
and rlimits: CPU seconds (`cpu_s`), address space (`memory_mb`), file size (`output_bytes`: its
output goes to a file, so a process printing megabytes is stopped by the kernel), open files and no
core dumps. The wall-clock limit is the tool's `timeout_s`. What it does not protect against:
the network (no namespace isolation: a container or a firewall is the place for that) and reading
files the trainer's user may read. docs/multi-turn.md says the same.
"""
from __future__ import annotations

import ast
import operator
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

from .base import Tool, ToolOutput

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_DIGITS = 4000
MAX_EXPRESSION_CHARS = 500


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (module docstring); ValueError says what is refused."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents above {MAX_EXPONENT} are refused")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
        if isinstance(result, int) and result.bit_length() > MAX_DIGITS * 3.33:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return result
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


# The child: set the limits (hard = soft: the code cannot raise them again unless it runs as root),
# then run the code as __main__ with the arguments gone.
_BOOT = """
import resource, sys
code, limits = sys.argv[1], sys.argv[2:]
for item in limits:
    name, value = item.split("=")
    resource.setrlimit(getattr(resource, name), (int(value), int(value)))
sys.argv = ["-c"]
exec(compile(code, "<python tool>", "exec"), {"__name__": "__main__"})
"""


class Calculator(Tool):
    """`{"expression": "12*34"}` -> "408"."""

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolOutput:
        try:
            value = evaluate(str(arguments["expression"]))
        except ValueError as err:
            return ToolOutput(f"error: {err}", error=True)
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        return ToolOutput(str(value))


class Python(Tool):
    """`{"code": "print(12*34)"}` -> its stdout and stderr (module docstring for the sandbox).
    config: timeout_s (wall clock, default 10), cpu_s (default timeout_s), memory_mb (256),
    output_bytes (65536)."""

    def __init__(self, config, schema) -> None:
        super().__init__({"timeout_s": 10, **config}, schema)
        self.cpu_s = int(self.config.get("cpu_s", max(1, int(self.timeout_s))))
        self.memory_mb = int(self.config.get("memory_mb", 256))
        self.output_bytes = int(self.config.get("output_bytes", 65536))
        if min(self.timeout_s, self.cpu_s, self.memory_mb, self.output_bytes) <= 0:
            raise ValueError("timeout_s, cpu_s, memory_mb and output_bytes must be > 0")

    def _limits(self) -> list[str]:
        """The child's rlimits (resource name, value), set by _BOOT before the code runs: a bootstrap
        rather than subprocess's preexec_fn, which is unsafe in a process with threads."""
        mib = 1 << 20
        return [f"RLIMIT_CPU={self.cpu_s}", f"RLIMIT_AS={self.memory_mb * mib}",
                f"RLIMIT_FSIZE={self.output_bytes}", "RLIMIT_NOFILE=64", "RLIMIT_CORE=0"]

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolOutput:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolOutput('error: the python tool takes {"code": "<python source>"}', error=True)
        workdir = tempfile.mkdtemp(prefix="rlcorr-python-tool-")
        try:  # the output file is beside the working directory, not in it: the code sees an empty directory
            with tempfile.TemporaryFile() as output:
                return self._run(code, workdir, output)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _run(self, code: str, workdir: str, output) -> ToolOutput:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOT, code, *self._limits()], cwd=workdir,
                                env={}, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            status = proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return ToolOutput(f"error: the code ran past the {self.timeout_s:g} s limit and was stopped",
                              error=True, timeout=True)
        size = output.seek(0, os.SEEK_END)
        output.seek(0)
        text = output.read(self.output_bytes).decode("utf-8", errors="replace")
        if size >= self.output_bytes:  # the file-size limit stopped its writes
            return ToolOutput(text + f"\n[output truncated at {self.output_bytes} bytes]", error=True)
        if status in (-signal.SIGXCPU, -signal.SIGKILL):
            return ToolOutput(text + f"\nerror: the code used its {self.cpu_s} s of CPU and was stopped",
                              error=True, timeout=True)
        if status != 0:
            return ToolOutput(text + f"\n[exit code {status}]", error=True)
        return ToolOutput(text)
