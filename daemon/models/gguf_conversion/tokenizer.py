"""The Hugging Face tokenizer of a GGUF file, rebuilt from the vocabulary in its metadata.

transformers 5 ships the builders (transformers.integrations.gguf.gguf_tokenizer_mapping):
byte-level BPE ("gpt2": Llama 3, Qwen, SmolLM, LFM2) with the split regex of each llama.cpp
pre-tokenizer, and SentencePiece ("llama": Gemma, Phi-3, Llama 2) with the fixes Gemma and
Phi-3 files need. What is added here: SmolLM's digit splitting, which transformers' table lacks,
the BOS/EOS the file asks for, and the end-of-turn tokens that config.json lists as eos.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import GGUFImportError

# Pre-tokenizers of byte-level files handled besides transformers' GGUF_PRE_TOKENIZER_SPLITS:
# "default"/"gpt2" are GPT-2's own regex (GPT2Tokenizer's default); "smollm" splits digits first.
_OWN_PRE_TOKENIZERS = ("default", "gpt2", "smollm")
_CONTROL = 3  # llama.cpp's token type for control tokens


def _builders():
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping
    except ImportError as e:
        raise GGUFImportError(
            "rebuilding a GGUF tokenizer needs transformers 5 (transformers.integrations.gguf)"
        ) from e
    return gguf_tokenizer_mapping


def check_tokenizer(metadata: dict, arch: str, file_name: str) -> None:
    """Refuse, before the slow part, a tokenizer that cannot be rebuilt, naming it."""
    mapping = _builders()
    kind, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre", "default")
    if not metadata.get("tokenizer.ggml.tokens"):
        raise GGUFImportError(f"{file_name}: no vocabulary (tokenizer.ggml.tokens) in the metadata")
    if kind == "gpt2":
        known = (*_OWN_PRE_TOKENIZERS, *mapping.GGUF_PRE_TOKENIZER_SPLITS)
        if pre not in known:
            raise GGUFImportError(
                f"{file_name}: byte-level BPE pre-tokenizer {pre!r} is not "
                f"supported; supported: {', '.join(sorted(known))}"
            )
    elif kind != "llama":  # SentencePiece: one way to split, whatever "pre" says
        raise GGUFImportError(
            f"{file_name}: tokenizer {kind!r} is not supported; supported: "
            "'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
        )


def save_tokenizer(metadata: dict, arch: str, end_tokens: tuple[str, ...], out: Path) -> list[int]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json into out.

    Returns the eos token ids for config.json: the file's eos, then the end-of-turn control
    tokens of end_tokens that the vocabulary has."""
    from tokenizers import pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    mapping = _builders()
    renames = mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]
    spec = {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
    built = mapping.select_tokenizer_builder(arch, spec.get("tokenizer_type"))(spec)
    built = mapping.add_gguf_special_tokens(built, spec)
    built = mapping.set_split_regex(built, spec)
    backend = built.backend_tokenizer
    if spec.get("pre_tokenizer_type") == "smollm":  # llama.cpp: digits one by one, then GPT-2's regex
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )

    tokens = metadata["tokenizer.ggml.tokens"]

    def token(key):
        i = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", spec.get("tokenizer_type") == "llama")
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    single = ([f"{bos}"] if add_bos and bos else []) + ["$A"] + ([f"{eos}"] if add_eos and eos else [])
    specials = [(t, tokens.index(t)) for t in {bos, eos} if t and t in single]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(single + ["$B:1"]), special_tokens=specials
    )

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    # save_jinja_files=False keeps chat_template inside tokenizer_config.json.
    wrapped.save_pretrained(out, save_jinja_files=False)
    _write_configs(out)

    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    ids = {t: i for i, t in enumerate(tokens) if t in end_tokens and types[i] == _CONTROL}
    eos_ids = [metadata["tokenizer.ggml.eos_token_id"]] if eos else []
    return eos_ids + [ids[t] for t in end_tokens if t in ids and ids[t] not in eos_ids]


def _write_configs(out: Path) -> None:
    # transformers 5 names its own "TokenizersBackend" class; the 4.x name loads in both.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    specials = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(k)}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
