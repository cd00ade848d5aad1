"""trainer.logger's trackers (rl/trackers.py): MLflow's name mapping and params, the refusal of a
tracker whose package is missing, the console switch, an MLflow run that a resume reopens, and the
line each tracker prints when it opens (where it writes)."""
import importlib.util
import json
import os

import pytest

from megatron_rlcorr.recipe import load_recipe
from megatron_rlcorr.rl.progress import MetricsLogger
from megatron_rlcorr.rl.settings import TrainerSettings
from megatron_rlcorr.rl.trackers import (MLFLOW_MAX_NAME, MLFLOW_MAX_PARAM_VALUE, NameMap, flatten_config,
                                         mlflow_name, open_trackers)

from tests.unit.test_docs import ROOT

TINY = ROOT / "recipes" / "tiny_cpu.yaml"

# Names this trainer logs or may log (validation's per-source names carry the data source).
NAMES = ["loss", "val-core/openai/gsm8k/acc/mean@4", "val-core/math_dapo/acc/best@2/std", "val-aux/x/pass@8",
         "rollout_corr/k3_kl", "val-core/a+b (v2)/acc/maj@4/mean", "val-core//acc/mean@1", "val-core/../acc",
         "val-core/./x/", "val-core/aime:2024/acc/mean@1", "val-core/é/acc", "/lead", "x" * 300, "@", ""]


@pytest.mark.parametrize("name", NAMES)
def test_mapped_names_are_ones_mlflow_accepts(name):
    validation = pytest.importorskip("mlflow.utils.validation")
    mapped = mlflow_name(name)
    validation._validate_metric_name(mapped)  # raises MlflowException on a refused name
    validation._validate_param_name(mapped)
    assert len(mapped) <= MLFLOW_MAX_NAME
    assert mlflow_name(name) == mapped  # deterministic
    assert "@" not in mapped and ":" not in mapped  # refused on Windows: mapped everywhere alike


def test_the_mapping_is_verls_for_at_and_leaves_accepted_names_alone():
    assert mlflow_name("val-core/openai/gsm8k/acc/mean@4") == "val-core/openai/gsm8k/acc/mean_at_4"
    assert mlflow_name("val-aux/x/pass@8") == "val-aux/x/pass_at_8"
    for name in ("loss", "rollout_corr/k3_kl", "actor/pg_loss", "throughput/gen_tokens_per_s", "data/epoch"):
        assert mlflow_name(name) == name
    assert mlflow_name("val-core//acc/mean@1") == "val-core/acc/mean_at_1"
    assert mlflow_name("val-core/../acc") == "val-core/__/acc"
    assert mlflow_name("val-core/a+b (v2)/acc") == "val-core/a_b _v2_/acc"
    long_a, long_b = "x" * 300, "x" * 299 + "y"
    assert mlflow_name(long_a) != mlflow_name(long_b) and len(mlflow_name(long_a)) == MLFLOW_MAX_NAME


def test_names_that_map_alike_stay_apart(capsys):
    names = NameMap()
    first, second = names("acc/mean@4"), names("acc/mean_at_4")
    assert first == "acc/mean_at_4" and second != first and second.startswith("acc/mean_at_4-")
    assert names("acc/mean_at_4") == second and names("acc/mean@4") == first  # memoised
    assert "both map to" in capsys.readouterr().err


def test_config_is_flattened_to_params_within_mlflows_limits():
    config = {"name": "r", "trainer": {"steps": 3, "logger": ["console", "mlflow"], "experiment_name": None},
              "rollout": {"val_kwargs": {"n": 4, "do_sample": False}, "extra": {}},
              "data": {"files": ["f" * 5000, "g" * 5000]}}
    flat = flatten_config(config)
    assert flat["name"] == "r" and flat["trainer.steps"] == "3"
    assert json.loads(flat["trainer.logger"]) == ["console", "mlflow"]
    assert flat["trainer.experiment_name"] == "null" and flat["rollout.extra"] == "{}"
    assert flat["rollout.val_kwargs.n"] == "4" and flat["rollout.val_kwargs.do_sample"] == "false"
    cut = flat["data.files"]
    full = json.dumps(["f" * 5000, "g" * 5000])
    assert len(cut) == MLFLOW_MAX_PARAM_VALUE and cut.endswith(f"[cut: {len(full)} characters]")
    assert cut.startswith(full[:MLFLOW_MAX_PARAM_VALUE - 100])
    assert set(flat) == {"name", "trainer.steps", "trainer.logger", "trainer.experiment_name", "rollout.extra",
                         "rollout.val_kwargs.n", "rollout.val_kwargs.do_sample", "data.files"}


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_without_its_package_is_refused_at_launch_not_by_plan(monkeypatch, tracker):
    """`train` checks the launch (check_layout here) before any process starts; `plan` (here=False)
    sizes a cluster from a laptop without the tracker's package and must not refuse."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else real(name, *a))
    recipe = load_recipe(TINY, [f"trainer.logger=[console,{tracker}]"])
    with pytest.raises(ValueError, match=rf"trainer: logger lists {tracker} but the {tracker} package is not "
                                         rf"installed: pip install -e \.\[{tracker}\]"):
        recipe.check_layout(1)
    assert recipe.check_layout(1, here=False) == 1
    assert TrainerSettings(logger=("console", "tensorboard")).logger == ("console", "tensorboard")


def test_installed_trackers_are_accepted():
    for module in ("wandb", "mlflow"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e .[dev])")
    recipe = load_recipe(TINY, ["trainer.logger=[console,tensorboard,wandb,mlflow]"])
    assert recipe.trainer.logger == ("console", "tensorboard", "wandb", "mlflow")


def test_the_console_line_only_with_console(tmp_path, capsys):
    for trackers, printed in ((["console"], True), ([], False)):
        logger = MetricsLogger(tmp_path / str(printed), 2, True, trackers=trackers)
        logger.log(1, {"loss": 0.5})
        logger.close()
        assert ("step 1/2 loss=0.5" in capsys.readouterr().out) is printed
        assert json.loads((tmp_path / str(printed) / "metrics.jsonl").read_text())["loss"] == 0.5


def test_a_resumed_mlflow_run_continues_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = {"trainer": {"steps": 3, "exit_interval": 2}, "name": "r"}
    kwargs = dict(trackers=["mlflow"], project="proj", experiment="exp")
    first = MetricsLogger(tmp_path, 3, True, config=config, **kwargs)
    for step in (1, 2):
        first.log(step, {"val-core/s/acc/mean@2": step / 4, "loss": float(step)})
    first.close()
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"]

    changed = {"trainer": {"steps": 4, "exit_interval": 2}, "name": "r"}
    resumed = MetricsLogger(tmp_path, 4, True, config=changed, resume_step=2, **kwargs)
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"] == run_id
    resumed.log(3, {"val-core/s/acc/mean@2": 0.75, "loss": 3.0})
    resumed.close()

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id] and runs[0].info.run_name == "exp"
    history = client.get_metric_history(run_id, "val-core/s/acc/mean_at_2")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    data = client.get_run(run_id).data
    assert data.params == {"trainer.steps": "3", "trainer.exit_interval": "2", "name": "r"}
    assert data.tags["resume/step_2/trainer.steps"] == "4" and runs[0].info.status == "FINISHED"


def test_a_failed_step_marks_the_mlflow_run_failed(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = MetricsLogger(tmp_path, 3, True, trackers=["mlflow"], project="proj", experiment="exp")
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("a step failed")
        finally:
            logger.close()
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"]
    assert MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri()).get_run(run_id).info.status == "FAILED"


def test_a_resume_whose_mlflow_run_is_gone_logs_to_a_new_run_and_says_so(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = (tmp_path / "mlruns").resolve().as_uri()
    (tmp_path / "trackers.json").write_text(json.dumps({"mlflow": {"run_id": "0123abcd", "tracking_uri": uri}}))
    logger = MetricsLogger(tmp_path, 3, True, trackers=["mlflow"], project="proj", experiment="exp", resume_step=2)
    logger.close()
    assert "cannot reopen run 0123abcd" in capsys.readouterr().out
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"] != "0123abcd"


def test_the_console_line_shows_a_validations_headline(tmp_path):
    logger = MetricsLogger(tmp_path, 150, False, trackers=["console"])
    line = logger.console_line(0, {"val-core/math_dapo/acc/mean@8": 0.2625, "val-core/math_dapo/acc/pass@8": 0.85,
                                   "val-core/math_dapo/acc/best@8/mean": 0.74, "val-aux/math_dapo/reward/mean@8": -0.4,
                                   "timing/val_s": 1.5})
    assert line.endswith("step 0/150 math_dapo/acc/mean@8=0.2625 math_dapo/acc/pass@8=0.85")


def _restore_environ(before: dict) -> None:
    """wandb and MLflow set process-wide variables (wandb's service, MLflow's file-store opt-in)."""
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)


def test_each_tracker_says_once_where_it_writes(tmp_path, monkeypatch, capsys):
    """open_trackers prints one line per tracker: TensorBoard's log directory, wandb's run id, mode and
    run directory (offline here, with the command that uploads it), MLflow's run id, experiment and
    tracking URI (the file store in the run directory when MLFLOW_TRACKING_URI is unset)."""
    for module in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(module)
    import wandb

    before = dict(os.environ)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        trackers = open_trackers(["console", "tensorboard", "wandb", "mlflow"], tmp_path, project="proj",
                                 experiment="exp", config={"name": "r"}, resume_step=0)
        printed = capsys.readouterr().out.splitlines()
        for tracker in trackers:
            tracker.close(False)
    finally:
        wandb.teardown()
        _restore_environ(before)
    state = json.loads((tmp_path / "trackers.json").read_text())
    wandb_id, mlflow_id = state["wandb"]["id"], state["mlflow"]["run_id"]
    (wandb_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert (wandb_dir / f"run-{wandb_id}.wandb").is_file()
    uri = (tmp_path / "mlruns").resolve().as_uri()
    assert printed == [
        f"tensorboard: events in {tmp_path / 'tensorboard'} (`tensorboard --logdir {tmp_path / 'tensorboard'}` "
        "shows them)",
        f"wandb: run {wandb_id} (exp) of project proj, mode offline, in {wandb_dir} (`wandb sync {wandb_dir}` "
        "uploads it)",
        f"mlflow: run {mlflow_id} (exp) of experiment proj at {uri} (`mlflow ui --backend-store-uri {uri}` shows it)",
    ]


def test_mlflow_says_the_tracking_uri_it_was_given(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    uri = (tmp_path / "elsewhere").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store named in the URI needs it from the user
    (tmp_path / "run").mkdir()
    (tracker,) = open_trackers(["mlflow"], tmp_path / "run", project="proj", experiment="exp", config={},
                               resume_step=0)
    tracker.close(False)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"mlflow: run {tracker.run_id} (exp) of experiment proj at {uri} ")
    assert not (tmp_path / "run" / "mlruns").exists()


def test_only_the_writing_rank_opens_and_announces_trackers(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    MetricsLogger(tmp_path / "other_rank", 3, False, trackers=["console", "tensorboard"]).close()
    assert capsys.readouterr().out == "" and not (tmp_path / "other_rank").exists()
    MetricsLogger(tmp_path / "rank0", 3, True, trackers=["console", "tensorboard"]).close()
    assert capsys.readouterr().out.splitlines() == [
        f"tensorboard: events in {tmp_path / 'rank0' / 'tensorboard'} "
        f"(`tensorboard --logdir {tmp_path / 'rank0' / 'tensorboard'}` shows them)"]
