import platform
from importlib import metadata

import pytest
import torch

from tests.launched import tiny_cpu_launch  # noqa: F401  (a fixture: the session's real launch)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def pytest_report_header(config):
    """The versions the suite's results depend on (read from the installed metadata: importing
    megatron.core here would cost seconds before every run)."""
    cuda = torch.version.cuda or "none"
    return [f"megatron-rlcorr: Python {platform.python_version()}, torch {torch.__version__} (CUDA {cuda}), "
            f"megatron-core {_version('megatron-core')}, transformer-engine {_version('transformer-engine')}"]


def pytest_collection_modifyitems(config, items):
    from tests.tiers import SLOW

    slow = set(SLOW)
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _make_tiny_hf(tmp_path_factory, name: str, *flags: str):
    """tools/make_tiny_hf.py's files, built once per test run (tests/session_once.py)."""
    import importlib.util
    from pathlib import Path

    from tests.session_once import once

    path = Path(__file__).resolve().parents[1] / "tools" / "make_tiny_hf.py"
    spec = importlib.util.spec_from_file_location("make_tiny_hf", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out, code = once(tmp_path_factory, name, lambda out: tool.main(["--out", str(out), "--seed", "0", *flags]))
    assert code == 0
    return out


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """tools/make_tiny_hf.py's Qwen2 checkpoint (`model/`) and DAPO parquets (`data/train.parquet`, `data/val.parquet`),
    built once per test session (about 10-20 s)."""
    return _make_tiny_hf(tmp_path_factory, "tiny_hf")


@pytest.fixture(scope="session")
def tiny_hf_moe(tmp_path_factory):
    """tools/make_tiny_hf.py --moe: its Qwen3-MoE checkpoint (`model/`: layer 0 dense, layers 1-2 with 8 experts,
    top-2) and the same parquets as `tiny_hf`, built once per test session (about 25 s of CPU)."""
    return _make_tiny_hf(tmp_path_factory, "tiny_hf_moe", "--moe")


def pytest_collection_finish(session):
    """The sys.path the distributed tests' pools start with (tests/dist.py)."""
    from tests.dist import record_session_sys_path

    record_session_sys_path()


def pytest_sessionfinish(session, exitstatus):
    """The distributed tests' process pools (tests/dist_pool.py) end with the session; a pytest-xdist
    worker hands its pool counts to the controller, which reports them."""
    from tests.dist import close_pools, pool_stats

    close_pools()
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["pool_stats"] = pool_stats


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown when the plugin is off (-p no:xdist)
def pytest_testnodedown(node, error):
    """(pytest-xdist's controller) A worker's pool counts, added to the run's."""
    from tests.dist import pool_stats

    theirs = getattr(node, "workeroutput", {}).get("pool_stats")
    if theirs:
        pool_stats["started"] += theirs["started"]
        pool_stats["replaced"].extend(theirs["replaced"])


def pytest_terminal_summary(terminalreporter):
    """How many process pools the distributed tests started, and why worn ones were replaced."""
    from tests.dist import pool_stats

    if pool_stats["started"]:
        terminalreporter.write_line(f"distributed test pools started: {pool_stats['started']}")
        for reason in pool_stats["replaced"]:
            terminalreporter.write_line(f"  replaced a pool of {reason}")
