"""GGUF files the importer cannot convert fail with a GGUFImportError that names the problem."""

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from prefixd.daemon.models.gguf_import import GGUFImportError, import_gguf

GGML_F32 = 0


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


def test_unsupported_architecture_is_refused(tmp_path):
    src = write_gguf(tmp_path / "gpt2.gguf", {"general.architecture": "gpt2"},
                     [("token_embd.weight", [4, 2], GGML_F32, bytes(32))])
    out = tmp_path / "model"
    with pytest.raises(GGUFImportError, match="architecture 'gpt2' is not supported") as err:
        import_gguf(src, out)
    for supported in ("llama", "qwen2", "qwen3", "gemma3", "phi3", "lfm2"):
        assert supported in str(err.value)
    assert not out.exists()


def _tiny_llama(tmp_path, name: str, extra):
    """The tiny llama of tests/support/gguf_files.py, plus what extra(writer) adds."""
    from tests.support.gguf_files import write_tiny_gguf

    return write_tiny_gguf("llama", Q.Q8_0, tmp_path / name, extra=extra)[0]


def test_unsupported_tensor_type_is_named(tmp_path):
    # IQ4_NL: a type gguf can read but this importer does not take on trust
    src = _tiny_llama(tmp_path, "iq.gguf", lambda w: w.add_tensor(
        "blk.0.attn_q_b.weight", np.zeros((1, 18), np.uint8), raw_dtype=Q.IQ4_NL))
    with pytest.raises(GGUFImportError, match="IQ4_NL") as err:
        import_gguf(src, tmp_path / "model")
    assert "blk.0.attn_q_b.weight" in str(err.value) and "Q4_K" in str(err.value)


def test_unknown_tensor_is_refused(tmp_path):
    src = _tiny_llama(tmp_path, "moe.gguf", lambda w: w.add_tensor(
        "blk.0.ffn_gate_exps.weight", np.zeros((2, 256), np.float32)))
    with pytest.raises(GGUFImportError, match="ffn_gate_exps"):
        import_gguf(src, tmp_path / "model")


def _with_tokenizer(path, model: str, pre: str):
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_string("tokenizer.ggml.model", model)
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_tokenizer_is_named(tmp_path):
    src = _with_tokenizer(tmp_path / "bert.gguf", "bert", "default")
    with pytest.raises(GGUFImportError, match="tokenizer 'bert' is not supported"):
        import_gguf(src, tmp_path / "model")


def test_unknown_pre_tokenizer_is_named(tmp_path):
    src = _with_tokenizer(tmp_path / "jais.gguf", "gpt2", "jais")
    with pytest.raises(GGUFImportError, match="pre-tokenizer 'jais'") as err:
        import_gguf(src, tmp_path / "model")
    assert "llama-bpe" in str(err.value)


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
