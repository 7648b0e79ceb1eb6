"""Method names, protocol constants and parameter validation.

Every prefixd method takes one map as the only element of ``params``. The
validators here turn that map into typed parameters or raise INVALID_PARAMS
with a message naming the offending field, so every client gets the same
answer for the same mistake.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import ErrorCode, RpcError
from .keep_alive import parse_keep_alive
from .tools import ToolChoice, parse_message_tool_fields, parse_tool_choice, parse_tools

PROTOCOL_VERSION = 1

HELLO = "hello"
PING = "ping"
GENERATE = "generate"
TOKENIZE = "tokenize"
MODELS = "models"
STATS = "stats"
CANCEL = "cancel"
CACHE_WARM = "cache.warm"
CACHE_PIN = "cache.pin"
CACHE_UNPIN = "cache.unpin"
GENERATE_CHUNK = "generate.chunk"  # server -> client notification while streaming

METHODS = (HELLO, PING, GENERATE, TOKENIZE, MODELS, STATS, CANCEL, CACHE_WARM, CACHE_PIN, CACHE_UNPIN)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"

MAX_STOP_STRINGS = 16
MAX_TOKENS_LIMIT = 1 << 20
MAX_CONSTRAINT_CHARS = 1 << 18  # a JSON schema (as JSON text), a regex or a Lark grammar

# constraint kinds: the one key of a generate's ``constraint`` map
JSON_SCHEMA = "json_schema"
JSON_OBJECT = "json_object"
REGEX = "regex"
LARK = "lark"
CONSTRAINT_KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, LARK)


def _invalid(message: str, param: str | None = None) -> RpcError:
    """INVALID_PARAMS; ``param`` names the field at fault, as the error's data ({"param": ...})."""
    return RpcError(ErrorCode.INVALID_PARAMS, message, {"param": param} if param else None)


def single_map_param(params: list[Any]) -> dict[str, Any]:
    """The one map a prefixd method takes; an empty params array means {}."""
    if not params:
        return {}
    if len(params) != 1 or not isinstance(params[0], dict):
        raise _invalid('params must be an array holding one map, e.g. [{"prompt": "..."}]')
    return params[0]


def _check_keys(params: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(str(key) for key in params if key not in allowed)
    if unknown:
        raise _invalid(f"unknown parameter(s): {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def _get(params: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise _invalid(f"'{key}' must be {what}, got a boolean", key)
    if not isinstance(value, kinds):
        raise _invalid(f"'{key}' must be {what}, got {type(value).__name__}", key)
    return value


@dataclass(frozen=True, slots=True)
class CacheOptions:
    """Per-request cache switches: ``cache: {use, store, verify}``.

    ``verify``: once the answer is done, re-run the request without the
    cache and put the comparison in the reply (``verify`` map); greedy only.
    """

    use: bool = True
    store: bool = True
    verify: bool = False


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the answer must match, enforced token by token while it is sampled (constrained decoding).

    ``kind`` is one of CONSTRAINT_KINDS; ``source`` is the JSON schema as
    JSON text (json_schema), "" (json_object: any JSON object), the pattern
    (regex: the whole answer matches it) or the grammar (lark, llguidance's
    Lark dialect). Build one with the class methods; a front that forces an
    answer's shape (a tool call) puts one on GenerateParams.constraint.
    Whether the grammar compiles is the daemon's check, not this one's.
    """

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> "Constraint":
        return cls(JSON_SCHEMA, _schema_text(schema, "json_schema"))

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls(JSON_OBJECT, "")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls(REGEX, pattern)

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        return cls(LARK, grammar)

    def to_wire(self) -> dict[str, Any]:
        """The ``constraint`` map that parse_constraint reads back."""
        if self.kind == JSON_SCHEMA:
            return {JSON_SCHEMA: json.loads(self.source)}
        return {self.kind: True if self.kind == JSON_OBJECT else self.source}


def _schema_text(schema: Any, where: str) -> str:
    if not isinstance(schema, dict):
        raise _invalid(f"'{where}' must be a JSON schema (a map), got {type(schema).__name__}", where)
    try:
        # Key order kept: a schema's property order is the order the answer writes them in.
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _invalid(f"'{where}' is not a JSON schema: {exc}", where) from None


def parse_constraint(raw: Any, where: str = "constraint") -> Constraint | None:
    """``{json_schema: {...}}``, ``{json_object: true}``, ``{regex: "..."}`` or ``{lark: "..."}``; None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in CONSTRAINT_KINDS:
        raise _invalid(
            f"'{where}' must be a map with exactly one of {', '.join(CONSTRAINT_KINDS)}, "
            'e.g. {"json_schema": {"type": "object"}} or {"regex": "[0-9]+"}',
            where,
        )
    ((kind, value),) = raw.items()
    if kind == JSON_OBJECT:
        if value is not True:
            raise _invalid(f"'{where}.json_object' must be true", f"{where}.json_object")
        return Constraint.json_object()
    if kind == JSON_SCHEMA:
        constraint = Constraint(JSON_SCHEMA, _schema_text(value, f"{where}.json_schema"))
    elif not isinstance(value, str) or not value:
        raise _invalid(f"'{where}.{kind}' must be a non-empty string", f"{where}.{kind}")
    else:
        constraint = Constraint(kind, value)
    if len(constraint.source) > MAX_CONSTRAINT_CHARS:
        raise _invalid(f"'{where}.{kind}' is longer than {MAX_CONSTRAINT_CHARS} characters", f"{where}.{kind}")
    return constraint


@dataclass(frozen=True, slots=True)
class PromptInput:
    """Exactly one of text, messages or tokens."""

    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tokens: tuple[int, ...] | None = None
    add_generation_prompt: bool = True
    tools: tuple[dict[str, Any], ...] | None = None  # (messages only) for the chat template's tools section


@dataclass(frozen=True, slots=True)
class GenerateParams:
    prompt: PromptInput
    model: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    session: str | None = None
    cache: CacheOptions = field(default_factory=CacheOptions)
    constraint: Constraint | None = None  # the answer's grammar (constrained decoding)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    keep_alive: float | None = None  # seconds the model stays loaded once idle (negative: for good); None: the daemon's


_PROMPT_KEYS = {"prompt", "messages", "tokens", "add_generation_prompt", "model", "session", "cache", "tools"}
_GENERATE_KEYS = _PROMPT_KEYS | {
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "constraint",
    "tool_choice",
    "keep_alive",
}


def parse_prompt_input(params: dict[str, Any]) -> PromptInput:
    """Validate the prompt part shared by generate, tokenize and cache.*."""
    given = [key for key in ("prompt", "messages", "tokens") if params.get(key) is not None]
    if len(given) != 1:
        raise _invalid("give exactly one of 'prompt' (text), 'messages' (chat) or 'tokens' (ids)")
    add_gen = _get(params, "add_generation_prompt", (bool,), True, "a boolean")
    tools = parse_tools(params.get("tools"))
    if tools is not None and given[0] != "messages":
        raise _invalid("'tools' go into the chat template: they need 'messages'", "tools")
    if given[0] == "prompt":
        return PromptInput(text=_get(params, "prompt", (str,), None, "a string"))
    if given[0] == "tokens":
        tokens = params["tokens"]
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise _invalid("'tokens' must be a non-empty array of integers", "tokens")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise _invalid("'tokens' must hold non-negative integers only", "tokens")
        return PromptInput(tokens=tuple(tokens))
    return PromptInput(messages=_parse_messages(params["messages"]), add_generation_prompt=add_gen, tools=tools)


def _parse_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise _invalid("'messages' must be a non-empty array of {role, content} maps", "messages")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _invalid(f"messages[{index}] must be a map with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        tool_fields = parse_message_tool_fields(index, message)
        if content is None and "tool_calls" in tool_fields:
            content = ""  # an assistant turn that only calls tools
        if not isinstance(role, str) or not isinstance(content, str):
            raise _invalid(f"messages[{index}] needs string 'role' and 'content'")
        parsed.append({"role": role, "content": content, **tool_fields})
    return tuple(parsed)


def parse_cache_options(params: dict[str, Any]) -> CacheOptions:
    raw = _get(params, "cache", (dict,), {}, "a map {use: bool, store: bool, verify: bool}")
    _check_keys(raw, {"use", "store", "verify"})
    return CacheOptions(
        use=_get(raw, "use", (bool,), True, "a boolean"),
        store=_get(raw, "store", (bool,), True, "a boolean"),
        verify=_get(raw, "verify", (bool,), False, "a boolean"),
    )


def parse_generate(params: dict[str, Any]) -> GenerateParams:
    """Validate ``generate`` parameters."""
    _check_keys(params, _GENERATE_KEYS)
    max_tokens = _get(params, "max_tokens", (int,), 256, "an integer")
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise _invalid(f"'max_tokens' must be between 1 and {MAX_TOKENS_LIMIT}", "max_tokens")
    temperature = float(_get(params, "temperature", (int, float), 0.0, "a number"))
    if not 0.0 <= temperature <= 100.0:
        raise _invalid("'temperature' must be between 0 and 100 (0 means greedy)", "temperature")
    top_p = float(_get(params, "top_p", (int, float), 1.0, "a number"))
    if not 0.0 < top_p <= 1.0:
        raise _invalid("'top_p' must be in (0, 1]", "top_p")
    seed = _get(params, "seed", (int,), None, "an integer")
    if seed is not None and not 0 <= seed < 2**63:
        raise _invalid("'seed' must be between 0 and 2**63-1", "seed")
    stop = params.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise _invalid("'stop' must be a string or an array of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise _invalid(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    cache = parse_cache_options(params)
    if cache.verify and temperature > 0:
        raise _invalid("'cache.verify' compares greedy runs: it needs temperature 0", "cache.verify")
    constraint = parse_constraint(params.get("constraint"))
    if cache.verify and constraint is not None:
        raise _invalid(
            "'cache.verify' re-runs the request unconstrained: it cannot go with 'constraint'", "cache.verify"
        )
    prompt = parse_prompt_input(params)
    tool_choice = parse_tool_choice(params.get("tool_choice"), prompt.tools)
    if tool_choice.forces_call and (constraint is not None or cache.verify):
        # The daemon forces the call with a grammar of its own (the model's tool-call format).
        raise _invalid(
            f"'tool_choice' that forces a call constrains the answer itself: it cannot go with "
            f"'{'constraint' if constraint is not None else 'cache.verify'}'",
            "tool_choice",
        )
    return GenerateParams(
        prompt=prompt,
        model=_get(params, "model", (str,), None, "a string"),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=tuple(stop),
        stream=_get(params, "stream", (bool,), False, "a boolean"),
        session=_get(params, "session", (str,), None, "a string"),
        cache=cache,
        constraint=constraint,
        tool_choice=tool_choice,
        keep_alive=_keep_alive(params.get("keep_alive")),
    )


def _keep_alive(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise _invalid(f"'keep_alive' {exc}", "keep_alive") from None


def parse_prompt_request(params: dict[str, Any], extra: set[str] = frozenset()) -> tuple[PromptInput, str | None]:
    """Validate tokenize / cache.* parameters: a prompt and an optional model."""
    _check_keys(params, _PROMPT_KEYS | set(extra))
    return parse_prompt_input(params), _get(params, "model", (str,), None, "a string")


def parse_cancel(params: dict[str, Any]) -> int:
    """``cancel`` takes {id: msgid of a request on the same connection}."""
    _check_keys(params, {"id"})
    msgid = params.get("id")
    if not isinstance(msgid, int) or isinstance(msgid, bool) or not 0 <= msgid < 2**32:
        raise _invalid("'id' must be the integer msgid of a generate request on this connection", "id")
    return msgid
