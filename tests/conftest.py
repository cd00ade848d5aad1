import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """tools/make_tiny_hf.py's Qwen2 checkpoint (`model/`) and DAPO parquet (`data/train.parquet`),
    built once per test session (about 10-20 s)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "make_tiny_hf.py"
    spec = importlib.util.spec_from_file_location("make_tiny_hf", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path_factory.mktemp("tiny_hf")
    assert tool.main(["--out", str(out), "--seed", "0"]) == 0
    return out
