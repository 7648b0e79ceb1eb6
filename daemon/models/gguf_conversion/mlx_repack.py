"""Q4_0, Q4_1 and Q8_0 blocks as MLX affine-quantized arrays, bit for bit (dtype "keep").

Each of these types is, per block of 32 values, codes q in [0, 2^bits) with w = scale * q + bias:
Q4_0 w = d (q - 8), Q4_1 w = d q + m, Q8_0 w = d q' (q' int8, so q = q' + 128). MLX's affine
quantization with group size 32 holds exactly that: codes packed little-endian into uint32 words,
one scale and bias per group. d and m are float16 in the file; they are kept as float32 so that
MLX computes scale * q + bias in float32, exactly as gguf.quants.dequantize does (in float16
the product d * q would round).
"""

from __future__ import annotations

import numpy as np

from gguf import GGMLQuantizationType as QType

GROUP_SIZE = 32
REPACKABLE = {QType.Q4_0: 4, QType.Q4_1: 4, QType.Q8_0: 8}  # type -> MLX bits


def repack(blocks: np.ndarray, qtype: QType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed uint32 weight, float32 scales, float32 biases) for a [rows, bytes] block tensor."""
    rows = blocks.shape[0]
    per_block = {QType.Q4_0: 18, QType.Q4_1: 20, QType.Q8_0: 34}[qtype]
    b = blocks.reshape(rows, -1, per_block)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == QType.Q8_0:
        codes = (b[..., 2:].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias = d * np.float32(-128)
    else:
        nibbles = b[..., 4:] if qtype == QType.Q4_1 else b[..., 2:]
        # a block's first 16 values are the low nibbles, the next 16 the high ones
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
        bias = (
            b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            if qtype == QType.Q4_1
            else d * np.float32(-8)
        )
    return _pack(codes.reshape(rows, -1), REPACKABLE[qtype]), d, bias


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    per_word = 32 // bits
    words = codes.reshape(codes.shape[0], -1, per_word).astype(np.uint32)
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    return np.bitwise_or.reduce(words << shifts, axis=-1).astype(np.uint32)
