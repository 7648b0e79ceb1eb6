"""GGUF files the importer cannot convert fail with a GGUFImportError that names the problem."""

import struct

import pytest

from prefixd.daemon.models.gguf_import import GGUFImportError, import_gguf

GGML_F32, GGML_Q4_K = 0, 12


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_gguf(path, metadata: dict[str, str], tensors: list[tuple[str, list[int], int, bytes]]):
    """A minimal GGUF v3 writer: string metadata, tensors as (name, dims, ggml type, raw bytes)."""
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, value in metadata.items():
        header += _string(key) + struct.pack("<I", 8) + _string(value)  # 8 = string
    data, offset = b"", 0
    for name, dims, ggml_type, raw in tensors:
        header += _string(name) + struct.pack("<I", len(dims))
        header += b"".join(struct.pack("<Q", d) for d in dims)
        header += struct.pack("<IQ", ggml_type, offset)
        raw += b"\0" * (-len(raw) % 32)  # tensor data is 32-byte aligned
        data, offset = data + raw, offset + len(raw)
    header += b"\0" * (-len(header) % 32)
    path.write_bytes(header + data)
    return path


def test_non_llama_architecture_is_refused(tmp_path):
    src = write_gguf(tmp_path / "gpt2.gguf", {"general.architecture": "gpt2"},
                     [("token_embd.weight", [4, 2], GGML_F32, bytes(32))])
    out = tmp_path / "model"
    with pytest.raises(GGUFImportError, match="architecture 'gpt2' is not supported") as err:
        import_gguf(src, out)
    assert "llama" in str(err.value)
    assert not out.exists()


def test_unsupported_tensor_type_is_named(tmp_path):
    # One Q4_K block (256 values, 144 bytes): MLX would silently load it as float16.
    src = write_gguf(tmp_path / "k.gguf", {"general.architecture": "llama"},
                     [("blk.0.attn_q.weight", [256, 1], GGML_Q4_K, bytes(144))])
    with pytest.raises(GGUFImportError, match="Q4_K") as err:
        import_gguf(src, tmp_path / "model")
    assert "blk.0.attn_q.weight" in str(err.value)


def test_unknown_tensor_is_refused(tmp_path):
    src = write_gguf(tmp_path / "rope.gguf", {"general.architecture": "llama"},
                     [("rope_freqs.weight", [32], GGML_F32, bytes(128))])
    with pytest.raises(GGUFImportError, match="rope_freqs"):
        import_gguf(src, tmp_path / "model")


def test_not_a_gguf_file(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"PK\x03\x04 certainly not a GGUF file")
    with pytest.raises(GGUFImportError, match="not a GGUF file"):
        import_gguf(src, tmp_path / "model")


def test_truncated_header(tmp_path):
    full = write_gguf(tmp_path / "full.gguf", {"general.architecture": "llama"}, []).read_bytes()
    src = tmp_path / "cut.gguf"
    src.write_bytes(full[:30])
    with pytest.raises(GGUFImportError, match="truncated or corrupt"):
        import_gguf(src, tmp_path / "model")
