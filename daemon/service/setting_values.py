"""The kinds of value a setting takes: how each is read from any source, and how it is shown.

A ``ValueKind`` reads strictly (``parse``: a TOML value, an environment
string or a flag's value, raising ValueError that says what is wrong) and
tells the command-line parser how to take the flag (``flag_type``, a loose
first reading that leaves range checks to ``parse``, so that a flag's bad
value gets the same message, naming the setting and its source, as one from
the file or the environment).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True)
class ValueKind:
    """How one setting's values are read and shown."""

    parse: Callable[[Any], Any]
    name: str  # as the docs show it
    metavar: str | None = None  # None with choices: argparse shows them, {a,b}
    flag_type: Callable[[str], Any] | None = None  # argparse's first reading of the flag's text; None: the text
    choices: tuple[str, ...] | None = None
    repeatable: bool = False  # a list: the flag may be given several times
    is_switch: bool = False  # a flag that takes no value

    def named(self, metavar: str) -> ValueKind:
        return replace(self, metavar=metavar)


def parse_size(value: Any) -> int:
    """'512M', '4G', '1.5GiB' or plain bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("must not be negative")
        return value
    if not isinstance(value, str):
        raise ValueError("must be a size such as 512M or 4G")
    cleaned = value.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        size = (
            int(float(cleaned[:-1]) * SIZE_UNITS[cleaned[-1]])
            if cleaned and cleaned[-1] in SIZE_UNITS
            else int(cleaned)
        )
    except ValueError:
        raise ValueError(f"not a size: {value!r} (use e.g. 512M or 4G)") from None
    return parse_size(size)


def _size_flag(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_cache_bytes() -> int:
    """A quarter of physical memory, at most 8 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return min(total // 4, 8 << 30)


def size() -> ValueKind:
    return ValueKind(parse_size, "size: bytes, or 512M, 4G", "SIZE", _size_flag)


def whole(minimum: int, maximum: int | None = None) -> ValueKind:
    def parse(value: Any) -> int:
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError("must be a whole number")
        if value < minimum:
            raise ValueError(f"must be at least {minimum}")
        if maximum is not None and value > maximum:
            raise ValueError(f"must be at most {maximum}")
        return value

    bounds = f"{minimum} to {maximum}" if maximum is not None else f"at least {minimum}"
    return ValueKind(parse, f"whole number, {bounds}", "N", int)


def _number(minimum: float) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ValueError("must be a number") from None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError("must be a number")
        if value < minimum:
            raise ValueError(f"must be at least {minimum:g}")
        return float(value)

    return parse


def seconds(minimum: float) -> ValueKind:
    return ValueKind(_number(minimum), f"seconds, at least {minimum:g}", "SECONDS", float)


def share() -> ValueKind:
    """A share between 0 and 1."""

    def parse(value: Any) -> float:
        fraction = _number(0)(value)
        if fraction > 1:
            raise ValueError("must be between 0 and 1")
        return fraction

    return ValueKind(parse, "share, 0 to 1", "SHARE", float)


def duration() -> ValueKind:
    """How long, as Ollama's keep_alive spells it ("5m", seconds; negative: for good)."""

    def parse(value: Any) -> float:
        from ...protocol.keep_alive import parse_keep_alive

        return parse_keep_alive(value)

    return ValueKind(parse, "duration: seconds, or 5m, 1h", "DURATION")


def one_of(*choices: str) -> ValueKind:
    def parse(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return ValueKind(parse, "one of " + ", ".join(choices), choices=choices)


def switch() -> ValueKind:
    """On or off: a flag given (True); true/false in the file; 1/0, yes/no, on/off, true/false in the environment."""

    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        words = {
            "1": True,
            "yes": True,
            "on": True,
            "true": True,
            "0": False,
            "no": False,
            "off": False,
            "false": False,
        }
        if isinstance(value, str) and value.strip().lower() in words:
            return words[value.strip().lower()]
        raise ValueError("must be true or false")

    return ValueKind(parse, "true or false", is_switch=True)


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    return value


def text(metavar: str) -> ValueKind:
    return ValueKind(_text, "text", metavar)


def path(metavar: str) -> ValueKind:
    def parse(value: Any) -> Path:
        return (value if isinstance(value, Path) else Path(_text(value))).expanduser()

    return ValueKind(parse, "path", metavar, Path)


def list_of(item: ValueKind) -> ValueKind:
    """A list; a single value or, from the environment, a comma-separated string is accepted too."""

    def parse(value: Any) -> list:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        elif not isinstance(value, (list, tuple)):
            value = [value]
        return [item.parse(entry) for entry in value]

    return replace(item, parse=parse, name=f"list of {item.name}", repeatable=True)
