"""What the daemon knows of a configured model without loading its weights.

Models load on demand (engine/model_residency.py), but the fronts must encode
prompts, the disk cache must know each model's namespace and cache layout, and
a model mlx-lm cannot batch must be refused at start, all before any weights
are read. So at start every configured model is described: its tokenizer is
loaded (no MLX), and mlx-lm builds the model *lazily* (arrays that would read
the safetensors files only when evaluated, which they never are here: about
10 ms and no weight memory for a 135M model), which gives its cache layout,
its parameter bytes and the dtype its fingerprint names, the same fingerprint
``load_model`` computes once the weights are read.

Engine thread only (the lazy model is MLX objects).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import mlx.core as mx
import structlog
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm.utils import load_tokenizer

from ..kv.layout import CacheLayout, make_cache_layout
from ..kv.quantized_kv import GROUP_SIZES, UnquantizableKV, describe_kv, group_size_for
from .chat_template_file import ChatTemplateError, ChatTemplateFile, check_all_used, check_renders, template_for
from .generic_tools import tools_path
from .kv_bits_setting import KvBitsChoice, KvBitsError, check_all_named, kv_bits_for
from .loaded_model import (
    ModelCard,
    _context_length,
    model_description,
    model_fingerprint,
    refuse_unbatchable,
    resolve_model_path,
    tokenizer_extra,
)
from .prompt_encoding import PromptEncoder

log = structlog.get_logger("prefixd.models")


@dataclass(frozen=True)
class CatalogEntry:
    """One configured model, loaded or not: its identity, tokenizer, cache layout and size."""

    name: str
    spec: str  # as configured (--model)
    path: Path
    fingerprint: str
    context_length: int
    layout: CacheLayout
    weight_bytes: int  # its parameters once loaded (with --dtype applied)
    dtype: str  # of its first parameter once loaded, as LoadedModel.dtype says it
    tokenizer: Any  # mlx_lm TokenizerWrapper: what the grammar compiler reads
    eos_token_ids: frozenset[int]
    card: ModelCard  # what the fronts read
    chat_template: str | None = None  # --chat-template's text, replacing the model's own (chat_template_file.py)

    @property
    def kv(self) -> str:
        """As LoadedModel.kv says it, but for the group size, which the first token through the model shows."""
        return describe_kv(self.layout.kv_bits, self.dtype)

    def describe(self, default: bool) -> dict[str, Any]:
        """The same keys as LoadedModel.describe, for a model that is not loaded now."""
        return model_description(self, default, None)


def describe_models(
    specs: Iterable[str],
    dtype: str,
    found_specs: Iterable[str] = (),
    chat_templates: Iterable[ChatTemplateFile] = (),
    kv_bits: Iterable[KvBitsChoice] = (),
) -> dict[str, CatalogEntry]:
    """Every configured model by name, in order (a repeated name gets a ``-N`` suffix, as before).

    ``specs`` (``--model``) must all be servable: the first that is not raises.
    ``found_specs`` (found in ``--models-dir``) come after them; one that is
    not servable is logged and passed over, and one already among ``specs``
    (the same directory) is not listed twice. ``chat_templates``
    (``--chat-template``) replace their models' own; one that names no model
    or does not render raises ChatTemplateError; a ``kv_bits`` choice
    (``--kv-bits``) that names no model, or one its model cannot take,
    raises KvBitsError, for found models too.
    """
    templates = {file.model: file for file in chat_templates}
    bits = {choice.model: choice for choice in kv_bits}
    entries: dict[str, CatalogEntry] = {}
    for spec in specs:
        entry = describe_model(spec, dtype, taken=entries, templates=templates, kv_bits=bits)
        entries[entry.name] = entry
    for spec in found_specs:
        if any(entry.path == Path(spec).resolve() for entry in entries.values()):
            continue
        try:
            entry = describe_model(spec, dtype, taken=entries, templates=templates, kv_bits=bits)
        except (ChatTemplateError, KvBitsError):
            raise  # the user's template or --kv-bits for it, not the model, is what is wrong
        except Exception as exc:  # a folder of models may hold one the engine cannot serve: the others still are
            log.warning("model_skipped", path=spec, error=f"{type(exc).__name__}: {exc}")
            continue
        entries[entry.name] = entry
    check_all_used(templates, entries)
    check_all_named(bits, entries)
    return entries


def describe_model(
    spec: str,
    dtype: str,
    taken: dict[str, Any] | None = None,
    templates: Mapping[str, ChatTemplateFile] | None = None,
    kv_bits: Mapping[str, KvBitsChoice] | None = None,
) -> CatalogEntry:
    """Raises what load_model would for a missing directory or a model the engine cannot batch."""
    path = resolve_model_path(spec)
    model, config = mlx_lm_load_model(path, lazy=True)
    refuse_unbatchable(model, path)
    if dtype != "auto":
        model.set_dtype(getattr(mx, dtype))  # lazy too: only the dtype the arrays will have is read below
    params = [value for _, value in tree_flatten(model.parameters())]
    name = path.name
    if taken and name in taken:
        name = f"{name}-{len(taken)}"
    template = template_for(templates or {}, name, is_default=not taken)
    chat_template = template.source if template is not None else None
    tokenizer = load_tokenizer(path, tokenizer_extra(chat_template), eos_token_ids=config.get("eos_token_id"))
    if template is not None:
        check_renders(tokenizer, template, name)
        log.info("chat_template_replaced", model=name, file=str(template.path), tools=tools_path(tokenizer))
    context_length = _context_length(config)
    requested_bits = kv_bits_for(kv_bits or {}, name, is_default=not taken)
    layout = make_cache_layout(model, requested_bits)
    if requested_bits and not layout.kv_bits:
        log.warning(
            "kv_bits_ignored", model=name, kv_bits=requested_bits, reason="no attention layers: no KV to quantize"
        )
    refuse_unquantizable(name, config, layout.kv_bits)
    fingerprint = model_fingerprint(path, tokenizer, str(params[0].dtype), layout.kv_bits)
    encoder = PromptEncoder(tokenizer, name, context_length)
    return CatalogEntry(
        name=name,
        spec=spec,
        path=path,
        fingerprint=fingerprint,
        context_length=context_length,
        layout=layout,
        weight_bytes=sum(value.nbytes for value in params),
        dtype=str(params[0].dtype).replace("mlx.core.", ""),
        tokenizer=tokenizer,
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
        card=ModelCard(name, fingerprint, context_length, encoder),
        chat_template=chat_template,
    )


def refuse_unquantizable(name: str, config: Mapping[str, Any], kv_bits: int) -> None:
    """KvBitsError at start for a --kv-bits model whose head dimension no quantization group divides.

    Otherwise the model would fail when it loads, on demand, at the first
    token through a round-trip cache (kv/quantized_kv.group_size_for).
    """
    head_dim = config_head_dim(config) if kv_bits else None
    if head_dim is None:
        return
    try:
        group_size_for(head_dim)
    except UnquantizableKV:
        raise KvBitsError(
            f"--kv-bits {kv_bits} for model {name}: its attention head dimension is {head_dim} (config.json), "
            f"which no quantization group ({' or '.join(map(str, GROUP_SIZES))}) divides; serve it without --kv-bits"
        ) from None


def config_head_dim(config: Mapping[str, Any]) -> int | None:
    """The head dimension of the keys and values mlx-lm caches, as the config gives it; None where it cannot tell.

    mlx-lm's attention takes ``head_dim``, else hidden_size / num_attention_heads
    (a multimodal config nests them in ``text_config``). A latent-attention
    config (``kv_lora_rank``: DeepSeek's MLA) caches other arrays, whose
    widths depend on the model code: None, and the load measures them.
    """
    for part in (config, config.get("text_config") or {}):
        if "kv_lora_rank" in part:
            return None
        if part.get("head_dim"):
            return int(part["head_dim"])
        hidden, heads = part.get("hidden_size"), part.get("num_attention_heads")
        if hidden and heads and hidden % heads == 0:
            return hidden // heads
    return None
