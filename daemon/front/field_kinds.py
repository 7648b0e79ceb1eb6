"""The JSON type of each request field the HTTP APIs share, checked before anything reads the field.

A field of the wrong type must be a 400 that names it, never a 500 from
``float("x")`` deep in a front, nor silently taken for something else (``n:
true`` read as 1, ``top_k: "40"`` let through because greedy decoding ignores
it, ``options.stop: {...}`` read as its keys). Each front calls
``check_field_kinds`` on its body (and Ollama on its ``options``) once its
unknown fields are refused; the fields each front then reads are known to be
of the right type. A name means the same thing in every API that has it;
fields whose type depends on the API (``logprobs``: a boolean for chat, a
count for completions) or whose shape is checked where it is read (messages,
tools, prompts) are not in the table.
"""

from __future__ import annotations

from typing import Any

from .http_errors import invalid

NUMBER, INTEGER, BOOLEAN = "a number", "an integer", "a boolean"
STRING, ARRAY, OBJECT = "a string", "an array", "an object"

FIELD_KINDS: dict[str, tuple[str, ...]] = {
    # sampling and length
    **dict.fromkeys(
        (
            "temperature",
            "top_p",
            "min_p",
            "typical_p",
            "repeat_penalty",
            "presence_penalty",
            "frequency_penalty",
            "tfs_z",
            "mirostat",
            "mirostat_tau",
            "mirostat_eta",
            "dry_multiplier",
            "dry_base",
            "xtc_probability",
            "xtc_threshold",
            "t_max_prompt_ms",
            "t_max_predict_ms",
            "n_indent",
        ),
        (NUMBER,),
    ),
    **dict.fromkeys(
        (
            "max_tokens",
            "max_completion_tokens",
            "max_output_tokens",
            "n",
            "best_of",
            "seed",
            "top_k",
            "top_logprobs",
            "repeat_last_n",
            "dry_allowed_length",
            "dry_penalty_last_n",
            "min_keep",
            "n_predict",
            "n_keep",
            "id_slot",
            "num_predict",
        ),
        (INTEGER,),
    ),
    "stop": (STRING, ARRAY),
    "stop_sequences": (ARRAY,),  # Anthropic's: an array only
    # switches
    **dict.fromkeys(
        (
            "stream",
            "store",
            "echo",
            "parallel_tool_calls",
            "cache_prompt",
            "penalize_newline",
            "penalize_nl",
            "raw",
            "timings_per_token",
            "return_tokens",
        ),
        (BOOLEAN,),
    ),
    # labels and prefixd's own
    **dict.fromkeys(
        (
            "model",
            "user",
            "session",
            "service_tier",
            "prompt_cache_key",
            "safety_identifier",
            "prompt_cache_retention",
            "previous_response_id",
            "suffix",
        ),
        (STRING,),
    ),
    **dict.fromkeys(("stream_options", "metadata", "cache", "options"), (OBJECT,)),
    "samplers": (STRING, ARRAY),  # llama.cpp takes a string of letters too
    "keep_alive": (STRING, NUMBER),  # Ollama's duration ("5m") or seconds
    # Ollama's options that tune the runtime, never the tokens
    **dict.fromkeys(("num_ctx", "num_keep", "num_thread", "num_gpu", "main_gpu", "num_batch"), (INTEGER,)),
    **dict.fromkeys(
        ("use_mmap", "use_mlock", "numa", "low_vram", "f16_kv", "vocab_only", "logits_all", "embedding_only"),
        (BOOLEAN,),
    ),
}


def kind_of(value: Any) -> str:
    """What a JSON value is, in the words of the error messages (a boolean is not a number here)."""
    if isinstance(value, bool):
        return BOOLEAN
    if isinstance(value, int):
        return INTEGER
    if isinstance(value, float):
        return NUMBER
    return {str: STRING, list: ARRAY, dict: OBJECT}.get(type(value), type(value).__name__)


def is_kind(value: Any, kind: str) -> bool:
    found = kind_of(value)
    return found == kind or (kind == NUMBER and found == INTEGER)


def check_field_kind(value: Any, name: str, kinds: tuple[str, ...]) -> None:
    """A 400 naming ``name`` unless ``value`` (not null) is of one of ``kinds``."""
    if value is not None and not any(is_kind(value, kind) for kind in kinds):
        raise invalid(f"'{name}' must be {' or '.join(kinds)}, got {kind_of(value)}", name)


def check_field_kinds(body: dict[str, Any], where: str = "") -> None:
    """A 400 naming the first field of ``body`` in FIELD_KINDS of the wrong type; ``where`` prefixes its name."""
    for name, value in body.items():
        if name in FIELD_KINDS:
            check_field_kind(value, where + name, FIELD_KINDS[name])
