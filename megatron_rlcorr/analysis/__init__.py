"""The mismatch analyzer behind `megatron-rlcorr analyze`: how far the rollout engine's token
log-probs are from the trainer's, what each correction preset would do about it, and which
thresholds to move.

Modules, one concept each: inputs (what is read), statistics (divergences and ratio quantiles),
presets (settings run through the correction on the data; the block to judge), trend (k3 over
the steps), findings (the checks and their recommendations), report (report.md), plots (PNGs,
matplotlib only there), run (all of it end to end). Importing this package imports neither
matplotlib nor Megatron-Core.
"""
from .findings import CHECKS, Finding
from .inputs import AnalysisInput, Batch, load_input
from .presets import DAPO_BLOCK, Evaluation, evaluate, load_block
from .run import Analysis, Outputs, analyze, write_outputs

__all__ = ["CHECKS", "DAPO_BLOCK", "Analysis", "AnalysisInput", "Batch", "Evaluation", "Finding", "Outputs", "analyze",
           "evaluate", "load_block", "load_input", "write_outputs"]
