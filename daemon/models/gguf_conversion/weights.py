"""Dequantize, transform and write the weights: float, re-quantized with mx.quantize, or kept.

The dtype of an import:
  float32 / float16 / bfloat16  every tensor dequantized (gguf.quants) and cast
  q4 / q8   weight matrices re-quantized by mx.quantize (group size 64) from the dequantized
            values; the rest bfloat16, the dtype mlx-lm's quantized models compute in
  keep      Q4_0/Q4_1/Q8_0 matrices moved into MLX's layout bit for bit (mlx_repack.py); other
            quantized matrices (K-quants, Q5_*) have no MLX layout that holds them exactly and are
            re-quantized at 8 bits, group size 32; float tensors stay float32
  auto      float32 where MLX runs on the CPU (the fast path there, with an optimized BLAS:
            dequantizing on every matmul costs more than it saves), q8 on a GPU (half the memory
            of bfloat16 at the quality of the file; q4 is the smaller, lossier choice)
Tensors are converted one at a time and written in shards of at most 2 GiB, so memory holds one
shard, not the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

import mlx.core as mx

from gguf import GGMLQuantizationType as QType

from .mlx_repack import GROUP_SIZE as REPACK_GROUP, REPACKABLE, repack
from .reader import GGUFFile

DTYPES = ("auto", "float32", "float16", "bfloat16", "q4", "q8", "keep")
_FLOATS = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_REQUANT_BITS = {"q4": 4, "q8": 8}
_REQUANT_GROUP = 64
_KEEP_FALLBACK_BITS = 8
_FLOAT_TYPES = {QType.F32, QType.F16, QType.BF16}
SHARD_BYTES = 2 << 30

Transform = Callable[[str, np.ndarray, dict], np.ndarray]


def resolve_dtype(dtype: str) -> str:
    """The concrete dtype "auto" stands for on this machine; any other dtype as it is."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype != "auto":
        return dtype
    return "float32" if mx.default_device().type == mx.DeviceType.cpu else "q8"


def _is_matrix(mlx_name: str, values: np.ndarray, group: int) -> bool:
    """A Linear or Embedding weight that MLX can quantize (2D, rows a multiple of the group)."""
    return mlx_name.endswith(".weight") and values.ndim == 2 and values.shape[-1] % group == 0


def convert_tensor(
    source: GGUFFile, gguf_name: str, mlx_name: str, transform: Transform, config: dict, dtype: str
) -> dict[str, mx.array]:
    """{mlx name: array} for one GGUF tensor (three arrays for a quantized matrix)."""
    qtype = source.type_of(gguf_name)
    base = mlx_name.removesuffix(".weight")
    # The llama Q/K permutation moves whole rows and blocks never span rows, so raw blocks of a
    # permuted tensor can be reordered like the values (the transform is applied to block rows).
    if dtype == "keep" and qtype in REPACKABLE and mlx_name.endswith(".weight"):
        blocks = source.raw_blocks(gguf_name)
        if blocks.ndim == 2:
            blocks = transform(mlx_name, blocks, config)
            w, scales, biases = repack(blocks, qtype)
            return {mlx_name: mx.array(w), f"{base}.scales": mx.array(scales), f"{base}.biases": mx.array(biases)}
    values = transform(mlx_name, source.dequantize(gguf_name), config)
    if dtype in _FLOATS:
        return {mlx_name: mx.array(values).astype(_FLOATS[dtype])}
    if dtype == "keep":
        if qtype in _FLOAT_TYPES or not _is_matrix(mlx_name, values, REPACK_GROUP):
            return {mlx_name: mx.array(values)}
        return _quantized(mlx_name, mx.array(values), REPACK_GROUP, _KEEP_FALLBACK_BITS, mx.float32)
    # q4 / q8
    weights = mx.array(values).astype(mx.bfloat16)
    if not _is_matrix(mlx_name, values, _REQUANT_GROUP):
        return {mlx_name: weights}
    return _quantized(mlx_name, weights, _REQUANT_GROUP, _REQUANT_BITS[dtype], mx.bfloat16)


def _quantized(mlx_name: str, w: mx.array, group: int, bits: int, scale_dtype) -> dict:
    q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    base = mlx_name.removesuffix(".weight")
    return {mlx_name: q, f"{base}.scales": scales.astype(scale_dtype), f"{base}.biases": biases.astype(scale_dtype)}


def quantization_config(dtype: str, written: dict[str, tuple]) -> dict | None:
    """config.json's "quantization": mlx-lm reads each layer's bits and group size from the shapes
    of its arrays, so the default given here only has to be one of those present."""
    if dtype in _REQUANT_BITS:
        return {"group_size": _REQUANT_GROUP, "bits": _REQUANT_BITS[dtype]}
    if dtype == "keep" and any(name.endswith(".scales") for name in written):
        bits = [b for b in (_bits_of(name, written) for name in written) if b]
        return {"group_size": REPACK_GROUP, "bits": max(set(bits), key=bits.count)}
    return None


def _bits_of(name: str, shapes: dict[str, tuple]) -> int | None:
    if not name.endswith(".scales"):
        return None
    base = name.removesuffix(".scales")
    in_dims = shapes[name][-1] * REPACK_GROUP
    return shapes[f"{base}.weight"][-1] * 32 // in_dims


class ShardWriter:
    """model.safetensors, or model-0000N.safetensors + model.safetensors.index.json past 2 GiB."""

    def __init__(self, out: Path):
        self.out, self.pending, self.pending_bytes = out, {}, 0
        self.shapes: dict[str, tuple] = {}
        self.weight_map: dict[str, str] = {}
        self.count = 0

    def add(self, arrays: dict[str, mx.array]) -> None:
        mx.eval(*arrays.values())
        for name, array in arrays.items():
            self.pending[name] = array
            self.pending_bytes += array.nbytes
            self.shapes[name] = tuple(array.shape)
        if self.pending_bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        self.count += 1
        name = f"model-{self.count:05d}.safetensors"
        mx.save_safetensors(str(self.out / name), self.pending, metadata={"format": "mlx"})
        self.weight_map.update(dict.fromkeys(self.pending, name))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.count == 0:  # one shard: the plain name
            mx.save_safetensors(str(self.out / "model.safetensors"), self.pending, metadata={"format": "mlx"})
            return
        self._flush()
        index = {"metadata": {}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
