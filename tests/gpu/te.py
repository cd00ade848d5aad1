"""The GPU tier's gate on Transformer Engine: on a CUDA machine a missing or broken Transformer
Engine fails the TE tests with the fix (the model's own error, which names it), never a skip that
would let the tier pass without testing the layers GPU users run. Without CUDA the `gpu` marker
skips them first (tests/conftest.py)."""
from __future__ import annotations

import pytest


def require_transformer_engine() -> None:
    from megatron_rlcorr.model.implementation import resolve_transformer_impl

    try:
        resolve_transformer_impl("transformer_engine")
    except ValueError as err:
        pytest.fail(f"the GPU tier needs Transformer Engine: {err}", pytrace=False)
