"""``keep_alive``: how long a model stays loaded after a request, as Ollama spells it.

A number is seconds; a string is a Go-style duration ("5m", "1h30m", "300ms",
"-1m") or a plain number of seconds ("300", "-1"). 0 unloads the model as soon
as its requests are done; any negative value keeps it loaded for good.
Pure data: the socket protocol, the Ollama front and the daemon's
``--keep-alive`` all read it here, so they agree on every spelling.
"""

from __future__ import annotations

import math
import re
from typing import Any

FOREVER = -1.0  # what every negative keep_alive becomes
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^(-?)((?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+)$")
_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def parse_keep_alive(value: Any) -> float:
    """Seconds to stay loaded once idle (``FOREVER`` for any negative); ValueError for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError('must be a duration ("5m", "1h", "-1") or a number of seconds')
    if isinstance(value, str):
        text = value.strip()
        if _NUMBER.match(text):
            seconds = float(text)
        elif match := _DURATION.match(text):
            sign, body = match.groups()
            seconds = sum(float(amount) * _UNIT_SECONDS[unit] for amount, unit in _PART.findall(body))
            seconds = -seconds if sign else seconds
        else:
            raise ValueError(f'{value!r} is not a duration (use e.g. "5m", "1h30m", "0" or "-1")')
    else:
        seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) and seconds > 0:
        raise ValueError("must be a finite duration, or negative to keep the model loaded for good")
    return FOREVER if seconds < 0 else seconds


def describe_keep_alive(seconds: float) -> str:
    """How a parsed keep_alive reads in logs and listings: "forever", "0s", "300s"."""
    return "forever" if seconds < 0 else f"{seconds:g}s"
