"""The architectures the importer converts: GGUF tensor names -> mlx-lm names, value transforms.

llama.cpp's converter renames every tensor (blk.N.attn_q.weight, ...) and changes a few values;
each entry here undoes that for one `general.architecture` (the same undoing transformers'
GGUF loader does, see transformers.modeling_gguf_pytorch_utils's TensorProcessors):
  llama   Q and K rows permuted for llama.cpp's interleaved rope -> permuted back
  gemma3  RMSNorm weights stored as w + 1 (Gemma's norm multiplies by 1 + w) -> minus one
  lfm2    the short convolution's kernel squeezed to 2D -> MLX's Conv1d layout [out, width, in]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import configs
from .errors import GGUFImportError

_DENSE_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_DENSE_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def _unchanged(name: str, values: np.ndarray, config: dict) -> np.ndarray:
    return values


def _llama_unpermute(name: str, values: np.ndarray, config: dict) -> np.ndarray:
    # llama.cpp's permute reshapes each head's rows to (2, n/2) and transposes; this transposes back
    if ".self_attn.q_proj." in name:
        heads = config["num_attention_heads"]
    elif ".self_attn.k_proj." in name:
        heads = config["num_key_value_heads"]
    else:
        return values
    rows = values.shape[0]
    grouped = values.reshape(heads, rows // heads // 2, 2, *values.shape[1:])
    return grouped.swapaxes(1, 2).reshape(values.shape)


def _gemma_norm(name: str, values: np.ndarray, config: dict) -> np.ndarray:
    return values - 1 if name.endswith("norm.weight") else values


def _lfm2_conv(name: str, values: np.ndarray, config: dict) -> np.ndarray:
    # GGUF [channels, width]; MLX's depthwise Conv1d weight is [out channels, width, 1]
    return values[:, :, None] if name.endswith("conv.conv.weight") else values


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    make_config: Callable[[configs.Hyper], dict]
    global_names: dict[str, str]
    layer_names: dict[str, str]
    transform: Callable[[str, np.ndarray, dict], np.ndarray] = _unchanged
    # tensors that carry configuration, read by make_config and not written as weights
    config_tensors: frozenset[str] = field(default_factory=frozenset)
    # control tokens that end a turn besides the file's eos (what llama.cpp calls end-of-generation)
    end_tokens: tuple[str, ...] = ()

    def mlx_name(self, gguf_name: str) -> str | None:
        """mlx-lm's parameter name for a GGUF tensor, or None when the model has none."""
        base, _, suffix = gguf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            return None
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            mapped = self.layer_names.get(part)
            return mapped and f"model.layers.{layer}.{mapped}.{suffix}"
        mapped = self.global_names.get(base)
        return mapped and f"{mapped}.{suffix}"

    def weight_names(self, tensor_names) -> dict[str, str]:
        """{gguf name: mlx name} for every weight; refuses a file with a tensor left over."""
        weights = {n: self.mlx_name(n) for n in tensor_names if n not in self.config_tensors}
        if unknown := sorted(n for n, mapped in weights.items() if mapped is None):
            raise GGUFImportError(
                f"tensor(s) {', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''} have no "
                f"counterpart in mlx-lm's {self.name} (a mixture of experts, a vision tower, ...)"
            )
        return weights


ARCHITECTURES = {
    arch.name: arch
    for arch in [
        Architecture(
            "llama",
            configs.llama_config,
            _DENSE_GLOBAL,
            _DENSE_LAYER,
            transform=_llama_unpermute,
            config_tensors=frozenset({"rope_freqs.weight"}),
            end_tokens=("<|eot_id|>", "<|im_end|>"),
        ),
        Architecture("qwen2", configs.qwen2_config, _DENSE_GLOBAL, _DENSE_LAYER, end_tokens=("<|im_end|>",)),
        Architecture(
            "qwen3", configs.qwen3_config, _DENSE_GLOBAL, _DENSE_LAYER | _QK_NORMS, end_tokens=("<|im_end|>",)
        ),
        Architecture(
            "gemma3",
            configs.gemma3_config,
            _DENSE_GLOBAL,
            _QK_NORMS
            | {
                "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj",
                "attn_norm": "input_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
                "ffn_gate": "mlp.gate_proj",
                "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj",
            },
            transform=_gemma_norm,
            end_tokens=("<end_of_turn>",),
        ),
        # Phi-3 keeps Q/K/V fused (attn_qkv) and gate/up fused (ffn_up), as mlx-lm's phi3 does
        Architecture(
            "phi3",
            configs.phi3_config,
            _DENSE_GLOBAL,
            {
                "attn_qkv": "self_attn.qkv_proj",
                "attn_output": "self_attn.o_proj",
                "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm",
                "ffn_up": "mlp.gate_up_proj",
                "ffn_down": "mlp.down_proj",
            },
            config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
            end_tokens=("<|end|>",),
        ),
        # LFM2's final norm is called embedding_norm (token_embd_norm in GGUF); names as transformers'
        Architecture(
            "lfm2",
            configs.lfm2_config,
            {
                "token_embd": "model.embed_tokens",
                "token_embd_norm": "model.embedding_norm",
            },
            {
                "attn_norm": "operator_norm",
                "ffn_norm": "ffn_norm",
                "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.out_proj",
                "attn_q_norm": "self_attn.q_layernorm",
                "attn_k_norm": "self_attn.k_layernorm",
                "ffn_gate": "feed_forward.w1",
                "ffn_up": "feed_forward.w3",
                "ffn_down": "feed_forward.w2",
                "shortconv.in_proj": "conv.in_proj",
                "shortconv.out_proj": "conv.out_proj",
                "shortconv.conv": "conv.conv",
            },
            transform=_lfm2_conv,
            end_tokens=("<|im_end|>",),
        ),
    ]
}


def architecture_of(metadata: dict, file_name: str) -> Architecture:
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(
            f"{file_name}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[arch]
