"""The README's quick start is exactly the two commands newcomers copy, and both scripts exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_quick_start_has_exactly_demo_and_tests():
    assert _quick_start_commands() == ["bash tools/demo.sh", "bash tools/test.sh"]


def test_ci_runs_the_readme_test_command():
    assert "bash tools/test.sh" in (ROOT / ".ci" / "run").read_text()
    for script in ("tools/demo.sh", "tools/test.sh"):
        assert (ROOT / script).is_file(), script
