"""A GGUF file opened with the `gguf` package (llama.cpp's reader): metadata, tensors, dequantization.

The reader memory-maps the file, so opening it reads only the header; a tensor's data is read
when it is dequantized.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .errors import GGUFImportError

# Imported here rather than at the top of gguf_import: `gguf` pulls in numpy and yaml, which only
# an import needs.
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402

# Every type gguf.quants dequantizes that llama.cpp's quantize tool writes for the models people
# have. The rest (IQ*, TQ*, MXFP4, I8..I64, F64) are refused by name rather than converted untested.
SUPPORTED_TYPES = frozenset(
    {
        QType.F32,
        QType.F16,
        QType.BF16,
        QType.Q4_0,
        QType.Q4_1,
        QType.Q5_0,
        QType.Q5_1,
        QType.Q8_0,
        QType.Q2_K,
        QType.Q3_K,
        QType.Q4_K,
        QType.Q5_K,
        QType.Q6_K,
    }
)


class GGUFFile:
    """metadata: {key: value} (strings, numbers, lists); tensors: {name: gguf ReaderTensor}."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.name = self.path.name
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise GGUFImportError(f"{self.name}: not a GGUF file (bad magic)")
        try:
            reader = gguf.GGUFReader(self.path, "r")
            self.metadata = {key: field.contents() for key, field in reader.fields.items()}
        except (ValueError, IndexError, KeyError, TypeError, OSError, OverflowError) as e:
            # numpy raises these for a header cut short or a count past the end of the file
            raise GGUFImportError(f"{self.name}: truncated or corrupt GGUF file ({e})") from e
        self.tensors = {t.name: t for t in reader.tensors}

    def check_types(self) -> None:
        """Refuse a file with any tensor type outside SUPPORTED_TYPES, naming the types."""
        bad: dict[str, str] = {}
        for name, tensor in self.tensors.items():
            if tensor.tensor_type not in SUPPORTED_TYPES:
                bad.setdefault(tensor.tensor_type.name, name)
        if bad:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            kinds = ", ".join(f"{kind} (e.g. tensor {name!r})" for kind, name in sorted(bad.items()))
            raise GGUFImportError(f"{self.name}: tensor type(s) {kinds} not supported; supported: {supported}")

    def type_of(self, name: str) -> QType:
        return self.tensors[name].tensor_type

    def num_bytes(self, name: str) -> int:
        return int(self.tensors[name].n_bytes)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32, in numpy's order (a matrix is [out_features, in_features])."""
        tensor = self.tensors[name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.ascontiguousarray(values, dtype=np.float32)

    def raw_blocks(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored: [rows, bytes per row] for a block-quantized type."""
        return self.tensors[name].data
