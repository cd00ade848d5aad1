"""Which checkpoints may resume where: distributed checkpoints on any layout; per-rank ones (the
format before them) on the layout that wrote them, with the plain optimizer, else stopped early."""
import inspect
import json

import pytest
import torch

from megatron_rlcorr import runtime, train
from megatron_rlcorr.training import checkpoint

from tests.legacy_checkpoint import write_legacy
from tests.unit.test_recipes import TINY

DP2 = {"world_size": 2, "tp": 1, "pp": 1, "cp": 1, "vpp": None}
TP2 = {"world_size": 2, "tp": 2, "pp": 1, "cp": 1, "vpp": None}
STATE = {"step": 1, "w": torch.arange(3)}


def _check(run_dir, layout, distributed_optimizer=False):
    checkpoint.check_resumable(run_dir, layout, distributed_optimizer=distributed_optimizer)


def test_legacy_checkpoint_loads_its_rank_file(tmp_path):
    directory = write_legacy(tmp_path, 4, [STATE, STATE], DP2)
    assert checkpoint.latest_step(tmp_path) == 4 and checkpoint.is_legacy(directory)
    assert checkpoint.saved_layout(directory) == DP2
    assert torch.equal(checkpoint.load_legacy(directory)["w"], torch.arange(3))


def test_same_layout_or_no_checkpoint_resumes(tmp_path):
    _check(tmp_path, TP2)  # nothing saved yet
    write_legacy(tmp_path, 1, [STATE, STATE], TP2)
    _check(tmp_path, dict(TP2))


def test_checkpoint_without_a_layout_record_is_not_checked(tmp_path):
    write_legacy(tmp_path, 1, [STATE, STATE], None)  # written by an older version
    _check(tmp_path, TP2)


def test_other_layout_is_refused_with_both_layouts_and_the_fix(tmp_path):
    write_legacy(tmp_path, 1, [STATE, STATE], DP2)
    write_legacy(tmp_path, 2, [STATE, STATE], TP2)  # the latest checkpoint is the one that counts
    _check(tmp_path, TP2)
    with pytest.raises(ValueError) as info:
        _check(tmp_path, DP2)
    message = str(info.value)
    assert "step_000002" in message and "trainer.resume=false" in message
    assert "tp=2 pp=1 cp=1" in message and "tp=1 pp=1 cp=1" in message


def test_legacy_checkpoint_needs_the_plain_optimizer(tmp_path):
    write_legacy(tmp_path, 1, [STATE, STATE], TP2)
    with pytest.raises(ValueError, match="optim.use_distributed_optimizer=false"):
        _check(tmp_path, TP2, distributed_optimizer=True)


def test_distributed_checkpoint_without_a_record_is_never_refused_for_its_layout(tmp_path):
    """Written before checkpoint.json, in the fully reshardable format (by 0.16: with common.pt)."""
    directory = checkpoint.checkpoint_dir(tmp_path, 3)
    directory.mkdir(parents=True)
    (directory / "metadata.json").write_text("{}")
    (directory / "common.pt").write_bytes(b"")
    (directory / checkpoint.LAYOUT_FILE).write_text('{"world_size": 2, "tp": 2}')
    (tmp_path / "checkpoints" / "latest").write_text("3\n")
    assert not checkpoint.is_legacy(directory)
    _check(tmp_path, DP2, distributed_optimizer=True)


def test_train_refuses_to_resume_on_another_layout_before_any_process_group(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runtime.dist, "init_process_group",
                        lambda *a, **k: pytest.fail("a process group was created for an unresumable run"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    args = ["--config", str(TINY), f"trainer.output_dir={tmp_path}", "name=run", "optim.use_distributed_optimizer=false"]
    write_legacy(tmp_path / "run", 3, [STATE, STATE], TP2)  # written by tp=2; tiny_cpu.yaml on 2 processes is dp=2
    assert train.main(args) == train.EXIT_BAD_RECIPE
    assert "resume only on the layout that wrote them" in capsys.readouterr().err
    # Starting afresh is allowed: the recipe check passes (then the process group would be built).
    assert train.load_and_check(str(TINY), args[2:] + ["trainer.resume=false"], 2).trainer.resume is False


@pytest.mark.parametrize("adam_cls, extra", [(torch.optim.Adam, {}), (torch.optim.AdamW, {"weight_decay": 0.1}),
                                             (torch.optim.Adam, {"amsgrad": True})])
def test_a_started_adam_state_steps_exactly_like_no_state(adam_cls, extra):
    """start_adam_state (for saving a run whose updates were all skipped) gives step 0 and zero
    moments; the next real steps equal a fresh Adam's, bit for bit."""
    from types import SimpleNamespace

    from megatron_rlcorr.training.checkpoint import start_adam_state

    torch.manual_seed(0)
    start = [torch.randn(4, 3), torch.randn(5)]
    fresh = [p.clone().requires_grad_() for p in start]
    started = [p.clone().requires_grad_() for p in start]
    opt_fresh, opt_started = adam_cls(fresh, lr=1e-2, **extra), adam_cls(started, lr=1e-2, **extra)
    start_adam_state(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=opt_started)]))
    assert all(float(opt_started.state[p]["step"]) == 0 and not opt_started.state[p]["exp_avg"].any()
               for p in started)
    assert opt_started.state_dict()["state"] and not opt_fresh.state_dict()["state"]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in start]
        for params, opt in ((fresh, opt_fresh), (started, opt_started)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for a, b, before in zip(fresh, started, start):
        assert torch.equal(a, b)
        assert not torch.equal(a, before)  # it did train


def _distributed_checkpoint(run_dir, step, *, record=None, common_pt=True, layout=DP2):
    directory = checkpoint.checkpoint_dir(run_dir, step)
    directory.mkdir(parents=True)
    (directory / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    if common_pt:
        (directory / "common.pt").write_bytes(b"")
    (directory / checkpoint.LAYOUT_FILE).write_text(json.dumps(layout))
    if record is not None:
        (directory / checkpoint.RECORD_FILE).write_text(json.dumps(record))
    (run_dir / "checkpoints" / "latest").write_text(f"{step}\n")
    return directory


def test_a_checkpoint_from_a_newer_megatron_core_is_refused_naming_both_versions(tmp_path):
    installed = checkpoint.megatron_core_version()
    major, minor = checkpoint._release(installed)
    newer = f"{major}.{minor + 1}.0"
    directory = _distributed_checkpoint(tmp_path, 5, record={"megatron_core": newer, "optimizer": "distributed",
                                                             "optimizer_format": "dp_reshardable"})
    with pytest.raises(ValueError) as info:
        checkpoint.check_readable(directory)
    message = str(info.value)
    assert f"Megatron-Core {newer}" in message and f"megatron-core {installed} is installed" in message
    assert "forward only" in message and "trainer.resume=false" in message
    with pytest.raises(ValueError, match=newer):  # and before any process group exists
        _check(tmp_path, DP2, distributed_optimizer=True)
    # The same release, or an older one, reads.
    for writer in (installed, "0.15.0"):
        (directory / checkpoint.RECORD_FILE).write_text(json.dumps({"megatron_core": writer, "optimizer": "plain",
                                                                    "optimizer_format": "dp_reshardable"}))
        checkpoint.check_readable(directory)


def test_a_checkpoint_without_common_pt_needs_megatron_core_019(tmp_path):
    """Written before checkpoint.json by 0.19+ (common state inside the .distcp files)."""
    directory = _distributed_checkpoint(tmp_path, 2, common_pt=False)
    with pytest.raises(ValueError) as info:
        checkpoint.check_readable(directory, installed="0.16.1")
    assert "0.19 or newer" in str(info.value) and "megatron-core 0.16.1 is installed" in str(info.value)
    checkpoint.check_readable(directory, installed="0.19.2")
    checkpoint.check_readable(_distributed_checkpoint(tmp_path, 3), installed="0.16.1")  # has common.pt


def test_a_dp_sharded_optimizer_state_resumes_only_on_its_model_parallel_layout(tmp_path):
    record = {"megatron_core": checkpoint.megatron_core_version(), "optimizer": "distributed",
              "optimizer_format": "dp_reshardable"}
    _distributed_checkpoint(tmp_path, 4, record=record, layout=DP2)
    _check(tmp_path, {**DP2, "world_size": 4}, distributed_optimizer=True)  # another DP size
    with pytest.raises(ValueError, match="optimizer_checkpoint_format=fully_reshardable"):
        _check(tmp_path, TP2, distributed_optimizer=True)
    # The fully reshardable format, and the plain optimizer's per-parameter state, load anywhere.
    for changed in ({"optimizer_format": "fully_reshardable"}, {"optimizer": "plain"}):
        (checkpoint.checkpoint_dir(tmp_path, 4) / checkpoint.RECORD_FILE).write_text(json.dumps({**record, **changed}))
        _check(tmp_path, TP2, distributed_optimizer=True)


def test_a_dp_sharded_optimizer_state_resumes_only_on_its_expert_layout(tmp_path):
    """The experts' optimizer state is sharded over the expert-data-parallel group, which ep and etp
    change; a layout without them (ParallelSettings.layout at ep = etp = 1) means 1 of each."""
    record = {"megatron_core": checkpoint.megatron_core_version(), "optimizer": "distributed",
              "optimizer_format": "dp_reshardable"}
    ep2 = {**DP2, "ep": 2, "etp": 1}
    _distributed_checkpoint(tmp_path, 4, record=record, layout=ep2)
    _check(tmp_path, ep2, distributed_optimizer=True)
    for other, changed in (({**DP2, "ep": 4, "etp": 1}, "ep"), (DP2, "ep"), ({**DP2, "ep": 2, "etp": 2}, "etp")):
        with pytest.raises(ValueError, match=f"not with another {changed}:"):
            _check(tmp_path, other, distributed_optimizer=True)
    (checkpoint.checkpoint_dir(tmp_path, 4) / checkpoint.LAYOUT_FILE).write_text(json.dumps(DP2))
    _check(tmp_path, {**DP2, "ep": 1, "etp": 1}, distributed_optimizer=True)  # ep = etp = 1 spelled out


def test_the_asynchronous_writer_is_megatrons_own_on_every_version():
    """0.17+ default to async_strategy="nvrx" (nvidia-resiliency-ext); 0.16 has no such argument."""
    from megatron.core import dist_checkpointing

    def save_017(state, directory, strategy=None, async_sharded_save=False, content_metadata=None,
                 async_strategy="nvrx"):
        ...

    def save_016(state, directory, strategy=None, async_sharded_save=False, content_metadata=None):
        ...

    assert checkpoint.async_options(save_017) == {"async_strategy": "mcore"}
    assert checkpoint.async_options(save_016) == {}
    takes_it = "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
    assert checkpoint.async_options(dist_checkpointing.save) == ({"async_strategy": "mcore"} if takes_it else {})
