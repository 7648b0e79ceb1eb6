"""A model the engine has loaded: weights, tokenizer, cache layout, identity (fingerprint).

Engine thread only: loading and the model itself make MLX calls. How prompts
become tokens is prompt_encoding.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx_lm
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_tokenizer

from ...protocol.methods import PromptInput
from ..kv.fork import live_cache
from ..kv.layout import CacheLayout, make_cache_layout, unbatchable_cache_types
from ..kv.quantized_kv import describe_kv
from . import row_linear, short_conv, tail_attention
from .batch_step import choose_batch_step, wants_ragged
from .shared_forks import wants_shared_forks, with_shared_forks
from .generic_tools import tools_path
from .prompt_encoding import EncodedPrompt, PromptEncoder

_FINGERPRINT_SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelCard:
    """What the fronts may read of a loaded model, from any thread: plain values and its (thread-safe) encoder."""

    name: str
    fingerprint: str
    context_length: int
    encoder: PromptEncoder


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: Any
    tokenizer: Any  # mlx_lm TokenizerWrapper
    encoder: PromptEncoder
    layout: CacheLayout
    fingerprint: str
    context_length: int
    dtype: str
    load_seconds: float
    weight_bytes: int
    kv_bytes_per_token: int = 0  # KV per token, every layer that grows with the sequence
    state_bytes_per_sequence: int = 0  # conv/SSM state of a hybrid model, per sequence
    prefill_tokens_per_s: float = 0.0  # running estimate, for "time saved" figures
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    attention: str = "fused"  # how short multi-token passes attend (tail_attention.py)
    short_conv: str = "native"  # the form of a hybrid model's short convolutions (short_conv.py)
    linear: str = "matmul"  # how 2-8 rows pass through the linear layers (row_linear.py)
    kv: str = ""  # its attention KV as stats say it: float32, q8 (group 64), ... (quantized_kv.describe_kv)
    fork: str = "copy"  # how a hit's stored KV reaches its passes: share or copy, and why (shared_forks.py)
    batch_step: str = "padded"  # its decode batch: ragged (engine/ragged_batch.py) or padded, and why (batch_step.py)

    def describe(self, default: bool) -> dict[str, Any]:
        return model_description(self, default, self.attention)

    def encode(self, prompt: PromptInput, generates: bool | None = True) -> EncodedPrompt:
        """Token ids for a prompt, checked against the context (see PromptEncoder)."""
        return self.encoder.encode(prompt, generates)

    def card(self) -> ModelCard:
        return ModelCard(self.name, self.fingerprint, self.context_length, self.encoder)

    def note_prefill_rate(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 16 or seconds <= 0:
            return
        rate = num_tokens / seconds
        self.prefill_tokens_per_s = (
            rate if not self.prefill_tokens_per_s else 0.7 * self.prefill_tokens_per_s + 0.3 * rate
        )


def model_description(model: Any, default: bool, attention: str | None) -> dict[str, Any]:
    """What ``models`` says of a model, loaded (LoadedModel) or not (model_catalog's entry): the same keys."""
    return {
        "name": model.name,
        "path": str(model.path),
        "default": default,
        "context_length": model.context_length,
        "fingerprint": model.fingerprint,
        "hybrid": model.layout.is_hybrid,
        "dtype": model.dtype,
        "cache_layers": model.layout.describe(),
        "kv": model.kv,  # the store's and live passes' attention KV: the dtype, or q8/q4 and its group (--kv-bits)
        "attention": attention,  # None until it loads (tail_attention.py chooses then)
        "tools": tools_path(model.tokenizer),  # its template's own tool section, prefixd's generic one, or none
    }


def load_model(
    spec: str,
    name: str | None = None,
    dtype: str = "auto",
    attention: str = "auto",
    load_weights: Callable[[str], tuple[Any, Any]] = mlx_lm_load,
    conv: str = "auto",
    chat_template: str | None = None,
    kv_bits: int = 0,
    fork: str = "auto",
    linear: str = "auto",
    batch_step: str = "auto",
) -> LoadedModel:
    """Load a local MLX model directory, or a Hugging Face id already in the local cache.

    ``attention``: how short multi-token passes attend (tail_attention.py).
    ``conv``: the form of a hybrid model's short convolutions (short_conv.py).
    ``load_weights``: path -> (model, tokenizer); ranks of a distributed daemon
    each load their shard (distributed/sharded_loading.py).
    ``chat_template``: a template replacing the model's own (--chat-template,
    chat_template_file.py); a tokenizer from ``load_weights`` without it is
    loaded again with it.
    ``kv_bits``: 8 or 4 quantizes its attention KV (--kv-bits, kv/quantized_kv.py); 0 keeps full precision.
    ``fork``: auto, copy or share: whether a hit reads the stored segments in place (--fork, shared_forks.py).
    ``linear``: how 2-8 rows pass through the linear layers (--linear, row_linear.py).
    ``batch_step``: auto, padded or ragged: the decode batch its rows run in (--batch-step, batch_step.py).
    """
    path = resolve_model_path(spec)
    started = time.perf_counter()
    model, tokenizer = load_weights(str(path))
    if dtype != "auto":
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    config = json.loads((path / "config.json").read_text())
    if chat_template is not None and getattr(tokenizer, "chat_template", None) != chat_template:
        tokenizer = load_tokenizer(path, tokenizer_extra(chat_template), eos_token_ids=config.get("eos_token_id"))
    load_seconds = time.perf_counter() - started
    context_length = _context_length(config)
    weight_bytes = sum(v.nbytes for _, v in _flatten(model.parameters()))
    first_param = next(v for _, v in _flatten(model.parameters()))
    layout = make_cache_layout(model, kv_bits)
    refuse_unbatchable(model, path)
    attention = tail_attention.install(model, attention)
    conv = short_conv.install(model, conv)
    linear = row_linear.install(model, linear)
    on_gpu = mx.default_device().type == mx.gpu
    layout, fork = with_shared_forks(model, layout, wants_shared_forks(fork, on_gpu), first_param.dtype)
    batch_step = choose_batch_step(model, layout, wants_ragged(batch_step, on_gpu))
    kv_bytes_per_token, state_bytes_per_sequence, kv_dtype, head_dims = _measure_cache_bytes(model, layout)
    return LoadedModel(
        name=name or path.name,
        path=path,
        model=model,
        tokenizer=tokenizer,
        encoder=PromptEncoder(tokenizer, name or path.name, context_length),
        layout=layout,
        kv_bytes_per_token=kv_bytes_per_token,
        state_bytes_per_sequence=state_bytes_per_sequence,
        fingerprint=model_fingerprint(path, tokenizer, str(first_param.dtype), layout.kv_bits),
        context_length=context_length,
        dtype=str(first_param.dtype).replace("mlx.core.", ""),
        load_seconds=load_seconds,
        weight_bytes=weight_bytes,
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
        attention=attention,
        short_conv=conv,
        linear=linear,
        kv=describe_kv(layout.kv_bits, kv_dtype or _dtype_name(first_param.dtype), head_dims),
        fork=fork,
        batch_step=batch_step,
    )


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("mlx.core.", "")


def tokenizer_extra(chat_template: str | None) -> dict[str, Any] | None:
    """mlx-lm's ``tokenizer_config_extra`` that makes a tokenizer load with ``chat_template`` as its template."""
    return {"chat_template": chat_template} if chat_template is not None else None


class UnsupportedModelError(ValueError):
    """The model loads in mlx-lm but the engine cannot serve it; refused at load, never per request."""


def refuse_unbatchable(model: Any, path: Path) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    names = unbatchable_cache_types(make_prompt_cache(model))
    if names:
        raise UnsupportedModelError(
            f"{path.name}: its cache layers ({', '.join(names)}) cannot be batched by mlx-lm (no merge), so "
            "two requests could not decode together; prefixd refuses the model at load rather than fail "
            "its requests"
        )


def resolve_model_path(spec: str) -> Path:
    """A directory as given, or the local Hugging Face snapshot of a repo id (never downloaded)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not an MLX model directory")
        return path.resolve()
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(spec, local_files_only=True))
        except Exception:
            raise FileNotFoundError(
                f"model {spec!r} is not a local directory and not in the local Hugging Face cache; "
                "prefixd never downloads at run time (see `prefixd setup` / `prefixd import-gguf`)"
            ) from None
    raise FileNotFoundError(f"model directory {spec!r} does not exist")


def model_fingerprint(path: Path, tokenizer: Any, dtype: str, kv_bits: int = 0) -> str:
    """Identity of everything that shapes a KV cache: weights, tokenizer, template, versions, --kv-bits.

    --kv-bits is a suffix (``-q8``) rather than part of the digest: full
    precision keeps the fingerprint it always had, and the disk cache can
    tell another setting's folder of the same model (persist/cache_dir.py).
    """
    digest = hashlib.sha256()
    for file in sorted(path.iterdir()):
        if file.suffix not in {".json", ".safetensors", ".jinja", ".model", ".txt"} or not file.is_file():
            continue
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as handle:
            digest.update(handle.read(_FINGERPRINT_SAMPLE_BYTES))
            if size > 2 * _FINGERPRINT_SAMPLE_BYTES:
                handle.seek(size - _FINGERPRINT_SAMPLE_BYTES)
                digest.update(handle.read())
    digest.update(str(getattr(tokenizer, "chat_template", "")).encode())
    digest.update(f"{dtype}|mlx={mx.__version__}|mlx_lm={mlx_lm.__version__}".encode())
    return digest.hexdigest()[:16] + kv_bits_suffix(kv_bits)


def kv_bits_suffix(kv_bits: int) -> str:
    return f"-q{kv_bits}" if kv_bits else ""


def _measure_cache_bytes(model: Any, layout: CacheLayout) -> tuple[int, int, str | None, tuple[int, ...]]:
    """(bytes per token of every layer that grows with the sequence, bytes per sequence of state layers,
    the dtype of the attention KV, the head dimensions of its keys and values).

    Measured, not derived from the config: one token through a fresh live
    cache. Layers with keys and values (plain, rotating, ...) count per
    allocated slot, with the packed form a --kv-bits cache keeps beside them;
    conv/SSM state layers (ArraysCache) hold a fixed size per sequence.
    """
    cache = live_cache(model, layout)
    model(mx.array([[0]]), cache=cache)
    per_token = per_sequence = 0
    dtype, head_dims = None, set()
    for index, layer_cache in enumerate(cache):
        if index in layout.state_layers:
            arrays = [a for a in layer_cache.cache if a is not None]
            mx.eval(arrays)
            per_sequence += sum(a.nbytes for a in arrays)
            continue
        keys, values = getattr(layer_cache, "keys", None), getattr(layer_cache, "values", None)
        if keys is None or values is None:
            continue
        mx.eval(layer_cache.state, [part.state for part in getattr(layer_cache, "packed", [])])
        per_token += layer_cache.nbytes // max(keys.shape[2], 1)
        dtype = _dtype_name(keys.dtype)
        head_dims.update((keys.shape[-1], values.shape[-1]))
    return per_token, per_sequence, dtype, tuple(sorted(head_dims))


def _context_length(config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
        value = config.get(key) or config.get("text_config", {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return int(os.environ.get("PREFIXD_DEFAULT_CONTEXT", "4096"))


def _flatten(params: Any):
    from mlx.utils import tree_flatten

    return tree_flatten(params)
