"""RolloutCorrectionConfig against its contract (docs/api.md): defaults, presets, legacy names, loading,
validation. Equivalent spellings of the same options are checked on outputs in
test_correction_reference.py (the stored representation is the implementation's business)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from megatron_rlcorr.config import RolloutCorrectionConfig, did_you_mean

DEFAULTS = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_threshold_lower=None,
                rollout_is_batch_normalize=False, rollout_rs=None, rollout_rs_threshold=None,
                rollout_rs_threshold_lower=None, rollout_token_veto_threshold=None,
                bypass_mode=False, use_policy_gradient=False)


def _fields(cfg: RolloutCorrectionConfig) -> dict:
    return {name: getattr(cfg, name) for name in DEFAULTS}


def _expect(**changes) -> dict:
    return {**DEFAULTS, **changes}


def test_defaults_are_disabled():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = RolloutCorrectionConfig()
    assert _fields(cfg) == DEFAULTS


def test_config_is_a_dataclass_with_the_spec_fields():
    names = {f.name for f in dataclasses.fields(RolloutCorrectionConfig)}
    assert set(DEFAULTS) <= names


PRESETS = [
    ("disabled", (), {}, _expect()),
    ("decoupled_token_is", (), {}, _expect(rollout_is="token", rollout_is_threshold=2.0)),
    ("decoupled_token_is", (3.0,), {}, _expect(rollout_is="token", rollout_is_threshold=3.0)),
    ("decoupled_seq_is", (), {}, _expect(rollout_is="sequence", rollout_is_threshold=2.0)),
    ("decoupled_seq_is", (), {"threshold": 4.0}, _expect(rollout_is="sequence", rollout_is_threshold=4.0)),
    ("decoupled_seq_is_rs", (), {},
     _expect(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="sequence", rollout_rs_threshold=2.0)),
    ("decoupled_seq_is_rs", (), {"is_threshold": 3.0, "rs_threshold": 5.0, "rs_threshold_lower": 0.1},
     _expect(rollout_is="sequence", rollout_is_threshold=3.0, rollout_rs="sequence", rollout_rs_threshold=5.0,
             rollout_rs_threshold_lower=0.1)),
    ("decoupled_geo_rs", (), {},
     _expect(rollout_rs="geometric", rollout_rs_threshold=1.001, rollout_token_veto_threshold=1e-4)),
    ("decoupled_geo_rs", (), {"rs_threshold": 1.01, "rs_threshold_lower": 0.98, "veto_threshold": 1e-5},
     _expect(rollout_rs="geometric", rollout_rs_threshold=1.01, rollout_rs_threshold_lower=0.98,
             rollout_token_veto_threshold=1e-5)),
    ("ppo_is_bypass", (), {}, _expect(rollout_is="token", rollout_is_threshold=2.0, bypass_mode=True)),
    ("ppo_is_bypass", (), {"threshold": 1.5},
     _expect(rollout_is="token", rollout_is_threshold=1.5, bypass_mode=True)),
    ("pg_is", (), {}, _expect(rollout_is="sequence", rollout_is_threshold=2.0, bypass_mode=True,
                              use_policy_gradient=True)),
    ("pg_is", (), {"threshold": 8.0}, _expect(rollout_is="sequence", rollout_is_threshold=8.0, bypass_mode=True,
                                              use_policy_gradient=True)),
    ("pg_rs", (), {},
     _expect(rollout_rs="geometric", rollout_rs_threshold=1.001, rollout_token_veto_threshold=1e-4,
             bypass_mode=True, use_policy_gradient=True)),
    ("pg_rs", (), {"rs_threshold": 1.002, "rs_threshold_lower": 0.997, "veto_threshold": 1e-3},
     _expect(rollout_rs="geometric", rollout_rs_threshold=1.002, rollout_rs_threshold_lower=0.997,
             rollout_token_veto_threshold=1e-3, bypass_mode=True, use_policy_gradient=True)),
]


@pytest.mark.parametrize("name,args,kwargs,expected", PRESETS,
                         ids=[f"{p[0]}-{i}" for i, p in enumerate(PRESETS)])
def test_presets(name, args, kwargs, expected):
    cfg = getattr(RolloutCorrectionConfig, name)(*args, **kwargs)
    assert isinstance(cfg, RolloutCorrectionConfig)
    assert _normalise(_fields(cfg)) == _normalise(expected)


def _normalise(fields: dict) -> dict:
    """Thresholds as floats; a one-element list as its element (storage is the config's choice)."""
    out = dict(fields)
    rs = out["rollout_rs"]
    if isinstance(rs, (list, tuple)) and len(rs) == 1:
        out["rollout_rs"] = rs[0]
    for key in ("rollout_is_threshold", "rollout_rs_threshold", "rollout_rs_threshold_lower",
                "rollout_is_threshold_lower", "rollout_token_veto_threshold"):
        value = out[key]
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        out[key] = None if value is None else float(value)
    return out


# ---- legacy names ---------------------------------------------------------------------------

@pytest.mark.parametrize("legacy,value,field,expected", [
    ("bypass_old_logprob_for_rollout", True, "bypass_mode", True),
    ("bypass_old_logprob_for_rollout", False, "bypass_mode", False),
    ("use_pure_rollout_correction", True, "use_policy_gradient", True),
    ("use_pure_rollout_correction", False, "use_policy_gradient", False),
    ("loss_type", "reinforce", "use_policy_gradient", True),
    ("loss_type", "ppo_clip", "use_policy_gradient", False),
])
def test_legacy_names_warn_and_map(legacy, value, field, expected):
    # the policy-gradient loss requires bypass mode (docs/api.md)
    bypass = {} if field == "bypass_mode" else {"bypass_mode": True}
    with pytest.warns(DeprecationWarning, match=legacy):
        cfg = RolloutCorrectionConfig(**{legacy: value}, **bypass)
    assert getattr(cfg, field) is expected
    with pytest.warns(DeprecationWarning, match=legacy):
        cfg = RolloutCorrectionConfig.from_dict({legacy: value, "rollout_is": "token", **bypass})
    assert getattr(cfg, field) is expected and cfg.rollout_is == "token"


@pytest.mark.parametrize("options", [dict(use_policy_gradient=True), dict(loss_type="reinforce"),
                                     dict(use_pure_rollout_correction=True, bypass_old_logprob_for_rollout=False)])
def test_policy_gradient_without_bypass_names_both_fixes(options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy names warn first
        with pytest.raises(ValueError) as err:
            RolloutCorrectionConfig(**options)
    assert "requires bypass_mode=True" in str(err.value) and "use_policy_gradient: false" in str(err.value)


def test_legacy_loss_type_rejects_unknown_value():
    with pytest.raises(ValueError, match="loss_type"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        RolloutCorrectionConfig(loss_type="grpo_magic")


def test_new_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutCorrectionConfig(bypass_mode=True, use_policy_gradient=True, rollout_is="sequence")


def test_unknown_constructor_keyword_is_rejected():
    with pytest.raises((TypeError, ValueError)):
        RolloutCorrectionConfig(rollout_is_treshold=2.0)


# ---- loading ----------------------------------------------------------------------------------

BLOCK = {"rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_is_batch_normalize": True,
         "rollout_rs": "geometric", "rollout_rs_threshold": 1.01, "rollout_rs_threshold_lower": 0.99,
         "rollout_token_veto_threshold": 1e-4, "bypass_mode": False, "use_policy_gradient": False}


def test_from_dict_bare_mapping():
    cfg = RolloutCorrectionConfig.from_dict(BLOCK)
    assert _normalise(_fields(cfg)) == _normalise(_expect(**BLOCK))


def test_from_dict_partial_mapping_keeps_defaults():
    cfg = RolloutCorrectionConfig.from_dict({"rollout_is": "token"})
    assert _fields(cfg) == _expect(rollout_is="token")


def test_from_dict_recipe_block():
    recipe = {"algorithm": {"adv_estimator": "grpo", "rollout_correction": dict(BLOCK)},
              "trainer": {"total_epochs": 1}}
    cfg = RolloutCorrectionConfig.from_dict(recipe)
    assert _normalise(_fields(cfg)) == _normalise(_expect(**BLOCK))


YAML = """\
algorithm:
  adv_estimator: grpo
  rollout_correction:
    rollout_is: sequence
    rollout_is_threshold: 2
    rollout_is_batch_normalize: true
    rollout_rs: geometric
    rollout_rs_threshold: 1.01
    rollout_rs_threshold_lower: 0.99
    rollout_token_veto_threshold: 1e-4
"""
YAML_EXPECTED = _expect(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                        rollout_rs="geometric", rollout_rs_threshold=1.01, rollout_rs_threshold_lower=0.99,
                        rollout_token_veto_threshold=1e-4)


def test_pyyaml_reads_1e_minus_4_as_a_string():
    yaml = pytest.importorskip("yaml")
    assert yaml.safe_load("x: 1e-4")["x"] == "1e-4"


def test_from_yaml_text():
    cfg = RolloutCorrectionConfig.from_yaml(YAML)
    fields = _fields(cfg)
    assert isinstance(fields["rollout_token_veto_threshold"], float)
    assert _normalise(fields) == _normalise(YAML_EXPECTED)


def test_from_yaml_path(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(YAML)
    for arg in (path, str(path)):
        cfg = RolloutCorrectionConfig.from_yaml(arg)
        assert _normalise(_fields(cfg)) == _normalise(YAML_EXPECTED)


def test_from_yaml_bare_block_with_string_numbers():
    text = "rollout_is: token\nrollout_is_threshold: 2e0\nrollout_rs: token\nrollout_rs_threshold: 3e0\n" \
           "rollout_rs_threshold_lower: 5e-1\nrollout_token_veto_threshold: 1e-5\n"
    cfg = RolloutCorrectionConfig.from_yaml(text)
    assert _normalise(_fields(cfg)) == _normalise(_expect(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token", rollout_rs_threshold=3.0,
        rollout_rs_threshold_lower=0.5, rollout_token_veto_threshold=1e-5))
    assert isinstance(cfg.rollout_is_threshold, float)


def test_from_dict_accepts_numeric_strings():
    cfg = RolloutCorrectionConfig.from_dict({"rollout_token_veto_threshold": "1e-4", "rollout_is": "token",
                                             "rollout_is_threshold": "2.5"})
    assert cfg.rollout_token_veto_threshold == pytest.approx(1e-4)
    assert cfg.rollout_is_threshold == pytest.approx(2.5)


def test_from_yaml_divergence_strings():
    text = 'rollout_rs: "token_k1,seq_max_k3"\nrollout_rs_threshold: "0.5_2.0,3.0"\n'
    cfg = RolloutCorrectionConfig.from_yaml(text)
    assert cfg.rollout_rs is not None


@pytest.mark.parametrize("typo,close", [
    ("rollout_is_treshold", "rollout_is_threshold"),
    ("rollout_rs_threshhold", "rollout_rs_threshold"),
    ("rollout_token_veto", "rollout_token_veto_threshold"),
    ("bypass_mod", "bypass_mode"),
])
def test_unknown_key_suggests_close_name(typo, close):
    with pytest.raises(ValueError, match="(?i)did you mean") as info:
        RolloutCorrectionConfig.from_dict({typo: 1.0})
    assert close in str(info.value) and typo in str(info.value)
    with pytest.raises(ValueError, match="(?i)did you mean") as info:
        RolloutCorrectionConfig.from_yaml(f"algorithm:\n  rollout_correction:\n    {typo}: 1.0\n")
    assert close in str(info.value)


def test_unknown_key_with_nothing_close_gets_no_suggestion():
    with pytest.raises(ValueError, match=r"unknown rollout correction key 'clip_ratio'; allowed keys: rollout_is, "):
        RolloutCorrectionConfig.from_dict({"clip_ratio": 0.2})


@pytest.mark.parametrize("name, choices, suggested", [
    ("stpes", ["steps", "seed", "save_every"], "steps"),
    ("rollout_token_veto", ["rollout_token_veto_threshold", "rollout_is"], "rollout_token_veto_threshold"),
    ("trian", ["train", "score", "eval", "export"], "train"),
    ("qwen9", ["qwen2.5-7b", "qwen3-8b", "qwen3-32b", "llama-3.1-8b"], None),  # only the prefix is shared
    ("learning_rate", ["lr", "clip_grad", "weight_decay"], None),
    ("zzzz", ["steps"], None),
])
def test_did_you_mean_names_only_a_close_name(name, choices, suggested):
    assert did_you_mean(name, choices) == (f' (did you mean "{suggested}"?)' if suggested else "")


# ---- validation ------------------------------------------------------------------------------

INVALID = [
    (dict(rollout_is="tokens"), "rollout_is"),
    (dict(rollout_is="geometric"), "rollout_is"),
    (dict(rollout_is="token", rollout_is_threshold=0.0), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=-1.0), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold="abc"), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold_lower=0.0), "rollout_is_threshold_lower"),
    (dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_threshold_lower=3.0),
     "rollout_is_threshold_lower"),
    (dict(rollout_rs="bogus", rollout_rs_threshold=2.0), "rollout_rs"),
    (dict(rollout_rs="token"), "rollout_rs_threshold"),
    (dict(rollout_rs="seq_max_k2"), "rollout_rs_threshold"),
    (dict(rollout_rs="sequence", rollout_rs_threshold=0.0), "rollout_rs_threshold"),
    (dict(rollout_rs="sequence", rollout_rs_threshold=-2.0), "rollout_rs_threshold"),
    (dict(rollout_rs="token", rollout_rs_threshold=0.5), "rollout_rs_threshold"),
    (dict(rollout_rs="geometric", rollout_rs_threshold=0.999), "rollout_rs_threshold"),
    (dict(rollout_rs="sequence", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0),
     "rollout_rs_threshold_lower"),
    (dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.0),
     "rollout_rs_threshold_lower"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5),
     "rollout_rs_threshold_lower"),
    (dict(rollout_rs="seq_max_k3,token_k2", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5),
     "rollout_rs_threshold_lower"),
    (dict(rollout_rs="token_k1,token_k1", rollout_rs_threshold=2.0), "rollout_rs"),
    (dict(rollout_rs=["seq_max_k2", "seq_max_k2"], rollout_rs_threshold=[2.0, 3.0]), "rollout_rs"),
    (dict(rollout_rs="token,seq_max_k2", rollout_rs_threshold=2.0), "rollout_rs"),
    (dict(rollout_rs=["geometric", "token_k3"], rollout_rs_threshold=[1.01, 2.0]), "rollout_rs"),
    (dict(rollout_rs="token,sequence", rollout_rs_threshold=2.0), "rollout_rs"),
    (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0), "rollout_rs"),
    (dict(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold=[2.0, 3.0, 4.0]), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.5_2.0,3.0,4.0"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="2.0_0.5"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="0_2.0"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2.0"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k3", rollout_rs_threshold=-1.0), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="abc"), "rollout_rs_threshold"),
    (dict(rollout_token_veto_threshold=0.0), "rollout_token_veto_threshold"),
    (dict(rollout_token_veto_threshold=-1e-4), "rollout_token_veto_threshold"),
]


@pytest.mark.parametrize("kwargs,field", INVALID, ids=[str(k) for k, _ in INVALID])
def test_invalid_combinations_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        RolloutCorrectionConfig(**kwargs)
    assert field in str(info.value), f"message does not name {field}: {info.value}"
    with pytest.raises(ValueError):
        RolloutCorrectionConfig.from_dict(kwargs)


VALID = [
    dict(rollout_rs="token_k1", rollout_rs_threshold=2.0),  # k1 with one number U: [1/U, U]
    dict(rollout_rs="token_k1", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.8),
    dict(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.5_2.0,3.0"),
    dict(rollout_rs=["seq_sum_k2", "seq_mean_k1"], rollout_rs_threshold=[4.0, 1.2],
         rollout_rs_threshold_lower=0.9),
    dict(rollout_rs="seq_mean_k3,token_k2", rollout_rs_threshold=0.3),
    # upper < 1 is fine once a lower bound below it is given
    dict(rollout_rs="sequence", rollout_rs_threshold=0.5, rollout_rs_threshold_lower=0.1),
    dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_threshold_lower=2.0),
]


@pytest.mark.parametrize("kwargs", VALID, ids=[str(k) for k in VALID])
def test_valid_combinations(kwargs):
    RolloutCorrectionConfig(**kwargs)


def test_replace_keeps_per_option_lists():
    cfg = RolloutCorrectionConfig(rollout_rs=["token_k1", "seq_max_k3"], rollout_rs_threshold=[1.5, 0.2])
    copy = dataclasses.replace(cfg, rollout_is="token")
    assert copy.rollout_rs == ("token_k1", "seq_max_k3") and copy.rollout_rs_threshold == (1.5, 0.2)
    assert copy.rejection_rules == cfg.rejection_rules
    assert copy.rollout_is == "token"
