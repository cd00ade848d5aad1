"""Write tests/tiers.py's SLOW list from a measured run of the whole suite.

    bash tools/test.sh --junitxml=/tmp/suite.xml
    python tools/mark_slow.py /tmp/suite.xml [--budget-s 150]
    bash tools/test.sh --quick --junitxml=/tmp/quick.xml           # then, to fold in what the quick
    python tools/mark_slow.py /tmp/suite.xml /tmp/quick.xml        # tier itself measured

The quick tier (`bash tools/test.sh --quick`, `-m "not slow"`) keeps the fastest tests, every
module's unit tests among them, and the distributed tests named in tests/tiers.py's
QUICK_DISTRIBUTED (one per parallel family), until their measured seconds add up to --budget-s;
every other test is marked slow. A test's seconds are JUnit's (set-up, call and tear-down: a
module's shared fixture is paid by its first test), the most any of the given runs measured: a
test that reads a fixture another test paid for in the whole suite pays for it in the quick tier
when that other test is slow, which only a run of the quick tier shows. The measurement's date and machine are written
beside the list, so a new measurement replaces the list whole rather than a guess per test.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measured_seconds(*junit_xmls: Path) -> dict[str, float]:
    """nodeid -> seconds, the most any of the runs measured, for the tests that ran (skipped ones
    included: they cost nothing)."""
    out: dict[str, float] = {}
    for junit_xml in junit_xmls:
        for case in ET.parse(junit_xml).getroot().iter("testcase"):
            module = case.get("classname", "")
            nodeid = f"{module.replace('.', '/')}.py::{case.get('name')}"
            out[nodeid] = max(out.get(nodeid, 0.0), float(case.get("time", 0.0)))
    return out


def choose_slow(seconds: dict[str, float], keep: set[str], budget_s: float) -> list[str]:
    """The tests outside a quick tier of `keep` plus the fastest others within `budget_s`."""
    spent = sum(seconds.get(k, 0.0) for k in keep)
    slow = []
    for nodeid, s in sorted(seconds.items(), key=lambda kv: (kv[1], kv[0])):
        if nodeid in keep:
            continue
        if spent + s <= budget_s:
            spent += s
        else:
            slow.append(nodeid)
    return sorted(slow)


def render(slow: list[str], seconds: dict[str, float], quick_distributed: list[str], budget_s: float) -> str:
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    lines = [
        '"""The quick tier (`bash tools/test.sh --quick`): which tests are marked `slow` (tests/conftest.py).',
        "",
        "Written by tools/mark_slow.py from a measured run of the whole suite; do not edit SLOW by hand,",
        "measure again. QUICK_DISTRIBUTED is chosen: one distributed test per parallel family, always in",
        "the quick tier.",
        '"""',
        "",
        f"MEASURED = {datetime.date.today().isoformat()!r}  # on {machine}",
        f"BUDGET_S = {budget_s:g}  # measured seconds of the quick tier's tests, at most",
        "",
        "QUICK_DISTRIBUTED = [",
        *(f"    {nodeid!r}," for nodeid in quick_distributed),
        "]",
        "",
        "SLOW = [  # measured seconds",
        *(f"    {nodeid!r},  # {seconds[nodeid]:.1f}" for nodeid in slow),
        "]",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml", type=Path, nargs="+",
                        help="the whole suite's JUnit XML, then optionally the quick tier's")
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "tiers.py")
    args = parser.parse_args(argv)
    from tests.tiers import QUICK_DISTRIBUTED

    seconds = measured_seconds(*args.junit_xml)
    missing = [k for k in QUICK_DISTRIBUTED if k not in seconds]
    if missing:
        print(f"error: QUICK_DISTRIBUTED names tests the run did not measure: {missing}", file=sys.stderr)
        return 2
    slow = choose_slow(seconds, set(QUICK_DISTRIBUTED), args.budget_s)
    args.out.write_text(render(slow, seconds, QUICK_DISTRIBUTED, args.budget_s))
    quick = sum(s for k, s in seconds.items() if k not in set(slow))
    print(f"{len(seconds) - len(slow)} quick tests ({quick:.0f} s measured), {len(slow)} slow -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
