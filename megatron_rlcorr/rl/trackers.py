"""Experiment trackers of `trainer.logger`: TensorBoard, Weights & Biases and MLflow behind one interface.

What: every tracker gets `log(step, values)` with the same flat {name: float} record that
`runs/<name>/metrics.jsonl` receives (validation included), `log_config(config)` once when it opens
(the resolved recipe), and `close(failed)`. Only rank 0 opens trackers (`MetricsLogger`); as it
opens each, it prints one line saying where the tracker writes (`location()`: TensorBoard's log
directory; wandb's run id, mode and run directory, with the URL online or the `wandb sync` command
offline; MLflow's run id, experiment and tracking URI).

Why this shape: the loop converts its metrics to floats once per step (progress.py) and hands the
same dict to each tracker, so a tracker shows exactly the numbers of metrics.jsonl at the same steps.

Where each writes:
- tensorboard: `runs/<name>/tensorboard` (torch's SummaryWriter; needs the `tensorboard` package,
  skipped with a note when it is missing because it is in the default `trainer.logger`).
- wandb: project `trainer.project_name`, run name `trainer.experiment_name`, files under
  `runs/<name>/wandb`. It honours WANDB_MODE: `offline` needs no network or account and writes
  `runs/<name>/wandb/offline-run-*/run-<id>.wandb` (`wandb sync` uploads it later; `wandb leet
  inspect --json FILE` prints its records).
- mlflow: experiment `trainer.project_name`, run name `trainer.experiment_name`, at
  MLFLOW_TRACKING_URI when set (a server, or `sqlite:///...`, which needs the full `mlflow` package),
  else a file store at `runs/<name>/mlruns` (`mlflow ui --backend-store-uri runs/<name>/mlruns`).
  MLflow 3 keeps its file store in maintenance mode behind MLFLOW_ALLOW_FILE_STORE=true, which this
  module sets for that default only; the file store needs neither a server nor SQLAlchemy, so
  `mlflow-skinny` is enough.

Names: MLflow accepts metric and param names made of letters, digits, `_ - . / :` and spaces, no
empty, `.` or `..` path segment and at most 250 characters. `mlflow_name` maps the rest, the same
way on every machine: `@` -> `_at_` (verl's mapping: `mean@4` -> `mean_at_4`), any other refused
character (`:` included, which MLflow refuses on Windows) -> `_`, empty segments dropped (`a//b` ->
`a/b`), a segment of dots -> as many `_`, and a name still over 250 characters -> its first 241 and
`-` + 8 hex digits of its SHA-1. Two names that map to one get the later one's SHA-1 suffix too
(with a note). TensorBoard and wandb take every name this trainer logs unchanged.

Config: wandb gets the recipe tree as the run's config; MLflow gets it flattened to params
(`trainer.steps`, lists as JSON; values over MLflow's 6000 characters are cut with a note in the
value), 100 per batch (MLflow's limit); TensorBoard gets it as a text summary at step 0.

Resume: `runs/<name>/trackers.json` keeps each tracker's run id. A run that resumes from a checkpoint
(resume_step > 0) reopens those runs (wandb `id=` with resume="allow", MLflow's run id, TensorBoard's
log dir) and logs the steps after the checkpoint; a run that starts at step 0 opens new tracker runs, and so
does an MLflow run that cannot be reopened (another tracking URI, a deleted run), with a note.
Steps logged after the last checkpoint before a crash are logged again by the resumed process, and
the trackers treat the repeats differently: metrics.jsonl drops the old records (progress.py);
TensorBoard hides them (purge_step = the first re-run step); MLflow keeps both values at that step
in the metric's history (the later timestamp is the resumed one); wandb online refuses steps below
the run's last step (wandb warns and keeps the crashed process's values until the resumed run
passes that step), while wandb offline writes a new offline-run directory per launch with the same
run id, the repeated steps in both. MLflow params cannot change: a resumed run whose recipe
differs (more steps, another exit_interval) records the new values as tags
`resume/step_<k>/<param>`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

# Trackers that need a package of their own: (module to import, the extra that installs it).
OPTIONAL_TRACKERS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
STATE_FILE = "trackers.json"

MLFLOW_MAX_NAME = 250
MLFLOW_MAX_PARAM_VALUE = 6000
MLFLOW_MAX_PARAMS_PER_BATCH = 100
MLFLOW_MAX_METRICS_PER_BATCH = 1000
_MLFLOW_REFUSED = re.compile(r"[^\w./\- ]")


class Tracker(Protocol):
    name: str

    def state(self) -> dict:
        """What a resumed run needs to reopen this tracker's run (saved in trackers.json)."""

    def location(self) -> str:
        """One line: where this tracker writes (printed once when it opens)."""

    def log_config(self, config: Mapping[str, Any], *, resume_step: int) -> None: ...

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self, failed: bool) -> None: ...


def check_installed(logger: Sequence[str]) -> None:
    """Refuse, at recipe load, a tracker whose package is not installed (with the install line)."""
    for tracker in logger:
        if tracker in OPTIONAL_TRACKERS:
            module, extra = OPTIONAL_TRACKERS[tracker]
            if importlib.util.find_spec(module) is None:
                raise ValueError(f"logger lists {tracker} but the {module} package is not installed: "
                                 f"pip install -e .[{extra}] (or drop {tracker} from trainer.logger)")


def open_trackers(names: Sequence[str], run_dir: Path, *, project: str, experiment: str,
                  config: Mapping[str, Any], resume_step: int) -> list[Tracker]:
    """Open the trackers named in trainer.logger (console is progress.py's), reopening a resumed run's."""
    previous = _read_state(run_dir) if resume_step else {}
    trackers: list[Tracker] = []
    for name in names:
        if name == "console":
            continue
        tracker = OPENERS[name].open(run_dir, project=project, experiment=experiment, resume_step=resume_step,
                                     previous=previous.get(name))
        if tracker is None:
            continue
        tracker.log_config(config, resume_step=resume_step)
        print(tracker.location(), flush=True)
        trackers.append(tracker)
    # A resumed run keeps the ids of trackers it does not use this time (a later launch may again).
    _write_state(run_dir, {**previous, **{t.name: t.state() for t in trackers}})
    return trackers


def _read_state(run_dir: Path) -> dict:
    path = run_dir / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _write_state(run_dir: Path, state: dict) -> None:
    path = run_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)


# ---- names and params -------------------------------------------------------------------------


def mlflow_name(name: str) -> str:
    """A metric or param name MLflow accepts, the same on every machine (module docstring)."""
    mapped = _MLFLOW_REFUSED.sub("_", name.replace("@", "_at_"))
    segments = [("_" * len(s) if set(s) == {"."} else s) for s in mapped.split("/") if s]
    mapped = "/".join(segments) or "_"
    if len(mapped) > MLFLOW_MAX_NAME:
        mapped = mapped[:MLFLOW_MAX_NAME - 9] + "-" + _digest(name)
    return mapped


def _digest(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:8]


class NameMap:
    """Memoised `mlflow_name`; a second name mapping to a taken one gets its SHA-1 suffix."""

    def __init__(self) -> None:
        self.mapped: dict[str, str] = {}
        self.owner: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        out = self.mapped.get(name)
        if out is not None:
            return out
        out = mlflow_name(name)
        if out in self.owner:
            unique = out[:MLFLOW_MAX_NAME - 9] + "-" + _digest(name)
            print(f"mlflow: metric {name!r} and {self.owner[out]!r} both map to {out!r}; logging {name!r} "
                  f"as {unique!r}", file=sys.stderr, flush=True)
            out = unique
        self.mapped[name], self.owner[out] = out, name
        return out


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"trainer": {"steps": 3}} -> {"trainer.steps": "3"}: MLflow params (strings, lists as JSON).

    Values longer than MLflow's limit are cut, and say so."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, name + "."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > MLFLOW_MAX_PARAM_VALUE:
            marker = f"... [cut: {len(text)} characters]"
            text = text[:MLFLOW_MAX_PARAM_VALUE - len(marker)] + marker
        flat[name] = text
    return flat


def _batches(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


# ---- the trackers -----------------------------------------------------------------------------


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, writer, log_dir: Path) -> None:
        self.writer, self.log_dir = writer, log_dir

    @classmethod
    def open(cls, run_dir: Path, *, project: str, experiment: str, resume_step: int,
             previous: dict | None) -> TensorBoardTracker | None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("trainer.logger: tensorboard is not installed, so no TensorBoard events are written "
                  "(pip install -e .[tensorboard])", flush=True)
            return None
        log_dir = run_dir / "tensorboard"
        # purge_step: TensorBoard hides the events of steps >= it written before (a crashed attempt's).
        writer = SummaryWriter(str(log_dir), purge_step=resume_step + 1 if resume_step else None)
        return cls(writer, log_dir)

    def state(self) -> dict:
        return {"log_dir": str(self.log_dir)}

    def location(self) -> str:
        return f"tensorboard: events in {self.log_dir} (`tensorboard --logdir {self.log_dir}` shows them)"

    def log_config(self, config: Mapping[str, Any], *, resume_step: int) -> None:
        if not resume_step:
            self.writer.add_text("recipe", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, run) -> None:
        self.run = run

    @classmethod
    def open(cls, run_dir: Path, *, project: str, experiment: str, resume_step: int,
             previous: dict | None) -> WandbTracker:
        import wandb

        run_id = previous.get("id") if previous else None
        # dir=run_dir: wandb writes <dir>/wandb/; resume="allow" continues run_id or creates it.
        run = wandb.init(project=project, name=experiment, dir=str(run_dir), id=run_id,
                         resume="allow" if run_id else None)
        return cls(run)

    def state(self) -> dict:
        return {"id": self.run.id, "project": self.run.project, "name": self.run.name}

    def location(self) -> str:
        mode, run_dir = self.run.settings.mode, self.run.settings.sync_dir
        line = f"wandb: run {self.run.id} ({self.run.name}) of project {self.run.project}, mode {mode}, in {run_dir}"
        if mode == "offline":
            return f"{line} (`wandb sync {run_dir}` uploads it)"
        return f"{line}, {self.run.url}" if self.run.url else line

    def log_config(self, config: Mapping[str, Any], *, resume_step: int) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    name = "mlflow"

    def __init__(self, client, run_id: str, tracking_uri: str) -> None:
        self.client, self.run_id, self.tracking_uri = client, run_id, tracking_uri
        self.names = NameMap()

    @classmethod
    def open(cls, run_dir: Path, *, project: str, experiment: str, resume_step: int,
             previous: dict | None) -> MlflowTracker:
        tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not tracking_uri:
            tracking_uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3's file store refuses to open without this opt-in (maintenance mode).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        if previous and previous.get("tracking_uri") == tracking_uri:
            try:
                client.update_run(previous["run_id"], status="RUNNING")
                return cls(client, previous["run_id"], tracking_uri)
            except MlflowException as err:
                print(f"mlflow: cannot reopen run {previous['run_id']} at {tracking_uri} ({err.message}): the "
                      "resumed run logs to a new MLflow run", flush=True)
        elif previous:
            print(f"mlflow: run {previous.get('run_id')} was logged to {previous.get('tracking_uri')}, not "
                  f"{tracking_uri}: the resumed run logs to a new MLflow run", flush=True)
        found = client.get_experiment_by_name(project)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(project)
        run = client.create_run(experiment_id, run_name=experiment)
        return cls(client, run.info.run_id, tracking_uri)

    def state(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": self.tracking_uri}

    def location(self) -> str:
        run = self.client.get_run(self.run_id)
        experiment = self.client.get_experiment(run.info.experiment_id).name
        line = f"mlflow: run {self.run_id} ({run.info.run_name}) of experiment {experiment} at {self.tracking_uri}"
        if self.tracking_uri.startswith("file:"):
            line += f" (`mlflow ui --backend-store-uri {self.tracking_uri}` shows it)"
        return line

    def log_config(self, config: Mapping[str, Any], *, resume_step: int) -> None:
        from mlflow.entities import Param, RunTag

        logged = self.client.get_run(self.run_id).data.params if resume_step else {}
        params, tags = [], []
        for key, value in flatten_config(config).items():
            key = mlflow_name(key)
            if key not in logged:
                params.append(Param(key, value))
            elif logged[key] != value:
                tags.append(RunTag(mlflow_name(f"resume/step_{resume_step}/{key}"), value))
        for batch in _batches(params, MLFLOW_MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=batch)
        for batch in _batches(tags, MLFLOW_MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=batch)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(self.names(k), v, now, step) for k, v in values.items()]
        for batch in _batches(metrics, MLFLOW_MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


OPENERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
