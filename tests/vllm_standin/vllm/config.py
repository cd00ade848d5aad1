"""Stand-in of vllm.config: `set_current_vllm_config`, the context its loaders and layerwise
processing read the engine's config from (config/vllm.py in vLLM 0.25.1)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

_current: Any = None


@contextlib.contextmanager
def set_current_vllm_config(vllm_config: Any, check_compile: bool = False, prefix: str | None = None) -> Iterator[None]:
    global _current
    previous, _current = _current, vllm_config
    try:
        yield
    finally:
        _current = previous


def get_current_vllm_config() -> Any:
    if _current is None:
        raise AssertionError("stand-in vLLM: no current vLLM config (enter set_current_vllm_config)")
    return _current
