"""The quick tier's lists (tests/tiers.py) name tests that exist, and the slow-marking tool picks
the fastest tests within its budget."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _exists(nodeid: str) -> bool:
    path, _, name = nodeid.partition("::")
    return (ROOT / path).is_file() and f"def {name.split('[')[0]}(" in (ROOT / path).read_text()


def test_every_listed_test_exists():
    """A renamed test would otherwise leave the tiers silently (a slow test run in the quick tier)."""
    from tests.tiers import QUICK_DISTRIBUTED, SLOW

    missing = [n for n in [*QUICK_DISTRIBUTED, *SLOW] if not _exists(n)]
    assert not missing, f"tests/tiers.py names tests that do not exist (measure again: tools/mark_slow.py): {missing}"
    assert not set(QUICK_DISTRIBUTED) & set(SLOW)


def test_choose_slow_keeps_the_fastest_within_the_budget_and_the_chosen_ones(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("mark_slow", ROOT / "tools" / "mark_slow.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    seconds = {"a::t1": 1.0, "a::t2": 2.0, "a::t3": 3.0, "b::big": 50.0, "b::chosen": 40.0}
    assert tool.choose_slow(seconds, {"b::chosen"}, budget_s=44.0) == ["a::t3", "b::big"]
    assert tool.choose_slow(seconds, set(), budget_s=1000.0) == []
    xml = tmp_path / "run.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.unit.test_x" name="test_y[a]" time="1.5"/>'
                   '</testsuite></testsuites>')
    assert tool.measured_seconds(xml) == {"tests/unit/test_x.py::test_y[a]": 1.5}
    # A second run (the quick tier's) adds its tests and raises a test's seconds, never lowers them.
    quick = tmp_path / "quick.xml"
    quick.write_text('<testsuites><testsuite><testcase classname="tests.unit.test_x" name="test_y[a]" time="9"/>'
                     '<testcase classname="tests.unit.test_x" name="test_z" time="0.5"/></testsuite></testsuites>')
    both = {"tests/unit/test_x.py::test_y[a]": 9.0, "tests/unit/test_x.py::test_z": 0.5}
    assert tool.measured_seconds(xml, quick) == tool.measured_seconds(quick, xml) == both
