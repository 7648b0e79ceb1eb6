"""A request's Constraint compiled into an llguidance grammar for one model's tokenizer.

``grammar_text`` is the pure part (a Constraint -> llguidance's grammar text,
no tokenizer). ``GrammarCompiler`` is one model's: its LLTokenizer, built
once from the Hugging Face tokenizer on first use (~0.4 s for a 49k-token
vocabulary), and an LRU of grammars already checked, so the same schema sent
again costs a dictionary lookup and a matcher copy. Thread-safe; it runs on
worker threads, never on the engine thread (Engine.submit). A constraint
that does not compile raises ConstraintError, an INVALID_PARAMS naming it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable

from llguidance import LLMatcher, LLTokenizer

from ...protocol.errors import ErrorCode, RpcError
from ...protocol.methods import JSON_OBJECT, JSON_SCHEMA, LARK, REGEX, Constraint
from .grammar_state import GrammarState

# How JSON is written unless a schema's own "x-guidance" says otherwise: no
# free whitespace (a weak model could otherwise indent forever) and the
# separators of json.dumps and of the chat templates' ``tojson``.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}
MAX_GRAMMARS_PER_MODEL = 64
MAX_ERROR_CHARS = 800


class ConstraintError(RpcError):
    """A constraint that does not compile (INVALID_PARAMS), or a model whose tokenizer cannot take one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(ErrorCode.INVALID_PARAMS, message, {"param": param} if param else None)


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint (not yet checked: GrammarCompiler.compile checks it)."""
    kind = constraint.kind
    try:
        if kind == JSON_SCHEMA:
            return LLMatcher.grammar_from_json_schema(constraint.source, defaults=JSON_OPTIONS)
        if kind == JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
        if kind == REGEX:
            return LLMatcher.grammar_from_regex(constraint.source)
        if kind == LARK:
            return LLMatcher.grammar_from_lark(constraint.source)
    except ValueError as exc:  # grammar_from_json_schema: not a JSON object
        raise ConstraintError(
            f"'constraint.{kind}' does not compile: {_short(str(exc))}", f"constraint.{kind}"
        ) from None
    raise ConstraintError(f"'constraint' kind {kind!r} is not one this daemon knows", "constraint")


class GrammarCompiler:
    """One model's constraints -> matchers. ``tokenizer``: the model's Hugging Face tokenizer (fast)."""

    def __init__(
        self,
        hf_tokenizer: Any,
        eos_token_ids: Iterable[int],
        model_name: str = "",
        max_grammars: int = MAX_GRAMMARS_PER_MODEL,
    ):
        self._hf_tokenizer = hf_tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.model_name = model_name
        self.max_grammars = max_grammars
        self._lock = threading.Lock()
        self._tokenizer: LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self._grammars: OrderedDict[Constraint, LLMatcher] = OrderedDict()  # a fresh matcher each, copied per answer

    @property
    def num_cached(self) -> int:
        return len(self._grammars)

    def tokenizer(self) -> LLTokenizer:
        """The model's LLTokenizer, built on first use (under the lock: once)."""
        with self._lock:
            if self._tokenizer is None and self._tokenizer_error is None:
                self._tokenizer = self._build_tokenizer()
            if self._tokenizer is None:
                raise ConstraintError(self._tokenizer_error)
            return self._tokenizer

    def _build_tokenizer(self) -> LLTokenizer | None:
        import llguidance.hf
        from transformers import PreTrainedTokenizerBase

        hf = self._hf_tokenizer
        if not isinstance(hf, PreTrainedTokenizerBase):
            hf = getattr(hf, "_tokenizer", hf)  # an mlx-lm TokenizerWrapper: the Hugging Face tokenizer inside
        eos = sorted(self.eos_token_ids) or None
        for attempt in (1, 2):
            try:
                return llguidance.hf.from_tokenizer(hf, eos_token=eos)
            except ValueError as exc:  # a slow (Python) tokenizer: llguidance needs the Rust one
                self._tokenizer_error = (
                    f"model {self.model_name!r} cannot decode under a constraint: its tokenizer "
                    f"is not usable by llguidance ({exc})"
                )
                return None
            except RuntimeError:  # another thread held the tokenizer's state mutably for a moment
                if attempt == 2:
                    raise
        return None

    def compile(self, constraint: Constraint) -> LLMatcher:
        """A checked matcher for ``constraint`` (shared: copy it before use); raises ConstraintError."""
        with self._lock:
            matcher = self._grammars.get(constraint)
            if matcher is not None:
                self._grammars.move_to_end(constraint)
                return matcher
        tokenizer = self.tokenizer()
        grammar = grammar_text(constraint)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ConstraintError(
                f"'constraint.{constraint.kind}' does not compile: {_short(messages[0])}",
                f"constraint.{constraint.kind}",
            )
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(
                f"'constraint.{constraint.kind}' does not compile: {_short(matcher.get_error())}",
                f"constraint.{constraint.kind}",
            )
        with self._lock:
            self._grammars[constraint] = matcher
            self._grammars.move_to_end(constraint)
            while len(self._grammars) > self.max_grammars:
                self._grammars.popitem(last=False)
        return matcher

    def start(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher state for one answer under ``constraint``."""
        prototype = self.compile(constraint)
        tokenizer = self.tokenizer()
        return GrammarState(prototype.deep_copy(), tokenizer.vocab_size, self.eos_token_ids)


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."
