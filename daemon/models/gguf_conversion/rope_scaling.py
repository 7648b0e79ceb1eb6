"""Llama 3's rope scaling, recovered from the rope_freqs tensor llama.cpp writes instead of it.

llama.cpp's converter turns the config's rope_scaling {factor, low_freq_factor, high_freq_factor,
original_max_position_embeddings} into one factor per rotary frequency (the tensor rope_freqs) and
keeps none of the four numbers. mlx-lm's llama wants the four numbers. The factors are 1 for short
wavelengths, `factor` for long ones and a smooth blend between, where the blend depends only on
original/(high - low) and low/(high - low): so low_freq_factor can be fixed at 1 and the other two
solved from the blended factors. The result is checked against the tensor; a file whose factors
follow no such curve is refused rather than approximated.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import GGUFImportError

_LLAMA31_DEFAULTS = (1.0, 4.0, 8192)  # low_freq_factor, high_freq_factor, original context


def llama3_factors(head_dim: int, base: float, factor: float, low: float, high: float, original: float) -> np.ndarray:
    """The per-frequency factors llama.cpp's converter computes (convert_hf_to_gguf.py)."""
    wavelens = 2 * math.pi * base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (original / wavelens - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelens < original / high, 1.0, np.where(wavelens > original / low, factor, blended))


def recover_llama3_scaling(freq_factors: np.ndarray, head_dim: int, base: float) -> dict:
    """mlx-lm's rope_scaling dict whose factors equal freq_factors."""
    freq_factors = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
    if freq_factors.shape != (head_dim // 2,):
        raise GGUFImportError(f"rope_freqs has {freq_factors.size} values, expected {head_dim // 2}")
    factor = float(freq_factors.max())
    candidates = [_LLAMA31_DEFAULTS]
    if (fitted := _fit(freq_factors, head_dim, base, factor)) is not None:
        candidates.append(fitted)
    for low, high, original in candidates:
        expected = llama3_factors(head_dim, base, factor, low, high, original)
        if np.allclose(expected, freq_factors, rtol=1e-4, atol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise GGUFImportError(
        "rope_freqs does not follow Llama 3's rope scaling; this importer cannot reproduce it in mlx-lm"
    )


def _fit(freq_factors: np.ndarray, head_dim: int, base: float, factor: float):
    """(1, high, original) from the blended factors by least squares, or None with under two."""
    wavelens = 2 * math.pi * base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    blended = (freq_factors > 1 + 1e-6) & (freq_factors < factor - 1e-6)
    if blended.sum() < 2 or factor <= 1:
        return None
    # 1/f = (1 - s)/factor + s  =>  s = (1/f - 1/factor) / (1 - 1/factor)
    smooth = (1 / freq_factors[blended] - 1 / factor) / (1 - 1 / factor)
    # s = (original/w - 1) / (high - 1)  <=>  original * (1/w) - (high - 1) * s = 1
    a = np.stack([1 / wavelens[blended], -smooth], axis=1)
    (original, high_minus_one), *_ = np.linalg.lstsq(a, np.ones(len(smooth)), rcond=None)
    if original <= 0 or high_minus_one <= 0:
        return None
    return 1.0, float(high_minus_one + 1), float(original)
