"""tools/_requirements.py: what tools/_env.sh installs beside a pre-release torch (NGC builds)."""
import importlib.util
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def requirements_tool():
    spec = importlib.util.spec_from_file_location("_requirements", ROOT / "tools" / "_requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _names(requirements):
    from packaging.requirements import Requirement

    return {Requirement(text).name.lower() for text in requirements}


def test_the_project_requirements_without_torch_and_megatron_core(requirements_tool):
    base = _names(requirements_tool.requirements("megatron-rlcorr", []))
    dev = _names(requirements_tool.requirements("megatron-rlcorr", ["dev"]))
    assert {"pyyaml", "safetensors", "transformers"} <= base and "pytest" not in base
    assert base | {"pytest", "pytest-timeout"} <= dev
    assert not {"torch", "megatron-core"} & dev
    # megatron-core's own requirements: its base ones (numpy, packaging), never torch, no extras
    core = _names(requirements_tool.requirements("megatron-core", []))
    assert "numpy" in core and "torch" not in core
    assert all(";" not in text for text in requirements_tool.requirements("megatron-rlcorr", ["dev"]))


@pytest.mark.parametrize("version, prerelease", [("2.6.0a0+ecf3bae40a.nv25.01", True), ("2.13.0+cpu", False),
                                                 ("2.11.0+cu130", False), ("2.8.0rc1", True)])
def test_a_pre_release_torch_is_recognised(requirements_tool, monkeypatch, version, prerelease):
    from packaging.requirements import Requirement

    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: version if name == "torch" else real_version(name))
    assert requirements_tool.torch_is_prerelease() is prerelease
    assert requirements_tool.main(["--torch-is-prerelease"]) == (0 if prerelease else 1)
    # Why the tool exists: megatron-core's own torch floor refuses such a build, ours admits it.
    if prerelease and version.startswith("2.6.0"):
        assert not Requirement("torch>=2.6.0").specifier.contains(version, prereleases=True)
