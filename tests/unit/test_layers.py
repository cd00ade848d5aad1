"""The package's layers (docs/architecture.md): every import of every module goes to a layer above.

Imports are read from the source with `ast`, so imports inside functions and under TYPE_CHECKING
count too. A module may import its own folder and any lower-numbered layer; layers of the same
number are peers and do not import each other.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rlcorr"

LAYERS = {
    "config": 0,
    "settings": 1,
    "correction": 2,
    "parallel": 3,
    "model": 4,
    "training": 5,
    "rollout": 6, "data": 6,
    "rl": 7,
    "recipe": 8,
    "runtime": 9, "analysis": 9,
    "train": 10, "score": 10, "eval": 10, "export": 10, "plan": 10, "analyze": 10,
    "cli": 11,
}


def _unit(module: str) -> str:
    """The layer unit of a dotted module name inside the package ('model.weights' -> 'model')."""
    return module.split(".")[0]


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if parts:
            yield ".".join(parts), path


def _imports(module: str, path: Path):
    """Package-internal modules imported by `module` (dotted, relative to the package)."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}".lstrip(".") for a in node.names]
                yield from (n for n in names if n)
            elif node.module and node.module.startswith("megatron_rlcorr."):
                yield node.module[len("megatron_rlcorr."):]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megatron_rlcorr."):
                    yield alias.name[len("megatron_rlcorr."):]


def test_every_top_level_unit_has_a_layer():
    units = {_unit(m) for m, _ in _modules()}
    assert units == set(LAYERS), f"give these a layer in LAYERS and docs/architecture.md: {units ^ set(LAYERS)}"


@pytest.mark.parametrize("module, path", list(_modules()), ids=lambda x: str(x))
def test_imports_go_down_the_layers(module, path):
    mine = _unit(module)
    wrong = []
    for target in _imports(module, path):
        theirs = _unit(target)
        if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
            wrong.append(f"{target} (layer {LAYERS[theirs]})")
    assert not wrong, f"{module} (layer {LAYERS[mine]}) imports {', '.join(wrong)}"


def test_the_correction_imports_only_torch_and_the_config():
    for module, path in _modules():
        if _unit(module) != "correction":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert not any(n.startswith(("megatron", "transformer_engine")) for n in names), module


def test_the_checker_sees_a_violation(tmp_path):
    fake = tmp_path / "x.py"
    fake.write_text("from ..recipe import load_recipe\nfrom .sampling import x\n")
    assert list(_imports("rl.x", fake)) == ["recipe", "rl.sampling"]
