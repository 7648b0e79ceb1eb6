"""config.json for mlx-lm, one builder per architecture, from the GGUF metadata.

The plain hyperparameters go through transformers' own table of GGUF keys
(transformers.integrations.ggml.GGUF_CONFIG_MAPPING); what it leaves out, and what mlx-lm's
model classes need beyond transformers' names, is added here per architecture.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .errors import GGUFImportError
from .rope_scaling import recover_llama3_scaling

_REQUIRED = object()

# Reads a float tensor that carries configuration rather than weights (rope_freqs, rope factors).
TensorLoader = Callable[[str], np.ndarray]


class Hyper:
    """The metadata of one architecture: hyper("block_count") reads "<arch>.block_count"."""

    def __init__(self, metadata: dict, arch: str, tensor_names: set[str], load: TensorLoader):
        self.metadata, self.arch, self.tensor_names, self.load = metadata, arch, tensor_names, load

    def __call__(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.metadata.get(f"{self.arch}.{key}", default)
        if value is _REQUIRED:
            raise GGUFImportError(f"GGUF metadata lacks {self.arch}.{key}")
        return value

    def has(self, *tensor_suffixes: str) -> bool:
        return any(n.endswith(s) for n in self.tensor_names for s in tensor_suffixes)


def _common(h: Hyper, model_type: str) -> dict:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    config: dict[str, Any] = {"model_type": model_type}
    for key, hf_name in GGUF_CONFIG_MAPPING.get(h.arch, {}).items():
        if hf_name and f"{h.arch}.{key}" in h.metadata:
            config[hf_name] = h.metadata[f"{h.arch}.{key}"]
    for key in ("block_count", "embedding_length", "attention.head_count"):
        h(key)  # required by every builder below: fail with the key's name, not a KeyError
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("rms_norm_eps", h("attention.layer_norm_rms_epsilon"))
    if "vocab_size" not in config:
        tokens = h.metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise GGUFImportError(f"GGUF metadata lacks {h.arch}.vocab_size and tokenizer.ggml.tokens")
        config["vocab_size"] = len(tokens)
    config["max_position_embeddings"] = h("context_length", 4096)
    # llama.cpp writes the output projection only when it is not the embedding matrix
    config["tie_word_embeddings"] = "output.weight" not in h.tensor_names
    for key in ("bos_token_id", "eos_token_id"):
        if (value := h.metadata.get(f"tokenizer.ggml.{key}")) is not None:
            config[key] = value
    return config


def _head_dim(h: Hyper, config: dict) -> int:
    return h("attention.key_length", config["hidden_size"] // config["num_attention_heads"])


def _full_rotary(h: Hyper, head_dim: int) -> None:
    if (rotary := h("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFImportError(
            f"{h.arch}: partial rotary embeddings ({rotary} of {head_dim} "
            "dimensions) are not supported by mlx-lm's model"
        )


def _linear_or_no_scaling(h: Hyper) -> dict | None:
    scaling = h("rope.scaling.type", "none")
    if scaling == "none":
        return None
    if scaling == "linear":
        return {"rope_type": "linear", "factor": float(h("rope.scaling.factor"))}
    raise GGUFImportError(f"{h.arch}: rope scaling {scaling!r} is not supported")


def llama_config(h: Hyper) -> dict:
    config = _common(h, "llama")
    head_dim = config["head_dim"] = _head_dim(h, config)
    _full_rotary(h, head_dim)
    config.setdefault("rope_theta", 10000.0)
    config["rope_traditional"] = False  # the Q/K rows are un-permuted back to Hugging Face's order
    config["attention_bias"] = h.has("attn_q.bias")
    config["mlp_bias"] = h.has("ffn_up.bias")
    if "rope_freqs.weight" in h.tensor_names:  # Llama 3.1+: the factors stand in for rope_scaling
        config["rope_scaling"] = recover_llama3_scaling(h.load("rope_freqs.weight"), head_dim, config["rope_theta"])
    else:
        config["rope_scaling"] = _linear_or_no_scaling(h)
    return config


def qwen2_config(h: Hyper) -> dict:
    config = _common(h, "qwen2")
    config.setdefault("rope_theta", 1000000.0)
    _full_rotary(h, config["hidden_size"] // config["num_attention_heads"])
    config["rope_scaling"] = _linear_or_no_scaling(h)
    return config


def qwen3_config(h: Hyper) -> dict:
    config = _common(h, "qwen3")
    config["head_dim"] = _head_dim(h, config)  # qwen3 heads are wider than hidden/heads
    _full_rotary(h, config["head_dim"])
    config.setdefault("rope_theta", 1000000.0)
    config["rope_scaling"] = _linear_or_no_scaling(h)
    return config


def gemma3_config(h: Hyper) -> dict:
    config = _common(h, "gemma3_text")  # mlx-lm's text-only Gemma 3 (its "gemma3" is the VLM)
    head_dim = config["head_dim"] = _head_dim(h, config)
    # llama.cpp's gemma3 hard-codes these three (src/llama-model.cpp), so the file does not carry them:
    config["sliding_window_pattern"] = 6  # five sliding-window layers, then one global
    config["rope_local_base_freq"] = 10000.0
    # the query scale is 1/sqrt(head_dim), except for the 27B model (62 layers): hidden/heads
    wide = config["num_hidden_layers"] == 62
    config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if wide else head_dim
    config.setdefault("sliding_window", 512)
    config.setdefault("rope_theta", 1000000.0)
    config["rope_scaling"] = _linear_or_no_scaling(h)
    return config


def phi3_config(h: Hyper) -> dict:
    config = _common(h, "phi3")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    config["partial_rotary_factor"] = h("rope.dimension_count", head_dim) / head_dim
    config.setdefault("rope_theta", 10000.0)
    if "rope_factors_long.weight" in h.tensor_names:  # Phi-3 128k: "longrope" factors as tensors
        config["rope_scaling"] = {
            "type": "longrope",
            "long_factor": h.load("rope_factors_long.weight").reshape(-1).tolist(),
            "short_factor": h.load("rope_factors_short.weight").reshape(-1).tolist(),
        }
        config["original_max_position_embeddings"] = h("rope.scaling.original_context_length")
    else:
        config["rope_scaling"] = None
        config["original_max_position_embeddings"] = config["max_position_embeddings"]
    return config


def lfm2_config(h: Hyper) -> dict:
    try:  # transformers 5 rebuilds LFM2's config itself; older versions have no builder for it
        from transformers.integrations.gguf.gguf_config_mapping import get_gguf_config
    except ImportError as e:
        raise GGUFImportError("importing lfm2 needs transformers 5 (its GGUF config builder)") from e
    # get_gguf_config expects the vocabulary as its length, as transformers' own reader leaves it
    metadata = dict(h.metadata, **{"tokenizer.ggml.tokens": len(h.metadata["tokenizer.ggml.tokens"])})
    config = get_gguf_config(metadata, tuple(sorted(h.tensor_names)))
    config.pop("architectures", None)
    # mlx-lm's Lfm2 requires these; with block_auto_adjust_ff_dim off they do not change the width
    config.update(
        block_dim=config["hidden_size"],
        block_ff_dim=config["intermediate_size"],
        block_multiple_of=256,
        block_ffn_dim_multiplier=1.0,
        rope_theta=config["rope_parameters"]["rope_theta"],
    )
    return {k: v for k, v in config.items() if v is not None}
