"""Sampling fields prefixd has no sampler for, accepted only where they cannot change the answer.

prefixd samples with temperature and top_p (greedy at temperature 0). Other
APIs' clients send more knobs, often by default (llama.vim sends top_k 40,
Continue sends Ollama's num_ctx). Refusing them all would lock those clients
out; ignoring them would change answers silently. So each is accepted only
where its effect is nil, and refused with a 400 naming it otherwise:

* filters that always keep the most likely token (top_k, min_p, typical_p)
  change nothing under greedy decoding, so they are accepted at temperature 0;
* penalties and alternative samplers are accepted at their neutral value only;
* knobs that tune where or how fast a server runs (threads, GPU layers,
  mmap, batch sizes) cannot change the tokens, and are accepted and named in
  the reply's ``prefixd_notes``.
"""

from __future__ import annotations

from typing import Any

from .field_kinds import FIELD_KINDS, check_field_kind
from .http_errors import invalid

# Exact under greedy decoding: each keeps the argmax token.
GREEDY_EXACT = ("top_k", "min_p", "typical_p")
# Accepted at the value that turns them off.
NEUTRAL_VALUES: dict[str, float] = {
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "mirostat": 0,
    "tfs_z": 1.0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
}
# Only shape a penalty's window or its side effects: nothing while every penalty is neutral.
PENALTY_SHAPES = (
    "repeat_last_n",
    "penalize_newline",
    "mirostat_tau",
    "mirostat_eta",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "xtc_threshold",
    "min_keep",
)


def check_sampling_extras(fields: dict[str, Any], temperature: float, where: str = "") -> list[str]:
    """Refuse (400) the extras in ``fields`` that would change the answer; return notes on the accepted ones.

    ``fields`` holds only the extras a caller found in its request (not the
    fields prefixd samples with); ``temperature`` is the request's, already
    read (request_fields); ``where`` prefixes the field names ("options.").
    """
    notes: list[str] = []
    for name, value in fields.items():
        if value is None:
            continue
        if name in FIELD_KINDS:  # of the wrong type, it is refused whatever the temperature
            check_field_kind(value, where + name, FIELD_KINDS[name])
        if name in GREEDY_EXACT:
            if temperature > 0:
                raise invalid(
                    f"'{where}{name}' is not supported with temperature > 0 (prefixd samples with temperature "
                    f"and top_p only); at temperature 0 it is accepted, as it cannot change a greedy answer",
                    where + name,
                )
            notes.append(f"{where}{name}: no effect under greedy decoding (temperature 0)")
        elif name in NEUTRAL_VALUES:
            if not _is_number(value) or value != NEUTRAL_VALUES[name]:
                raise invalid(
                    f"'{where}{name}' is not supported except at its neutral value {NEUTRAL_VALUES[name]:g}",
                    where + name,
                )
        elif name in PENALTY_SHAPES:
            continue  # every penalty is neutral (checked above), so these shape nothing
        else:
            raise invalid(f"'{where}{name}' is not supported by prefixd", where + name)
    return notes


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
