"""tools/check_parallel_parity.py chooses a tiny model that fits every layout it is asked for
(it used a fixed 4-head, 2-query-group model, and `--layouts tp4` crashed)."""
import importlib.util
from pathlib import Path

import pytest

from megatron_rlcorr.model.config import ModelConfig

_spec = importlib.util.spec_from_file_location(
    "check_parallel_parity", Path(__file__).resolve().parents[2] / "tools" / "check_parallel_parity.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


@pytest.mark.parametrize("names", [["tp4"], ["tp2", "cp2", "pp2", "tp2cp2pp2"], ["tp8", "pp2vpp2"], ["tp4", "pp4"],
                                   ["pp3"], ["tp2", "pp2vpp3"]])
def test_tiny_model_fits_every_layout(names):
    layouts = [tool.parse_layout(name) for name in names] + [tool.parse_layout("tp1")]
    model = tool.tiny_model(layouts)
    ModelConfig(**model)  # a valid model
    for name, layout in zip(names, layouts):
        assert model["num_attention_heads"] % layout["tp"] == 0, name
        assert model["num_query_groups"] % layout["tp"] == 0, name
        assert model["num_layers"] % (layout["pp"] * (layout["vpp"] or 1)) == 0, name
        assert model["hidden_size"] == 8 * model["num_attention_heads"]
    assert model["num_layers"] >= 4


def test_tp4_needs_more_query_groups_than_the_old_fixed_model():
    model = tool.tiny_model([tool.parse_layout("tp4")])
    assert model["num_query_groups"] == 4 and model["num_attention_heads"] == 8


@pytest.mark.parametrize("name, message", [("tp2x", "cannot parse"), ("tp2tp2", "twice"), ("vpp2", "vpp needs pp > 1"),
                                           ("tp0", "must be >= 1")])
def test_bad_layout_names(name, message):
    with pytest.raises(ValueError, match=message):
        tool.parse_layout(name)


@pytest.mark.parametrize("name, sizes", [
    ("ep2", dict(dp=2, ep=2, etp=1)),                    # dp follows: ep*etp must divide tp*cp*dp
    ("pp2ep2", dict(pp=2, dp=2, ep=2)),
    ("tp2ep2", dict(tp=2, dp=1, ep=2)),                  # the EP ranks are the TP ranks
    ("tp2dp2ep2", dict(tp=2, dp=2, ep=2)),
    ("ep2etp2", dict(dp=4, ep=2, etp=2)),
    ("etp2", dict(dp=2, ep=1, etp=2)),
])
def test_expert_layouts(name, sizes):
    layout = tool.parse_layout(name)
    assert {key: layout[key] for key in sizes} == sizes
    assert tool.is_moe_layout(layout)
    assert tool.world_size(layout) == layout["tp"] * layout["pp"] * layout["cp"] * layout["dp"]


def test_a_dp_too_small_for_the_expert_groups_is_refused():
    with pytest.raises(ValueError, match=r"ep\*etp = 4 must divide tp\*cp\*dp = 2"):
        tool.parse_layout("dp2ep4")
    assert not tool.is_moe_layout(tool.parse_layout("tp2pp2"))


@pytest.mark.parametrize("kind", [None, *tool.MOE_KINDS])
def test_tiny_moe_model_fits_the_expert_layouts(kind):
    names = ["ep2", "tp2ep2", "pp2ep2", "ep4", "ep2etp2"]
    model = tool.tiny_model([tool.parse_layout(name) for name in names] + [tool.parse_layout("tp1")], kind)
    cfg = ModelConfig(**model)
    if kind is None:
        assert cfg.moe is None
        return
    moe = cfg.moe
    assert moe.num_experts % 4 == 0 and moe.router_topk == 2 and moe.dense_layers == (0,)
    assert moe.ffn_hidden_size % 2 == 0  # etp2
    assert [cfg.decoder_shape.is_moe_layer(i) for i in range(cfg.num_layers)] == [False] + [True] * (cfg.num_layers - 1)
    shared = moe.shared_expert_ffn_hidden_size
    assert (shared is not None) == (kind == "shared")
    if shared is not None:
        assert shared % 2 == 0  # tp2


def test_moe_with_tensor_parallelism_runs_sequence_parallel():
    import argparse

    plain = argparse.Namespace(sequence_parallel=False, moe=None)
    assert not tool.sequence_parallel(tool.parse_layout("tp2"), plain)
    assert tool.sequence_parallel(tool.parse_layout("tp2"), argparse.Namespace(sequence_parallel=True, moe=None))
    assert tool.sequence_parallel(tool.parse_layout("tp2ep2"), argparse.Namespace(sequence_parallel=False, moe="routed"))
    assert not tool.sequence_parallel(tool.parse_layout("ep2"), argparse.Namespace(sequence_parallel=False, moe="routed"))
