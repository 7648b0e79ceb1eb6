"""Tiny GGUF files written with the `gguf` package's GGUFWriter, and what they must import to.

write_tiny_gguf(arch, qtype, path) makes random weights in mlx-lm's layout, writes them the way
llama.cpp's converter does (its renames, the llama Q/K permutation, Gemma's norms + 1, LFM2's
squeezed conv kernel), weight matrices in qtype and vectors in F32 as real files have them, plus
a tokenizer in the metadata. It returns the reference: the mlx-lm config written here by hand
and the weights that the stored tensors dequantize to (gguf.quants.dequantize), with llama.cpp's
transforms undone by this module's own code, so the importer is checked against an independent
account of the same file.

Types gguf.quants can quantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quantized from
random values. It cannot quantize K-quants (Q2_K..Q6_K): for those the blocks are random bytes with
their float16 scales set to small finite values, which is still a valid block of that type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

from tests.support.gguf_tokenizers import VOCAB, add_tokenizer

HIDDEN, FFN, HEADS, KV_HEADS = 256, 512, 4, 2  # 256: K-quant rows hold 256 values


def num_layers(arch: str) -> int:
    """Two, but Gemma 3 needs a whole period of five sliding-window layers and a global one."""
    return 6 if arch == "gemma3" else 2


HEAD_DIM = HIDDEN // HEADS
# (byte offsets of the float16 scales inside one block, block bytes) for the K-quants
_K_SCALES = {Q.Q2_K: ((80, 82), 84), Q.Q3_K: ((108,), 110), Q.Q4_K: ((0, 2), 144),
             Q.Q5_K: ((0, 2), 176), Q.Q6_K: ((208,), 210)}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 3.0, "original_max_position_embeddings": 2048}


def _stored(values: np.ndarray, qtype: Q, rng) -> tuple[np.ndarray, np.ndarray]:
    """(what GGUFWriter stores, what it dequantizes to) for float32 values in numpy order."""
    if qtype in _K_SCALES:
        offsets, size = _K_SCALES[qtype]
        rows, cols = values.shape
        blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
        for offset in offsets:
            scale = rng.uniform(0.002, 0.02, size=(rows, cols // 256)).astype(np.float16)
            blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // 256, 2)
        data = blocks.reshape(rows, -1)
    else:
        data = gguf.quants.quantize(values, qtype)
    return data, gguf.quants.dequantize(data, qtype).astype(np.float32)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of _permute, by index: row r of the GGUF came from row order[r] of the model's."""
    half = w.shape[0] // heads // 2
    order = np.arange(w.shape[0]).reshape(heads, 2, half).swapaxes(1, 2).reshape(-1)
    out = np.empty_like(w)
    out[order] = w
    return out


def _tensors(arch: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(gguf name, mlx-lm name, numpy shape) of every tensor of the tiny model."""
    vocab = VOCAB[arch]
    names = [("token_embd.weight", "model.embed_tokens.weight", (len(vocab), HIDDEN))]
    names.append(("output_norm.weight", "model.norm.weight", (HIDDEN,)) if arch != "lfm2" else
                 ("token_embd_norm.weight", "model.embedding_norm.weight", (HIDDEN,)))
    if arch in ("llama", "phi3"):  # untied output; the others tie it to the embedding
        names.append(("output.weight", "lm_head.weight", (len(vocab), HIDDEN)))
    for i in range(num_layers(arch)):
        g, m = f"blk.{i}.", f"model.layers.{i}."
        attn = [("attn_q", "self_attn.q_proj", (HEADS * HEAD_DIM, HIDDEN)),
                ("attn_k", "self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
                ("attn_v", "self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN))]
        mlp = [("ffn_gate", "mlp.gate_proj", (FFN, HIDDEN)), ("ffn_up", "mlp.up_proj", (FFN, HIDDEN)),
               ("ffn_down", "mlp.down_proj", (HIDDEN, FFN))]
        parts = attn + [("attn_output", "self_attn.o_proj", (HIDDEN, HEADS * HEAD_DIM)),
                        ("attn_norm", "input_layernorm", (HIDDEN,))] + mlp
        if arch == "phi3":
            parts = [("attn_qkv", "self_attn.qkv_proj", ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)),
                     ("attn_output", "self_attn.o_proj", (HIDDEN, HIDDEN)),
                     ("attn_norm", "input_layernorm", (HIDDEN,)),
                     ("ffn_up", "mlp.gate_up_proj", (2 * FFN, HIDDEN)),
                     ("ffn_down", "mlp.down_proj", (HIDDEN, FFN))]
        if arch == "gemma3":
            parts += [("post_attention_norm", "post_attention_layernorm", (HIDDEN,)),
                      ("ffn_norm", "pre_feedforward_layernorm", (HIDDEN,)),
                      ("post_ffw_norm", "post_feedforward_layernorm", (HIDDEN,))]
        else:
            parts.append(("ffn_norm", "post_attention_layernorm", (HIDDEN,)))
        if arch in ("qwen3", "gemma3"):
            parts += [("attn_q_norm", "self_attn.q_norm", (HEAD_DIM,)),
                      ("attn_k_norm", "self_attn.k_norm", (HEAD_DIM,))]
        if arch == "qwen2":
            parts += [(f"attn_{x}.bias", f"self_attn.{x}_proj.bias", (n * HEAD_DIM,))
                      for x, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))]
        if arch == "lfm2":
            parts = _lfm2_layer(i)
        names += [(g + p if p.endswith(".bias") else f"{g}{p}.weight",
                   m + q if q.endswith(".bias") else f"{m}{q}.weight", s) for p, q, s in parts]
    return names


def _lfm2_layer(i: int):
    common = [("attn_norm", "operator_norm", (HIDDEN,)), ("ffn_norm", "ffn_norm", (HIDDEN,)),
              ("ffn_gate", "feed_forward.w1", (FFN, HIDDEN)), ("ffn_up", "feed_forward.w3", (FFN, HIDDEN)),
              ("ffn_down", "feed_forward.w2", (HIDDEN, FFN))]
    if i == 0:  # a short-convolution layer, then an attention layer
        return common + [("shortconv.in_proj", "conv.in_proj", (3 * HIDDEN, HIDDEN)),
                         ("shortconv.out_proj", "conv.out_proj", (HIDDEN, HIDDEN)),
                         ("shortconv.conv", "conv.conv", (HIDDEN, 3))]
    return common + [("attn_q", "self_attn.q_proj", (HEADS * HEAD_DIM, HIDDEN)),
                     ("attn_k", "self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
                     ("attn_v", "self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
                     ("attn_output", "self_attn.out_proj", (HIDDEN, HIDDEN)),
                     ("attn_q_norm", "self_attn.q_layernorm", (HEAD_DIM,)),
                     ("attn_k_norm", "self_attn.k_layernorm", (HEAD_DIM,))]


def write_tiny_gguf(arch: str, qtype: Q, path: Path, seed: int = 0,
                    extra: Callable[[gguf.GGUFWriter], None] | None = None) -> tuple[Path, dict, dict]:
    """Write the file; return (path, reference mlx-lm config, {mlx name: float32 reference}).

    extra(writer) adds what a test wants beside the model (a tensor of another type, ...)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    config = _metadata(writer, arch)
    reference = {}
    for gguf_name, mlx_name, shape in _tensors(arch):
        values = rng.normal(0, 0.5 if len(shape) == 1 else 0.05, size=shape).astype(np.float32)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            values = values + 1  # llama.cpp stores Gemma's norm weight w as w + 1
        permuted = arch == "llama" and gguf_name.split(".")[-2] in ("attn_q", "attn_k")
        if permuted:
            values = _permute(values, HEADS if ".attn_q." in gguf_name else KV_HEADS)
        matrix = len(shape) == 2 and not gguf_name.startswith("blk.0.shortconv.conv")
        data, stored = _stored(values, qtype if matrix else Q.F32, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype if matrix else Q.F32)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            stored = stored - 1
        if permuted:
            stored = _unpermute(stored, HEADS if ".attn_q." in gguf_name else KV_HEADS)
        if mlx_name.endswith("conv.conv.weight"):
            stored = stored[:, :, None]
        reference[mlx_name] = stored
    if arch == "llama":  # Llama 3.1-style rope scaling, as the factors tensor llama.cpp writes
        from prefixd.daemon.models.gguf_conversion.rope_scaling import llama3_factors
        s = LLAMA3_SCALING
        factors = llama3_factors(HEAD_DIM, 10000.0, s["factor"], s["low_freq_factor"],
                                 s["high_freq_factor"], s["original_max_position_embeddings"])
        writer.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    add_tokenizer(writer, arch)
    if extra:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, config, reference


def _metadata(writer: gguf.GGUFWriter, arch: str) -> dict:
    """Write the hyperparameters; return the mlx-lm config the model must import to."""
    def u32(key, value):
        writer.add_uint32(f"{arch}.{key}", value)

    for key, value in (("block_count", num_layers(arch)), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("attention.head_count", HEADS),
                       ("context_length", 4096)):
        u32(key, value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    if arch == "lfm2":
        writer.add_array(f"{arch}.attention.head_count_kv", [0, KV_HEADS])
        u32("shortconv.l_cache", 3)
    else:
        u32("attention.head_count_kv", KV_HEADS)
    common = dict(hidden_size=HIDDEN, num_hidden_layers=num_layers(arch), intermediate_size=FFN,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
                  vocab_size=len(VOCAB[arch]), rope_theta=10000.0, max_position_embeddings=4096)
    if arch == "llama":
        return dict(common, model_type="llama", head_dim=HEAD_DIM, tie_word_embeddings=False,
                    rope_scaling=LLAMA3_SCALING)
    if arch in ("qwen2", "qwen3"):
        return dict(common, model_type=arch, head_dim=HEAD_DIM, tie_word_embeddings=True)
    if arch == "gemma3":
        u32("attention.key_length", HEAD_DIM)
        u32("attention.sliding_window", 8)
        return dict(common, model_type="gemma3_text", head_dim=HEAD_DIM, sliding_window=8,
                    sliding_window_pattern=6, rope_local_base_freq=10000.0,
                    query_pre_attn_scalar=HEAD_DIM)
    if arch == "phi3":
        u32("rope.dimension_count", HEAD_DIM)
        return dict(common, model_type="phi3", tie_word_embeddings=False)
    common.pop("rms_norm_eps")
    return dict(common, model_type="lfm2", norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                block_dim=HIDDEN, block_ff_dim=FFN, block_multiple_of=256,
                block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                layer_types=["conv", "full_attention"])

