"""Weight quantisation used by the embedded engine to mimic an FP8 rollout engine.

`fp8_e4m3_qdq` rounds a tensor to the float8 e4m3fn grid with one per-tensor scale
(scale = amax / 448, the largest finite e4m3fn value) and returns it dequantised in float32, the
way an FP8 inference engine stores linear weights after online quantisation. The rounding uses
torch.float8_e4m3fn where torch has it, else `round_to_e4m3`, which reproduces the same grid
(3 mantissa bits, exponents -6..8, subnormals down to 2**-9, round-to-nearest-even, saturation
at 448) in float32 arithmetic.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
_E4M3_MIN_NORMAL_EXP = -6
_E4M3_MANTISSA_BITS = 3


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 x rounded to the nearest e4m3fn value (ties to even), saturating at +-448."""
    x = x.float().clamp(-E4M3_MAX, E4M3_MAX)
    _, exponent = torch.frexp(x)  # x = m * 2**exponent with 0.5 <= |m| < 1, so floor(log2|x|) = exponent - 1
    # Below the smallest normal the grid is uniform (subnormals): spacing 2**(-6 - 3).
    unbiased = (exponent - 1).clamp(min=_E4M3_MIN_NORMAL_EXP)
    step = torch.ldexp(torch.ones_like(x), unbiased - _E4M3_MANTISSA_BITS)
    # torch.round rounds half to even, as the hardware conversion does; a tie that rounds up to
    # the next binade lands on a representable value, so no renormalisation is needed.
    return (torch.round(x / step) * step).clamp(-E4M3_MAX, E4M3_MAX)


def _cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    if hasattr(torch, "float8_e4m3fn"):
        return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return round_to_e4m3(x)


def fp8_e4m3_qdq(weight: torch.Tensor) -> torch.Tensor:
    """Per-tensor e4m3 quantise-dequantise of `weight` (float32 result, same shape)."""
    weight = weight.float()
    amax = weight.abs().amax()
    # An all-zero tensor quantises exactly with any scale; 1.0 avoids dividing by zero.
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return _cast_e4m3(weight / scale) * scale
