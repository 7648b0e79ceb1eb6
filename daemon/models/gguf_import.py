"""Convert a llama-architecture GGUF file into a directory that mlx_lm.load() reads.

MLX reads GGUF tensors itself (Q4_0/Q4_1/Q8_0 arrive as MLX affine-quantized
weight/scales/biases with group size 32); what is left is renaming tensors to
mlx-lm's llama names, writing config.json from the GGUF metadata, and rebuilding
the Hugging Face tokenizer from the vocabulary stored in the metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from .blas import preload_blas

preload_blas()  # must run before mlx.core is imported anywhere in the process

import mlx.core as mx  # noqa: E402

__all__ = ["GGUFImportError", "import_gguf", "read_gguf_header", "read_import_record"]

RECORD_FILE = "prefixd_import.json"
_RECORD_FORMAT = 1  # bump when the output layout changes, so old imports are redone
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "keep": None}
_GROUP_SIZE = 32  # every GGUF block quantization MLX reads uses 32-element blocks

# GGML tensor type ids -> names. MLX reads the first five exactly. Others (K-quants,
# BF16, ...) it silently turns into float16 through gguflib, unchecked and lossy for
# BF16's range, so they are refused up front rather than imported on trust.
_SUPPORTED_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
_OTHER_TYPES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K",
                13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 24: "I8", 25: "I16", 26: "I32",
                27: "I64", 28: "F64", 30: "BF16"}

# GGUF tensor names -> mlx-lm llama parameter names ("blk.N." handled separately).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}

# llama.cpp pre-tokenizer names whose splitting rules are reproduced here.
_PRE_TOKENIZERS = ("default", "gpt2", "smollm")


class GGUFImportError(ValueError):
    """The GGUF file cannot be converted (architecture, tensor type, tokenizer, ...)."""


# ---------------------------------------------------------------- GGUF header

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_header(path: str | os.PathLike) -> tuple[dict, dict[str, int]]:
    """Return (metadata, {tensor name: GGML type id}) without reading tensor data.

    Parsed here rather than through mx.load so that a wrong architecture or an
    unsupported tensor type fails fast, and so that tensor types are known at all.
    """
    with open(path, "rb") as f:
        try:
            return _parse_header(f)
        except (struct.error, OverflowError, MemoryError) as e:
            raise GGUFImportError(f"{path}: truncated or corrupt GGUF header ({e})") from e


def _parse_header(f) -> tuple[dict, dict[str, int]]:
    def unpack(fmt):
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    def string():
        return f.read(unpack("<Q")).decode("utf-8", errors="replace")

    def value(kind):
        if kind == 8:
            return string()
        if kind == 9:
            item_kind, count = unpack("<I"), unpack("<Q")
            return [value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFImportError(f"{f.name}: unknown GGUF metadata value type {kind}")
        return unpack(_SCALARS[kind])

    if f.read(4) != b"GGUF":
        raise GGUFImportError(f"{f.name}: not a GGUF file (bad magic)")
    if (version := unpack("<I")) not in (2, 3):
        raise GGUFImportError(f"{f.name}: unsupported GGUF version {version}")
    num_tensors, num_kv = unpack("<Q"), unpack("<Q")
    metadata = {}
    for _ in range(num_kv):
        key = string()
        metadata[key] = value(unpack("<I"))
    tensor_types = {}
    for _ in range(num_tensors):
        name = string()
        f.seek(8 * unpack("<I"), os.SEEK_CUR)  # skip the dims
        tensor_types[name] = unpack("<I")
        f.seek(8, os.SEEK_CUR)  # skip the data offset
    return metadata, tensor_types


def _check_supported(path, metadata: dict, tensor_types: dict[str, int]) -> None:
    name = Path(path).name
    if (arch := metadata.get("general.architecture")) != "llama":
        raise GGUFImportError(f"{name}: architecture {arch!r} is not supported; only 'llama' "
                              "GGUF files (Llama, SmolLM, Mistral-style) can be imported")
    if unknown := [n for n in tensor_types if _mlx_name(n) is None]:
        raise GGUFImportError(f"{name}: tensor(s) {', '.join(unknown[:3])} have no counterpart "
                              "in mlx-lm's llama (Llama 3.1 rope_freqs, MoE experts, ...)")
    if bad := {n: t for n, t in tensor_types.items() if t not in _SUPPORTED_TYPES}:
        kinds = sorted({_OTHER_TYPES.get(t, f"type {t}") for t in bad.values()})
        raise GGUFImportError(f"{name}: tensor type(s) {', '.join(kinds)} not supported (e.g. "
                              f"tensor {next(iter(bad))!r}); supported: "
                              f"{', '.join(_SUPPORTED_TYPES.values())}")
    kind, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise GGUFImportError(f"{name}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not "
                              f"supported; only byte-level BPE ('gpt2') with "
                              f"{', '.join(_PRE_TOKENIZERS)} can be rebuilt")


# ---------------------------------------------------------------- config + weights

def _make_config(meta: dict, names: set[str]) -> dict:
    """config.json for mlx-lm's llama; names are the mlx-lm parameter names present."""
    def get(key, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise GGUFImportError(f"GGUF metadata lacks llama.{key}")
        return value

    hidden, num_heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // num_heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise GGUFImportError("partial rotary embeddings are not supported by mlx-lm's llama")
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "vocab_size": get("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])) or None),
        "rope_theta": get("rope.freq_base", 10000.0),
        # llama.cpp's converter permutes the Q/K rows for its interleaved rope;
        # the traditional (interleaved) rope reads them as they are.
        "rope_traditional": True,
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "lm_head.weight" not in names,
        "attention_bias": any(k.endswith("q_proj.bias") for k in names),
        "mlp_bias": any(k.endswith("up_proj.bias") for k in names),
    }
    if (scaling := meta.get("llama.rope.scaling.type", "none")) == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": get("rope.scaling.factor")}
    elif scaling != "none":
        raise GGUFImportError(f"rope scaling {scaling!r} is not supported")
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = meta[f"tokenizer.ggml.{key}"]
    return config


def _mlx_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        mapped = _LAYER_NAMES.get(part)
        mapped = mapped and f"model.layers.{layer}.{mapped}"
    else:
        mapped = _GLOBAL_NAMES.get(base)
    if mapped is None or suffix not in ("weight", "scales", "biases", "bias"):
        return None
    return f"{mapped}.{suffix}"


def _convert_weights(gguf: dict[str, mx.array], dtype: str) -> tuple[dict, dict | None]:
    """Rename tensors and dequantize them unless dtype == "keep".

    Returns (weights, config.json "quantization" entry or None)."""
    weights = {_mlx_name(k): v for k, v in gguf.items()}
    quantized = [k[: -len(".scales")] for k in weights if k.endswith(".scales")]
    bits = {base: weights[f"{base}.weight"].shape[-1] * 32
            // (weights[f"{base}.scales"].shape[-1] * _GROUP_SIZE) for base in quantized}
    if dtype == "keep":
        return weights, _quantization_config(bits)
    target = _DTYPES[dtype]
    for base in quantized:
        # Scales go to float32 first so that scale * q + bias is computed exactly.
        w = weights.pop(f"{base}.weight")
        scales = weights.pop(f"{base}.scales").astype(mx.float32)
        biases = weights.pop(f"{base}.biases").astype(mx.float32)
        weights[f"{base}.weight"] = mx.dequantize(
            w, scales, biases, group_size=_GROUP_SIZE, bits=bits[base]).astype(target)
    return {k: v.astype(target) for k, v in weights.items()}, None


def _quantization_config(bits: dict[str, int]) -> dict | None:
    """config.json "quantization": the commonest bit width as the default, plus
    per-layer entries for the others (a Q4/Q8 mix), which mlx-lm honours by path.
    Unquantized layers need no entry: mlx-lm quantizes only layers that have scales."""
    if not bits:
        return None
    widths = list(bits.values())
    default = max(set(widths), key=widths.count)
    config = {"group_size": _GROUP_SIZE, "bits": default}
    config.update({base: {"group_size": _GROUP_SIZE, "bits": b}
                   for base, b in bits.items() if b != default})
    return config


# ---------------------------------------------------------------- tokenizer

def _save_tokenizer(meta: dict, out: Path) -> None:
    # Imported here: tokenizers/transformers are slow to import and only needed now.
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's "smollm" pre-tokenizer: digits split one by one, then GPT-2's regex.
    if meta.get("tokenizer.ggml.pre") == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    # Control tokens (type 3) must never be split by BPE; they are already in the vocab.
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, token_type in zip(tokens, types) if token_type == 3])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = token("bos")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=bos, eos_token=token("eos"),
        unk_token=token("unknown"), pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"), clean_up_tokenization_spaces=False)
    # save_jinja_files=False keeps chat_template inside tokenizer_config.json.
    wrapped.save_pretrained(out, save_jinja_files=False)
    # transformers 5 names its own "TokenizersBackend" class; the 4.x name loads in both.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    specials = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                if config.get(k)}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


# ---------------------------------------------------------------- import

def _fingerprint(path: Path, dtype: str) -> dict:
    with open(path, "rb") as f:
        head = f.read(1 << 20)  # hashing all of a multi-GB file on every start would be slow
    return {"format": _RECORD_FORMAT, "source_name": path.name,
            "source_size": path.stat().st_size,
            "source_sha256_first_mib": hashlib.sha256(head).hexdigest(), "dtype": dtype}


def read_import_record(out_dir: str | os.PathLike) -> dict | None:
    """The prefixd_import.json of a finished import in out_dir, or None."""
    try:
        return json.loads((Path(out_dir) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                dtype: str = "float32") -> Path:
    """Convert a llama GGUF into an mlx-lm model directory at out_dir; return out_dir.

    dtype: "float32" (dequantize everything; the fast path on a Linux CPU with an
    optimized BLAS), "float16", "bfloat16", or "keep" (Q4_0/Q4_1/Q8_0 stay MLX
    quantized layers). Skipped when out_dir already holds an import of the same
    file with the same dtype. The directory appears atomically, complete or not at
    all. Raises GGUFImportError for files this importer cannot convert.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
    src, out = Path(gguf_path), Path(out_dir)
    record = _fingerprint(src, dtype)
    if read_import_record(out) == record:
        return out
    meta, tensor_types = read_gguf_header(src)
    _check_supported(src, meta, tensor_types)  # fail before the slow part
    config = _make_config(meta, {_mlx_name(name) for name in tensor_types})

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the model dir should be readable
        weights, quantization = _convert_weights(mx.load(str(src)), dtype)
        if quantization:
            config["quantization"] = quantization
        _save_tokenizer(meta, tmp)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        try:
            _replace_dir(tmp, out)
        except OSError:
            if read_import_record(out) != record:  # else a concurrent import won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _replace_dir(new: Path, out: Path) -> None:
    """Move new to out. rename() cannot overwrite a non-empty directory, so an existing
    out is first renamed onto an empty scratch dir. Readers never see a partial model."""
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    try:
        if out.exists():
            os.rename(out, old)
        try:
            os.rename(new, out)
        except OSError:
            if not out.exists() and any(old.iterdir()):
                os.rename(old, out)  # put the previous import back
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
