"""Rules for the trainer and the optimizer: the run's length (total_training_steps, total_epochs
from the train files' rows), checkpoints, validation, trackers and names, the learning-rate
schedule and the micro-batching."""
from __future__ import annotations

from typing import Any

from ...rl.settings import TRACKERS
from .datafiles import count_rows
from .core import Mapper
from .tables import A
from .values import Bad, pos_int, short, to_bool, to_float, to_int, to_str

# verl's trackers that this project has no counterpart of, and what to do instead
_OTHER_TRACKERS = {"file": "runs/<name>/metrics.jsonl is always written (verl's file logger's JSONL)"}


def _names(m: Mapper) -> None:
    key = "trainer.experiment_name"
    if m.pending(key):
        name = m.convert(key, to_str)
        m.map(key, "name", name)                        # the run directory runs/<name>
        m.flat["trainer.experiment_name"] = name        # the trackers' run name
        m.mapped.append((key, "trainer.experiment_name", name))


def _trackers(m: Mapper) -> None:
    key = "trainer.logger"
    if not m.pending(key):
        return
    names = m.convert(key, _tracker_names)
    kept = [n for n in dict.fromkeys(names) if n in TRACKERS]
    m.map(key, "trainer.logger", kept)
    m.differ(key, "trackers")
    dropped = [n for n in names if n not in TRACKERS]
    if dropped:
        reasons = [_OTHER_TRACKERS.get(n, f"{n}: a tracker this project does not have") for n in dropped]
        m.unmapped.append((key, f"{'; '.join(reasons)} (ours: {', '.join(TRACKERS)})"))


def _tracker_names(value: Any) -> list[str]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise Bad("a tracker name or a list of them (verl's console, wandb, ...)")
    return list(names)


def _validation(m: Mapper) -> None:
    """Validation on data.val_files (rl/validation.py): verl's keys, with test_freq <= 0 as 0 (never in the
    loop) and the generations written to runs/<name>/val_generations/."""
    freq, generations = "trainer.test_freq", "trainer.log_val_generations"
    if m.has("data.val_files") and not m.has("data.train_files") and m.pending("data.val_files"):
        m.skip("data.val_files", "validation files are read like data.train_files (the same keys, tokenizer and "
                                 "reward), which the source does not set")
    if m.pending(freq):
        m.map(freq, "trainer.test_freq", max(m.convert(freq, to_int), 0))   # verl: <= 0 never validates in the loop
    if m.pending(generations):
        m.map(generations, "trainer.log_val_generations", max(m.convert(generations, to_int), 0))
        m.differ(generations, "val_generations")


def _steps(m: Mapper) -> None:
    """trainer.steps: total_training_steps, or total_epochs x the train files' batches, whichever is
    fewer (verl stops at the first); m.steps keeps the result for the warm-up ratio."""
    epochs_key, steps_key = "trainer.total_epochs", "trainer.total_training_steps"
    if m.has(steps_key) and m.get(steps_key) is None:
        m.skip(steps_key, "null: verl trains total_epochs" + ("" if m.has(epochs_key) else "; set trainer.steps here"))
    steps = m.convert(steps_key, pos_int) if m.pending(steps_key) else None
    epochs = m.convert(epochs_key, pos_int) if m.pending(epochs_key) else None
    m.steps = steps
    if epochs is None:
        if steps is not None:
            m.map(steps_key, "trainer.steps", steps)
        return
    batch_key = "data.gen_batch_size" if m.dapo_recipe() and m.has("data.gen_batch_size") else "data.train_batch_size"
    batch = m.convert(batch_key, pos_int) if m.get(batch_key) is not None else None
    rows, why = count_rows(m.get("data.train_files")) if m.has("data.train_files") else (None, "no data.train_files")
    if batch is None or rows is None:
        unknown = why if rows is None else f"{batch_key} is not set"
        how = (f"set trainer.steps to {epochs} x (rows of data.train_files // {batch_key}"
               + (f" {batch}" if batch else "") + "): verl's loader drops the last partial batch")
        if steps is None:
            m.skip(epochs_key, f"ours counts steps and the epoch's length is not known here ({unknown}): {how}")
        else:
            m.map(steps_key, "trainer.steps", steps)
            m.skip(epochs_key, f"verl stops at whichever of total_epochs and total_training_steps comes first, and the "
                               f"epoch's length is not known here ({unknown}): if {epochs} epoch(s) are fewer than "
                               f"{steps} steps, {how}")
        return
    by_epochs = epochs * (rows // batch)
    filtered = (" (before verl's overlong-prompt filter, data.filter_overlong_prompts: verl's epoch can be shorter)"
                if m.get("data.filter_overlong_prompts") is True else "")
    counted = (f"{epochs} epoch(s) x ({rows} rows of data.train_files // {batch_key} {batch}) = {by_epochs} steps"
               f"{filtered}")
    if by_epochs < 1:
        m.skip(epochs_key, f"{counted}: the train files hold less than one batch; add rows or set trainer.steps")
        if steps is not None:
            m.map(steps_key, "trainer.steps", steps)
        return
    if steps is not None and steps <= by_epochs:
        m.map(steps_key, "trainer.steps", steps)
        m.skip(epochs_key, f"{counted}, more than {steps_key} {steps}: verl stops at whichever comes first")
        return
    m.map(epochs_key, "trainer.steps", by_epochs)
    m.steps = by_epochs
    if steps is not None:
        m.skip(steps_key, f"{counted}, fewer than {steps}: verl stops at whichever comes first (trainer.total_epochs)")
    m.differ(epochs_key, "epochs")


def _save(m: Mapper) -> None:
    save = "trainer.save_freq"
    if m.pending(save):
        value = m.convert(save, to_int)
        m.map(save, "trainer.save_every", max(value, 0))
        if value <= 0:
            m.differ(save, "save_freq")


def _optim(m: Mapper) -> None:
    o = A + "optim."
    lr = m.get(o + "lr")
    if m.pending(o + "min_lr"):
        m.map(o + "min_lr", "optim.min_lr", m.convert(o + "min_lr", to_float))
        if m.has(o + "min_lr_ratio"):
            m.skip(o + "min_lr_ratio", f"superseded by {o}min_lr")
    elif m.pending(o + "min_lr_ratio"):
        ratio = m.convert(o + "min_lr_ratio", to_float)
        if lr is None:
            m.skip(o + "min_lr_ratio", f"needs {o}lr to give optim.min_lr (= min_lr_ratio * lr)")
        else:
            m.map(o + "min_lr_ratio", "optim.min_lr", short(ratio * m.convert(o + "lr", to_float)))
    _warmup(m, o)
    styles = [k for k in (o + "lr_decay_style", o + "lr_scheduler_type", o + "warmup_style") if m.has(k)]
    for i, key in enumerate(styles):
        if not m.pending(key):
            continue
        value = m.convert(key, to_str)
        if i > 0:
            m.skip(key, f"superseded by {styles[0]}")
        elif value in ("constant", "linear", "cosine"):
            m.map(key, "optim.decay_style", value)
        else:
            m.skip(key, f"learning-rate schedule {value!r}: ours are constant, linear and cosine")
    for i, key in enumerate([k for k in (o + "clip_grad", A + "grad_clip") if m.has(k)]):
        if m.pending(key):
            if i == 0:
                m.map(key, "optim.clip_grad", m.convert(key, to_float))
            else:
                m.skip(key, f"superseded by {o}clip_grad")


def _warmup(m: Mapper, o: str) -> None:
    steps_key, ratio_key = o + "lr_warmup_steps", o + "lr_warmup_steps_ratio"
    steps = m.convert(steps_key, to_int) if m.pending(steps_key) else None
    if steps is not None and steps >= 0:
        m.map(steps_key, "optim.warmup_steps", steps)
        if m.has(ratio_key):
            m.skip(ratio_key, f"unused: {steps_key} is set")
        return
    if steps is not None:
        m.skip(steps_key, f"{steps}: verl then uses {ratio_key}")
    if not m.pending(ratio_key):
        return
    ratio = m.convert(ratio_key, to_float)
    if ratio <= 0:
        m.map(ratio_key, "optim.warmup_steps", 0)
    elif m.steps is None:
        m.skip(ratio_key, "needs the run's length (trainer.total_training_steps, or total_epochs with readable "
                          "train files) to give optim.warmup_steps")
    else:
        # verl truncates: int(ratio * total training steps)
        m.map(ratio_key, "optim.warmup_steps", int(ratio * m.steps))


def _micro_batching(m: Mapper) -> None:
    """verl's dynamic batch size: packed micro-batches of a token budget per GPU, which is
    trainer.max_tokens_per_micro_batch (both count a rank's tokens after the CP split)."""
    dynamic, budget = A + "use_dynamic_bsz", A + "ppo_max_token_len_per_gpu"
    if not m.pending(dynamic):
        if m.pending(budget):
            m.skip(budget, f"unused: {dynamic} is not set (verl's default: false)")
        return
    if not m.convert(dynamic, to_bool):
        m.skip(dynamic, "false: padded micro-batches of trainer.micro_batch_size sequences")
        if m.pending(budget):
            m.skip(budget, f"unused: {dynamic} is false")
        return
    if m.pending(budget):
        m.map(budget, "trainer.max_tokens_per_micro_batch", m.convert(budget, pos_int))
        m.skip(dynamic, f"true: packed micro-batches (see {budget})")
    else:
        m.map(dynamic, "trainer.max_tokens_per_micro_batch", 16384)  # verl's default budget


RULES = (_names, _trackers, _validation, _steps, _save, _optim, _micro_batching)
