"""A real run logging to every tracker, stopped by exit_interval and resumed: TensorBoard's events,
wandb's offline run files and MLflow's file store hold the steps and values of metrics.jsonl, and the
resumed launch continues the same wandb and MLflow runs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import run_distributed
from tests.runs import read_metrics, train_runs

pytestmark = [pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
STEPS, EXIT = 3, 2


def _jsonl_history(run_dir):
    """{step: {name: value}} of metrics.jsonl (records of one step merged, as the trackers show them)."""
    history = {}
    for record in read_metrics(run_dir):
        history.setdefault(record["step"], {}).update({k: v for k, v in record.items() if k not in ("step", "time")})
    return history


def _wandb_history(wandb_file):
    """The history records of an offline run's .wandb file, read by wandb's own reader (`wandb leet inspect`)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_file)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    run = next(r["run"] for r in records if r["type"] == "run")
    config = {}
    for r in records:
        if r["type"] in ("run", "config"):
            config.update(r[r["type"]].get("config", r[r["type"]]).get("update", {}))
    history = {}
    for r in records:
        if r["type"] == "history":  # wandb's own keys (_step, _runtime, _timestamp) start with "_"
            item = r["history"]["item"]
            history[int(r["history"]["step"]["num"])] = {k: v for k, v in item.items() if not k.startswith("_")}
    return run, config, history


def _tensorboard_history(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    history = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            history.setdefault(event.step, {})[tag] = event.value
    return history


def test_trackers_log_what_metrics_jsonl_holds_and_a_resume_continues_their_runs(tmp_path, monkeypatch):
    for module in ("wandb", "mlflow", "tensorboard"):
        pytest.importorskip(module)
    from mlflow.tracking import MlflowClient

    from megatron_rlcorr.rl.trackers import mlflow_name

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    launch = (TINY, ["name=trk", f"trainer.output_dir={tmp_path}", f"trainer.steps={STEPS}",
                     f"trainer.exit_interval={EXIT}", "trainer.logger=[console,tensorboard,wandb,mlflow]",
                     "trainer.project_name=rlcorr-test", "trainer.experiment_name=trk-exp",
                     "data.prompts_per_step=2", "rollout.n=4", "trainer.micro_batch_size=8",
                     "algorithm.dynamic_sampling.enabled=false"])
    # New processes: wandb and MLflow keep process-wide state (a service thread, its socket in the
    # environment) that the session's pool would carry into later cases (tests/dist_pool.py).
    first, resumed = run_distributed(train_runs, 1, [launch, launch], fresh=True)[0]
    run_dir = tmp_path / "trk"
    assert [r["step"] for r in first] == list(range(1, EXIT + 1))
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    expected = _jsonl_history(run_dir)
    ids = json.loads((run_dir / "trackers.json").read_text())

    # wandb offline: one offline-run directory per launch, both with the run id of trackers.json.
    launches = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(launches) == 2 and all(d.name.endswith("-" + ids["wandb"]["id"]) for d in launches)
    wandb_history, configs = {}, []
    for i, directory in enumerate(launches):
        run, config, history = _wandb_history(next(directory.glob("*.wandb")))
        assert run["run_id"] == ids["wandb"]["id"] and run["project"] == "rlcorr-test"
        assert run["display_name"] == "trk-exp" and bool(run.get("resume")) == (i == 1)
        configs.append(config)
        wandb_history.update(history)
    assert wandb_history.keys() == expected.keys()
    for step, values in expected.items():
        assert wandb_history[step] == pytest.approx(values, rel=1e-12, abs=0), step
    assert all(c["trainer"]["steps"] == STEPS and c["rollout"]["n"] == 4 for c in configs)

    # MLflow's file store in the run directory: one run, the same steps and values under mapped names.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens a file store only with it
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("rlcorr-test")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]]
    assert runs[0].info.run_name == "trk-exp" and runs[0].info.status == "FINISHED"
    names = {name for values in expected.values() for name in values}
    for name in names:
        history = client.get_metric_history(ids["mlflow"]["run_id"], mlflow_name(name))
        assert [(m.step, m.value) for m in history] == [(s, v[name]) for s, v in expected.items() if name in v], name
    params = runs[0].data.params
    assert params["trainer.steps"] == str(STEPS) and params["rollout.n"] == "4"
    assert json.loads(params["trainer.logger"]) == ["console", "tensorboard", "wandb", "mlflow"]

    # TensorBoard (float32 scalars): the same steps and values.
    tb = _tensorboard_history(run_dir / "tensorboard")
    assert tb.keys() == expected.keys()
    for step, values in expected.items():
        assert tb[step] == pytest.approx(values, rel=1e-6, abs=1e-30), step
