"""Tokenizer metadata for the tiny GGUF files: small vocabularies in llama.cpp's two kinds.

Byte-level BPE ("gpt2": llama, qwen2, qwen3, lfm2, each with its architecture's pre-tokenizer)
and SentencePiece ("llama": gemma3, phi3, with byte-fallback tokens), with special tokens marked
as control the way llama.cpp's converter marks them.
"""

from __future__ import annotations

import gguf

_NORMAL, _CONTROL, _BYTE = 1, 3, 6
_WORD_PIECES = ["t", "h", "e", "a", "c", "s", "i", "n", "o", "r", "th", "he", "the", "at", "in",
                "on", "er", "cat", "sat"]


def _byte_chars() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (bytes_to_unicode), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _bpe() -> tuple[list[str], list[int], list[str]]:
    tokens = _byte_chars()
    merges = ["Ġ t", "h e", "Ġt he", "a t", "i n", "o n", "e r", "c at", "s at", "Ġ c", "Ġc at",
              "Ġ s", "Ġs at"]
    tokens += ["".join(m.split(" ")) for m in merges]
    types = [_NORMAL] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [_CONTROL] * 3
    return tokens, types, merges


def _spm(specials: list[str], end: str) -> tuple[list[str], list[int], list[float]]:
    tokens = list(specials)
    types = [_CONTROL] * len(specials)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [_BYTE] * 256
    pieces = ["▁"] + _WORD_PIECES + ["▁" + p for p in ("t", "the", "c", "cat", "s", "sat", "on")]
    tokens += pieces
    types += [_NORMAL] * len(pieces)
    tokens.append(end)
    types.append(_CONTROL)
    scores = [0.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(len(pieces))] + [0.0]
    return tokens, types, scores


_BPE_TOKENS, _BPE_TYPES, _BPE_MERGES = _bpe()
_GEMMA = _spm(["<pad>", "<eos>", "<bos>", "<unk>"], "<end_of_turn>")
_PHI3 = _spm(["<unk>", "<s>", "</s>"], "<|end|>")
VOCAB = {"llama": _BPE_TOKENS, "qwen2": _BPE_TOKENS, "qwen3": _BPE_TOKENS, "lfm2": _BPE_TOKENS,
         "gemma3": _GEMMA[0], "phi3": _PHI3[0]}
PRE_TOKENIZER = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "lfm2": "lfm2"}


def add_tokenizer(writer: gguf.GGUFWriter, arch: str) -> None:
    if arch in PRE_TOKENIZER:
        writer.add_string("tokenizer.ggml.model", "gpt2")
        writer.add_string("tokenizer.ggml.pre", PRE_TOKENIZER[arch])
        writer.add_array("tokenizer.ggml.tokens", _BPE_TOKENS)
        writer.add_array("tokenizer.ggml.token_type", _BPE_TYPES)
        writer.add_array("tokenizer.ggml.merges", _BPE_MERGES)
        writer.add_uint32("tokenizer.ggml.bos_token_id", _BPE_TOKENS.index("<|im_start|>"))
        writer.add_uint32("tokenizer.ggml.eos_token_id", _BPE_TOKENS.index("<|endoftext|>"))
        writer.add_bool("tokenizer.ggml.add_bos_token", False)
        writer.add_string("tokenizer.chat_template", "{% for m in messages %}<|im_start|>"
                          "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
        return
    tokens, types, scores = _GEMMA if arch == "gemma3" else _PHI3
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_string("tokenizer.ggml.pre", "default")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.scores", scores)
    bos, eos, unk = ("<bos>", "<eos>", "<unk>") if arch == "gemma3" else ("<s>", "</s>", "<unk>")
    writer.add_uint32("tokenizer.ggml.bos_token_id", tokens.index(bos))
    writer.add_uint32("tokenizer.ggml.eos_token_id", tokens.index(eos))
    writer.add_uint32("tokenizer.ggml.unknown_token_id", tokens.index(unk))
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_space_prefix", arch == "phi3")
