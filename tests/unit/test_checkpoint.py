"""Per-rank checkpoints record the layout that wrote them; resuming on another layout stops early."""
import json

import pytest
import torch

from megatron_rlcorr import runtime, train
from megatron_rlcorr.training import checkpoint

from tests.unit.test_recipes import TINY

DP2 = {"world_size": 2, "tp": 1, "pp": 1, "cp": 1, "vpp": None}
TP2 = {"world_size": 2, "tp": 2, "pp": 1, "cp": 1, "vpp": None}


def _save(run_dir, step, layout):
    checkpoint.save(run_dir, step, {"step": step, "w": torch.arange(3)}, layout)


def test_save_records_the_layout_and_the_marker(tmp_path):
    _save(tmp_path, 4, DP2)
    directory = checkpoint.checkpoint_dir(tmp_path, 4)
    assert json.loads((directory / checkpoint.LAYOUT_FILE).read_text()) == DP2
    assert checkpoint.latest_step(tmp_path) == 4
    assert torch.equal(checkpoint.load(tmp_path, 4)["w"], torch.arange(3))


def test_same_layout_or_no_checkpoint_resumes(tmp_path):
    checkpoint.check_resumable(tmp_path, TP2)  # nothing saved yet
    _save(tmp_path, 1, TP2)
    checkpoint.check_resumable(tmp_path, dict(TP2))


def test_checkpoint_without_a_layout_record_is_not_checked(tmp_path):
    _save(tmp_path, 1, DP2)
    (checkpoint.checkpoint_dir(tmp_path, 1) / checkpoint.LAYOUT_FILE).unlink()  # written by an older version
    checkpoint.check_resumable(tmp_path, TP2)


def test_other_layout_is_refused_with_both_layouts_and_the_fix(tmp_path):
    _save(tmp_path, 1, DP2)
    _save(tmp_path, 2, TP2)  # the latest checkpoint is the one that counts
    checkpoint.check_resumable(tmp_path, TP2)
    with pytest.raises(ValueError) as info:
        checkpoint.check_resumable(tmp_path, DP2)
    message = str(info.value)
    assert "step_000002" in message and "trainer.resume=false" in message
    assert "tp=2 pp=1 cp=1" in message and "tp=1 pp=1 cp=1" in message


def test_train_refuses_to_resume_on_another_layout_before_any_process_group(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runtime.dist, "init_process_group",
                        lambda *a, **k: pytest.fail("a process group was created for an unresumable run"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    args = ["--config", str(TINY), f"trainer.output_dir={tmp_path}", "name=run"]
    _save(tmp_path / "run", 3, TP2)  # written by tp=2; tiny_cpu.yaml on 2 processes is dp=2
    assert train.main(args) == train.EXIT_BAD_RECIPE
    assert "per-rank checkpoints resume only on the layout that wrote them" in capsys.readouterr().err
    # Starting afresh is allowed: the recipe check passes (then the process group would be built).
    assert train.load_and_check(str(TINY), args[2:] + ["trainer.resume=false"], 2).trainer.resume is False
