"""Ablation of the rollout correction: one recipe, several corrections, several seeds.

    python tools/ablate.py --recipe recipes/tiny_hf_cpu.yaml --lag 3 --seeds 1 2 3 \\
        --settings none token_is seq_is_rs dapo --steps 150 --out docs/ablation [--nproc 2] [key=value ...]

Why: the correction matters only when rollouts and trainer disagree. `--lag K` sets
rollout.policy_lag (the embedded engine samples with the weights of K steps ago: the mismatch of
asynchronous RL, far larger than bf16-vs-fp32 rounding), so the settings can be compared on a
mismatch that is there, and the table says how large it was.

Each (setting, seed) is one training run through the normal entry point
(`python -m torch.distributed.run ... -m megatron_rlcorr.train`), with the overrides
algorithm.rollout_correction=<the setting's block>, rollout.policy_lag=K, trainer.seed=<seed>,
trainer.steps, trainer.output_dir=OUT/runs/<setting>_s<seed>, trainer.save_hf=false,
trainer.save_every=0, trainer.resume=false (after the user's key=value overrides, which may not set
these). Every run is validated before the first starts. Settings:
  none       the disabled preset (metrics only: PPO against the recomputed pi_old, no IS, no RS)
  token_is   decoupled_token_is          seq_is_rs  decoupled_seq_is_rs
  dapo       the recipe's own algorithm.rollout_correction block
  <preset>   any name of megatron_rlcorr.config.PRESETS
  --define NAME BASE FIELD=VALUE ...   your own: BASE's block with these fields changed, e.g.
             --define dapo_wide dapo rollout_rs_threshold_lower=0.31 rollout_rs_threshold=1.28

MoE recipes: `--routing-replay both` runs every setting twice, as <setting> (rollout.routing_replay
false: the trainer routes freely) and <setting>_r3 (true: rollout routing replay), `on` only the
latter; the table then has the routing mismatch column (moe/routing_mismatch_fraction: the share
of response tokens whose experts differ between the engine and the trainer's free routing, per
MoE layer). Default `off` leaves rollout.routing_replay to the recipe.

Outputs in OUT: ablation.md (the table; ablation_brief.md its main columns), ablation.json (the
summaries and every run's curves), ablation_<setting>.png (reward and KL per step, each seed thin,
the seeds' mean thick) and ablation.png (the settings' mean reward and KL curves side by side).
`--report-only` rebuilds them from the runs already in OUT; `--skip-done` keeps runs whose metrics
are complete; `--reference DIR` adds another ablation's settings (its ablation.json, e.g. the same
recipe at lag 0) to the table and, dashed, to ablation.png.

Conventions: "reward" is `reward_mean` (`--reward-key`), the round-0 samples' mean score. Final =
the mean of the last 10 steps (`--window`); AUC = the mean over all steps; both are averaged over
seeds (± the sample std over seeds). A grad-norm spike is a step whose grad norm exceeds 3x the
median of the previous 20 steps (at least 5 of them); steps with grad norm 0 (nothing trained:
every token rejected, or a batch of dynamic-sampling fillers only) neither count nor judge, and are
counted apart as "no-update steps"; both counts are averaged over seeds. A seed is "stuck" when no
step updated the policy from some step to the end, for at least the final window (a GRPO run whose
groups all score alike, e.g. all wrong, has no advantage left to learn from). The mismatch columns
average over the steps that had a training batch (batch/valid_response_tokens > 0) and over seeds:
k3 KL(rollout || trainer), |log ppl diff| (per-sequence |mean token log-ratio|) and chi2_seq
(E[w^2] - 1 of the untruncated sequence IS weights: their spread; effective sample size = 1 / (1 +
chi2)); "RS masked" is the share of tokens rejection sampling removed. With `trainer.dump_every=1`
among the overrides, "rejected: right / wrong answers" splits the rejections of a setting with RS
or a veto by the answer's reward (rejection_by_answer): under policy lag the split shows whether
rejection removes the samples that carry the learning signal.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_rlcorr.config import (
    PRESETS,
    RolloutCorrectionConfig,
    did_you_mean,
    preset,
)

NAMED = {"none": "disabled", "token_is": "decoupled_token_is", "seq_is_rs": "decoupled_seq_is_rs"}
SETTINGS = (*NAMED, "dapo", *PRESETS)
CONTROLLED = ("algorithm.rollout_correction", "rollout.policy_lag", "trainer.seed", "trainer.steps",
              "trainer.output_dir", "trainer.save_hf", "trainer.save_every", "trainer.resume", "rollout.routing_replay")
REPLAY_SUFFIX = "_r3"  # a setting run with rollout.routing_replay: true (--routing-replay)
ROUTING = ("routing mismatch", "moe/routing_mismatch_fraction")
KL, GRAD = "rollout_corr/k3_kl", "grad_norm"
MISMATCH = (("k3 KL", KL), ("abs log ppl diff", "rollout_corr/log_ppl_abs_diff"),
            ("chi2_seq", "rollout_corr/chi2_seq"), ("RS masked", "rollout_corr/rollout_rs_masked_fraction"), ROUTING)
SPIKE_FACTOR, SPIKE_WINDOW, SPIKE_MIN_HISTORY = 3.0, 20, 5
NO_REJECTION = {"rejected_right": math.nan, "rejected_wrong": math.nan}
UNSHOWN_OVERRIDES = ("trainer.logger=", "trainer.tensorboard=", "trainer.dump_every=")  # not in the figure title (tensorboard=: runs recorded before trainer.logger)


@dataclass(frozen=True)
class Run:
    setting: str
    seed: int
    overrides: tuple[str, ...]
    out_dir: Path      # trainer.output_dir of the run; its log is out_dir / "train.log"
    metrics: Path      # <out_dir>/<recipe name>/metrics.jsonl
    steps: int         # trainer.steps of the run

    @property
    def label(self) -> str:
        return f"{self.setting}_s{self.seed}"


# ---- arguments and the plan of runs -------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options, the --define groups, and the key=value overrides wherever they stand (after
    --settings or --seeds, whose lists would otherwise swallow them)."""
    argv, defines = _take_defines(list(sys.argv[1:] if argv is None else argv))
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", required=True, help="the recipe YAML every run starts from")
    p.add_argument("--lag", type=int, default=0, help="rollout.policy_lag of every run (default 0)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--settings", nargs="+", default=["none", "token_is", "seq_is_rs", "dapo"],
                   help=f"any of: {', '.join(SETTINGS)}")
    p.add_argument("--steps", type=int, default=None, help="trainer.steps (default: the recipe's)")
    p.add_argument("--out", required=True, help="output folder (runs/, table, figures)")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")
    p.add_argument("--reward-key", default="reward_mean", help="the metric plotted and tabled as reward")
    p.add_argument("--window", type=int, default=10, help="last steps averaged into the final reward")
    p.add_argument("--report-only", action="store_true", help="no training: rebuild the report from OUT/runs")
    p.add_argument("--skip-done", action="store_true", help="keep runs whose metrics have every step")
    p.add_argument("--reference", default=None, help="another ablation's folder, shown beside this one")
    p.add_argument("--routing-replay", choices=("off", "on", "both"), default="off",
                   help="MoE recipes: run each setting with rollout routing replay (on), with and without it "
                        "(both: <setting> and <setting>_r3), or leave it to the recipe (off, the default)")
    p.add_argument("--define", metavar="NAME BASE [FIELD=VALUE ...]",
                   help="a setting of your own: setting BASE with these algorithm.rollout_correction fields "
                        "changed, run as NAME (repeatable; NAME joins --settings)")
    args = p.parse_args([a for a in argv if a not in overrides])
    args.overrides = overrides  # recipe overrides (section.key=value) for every run
    args.defines = defines      # {NAME: (BASE, {field: value})}
    args.settings = [*args.settings, *(name for name in defines if name not in args.settings)]
    args.corrections = list(args.settings)  # the correction settings, before --routing-replay names the runs
    if args.routing_replay != "off":
        replayed = [s + REPLAY_SUFFIX for s in args.settings]
        args.settings = [x for pair in zip(args.settings, replayed) for x in pair] \
            if args.routing_replay == "both" else replayed
    return args


def correction_of(setting: str) -> str:
    """The correction setting a run setting trains with (<setting>_r3: <setting>, with routing replay)."""
    return setting.removesuffix(REPLAY_SUFFIX)


def _usage_error(message: str) -> None:
    print(f"ablate.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _take_defines(argv: list[str]) -> tuple[list[str], dict[str, tuple[str, dict[str, Any]]]]:
    """argv without its `--define NAME BASE [FIELD=VALUE ...]` groups, and the groups (a group
    ends at the next option)."""
    import yaml

    rest, defines, i = [], {}, 0
    while i < len(argv):
        if argv[i] != "--define":
            rest.append(argv[i])
            i += 1
            continue
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        group = argv[i + 1:j]
        if len(group) < 2 or any("=" in word for word in group[:2]):
            _usage_error(f"--define needs NAME BASE [FIELD=VALUE ...], got {group}")
        if group[0] in defines:
            _usage_error(f"--define {group[0]} is given twice")
        fields = {}
        for word in group[2:]:
            if "=" not in word:
                _usage_error(f"--define {group[0]}: {word!r} is not FIELD=VALUE")
            key, value = word.split("=", 1)
            fields[key] = yaml.safe_load(value)
        defines[group[0]] = (group[1], fields)
        i = j
    return rest, defines


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the argument and the fix."""
    if not Path(args.recipe).is_file():
        raise ValueError(f"--recipe {args.recipe}: no such file (e.g. recipes/tiny_hf_cpu.yaml)")
    for name, (base, _) in args.defines.items():
        if name in SETTINGS or not name.replace("_", "").isalnum() or name.endswith(REPLAY_SUFFIX):
            raise ValueError(f"--define {name}: the name must be new (not one of {', '.join(SETTINGS)}) and made "
                             f"of letters, digits and '_' (it names files), not ending in {REPLAY_SUFFIX} (which marks "
                             "runs with routing replay)")
        if base not in SETTINGS:
            raise ValueError(f"--define {name} {base}: unknown base setting{did_you_mean(base, SETTINGS)}; "
                             f"available: {', '.join(SETTINGS)}")
    known = (*SETTINGS, *args.defines)
    unknown = [s for s in args.corrections if s not in known]
    if unknown:
        raise ValueError(f"--settings: unknown setting {unknown[0]!r}{did_you_mean(unknown[0], known)}; "
                         f"available: {', '.join(known)} (or --define one)")
    for name, values in (("--settings", args.corrections), ("--seeds", args.seeds)):
        if len(set(values)) != len(values):
            raise ValueError(f"{name} lists a value twice: {values}")
    if args.lag < 0:
        raise ValueError(f"--lag must be >= 0 (rollout.policy_lag), got {args.lag}")
    for name in ("steps", "nproc", "window"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if args.reference and not (Path(args.reference) / "ablation.json").is_file():
        raise ValueError(f"--reference {args.reference}: no ablation.json there (the --out of an earlier run)")
    taken = [o for o in args.overrides if o.split("=", 1)[0] in CONTROLLED]
    if taken:
        raise ValueError(f"override {taken[0]!r}: ablate.py sets {taken[0].split('=', 1)[0]} itself; use "
                         "--settings, --lag, --seeds, --steps or --out instead")


def correction_block(setting: str, recipe: str | Path, overrides: Sequence[str],
                     defines: dict[str, tuple[str, dict[str, Any]]] | None = None) -> dict[str, Any]:
    """The algorithm.rollout_correction block a setting trains with."""
    setting = correction_of(setting)
    if defines and setting in defines:
        base, fields = defines[setting]
        block = {**correction_block(base, recipe, overrides), **fields}
        try:
            return RolloutCorrectionConfig.from_dict(block).to_dict()
        except ValueError as err:
            raise ValueError(f"--define {setting}: {err}") from None
    if setting == "dapo":
        from megatron_rlcorr.recipe.tree import read_tree

        block = (read_tree(Path(recipe), overrides).get("algorithm") or {}).get("rollout_correction")
        if not block:
            raise ValueError(f"--settings dapo uses the recipe's own algorithm.rollout_correction block, but "
                             f"{recipe} has none: drop dapo or give the recipe a block")
        return RolloutCorrectionConfig.from_dict(block).to_dict()
    return preset(NAMED.get(setting, setting)).to_dict()


def plan_runs(args: argparse.Namespace) -> list[Run]:
    """Every (setting, seed) run with its overrides, validated like the launcher validates."""
    from megatron_rlcorr.train import load_and_check

    out, runs = Path(args.out), []
    for setting in args.settings:
        block = json.dumps(correction_block(setting, args.recipe, args.overrides, args.defines))
        for seed in args.seeds:
            run_out = out / "runs" / f"{setting}_s{seed}"
            overrides = (*args.overrides, f"algorithm.rollout_correction={block}", f"rollout.policy_lag={args.lag}",
                         f"trainer.seed={seed}", f"trainer.output_dir={run_out}", "trainer.save_hf=false",
                         "trainer.save_every=0", "trainer.resume=false",
                         *([f"trainer.steps={args.steps}"] if args.steps else []),
                         *([f"rollout.routing_replay={str(setting.endswith(REPLAY_SUFFIX)).lower()}"]
                           if args.routing_replay != "off" else []))
            try:
                recipe = load_and_check(str(args.recipe), list(overrides), args.nproc)
            except ValueError as err:
                raise ValueError(f"setting {setting}, seed {seed}: {err}") from None
            runs.append(Run(setting, seed, overrides, run_out, recipe.run_dir / "metrics.jsonl",
                            recipe.trainer.steps))
    return runs


# ---- training -----------------------------------------------------------------------------------

def train(run: Run, recipe: str, nproc: int) -> float:
    """One run through the normal entry point; its output goes to <out_dir>/train.log. Seconds taken."""
    run.out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "megatron_rlcorr.train", "--config", str(recipe), *run.overrides]
    start = time.time()
    with (run.out_dir / "train.log").open("w") as log:
        log.write("+ " + " ".join(cmd) + "\n")
        log.flush()
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    if code != 0:
        tail = (run.out_dir / "train.log").read_text()[-3000:]
        raise RuntimeError(f"run {run.label} failed (exit {code}); the end of {run.out_dir / 'train.log'}:\n{tail}")
    return time.time() - start


def is_done(run: Run) -> bool:
    records = read_metrics(run.metrics) if run.metrics.is_file() else []
    return bool(records) and records[-1]["step"] >= run.steps


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---- summaries ----------------------------------------------------------------------------------

def series(records: list[dict], key: str) -> list[float]:
    """The metric per step (NaN where a step lacks it)."""
    return [float(r.get(key, math.nan)) for r in records]


def trained_series(records: list[dict], key: str) -> list[float]:
    """The metric per step, NaN on steps without a training batch (whose correction metrics are 0
    by convention, not a measured mismatch)."""
    return [float(r.get(key, math.nan)) if r.get("batch/valid_response_tokens", 1) > 0 else math.nan
            for r in records]


def _finite_mean(values: Sequence[float]) -> float:
    kept = [v for v in values if math.isfinite(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _updated(g: float) -> bool:
    return math.isfinite(g) and g > 0


def grad_spikes(grad_norms: Sequence[float]) -> int:
    """Steps whose grad norm exceeds SPIKE_FACTOR x the median of the previous SPIKE_WINDOW steps
    that updated (grad norm > 0)."""
    count = 0
    for i, value in enumerate(grad_norms):
        history = [g for g in grad_norms[max(0, i - SPIKE_WINDOW):i] if _updated(g)]
        if len(history) >= SPIKE_MIN_HISTORY and value > SPIKE_FACTOR * statistics.median(history):
            count += 1
    return count


def summarize_run(records: list[dict], reward_key: str, window: int) -> dict[str, float]:
    reward, grads = series(records, reward_key), series(records, GRAD)
    out = {"steps": len(records), "final_reward": _finite_mean(reward[-window:]), "reward_auc": _finite_mean(reward),
           "final_acc": _finite_mean(series(records, "reward/acc_mean")[-window:]),
           "grad_spikes": grad_spikes(grads), "no_update_steps": sum(1 for g in grads if g == 0),
           "stuck_from": stuck_from(grads, window)}
    out.update({key: _finite_mean(trained_series(records, key)) for _, key in MISMATCH})
    return out


def stuck_from(grad_norms: Sequence[float], window: int) -> float:
    """The step from which no step updated the policy to the end of the run (grad norm 0: a
    GRPO run whose groups all score alike, or whose tokens are all rejected, cannot leave that
    state), when that lasts at least `window` steps; NaN otherwise."""
    tail = 0
    while tail < len(grad_norms) and grad_norms[len(grad_norms) - 1 - tail] == 0:
        tail += 1
    return float(len(grad_norms) - tail + 1) if tail >= window else math.nan


def rejection_by_answer(dumps: Path, block: dict[str, Any]) -> dict[str, float]:
    """The share of right answers (reward > 0) and of wrong ones that the block's RS and veto
    reject (any token of the sequence), over every step's dump (trainer.dump_every=1): whether
    rejection is blind to the answer or takes a side. Each step's dump is corrected on its own,
    as the trainer corrects each step's batch; {} when the block rejects nothing or no dump
    holds a sequence."""
    from megatron_rlcorr.analysis.inputs import load_input
    from megatron_rlcorr.analysis.presets import evaluate

    config = RolloutCorrectionConfig.from_dict(block)
    if config.rollout_rs is None and config.rollout_token_veto_threshold is None:
        return {}
    if not dumps.is_dir() or not any(f.stat().st_size for f in dumps.glob("step_*.jsonl")):
        return {}  # no dumps, or only steps without a training batch
    inp = load_input(dumps)
    rejected = torch.zeros(inp.batch.num_sequences, dtype=torch.bool)
    valid = torch.zeros(inp.batch.num_sequences, dtype=torch.bool)
    for step in inp.steps:
        rows = inp.step_of_sequence == step
        ev = evaluate(inp.batch.select(rows), config)
        rejected[rows], valid[rows] = ~ev.sequence_kept, ev.nonempty
    scored = valid & inp.reward_of_sequence.isfinite()
    right = inp.reward_of_sequence > 0
    return {"rejected_right": _share(rejected[scored & right]), "rejected_wrong": _share(rejected[scored & ~right])}


def _share(flags: torch.Tensor) -> float:
    return flags.double().mean().item() if flags.numel() else math.nan


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    kept = [v for v in values if math.isfinite(v)]
    if not kept:
        return math.nan, math.nan
    return sum(kept) / len(kept), (statistics.stdev(kept) if len(kept) > 1 else 0.0)


def summarize_setting(per_seed: dict[int, dict[str, float]]) -> dict[str, Any]:
    keys = next(iter(per_seed.values())).keys()
    out: dict[str, Any] = {"seeds": sorted(per_seed),
                           "stuck_steps": [per_seed[seed]["stuck_from"] for seed in sorted(per_seed)]}
    for key in keys:
        mean, std = _mean_std([s[key] for s in per_seed.values()])
        out[key], out[key + "_std"] = mean, std
    return out


def mean_curve(curves: Sequence[Sequence[float]]) -> list[float]:
    """Step-wise mean over seeds (as long as the shortest run)."""
    length = min(len(c) for c in curves)
    return [_finite_mean([c[i] for c in curves]) for i in range(length)]


# ---- the report ---------------------------------------------------------------------------------

def _fmt(value: float, digits: int = 3) -> str:
    if not math.isfinite(value):
        return "n/a"
    return f"{value:.{digits}f}" if abs(value) >= 1e-2 or value == 0 else f"{value:.2e}"


def table(summaries: dict[str, dict[str, Any]], blocks: dict[str, dict], meta: dict[str, Any],
          reference: dict[str, dict[str, Any]] | None = None) -> str:
    reward = meta.get("reward_key", "reward_mean")
    rows = {**summaries, **{f"{label}, reference": ref["summary"] for label, ref in (reference or {}).items()}}
    # The routing column only for MoE runs (dense models have no routing to compare).
    mismatch = [m for m in MISMATCH if m != ROUTING
                or any(math.isfinite(r.get(ROUTING[1], math.nan)) for r in rows.values())]
    lines = [f"# Rollout-correction ablation: {meta.get('recipe', '')}, policy lag {meta.get('lag', 0)}", "",
             (f"{meta.get('steps', '?')} steps, seeds {meta.get('seeds', [])}, {meta.get('nproc', '?')} processes "
             f"per run. Reward: `{reward}`; final = mean of the last {meta.get('window', 10)} steps; AUC = mean "
             "over all steps; mean ± std over seeds. Grad-norm spikes: steps above "
             f"{SPIKE_FACTOR:g}x the median of the previous {SPIKE_WINDOW} updating steps, mean over seeds; "
             "no-update steps: grad norm 0 (all tokens rejected, or only dynamic-sampling fillers), mean over "
             "seeds; stuck seeds: runs whose last steps, at least the final window, all had grad norm 0 (a GRPO run "
             "whose groups all score alike cannot leave that state), with the step it began. Mismatch columns: mean "
             "over the steps with a training batch and over seeds. Rejected: "
             "the share of right answers (reward > 0) and of wrong ones that the setting's RS and veto reject, "
             "recomputed from every step's dump (runs with trainer.dump_every=1), mean over seeds."), "",
             "| setting | seeds | final reward | reward AUC | final acc | stuck seeds (from step) | grad-norm spikes | "
             "no-update steps | "
             + " | ".join(name for name, _ in mismatch) + " | rejected: right / wrong answers |",
             "|---|---|---|---|---|---|---|---|" + "---|" * (len(mismatch) + 1)]
    for setting, s in rows.items():
        cells = [setting, str(len(s["seeds"])), f"{_fmt(s['final_reward'])} ± {_fmt(s['final_reward_std'])}",
                 f"{_fmt(s['reward_auc'])} ± {_fmt(s['reward_auc_std'])}",
                 f"{_fmt(s['final_acc'])} ± {_fmt(s['final_acc_std'])}", _stuck_cell(s), f"{s['grad_spikes']:.1f}",
                 f"{s.get('no_update_steps', math.nan):.1f}",
                 *(_fmt(s.get(key, math.nan)) for _, key in mismatch), _rejection_cell(s)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Correction blocks (algorithm.rollout_correction, fields that differ from the default):", ""]
    default = RolloutCorrectionConfig().to_dict()
    for setting, block in blocks.items():
        changed = {k: v for k, v in block.items() if default.get(k) != v}
        lines.append(f"- `{setting}`: `{json.dumps(changed) if changed else '{} (metrics only)'}`")
    if meta.get("command"):
        lines += ["", f"Command: `{meta['command']}`"]
    if meta.get("wall_s"):
        lines += [f"Wall time of the training runs: {meta['wall_s'] / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def brief_table(summaries: dict[str, dict[str, Any]], reference: dict[str, dict[str, Any]] | None = None) -> str:
    """The table's main columns (ablation_brief.md, what the README shows)."""
    lines = ["| setting | final reward | right answers (last steps) | stuck seeds (from step) | RS masked | k3 KL |",
             "|---|---|---|---|---|---|"]
    rows = {**summaries, **{f"{label}, reference": ref["summary"] for label, ref in (reference or {}).items()}}
    for setting, s in rows.items():
        lines.append(f"| {setting} | {_fmt(s['final_reward'])} ± {_fmt(s['final_reward_std'])} | "
                     f"{_fmt(s['final_acc'])} ± {_fmt(s['final_acc_std'])} | {_stuck_cell(s)} | "
                     f"{_fmt(s['rollout_corr/rollout_rs_masked_fraction'])} | {_fmt(s[KL])} |")
    return "\n".join(lines) + "\n"


def _stuck_cell(s: dict[str, Any]) -> str:
    steps = s.get("stuck_steps")
    if steps is None:
        return "n/a"
    stuck = sorted(int(x) for x in steps if x is not None and math.isfinite(x))
    return f"{len(stuck)}/{len(steps)}" + (f" ({', '.join(map(str, stuck))})" if stuck else "")


def _rejection_cell(s: dict[str, Any]) -> str:
    right, wrong = s.get("rejected_right", math.nan), s.get("rejected_wrong", math.nan)
    if not (math.isfinite(right) and math.isfinite(wrong)):
        return "n/a"
    return f"{100 * right:.0f}% / {100 * wrong:.0f}%"


def load_reference(folder: str | Path) -> dict[str, dict[str, Any]]:
    """Another ablation's settings as {"<setting> (lag K)": {"summary", "curves"}} from its ablation.json."""
    saved = json.loads((Path(folder) / "ablation.json").read_text())
    lag = saved.get("meta", {}).get("lag", "?")
    return {f"{setting} (lag {lag})": {"summary": {k: math.nan if v is None else v for k, v in summary.items()},
                                       "curves": {int(seed): {k: [math.nan if x is None else x for x in v]
                                                              for k, v in c.items()}
                                                  for seed, c in saved["curves"][setting].items()}}
            for setting, summary in saved["summary"].items()}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("the figures need matplotlib: pip install -e .[plots]") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def smooth(values: Sequence[float], width: int) -> list[float]:
    """Trailing moving average over `width` steps (fewer at the start)."""
    return [_finite_mean(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]


def plot_setting(setting: str, curves: dict[int, dict[str, list[float]]], reward_key: str, path: Path) -> None:
    """Reward and k3 KL per step: each seed a thin line, the seeds' mean thick."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80, sharex=True)
    for ax, key, title in ((axes[0], "reward", reward_key), (axes[1], "kl", "k3 KL(rollout || trainer)")):
        for seed, c in sorted(curves.items()):
            ax.plot(range(1, len(c[key]) + 1), c[key], lw=0.7, alpha=0.5, label=f"seed {seed}")
        mean = mean_curve([c[key] for c in curves.values()])
        ax.plot(range(1, len(mean) + 1), mean, lw=2.2, color="black", label="mean")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"setting: {setting}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_combined(curves: dict[str, dict[int, dict[str, list[float]]]], meta: dict[str, Any], path: Path,
                  reference: dict[str, dict[str, Any]] | None = None) -> None:
    """The settings' mean reward (smoothed) and mean k3 KL per step, side by side; reference
    settings dashed."""
    plt = _pyplot()
    width = max(1, int(meta.get("smooth", 10)))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=80, sharex=True)
    lines = [(s, c, "-") for s, c in curves.items()]
    lines += [(label, ref["curves"], "--") for label, ref in (reference or {}).items()]
    for setting, per_seed, style in lines:
        reward = smooth(mean_curve([c["reward"] for c in per_seed.values()]), width)
        kl = smooth(mean_curve([c["kl"] for c in per_seed.values()]), width)
        color = "black" if style == "--" else None
        line, = axes[0].plot(range(1, len(reward) + 1), reward, style, lw=1.8, color=color, label=setting)
        axes[1].plot(range(1, len(kl) + 1), kl, style, lw=1.5, color=line.get_color(), label=setting)
    axes[0].set_title(f"{meta.get('reward_key', 'reward')}: mean of {len(meta.get('seeds', []))} seeds, "
                      f"{width}-step moving average", fontsize=9)
    axes[1].set_title("k3 KL(rollout || trainer), same averaging (steps that trained)", fontsize=9)
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    shown = [o for o in meta.get("overrides", []) if not o.startswith(UNSHOWN_OVERRIDES)]
    fig.suptitle(", ".join([Path(str(meta.get("recipe", ""))).name, f"rollout.policy_lag={meta.get('lag', 0)}",
                            *shown]), fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    fig.savefig(path)
    plt.close(fig)


def write_report(out: Path, records: dict[str, dict[int, list[dict]]], blocks: dict[str, dict],
                 meta: dict[str, Any], reference: dict[str, dict[str, Any]] | None = None,
                 rejections: dict[str, dict[int, dict[str, float]]] | None = None) -> dict[str, Any]:
    """ablation.md, ablation.json, ablation_<setting>.png and ablation.png from every run's
    metrics records ({setting: {seed: records}}) and rejection_by_answer results (same keys),
    with `reference` (load_reference) beside them in the table and the combined figure. Returns
    what ablation.json holds."""
    out.mkdir(parents=True, exist_ok=True)
    reward_key, window = meta.get("reward_key", "reward_mean"), int(meta.get("window", 10))
    empty = [f"{s}_s{seed}" for s, per_seed in records.items() for seed, r in per_seed.items() if not r]
    if empty:
        raise ValueError(f"runs without metrics: {', '.join(empty)}")
    summaries, curves = {}, {}
    for setting, per_seed in records.items():
        summaries[setting] = summarize_setting({
            seed: {**summarize_run(r, reward_key, window), **NO_REJECTION,
                   **(rejections or {}).get(setting, {}).get(seed, {})}
            for seed, r in per_seed.items()})
        curves[setting] = {seed: {"reward": series(r, reward_key), "acc": series(r, "reward/acc_mean"),
                                  "kl": trained_series(r, KL), "grad_norm": series(r, GRAD)}
                           for seed, r in per_seed.items()}
        plot_setting(setting, curves[setting], reward_key, out / f"ablation_{setting}.png")
    plot_combined(curves, meta, out / "ablation.png", reference)
    (out / "ablation.md").write_text(table(summaries, blocks, meta, reference))
    (out / "ablation_brief.md").write_text(brief_table(summaries, reference))
    result = {"meta": meta, "blocks": blocks, "summary": summaries,
              "curves": {s: {str(seed): c for seed, c in per.items()} for s, per in curves.items()}}
    (out / "ablation.json").write_text(json.dumps(_json_safe(result), indent=1) + "\n")
    return result


def _json_safe(x: Any) -> Any:
    """NaN -> null, so that ablation.json is strict JSON; floats to 6 significant digits."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


# ---- main ---------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        runs = plan_runs(args)
        previous = _previous_meta(Path(args.out)) if args.report_only or args.skip_done else {}
        wall = previous.get("wall_s", 0.0) if args.report_only else train_all(runs, args)
        if args.skip_done and not args.report_only:  # the kept runs' time (the earlier report's) + this call's
            wall += previous.get("wall_s", 0.0)
        command = ((previous.get("command") if args.report_only else None)
                   or "python tools/ablate.py " + " ".join(sys.argv[1:] if argv is None else argv))
        records = {s: {r.seed: read_metrics(r.metrics) if r.metrics.is_file() else []
                       for r in runs if r.setting == s} for s in args.settings}
        blocks = {s: correction_block(s, args.recipe, args.overrides, args.defines) for s in args.settings}
        rejections = {s: {r.seed: rejection_by_answer(r.metrics.parent / "dumps", blocks[s])
                          for r in runs if r.setting == s} for s in args.settings}
        meta = {"recipe": str(args.recipe), "lag": args.lag, "seeds": list(args.seeds), "nproc": args.nproc,
                "steps": args.steps or max((len(r) for per in records.values() for r in per.values()), default=0),
                "reward_key": args.reward_key, "window": args.window, "overrides": list(args.overrides),
                "command": command, "wall_s": wall, "reference": args.reference}
        reference = load_reference(args.reference) if args.reference else None
        write_report(Path(args.out), records, blocks, meta, reference, rejections)
    except ValueError as err:
        print(f"ablate.py: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a training run failed: its log says why
        print(f"ablate.py: {err}", file=sys.stderr)
        return 1
    print(f"table: {Path(args.out) / 'ablation.md'}\nfigure: {Path(args.out) / 'ablation.png'}")
    return 0


def _previous_meta(out: Path) -> dict[str, Any]:
    """The training command and wall time an earlier report recorded (--report-only keeps them)."""
    path = out / "ablation.json"
    meta = json.loads(path.read_text())["meta"] if path.is_file() else {}
    return {key: meta[key] for key in ("command", "wall_s") if meta.get(key)}


def train_all(runs: list[Run], args: argparse.Namespace) -> float:
    """Train every run in turn (keeping complete ones with --skip-done); the seconds it took."""
    start = time.time()
    for i, run in enumerate(runs, 1):
        if args.skip_done and is_done(run):
            print(f"[{i}/{len(runs)}] {run.label}: done already", flush=True)
            continue
        seconds = train(run, args.recipe, args.nproc)
        records = read_metrics(run.metrics)
        summary = summarize_run(records, args.reward_key, args.window)
        print(f"[{i}/{len(runs)}] {run.label}: {seconds:.0f} s, final {args.reward_key} "
              f"{summary['final_reward']:.3f}, k3 KL {summary[KL]:.3g}", flush=True)
    return time.time() - start


if __name__ == "__main__":
    sys.exit(main())
