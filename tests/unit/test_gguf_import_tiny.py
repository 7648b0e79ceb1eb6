"""Every architecture and tensor type the importer accepts, on tiny GGUF files the tests write.

Each file is imported, loaded by mlx-lm, and compared with the reference that
tests/support/gguf_files.py computes on its own: the weights equal to gguf's own dequantization
(llama.cpp's transforms undone), the logits equal to those of a model that mlx-lm builds from
the reference weights and a config written by hand.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from prefixd.daemon.models.gguf_import import import_gguf, read_import_record

import mlx.core as mx  # noqa: E402  (conftest preloaded the BLAS)
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

from tests.support.gguf_files import write_tiny_gguf  # noqa: E402

ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma3", "phi3", "lfm2"]
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
         Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
PROMPT = [[3, 17, 200, 45, 99, 260, 7, 1, 150, 64]]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def reference_model(tmp_path, config: dict, weights: dict):
    """mlx-lm's model for the hand-written config with the reference weights."""
    ref = tmp_path / "reference"
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(ref / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    model, _ = load_model(ref)
    return model


def imported(tmp_path, arch, qtype, dtype="float32"):
    src, config, weights = write_tiny_gguf(arch, qtype, tmp_path / f"{arch}-{qtype.name}.gguf")
    out = import_gguf(src, tmp_path / "model", dtype, progress=False)
    return out, config, weights


def assert_same_weights(model, weights: dict) -> None:
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == set(weights), set(params) ^ set(weights)
    for name, expected in weights.items():
        got = np.array(params[name])
        assert got.shape == expected.shape, name
        assert np.array_equal(got, expected), f"{name}: max diff {np.abs(got - expected).max()}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_imports_to_the_reference(tmp_path, arch):
    out, config, weights = imported(tmp_path, arch, Q.Q8_0)
    model, _ = load_model(out)
    assert_same_weights(model, weights)
    want = reference_model(tmp_path, config, weights)(mx.array(PROMPT))
    got = model(mx.array(PROMPT))
    assert got.dtype == mx.float32
    assert np.allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_tensor_type_dequantizes_as_gguf_does(tmp_path, qtype):
    out, config, weights = imported(tmp_path, "llama", qtype)
    model, _ = load_model(out)
    assert_same_weights(model, weights)
    assert read_import_record(out)["dtype"] == "float32"


def test_llama3_rope_scaling_is_recovered(tmp_path):
    out, config, _ = imported(tmp_path, "llama", Q.F16)
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    expected = config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == expected["factor"]
    # recovered with low_freq_factor fixed at 1, as the reference has it: the same numbers
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert scaling[key] == pytest.approx(expected[key], rel=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "phi3", "lfm2"])
def test_tokenizer_round_trips_and_marks_specials(tmp_path, arch):
    out, _, _ = imported(tmp_path, arch, Q.F16)
    _, tokenizer = mlx_lm.load(str(out))
    text = "the cat sat on the mat 42 é"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=True).strip() == text
    end = {"gemma3": "<end_of_turn>", "phi3": "<|end|>"}.get(arch, "<|im_end|>")
    assert tokenizer.convert_tokens_to_ids(end) in tokenizer.eos_token_ids
    if arch in ("gemma3", "phi3"):  # SentencePiece files ask for BOS; the BPE ones here do not
        assert ids[0] == tokenizer.bos_token_id
    assert len(tokenizer.encode(end, add_special_tokens=False)) == 1  # control tokens stay whole


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_keep_moves_q4_q8_blocks_bit_for_bit(tmp_path, qtype):
    out, _, weights = imported(tmp_path, "llama", qtype, dtype="keep")
    model, _ = load_model(out)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.group_size == 32
    assert q_proj.bits == (8 if qtype == Q.Q8_0 else 4)
    for i, layer in enumerate(model.model.layers):
        for part in ("q_proj", "k_proj", "o_proj"):
            linear = getattr(layer.self_attn, part)
            w = mx.dequantize(linear.weight, linear.scales, linear.biases, group_size=32,
                              bits=linear.bits).astype(mx.float32)
            assert np.array_equal(np.array(w), weights[f"model.layers.{i}.self_attn.{part}.weight"])


def test_keep_requantizes_k_quants_at_8_bits(tmp_path):
    out, _, weights = imported(tmp_path, "llama", Q.Q4_K, dtype="keep")
    model, _ = load_model(out)
    for i, layer in enumerate(model.model.layers):
        linear = layer.mlp.down_proj
        assert linear.bits == 8 and linear.group_size == 32
        got = np.array(mx.dequantize(linear.weight, linear.scales, linear.biases, group_size=32,
                                     bits=8))
        want = weights[f"model.layers.{i}.mlp.down_proj.weight"]
        groups = want.reshape(want.shape[0], -1, 32)
        # within one 8-bit step of each group's range (MLX keeps 0 exact, so not always half)
        step = (groups.max(-1) - groups.min(-1)) / 255
        error = np.abs(got - want).reshape(groups.shape).max(-1)
        assert (error <= step + 1e-7).all()


@pytest.mark.parametrize("dtype,bits", [("q8", 8), ("q4", 4)])
def test_requantized_imports_stay_close_to_the_float_model(tmp_path, dtype, bits):
    out, config, weights = imported(tmp_path, "qwen3", Q.F16, dtype=dtype)
    model, _ = load_model(out)
    assert model.model.layers[0].self_attn.q_proj.bits == bits
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    want = np.array(reference_model(tmp_path, config, weights)(mx.array(PROMPT)))
    got = np.array(model(mx.array(PROMPT)).astype(mx.float32))
    corr = np.corrcoef(got.ravel(), want.ravel())[0, 1]
    assert corr > (0.999 if bits == 8 else 0.95), corr


def test_bfloat16_import_is_the_reference_rounded(tmp_path):
    out, _, weights = imported(tmp_path, "gemma3", Q.BF16, dtype="bfloat16")
    model, _ = load_model(out)
    params = dict(tree_flatten(model.parameters()))
    for name, expected in weights.items():
        assert params[name].dtype == mx.bfloat16
        assert np.array_equal(np.array(params[name].astype(mx.float32)),
                              np.array(mx.array(expected).astype(mx.bfloat16).astype(mx.float32)))


def test_a_second_import_of_the_same_file_is_skipped(tmp_path):
    out, _, _ = imported(tmp_path, "qwen2", Q.Q8_0)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    src = tmp_path / "qwen2-Q8_0.gguf"
    assert import_gguf(src, out, "float32", progress=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
