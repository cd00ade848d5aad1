from dataclasses import dataclass, field
from typing import Literal

import pytest

from megatron_rlcorr.recipe.tree import apply_overrides
from megatron_rlcorr.settings import from_mapping


@dataclass(frozen=True)
class Inner:
    size: int = 1


@dataclass(frozen=True)
class Section:
    lr: float = 1e-3
    steps: int = 10
    mode: Literal["a", "b"] = "a"
    flag: bool = False
    maybe: float | None = None
    inner: Inner = field(default_factory=Inner)

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


def test_values_are_checked_and_coerced():
    s = from_mapping(Section, {"lr": "1e-4", "steps": 3, "mode": "b", "flag": True, "maybe": 2, "inner": {"size": 4}}, "opt")
    assert s == Section(lr=1e-4, steps=3, mode="b", flag=True, maybe=2.0, inner=Inner(4))


@pytest.mark.parametrize("mapping, message", [
    ({"lrr": 1.0}, r'unknown key opt\.lrr \(did you mean "lr"\?\)'),
    ({"steps": 2.5}, r"opt\.steps must be an integer"),
    ({"steps": 0}, r"opt: steps must be >= 1"),
    ({"mode": "c"}, r"opt\.mode must be one of 'a', 'b'"),
    ({"flag": "yes"}, r"opt\.flag must be true or false"),
    ({"lr": "fast"}, r"opt\.lr must be a number"),
    ({"inner": {"sise": 1}}, r'unknown key opt\.inner\.sise \(did you mean "size"\?\)'),
])
def test_errors_name_the_key(mapping, message):
    with pytest.raises(ValueError, match=message):
        from_mapping(Section, mapping, "opt")


def test_dotted_overrides_parse_yaml_values():
    tree = {"trainer": {"steps": 5}}
    apply_overrides(tree, ["trainer.steps=7", "optim.lr=1e-4", "algorithm.rollout_correction.rollout_is=null"])
    assert tree == {"trainer": {"steps": 7}, "optim": {"lr": "1e-4"},
                    "algorithm": {"rollout_correction": {"rollout_is": None}}}
    with pytest.raises(ValueError, match="section.key=value"):
        apply_overrides(tree, ["trainer.steps"])
