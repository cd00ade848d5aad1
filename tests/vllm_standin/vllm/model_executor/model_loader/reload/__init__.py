"""Stand-in of vllm.model_executor.model_loader.reload (vLLM 0.25.1's layerwise reload): with
`initialize_layerwise_reload(model)` a model whose weights were processed after loading (online
fp8) takes checkpoint-format tensors again, and `finalize_layerwise_reload(model, model_config)`
processes them (reload/layerwise.py). Both need the current vLLM config, as the real ones do; both
are recorded in vllm.CALLS. As the real one, finalizing an incomplete reload only warns ("Failed to
load weights") and keeps the old tensors of what did not come."""
from __future__ import annotations

from typing import Any

import torch


def initialize_layerwise_reload(model: torch.nn.Module | Any) -> None:
    import vllm
    from vllm.config import get_current_vllm_config

    get_current_vllm_config()
    vllm.CALLS.append(("initialize_layerwise_reload", None))
    model.begin_reload()


def finalize_layerwise_reload(model: torch.nn.Module | Any, model_config: Any) -> None:
    import vllm
    from vllm.config import get_current_vllm_config

    get_current_vllm_config()
    assert model_config is not None, "finalize_layerwise_reload needs the model config"
    vllm.CALLS.append(("finalize_layerwise_reload", None))
    model.finish_reload()
