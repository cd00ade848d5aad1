"""Stand-in of vllm.model_executor.layers.quantization.kv_cache: `KVCacheScaleParameter`, the scalar
parameter a quantized model's attention layers register for checkpoint KV-cache scales, -1 while
no checkpoint brought one (vLLM 0.25.1, same module)."""
from __future__ import annotations

import torch


class KVCacheScaleParameter(torch.nn.Parameter):
    def __new__(cls) -> "KVCacheScaleParameter":
        return super().__new__(cls, torch.tensor(-1.0), requires_grad=False)
