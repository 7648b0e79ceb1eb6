"""The request fields every HTTP API reads, under names of its own: answer length, sampling, stops, plain numbers.

OpenAI's ``max_completion_tokens``, Anthropic's ``stop_sequences``, Ollama's
``options.num_predict``, llama.cpp's ``n_predict``: each API spells them its
own way, and they all become a generate's ``max_tokens``, ``temperature``,
``top_p``, ``seed`` and ``stop``. Every front reads them here, with the
socket's rules (the ranges of ``protocol.methods.parse_generate``), so a value
is refused alike on every API, by a 400 that names the field as the client
sent it, in its message and in its data (``param``); ``parse_generate`` then
finds nothing more to refuse in them. A field of the wrong JSON type is
refused the same way (``field_kinds``), never by a 500 from ``float()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...protocol import methods as m
from .field_kinds import ARRAY, INTEGER, NUMBER, STRING, check_field_kind
from .http_errors import invalid

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True, slots=True)
class FieldNames:
    """Where an API keeps each generate field, as its clients spell it (None: it has no such field here)."""

    max_tokens: str | None = "max_tokens"
    temperature: str | None = "temperature"
    top_p: str | None = "top_p"
    seed: str | None = "seed"
    stop: str | None = "stop"


def generate_fields(
    body: dict[str, Any], names: FieldNames = FieldNames(), where: str = "", added_stops: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The generate params named by ``names`` that ``body`` holds (not null), checked; a 400 naming the first bad one.

    ``where`` prefixes the names in errors ("options."); ``added_stops`` are
    the front's own stop strings (a FIM format's end markers), put after the
    client's (see ``stop_strings``).
    """
    readers = (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p), ("seed", seed))
    params: dict[str, Any] = {}
    for key, read in readers:
        name = getattr(names, key)
        if name is not None and body.get(name) is not None:
            params[key] = read(body[name], where + name)
    stops = stop_strings(body.get(names.stop) if names.stop else None, where + (names.stop or "stop"), added_stops)
    if stops:
        params["stop"] = list(stops)
    return params


def max_tokens(value: Any, name: str) -> int:
    """An answer length: an integer from 1 to the protocol's limit."""
    check_field_kind(value, name, (INTEGER,))
    if not 1 <= value <= m.MAX_TOKENS_LIMIT:
        raise invalid(f"'{name}' must be between 1 and {m.MAX_TOKENS_LIMIT}, got {value}", name)
    return value


def temperature(value: Any, name: str) -> float:
    """A temperature from 0 (greedy) to 100; absent (None) is prefixd's default, greedy."""
    if value is None:
        return 0.0
    check_field_kind(value, name, (NUMBER,))
    if not 0.0 <= value <= MAX_TEMPERATURE:
        raise invalid(f"'{name}' must be between 0 and {MAX_TEMPERATURE:g} (0 means greedy), got {value}", name)
    return float(value)


def top_p(value: Any, name: str) -> float:
    check_field_kind(value, name, (NUMBER,))
    if not 0.0 < value <= 1.0:
        raise invalid(f"'{name}' must be in (0, 1], got {value}", name)
    return float(value)


def seed(value: Any, name: str) -> int:
    check_field_kind(value, name, (INTEGER,))
    if not 0 <= value <= MAX_SEED:
        raise invalid(f"'{name}' must be between 0 and 2**63-1, got {value}", name)
    return value


def stop_strings(value: Any, name: str, added: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The client's stop strings (a string or an array of non-empty strings, at most the protocol's limit), then ``added``.

    ``added`` (the front's own) fill the room the client's leave, so a
    client that sends the most it may is never refused for them.
    """
    check_field_kind(value, name, (STRING, ARRAY))
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not all(isinstance(stop, str) and stop for stop in stops):
        raise invalid(f"'{name}' must be a string or an array of non-empty strings", name)
    if len(stops) > m.MAX_STOP_STRINGS:
        raise invalid(f"'{name}' holds {len(stops)} stop strings; at most {m.MAX_STOP_STRINGS} are taken", name)
    room = m.MAX_STOP_STRINGS - len(stops)
    return (*stops, *[stop for stop in added if stop not in stops][:room])


def non_negative(value: Any, name: str) -> float:
    """A number of at least 0; absent (None) is 0."""
    if value is None:
        return 0.0
    check_field_kind(value, name, (NUMBER,))
    if value < 0:
        raise invalid(f"'{name}' must be a non-negative number, got {value}", name)
    return float(value)
