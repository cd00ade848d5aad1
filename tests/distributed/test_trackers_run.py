"""A real run logging to every tracker, stopped by exit_interval and resumed: TensorBoard's events,
wandb's offline run files and MLflow's file store hold the steps and values of metrics.jsonl, and the
resumed launch continues the same wandb and MLflow runs.

The run is the session's `one_process_run` (tests/distributed/conftest.py: tiny_cpu on one process,
3 steps, stopped after step 2 and resumed, wandb offline, MLflow's file store in the run directory),
which test_dumps.py reads too."""
import json
import subprocess
import sys

import pytest

from tests.runs import read_metrics

pytestmark = [pytest.mark.distributed]


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


def test_trackers_log_what_metrics_jsonl_holds_and_a_resume_continues_their_runs(one_process_run, monkeypatch):
    for module in ("wandb", "mlflow", "tensorboard"):
        pytest.importorskip(module)
    from mlflow.tracking import MlflowClient

    from megatron_rlcorr.rl.trackers import mlflow_name

    monkeypatch.setenv("WANDB_MODE", "offline")  # here for `wandb leet inspect` (the run had it: conftest.py)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = one_process_run
    steps, exit_interval = run.steps, run.exit_interval
    first, resumed, run_dir = run.first, run.resumed, run.run_dir
    assert run.loggers == ["console", "tensorboard", "wandb", "mlflow"]
    assert [r["step"] for r in first] == list(range(1, exit_interval + 1))
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    expected = _jsonl_history(run_dir)
    ids = json.loads((run_dir / "trackers.json").read_text())

    # wandb offline: one offline-run directory per launch, both with the run id of trackers.json.
    launches = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(launches) == 2 and all(d.name.endswith("-" + ids["wandb"]["id"]) for d in launches)
    wandb_history, configs = {}, []
    for i, directory in enumerate(launches):
        wandb_run, config, history = _wandb_history(next(directory.glob("*.wandb")))
        assert wandb_run["run_id"] == ids["wandb"]["id"] and wandb_run["project"] == "rlcorr-test"
        assert wandb_run["display_name"] == "trk-exp" and bool(wandb_run.get("resume")) == (i == 1)
        configs.append(config)
        wandb_history.update(history)
    assert wandb_history.keys() == expected.keys()
    for step, values in expected.items():
        assert wandb_history[step] == pytest.approx(values, rel=1e-12, abs=0), step
    assert all(c["trainer"]["steps"] == steps and c["rollout"]["n"] == 4 for c in configs)

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
    assert params["trainer.steps"] == str(steps) and params["rollout.n"] == "4"
    assert json.loads(params["trainer.logger"]) == ["console", "tensorboard", "wandb", "mlflow"]

    # TensorBoard (float32 scalars): the same steps and values.
    tb = _tensorboard_history(run_dir / "tensorboard")
    assert tb.keys() == expected.keys()
    for step, values in expected.items():
        assert tb[step] == pytest.approx(values, rel=1e-6, abs=1e-30), step
