"""``--kv-bits``: which models quantize their attention KV, and to how many bits.

Given as ``BITS`` (the default model, the first one served) or ``NAME=BITS``
(the model ``prefixd models`` lists as NAME), once per model; BITS is 8 or 4.
A NAME that names no configured model stops the daemon at start, as a
--chat-template's does. What the option does is kv/quantized_kv.py's.
No MLX here: the settings read it before anything imports mlx.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

DEFAULT_MODEL = ""  # the model of an entry given as BITS alone
KV_BITS_CHOICES = (8, 4)  # kv/quantized_kv.KV_BITS, which imports mlx


def parse_model_entry(entry: str) -> tuple[str, str]:
    """``NAME=BITS`` or ``BITS`` -> (NAME or DEFAULT_MODEL, BITS)."""
    name, sep, bits = entry.rpartition("=")
    return (name, bits) if sep else (DEFAULT_MODEL, entry)


class KvBitsError(ValueError):
    """A ``--kv-bits`` that cannot be used; the message says which entry."""


@dataclass(frozen=True)
class KvBitsChoice:
    model: str  # a model's name, or DEFAULT_MODEL
    bits: int


def parse_kv_bits_entry(value: Any) -> str:
    """One entry as the settings take it: ``8``, ``4`` or ``NAME=8`` (a number alone from a config file)."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not text:
        raise ValueError("must be 8 or 4, or NAME=8 / NAME=4")
    _, bits = parse_model_entry(text)
    if bits not in {str(choice) for choice in KV_BITS_CHOICES}:
        raise ValueError(f"{text!r}: the bits must be 8 or 4 (NAME=8 for one model)")
    return text


def read_kv_bits(entries: Iterable[str]) -> tuple[KvBitsChoice, ...]:
    """The choices of checked ``--kv-bits`` entries; KvBitsError for two given to one model."""
    choices: dict[str, KvBitsChoice] = {}
    for entry in entries:
        model, bits = parse_model_entry(entry)
        if model in choices:
            which = f"model {model}" if model else "the default model"
            raise KvBitsError(f"two --kv-bits for {which}: {choices[model].bits} and {bits}")
        choices[model] = KvBitsChoice(model, int(bits))
    return tuple(choices.values())


def kv_bits_for(choices: Mapping[str, KvBitsChoice], name: str, is_default: bool) -> int:
    """The bits chosen for the model ``name`` (by name, or as the default model), 0 when none."""
    named, default = choices.get(name), choices.get(DEFAULT_MODEL) if is_default else None
    if named is not None and default is not None and named.bits != default.bits:
        raise KvBitsError(f"two --kv-bits for model {name}: {default.bits} (the default model's) and {named.bits}")
    chosen = named or default
    return chosen.bits if chosen is not None else 0


def check_all_named(choices: Mapping[str, KvBitsChoice], names: Iterable[str]) -> None:
    """Every NAME= names a configured model (a typo must not leave a model at full precision unnoticed)."""
    known = list(names)
    for model, choice in choices.items():
        if model != DEFAULT_MODEL and model not in known:
            raise KvBitsError(
                f"--kv-bits {model}={choice.bits}: no model is named {model!r} (models: {', '.join(known) or 'none'})"
            )
