"""Which layers this process builds, and what they need of the machine: `model.transformer_impl`.

Transformer Engine's layers on a CUDA machine (BF16/FP8, fused kernels, with Megatron-LM's own GPU
defaults: implementation_fields), Megatron-Core's local layers on the CPU. Why a module of its own:
the choice is checked when a recipe is loaded for a run here (train, score, export), long before
a model is built, and `plan` must not make it (it plans a cluster from a machine without GPUs).

A CUDA machine without an importable Transformer Engine is an error naming the fix, never a
silent fall back to the local layers (no fused kernels, no FP8, an L x L float32 score matrix per
head). Both run sequence parallelism: the local layers with the sequence-parallel RMSNorm of
model/build.py (Megatron-Core's torch norm wrapper refuses it). FP8 recipes are checked against the GPU by Transformer Engine's
own rules (fp8_recipe_unsupported), then by the installed Transformer Engine's check functions.
"""
from __future__ import annotations

from typing import Any

import torch

from .config import ModelConfig, TransformerImpl

TE_INSTALL = "pip install -e .[te]"


def implementation_fields(impl: TransformerImpl, *, main_grads: bool) -> dict[str, Any]:
    """The TransformerConfig fields that follow from the layers: with Transformer Engine,
    Megatron-LM's own GPU defaults; with the local layers, the CPU path's host initialisation."""
    if impl == "local":
        # Parameters allocated in host memory (Megatron-Core's CPU path; moved to a GPU after, if any).
        return dict(use_cpu_initialization=True)
    return dict(
        # Each rank allocates its shards directly on its GPU (load_full_weights fills them by name), not
        # in host memory first, every rank of a node at once, to be copied over (Megatron-Core's host
        # path also builds each linear's full unsharded weight when it initialises one itself).
        use_cpu_initialization=False,
        # Transformer Engine's fused RoPE: the unfused packed (THD) path syncs with the host ~4 times
        # per layer per micro-batch.
        apply_rope_fusion=True,
        bias_activation_fusion=True,          # the fused SwiGLU
        # Free each pipeline stage's output once sent (the schedule keeps what autograd needs).
        deallocate_pipeline_outputs=True,
        gradient_accumulation_fusion=main_grads and gradient_accumulation_fusion_available(),
    )


def gradient_accumulation_fusion_available() -> bool:
    """Whether the fused weight-gradient kernel Megatron-Core's own linear layers (the output layer)
    require for gradient_accumulation_fusion is installed: apex's fused_weight_gradient_mlp_cuda, the
    module whose import Megatron-Core checks (tensor_parallel/layers.py); without it they raise."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_transformer_impl(requested: TransformerImpl | None) -> TransformerImpl:
    """The layers a model built in this process uses: `requested` (model.transformer_impl), by
    default Transformer Engine's where CUDA is available and Megatron-Core's local ones without.

    Raises ValueError when the choice cannot be built here: Transformer Engine without CUDA, or
    CUDA with a Transformer Engine that does not import (the local layers are slow on a GPU: no
    fused kernels, no FP8, an L x L float32 score matrix per head).
    """
    cuda = torch.cuda.is_available()
    impl = requested or ("transformer_engine" if cuda else "local")
    if impl == "local":
        return impl
    if not cuda:
        raise ValueError("model.transformer_impl: transformer_engine needs a CUDA GPU, and this process sees none "
                         "(torch.cuda.is_available() is False): run it on a GPU machine, or set "
                         "model.transformer_impl: local (Megatron-Core's torch layers) or leave it unset")
    problem = _transformer_engine_import_error()
    if problem is not None:
        why = "model.transformer_impl is transformer_engine" if requested else \
            "model.transformer_impl is unset, which means transformer_engine where CUDA is available"
        raise ValueError(f"Transformer Engine does not import on this CUDA machine ({problem}), and {why}: install "
                         f"it with `{TE_INSTALL}` (offline GPU machines: stage it as the README's GPU check says), or "
                         "set model.transformer_impl: local to use Megatron-Core's torch layers on the GPU (slower: "
                         "no fused kernels, no FP8)")
    return impl


def _transformer_engine_import_error() -> str | None:
    """Why `import transformer_engine.pytorch` fails here, or None. A partial install fails with
    other errors than ImportError (a missing torch extension, an assertion in its loader)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # noqa: BLE001 - reported to the user with the fix
        return f"{type(err).__name__}: {err}"
    return None


def check_layers_here(cfg: ModelConfig, *, sequence_parallel: bool) -> TransformerImpl:
    """What building `cfg` in this process needs, checked before anything is built (recipe load for
    train, score and export; `plan` skips it): the layers (resolve_transformer_impl), Transformer
    Engine's for FP8, and an FP8 recipe this GPU runs. Returns the layers. Sequence parallelism runs
    on both (the local layers take model/build.py's sequence-parallel RMSNorm); the argument stays
    for the callers that pass the layout."""
    impl = resolve_transformer_impl(cfg.transformer_impl)
    if cfg.fp8 is not None:
        if impl != "transformer_engine":
            raise ValueError("model.fp8 needs Transformer Engine's layers on a CUDA machine, and this process has no "
                             "CUDA GPU: remove model.fp8 to run here (`plan` checks FP8 recipes without a GPU)")
        reason = fp8_recipe_unsupported_here(cfg.fp8.recipe)
        if reason is not None:
            raise ValueError(f"model.fp8.recipe={cfg.fp8.recipe!r} cannot run on this machine: {reason}; use another "
                             "recipe (tensorwise or delayed run from compute capability 8.9 on) or remove model.fp8")
    return impl


# Transformer Engine's availability check per FP8 recipe (transformer_engine.pytorch.quantization).
_TE_FP8_CHECKS = {"delayed": "check_fp8_support", "tensorwise": "check_fp8_support",
                  "blockwise": "check_fp8_block_scaling_support", "mxfp8": "check_mxfp8_support"}


def fp8_recipe_unsupported(recipe: str, capability: tuple[int, int], cuda_version: str | None) -> str | None:
    """Why a GPU of compute `capability` under CUDA `cuda_version` (torch.version.cuda) cannot run
    the FP8 `recipe`, by the rules of Transformer Engine's checks (_TE_FP8_CHECKS), or None."""
    cuda = tuple(int(part) for part in (cuda_version or "0").split(".")[:2])
    if recipe in ("delayed", "tensorwise"):
        if capability < (8, 9):
            return "FP8 needs compute capability 8.9 or higher (Ada, Hopper, Blackwell)"
        if capability < (9, 0) and cuda < (12, 1):
            return "FP8 on compute capability 8.9 (Ada) needs CUDA 12.1 or higher"
    elif recipe == "blockwise":
        if capability < (9, 0) or cuda < (12, 9):
            return "blockwise FP8 scaling needs compute capability 9.0 or higher and CUDA 12.9 or higher"
    elif recipe == "mxfp8":
        if not (10, 0) <= capability < (12, 0):
            return ("MXFP8 needs compute capability 10.x (Blackwell data-centre GPUs; Transformer Engine does not run "
                    "it on 12.0+ yet)")
    return None


def fp8_recipe_unsupported_here(recipe: str) -> str | None:
    """Why this process's GPU cannot run the FP8 `recipe` (fp8_recipe_unsupported, then the
    installed Transformer Engine's own check, which is what its layers will assert), or None."""
    capability = torch.cuda.get_device_capability()
    where = (f"{torch.cuda.get_device_name()} has compute capability {capability[0]}.{capability[1]}, torch's CUDA "
             f"is {torch.version.cuda}")
    reason = fp8_recipe_unsupported(recipe, capability, torch.version.cuda)
    if reason is None:
        reason = _transformer_engine_fp8_check(recipe)
    return None if reason is None else f"{reason} ({where})"


def _transformer_engine_fp8_check(recipe: str) -> str | None:
    try:  # Transformer Engine >= 2.9; before, the same functions lived in transformer_engine.pytorch.fp8
        from transformer_engine.pytorch import quantization as checks
    except ImportError:
        from transformer_engine.pytorch import fp8 as checks
    check = getattr(checks, _TE_FP8_CHECKS[recipe], None)
    if check is None:
        return f"the installed Transformer Engine has no {_TE_FP8_CHECKS[recipe]} (it predates the {recipe} recipe)"
    supported, reason = check()
    return None if supported else f"Transformer Engine: {reason}"
