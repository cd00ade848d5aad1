"""Session fixtures built once per test run, also when pytest-xdist runs the tests on several workers.

A session-scoped fixture is per process: under `pytest -n 2` (tools/test.sh) each worker would
build its own copy of a tiny checkpoint or a shared launch. `once(tmp_path_factory, name, build)`
lets the first worker that asks build it, in the run's temporary directory common to all workers,
under a file lock; the others wait on the lock and read what it left: the directory, and the
JSON value `build` returned (xdist's documented pattern). Without xdist it is a plain
`tmp_path_factory.mktemp(name)` and a call. What is built must be read-only to its tests.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock


def once(tmp_path_factory, name: str, build: Callable[[Path], Any]) -> tuple[Path, Any]:
    """(directory, value): `build(directory)` run once per test run; its value must be JSON."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        out = tmp_path_factory.mktemp(name)
        return out, build(out)
    out = tmp_path_factory.getbasetemp().parent / name  # common to the run's workers
    done = out.with_name(f"{name}.json")
    with FileLock(f"{out}.lock"):
        if not done.exists():
            out.mkdir(exist_ok=True)  # a worker whose build failed may have left it
            value = build(out)
            done.write_text(json.dumps({"value": value}))
    return out, json.loads(done.read_text())["value"]
