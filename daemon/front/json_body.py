"""A request body's JSON, parsed with limits, so that a hostile body is a 400, not a 500 deep in the daemon.

Every HTTP API of the front reads its body through ``parse_json_body``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .http_errors import invalid

# Limits on what a request body may hold, so that a hostile one is a 400, not a 500 deep in the daemon.
MAX_JSON_DEPTH = 100  # OpenAI's bodies nest about 5 deep (messages[i].content[j].text); tool schemas a little more
MAX_INTEGER_DIGITS = 100  # the largest integer the API takes is a 64-bit seed: 20 digits
_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone one survives json.loads, then breaks the tokenizer


_invalid = invalid


class _TooManyDigits(ValueError):
    pass


def _bounded_int(digits: str) -> int:
    # json.loads would call int() itself, which gives up only at 4300 digits, and with a
    # message about sys.set_int_max_str_digits that means nothing to an HTTP client.
    if len(digits.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise _TooManyDigits(
            f"the request body holds an integer of {len(digits.lstrip('-'))} digits; at most {MAX_INTEGER_DIGITS} are accepted"
        )
    return int(digits)


def parse_json_body(text: str) -> Any:
    """A request body's JSON value; INVALID_PARAMS (HTTP 400) saying what is wrong with a bad one.

    Beyond invalid JSON, refused: integers of more than MAX_INTEGER_DIGITS
    digits, nesting deeper than MAX_JSON_DEPTH, and strings with a lone
    surrogate escape ("\\ud800"), which JSON allows but is not Unicode text.
    """
    too_deep = f"the request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays and objects"
    try:
        body = json.loads(text, parse_int=_bounded_int)
    except _TooManyDigits as exc:
        raise _invalid(str(exc)) from None
    except RecursionError:  # nesting that reaches the interpreter's recursion limit while parsing
        raise _invalid(too_deep) from None
    except json.JSONDecodeError as exc:
        raise _invalid(f"the request body is not valid JSON: {exc}") from None
    _check_values(body, too_deep)
    return body


def _check_values(body: Any, too_deep: str) -> None:
    """Walk the parsed body (without recursion, however deep it is) for what parse_json_body refuses."""
    pending: list[tuple[Any, int, str]] = [(body, 1, "")]
    while pending:
        value, depth, where = pending.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise _invalid(
                    f"{where or 'the request body'}: a lone surrogate escape (such as \\ud800) is not valid Unicode text",
                    where.split(".")[0].split("[")[0] or None,
                )
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _invalid(too_deep)
        if isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{key}" if where else key
                if _SURROGATE.search(key):
                    raise _invalid(
                        f"the key {path!r}: a lone surrogate escape (such as \\ud800) is not valid Unicode text"
                    )
                pending.append((item, depth + 1, path))
        else:
            pending.extend((item, depth + 1, f"{where}[{index}]") for index, item in enumerate(value))
