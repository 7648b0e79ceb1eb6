"""Prompts to token ids: text, chat messages (through the model's chat template) or ids as given.

A chat prompt also records where each message ends in the tokens, so the
prefill can checkpoint there and a reply can say which message a miss
diverged in. Pure Python on the tokenizer (no MLX).
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from ...protocol.errors import ErrorCode, RpcError
from ...protocol.methods import PromptInput
from ..common_prefix import common_prefix_length
from . import generic_tools
from .tokenization_memo import TokenizationMemo


@dataclass(frozen=True)
class MessageSpan:
    """Where message ``index`` ends in the prompt's tokens (exclusive)."""

    index: int
    role: str
    end_token: int


@dataclass(frozen=True)
class EncodedPrompt:
    tokens: list[int]
    text: str | None = None
    message_spans: tuple[MessageSpan, ...] = ()
    encode_seconds: float = 0.0  # templating and tokenizing, for the reply's timings
    tools: str | None = None  # a chat with tools: how they went in ("template" or "generic", generic_tools.py)

    def message_at(self, token_index: int) -> MessageSpan | None:
        """The message whose tokens include ``token_index`` (chat prompts only).

        None where that cannot be told: past the last message, or where the
        boundary of the message before it is not known (long chats, see
        PromptEncoder._message_ends).
        """
        spans = self.message_spans
        position = bisect.bisect_right([span.end_token for span in spans], token_index)
        if position >= len(spans):
            return None
        previous_index = spans[position - 1].index if position else -1
        return spans[position] if spans[position].index == previous_index + 1 else None


# Chats up to this long get an exact boundary for every message (one render of
# each prefix: quadratic, but cheap at this size). Longer ones get exact
# boundaries for their last EXACT_TAIL_MESSAGES messages (a chat's next turn
# diverges there) and content-end boundaries before them, so encoding stays
# linear in the chat's size however many messages it has.
EXACT_BOUNDARY_MESSAGES = 16
EXACT_TAIL_MESSAGES = 4
MAX_MESSAGE_GAP_CHARS = 4096  # template text between one message's content and the next one's, at most


class PromptEncoder:
    """Encodes prompts for one model's tokenizer (an mlx-lm TokenizerWrapper) and checks they fit.

    Thread-safe and MLX-free: the fronts run it on worker threads, so the
    engine thread never templates or tokenizes.
    """

    def __init__(self, tokenizer: Any, model_name: str, context_length: int):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context_length = context_length
        self._max_token_chars: int | None = None
        self._min_tokens_per_message: int | None = None
        self._tools_path: str | None = None
        # A fast tokenizer's own (tokenizers.Tokenizer): offsets, and encoding without special tokens. None: a slow one.
        self._backend = getattr(getattr(tokenizer, "_tokenizer", None), "backend_tokenizer", None)
        self._memo = self._make_memo()
        self._raw_frame = self._make_raw_frame()

    def _make_memo(self) -> TokenizationMemo | None:
        """A memo of recent chats' tokens (fast tokenizers only: it needs their offsets)."""
        backend = self._backend
        if backend is None:
            return None
        special = {i: added.content for i, added in backend.get_added_tokens_decoder().items() if added.special}

        def tokenize(text: str) -> tuple[list[int], list[int], list[int]]:
            encoding = backend.encode(text, add_special_tokens=False)
            return list(encoding.ids), [start for start, _ in encoding.offsets], [end for _, end in encoding.offsets]

        return TokenizationMemo(tokenize, special) if special else None

    def _make_raw_frame(self) -> tuple[list[int], list[int]] | None:
        """The ids ``tokenizer.encode`` puts before and after a raw text's own (a BOS, an EOS), where that is all it adds.

        A raw prompt (completions, infill, ``prompt=``) can then go through the
        memo, which tokenizes without special tokens, and be framed the same
        way: a long raw prompt sent again is not tokenized again (32,000
        tokens: about 110 ms on the H100 host's CPU). None where the
        framing is not that simple; such a tokenizer encodes every raw prompt whole.
        """
        if self._memo is None:
            return None
        backend = self._backend
        probes = ["Hello, world.\n  x = [1, 2]", " leading space", "two\n\nlines ✓"]
        frames = set()
        for probe in probes:
            full = list(self.tokenizer.encode(probe))
            own = list(backend.encode(probe, add_special_tokens=False).ids)
            starts = [k for k in range(len(full) - len(own) + 1) if full[k : k + len(own)] == own]
            if len(starts) != 1:
                return None
            frames.add((tuple(full[: starts[0]]), tuple(full[starts[0] + len(own) :])))
        if len(frames) != 1:
            return None
        head, tail = frames.pop()
        if list(self.tokenizer.encode("")) != [*head, *tail]:
            return None
        return list(head), list(tail)

    def _encode_raw(self, text: str) -> list[int]:
        """A raw prompt's ids, exactly as ``tokenizer.encode`` gives them."""
        if self._raw_frame is None:
            return list(self.tokenizer.encode(text))
        head, tail = self._raw_frame
        return head + self._memo.encode(text)[0] + tail

    def encode(self, prompt: PromptInput, generates: bool | None = True) -> EncodedPrompt:
        """Token ids for a prompt given as text, chat messages or ids.

        With ``generates`` True (a generate) or False (a cache.warm) the
        prompt must fit the context (RpcError otherwise), and one that
        certainly cannot (see ``min_tokens``) is refused before it is
        templated or tokenized. None: no length check (tokenize, pin).
        """
        started = time.perf_counter()
        if generates is not None:
            lower_bound = self.min_tokens(prompt)
            if lower_bound > self._limit(generates):
                raise self._too_long(lower_bound, generates, at_least=True)
        encoded = self._encode(prompt)
        if generates is not None:
            self.check_length(len(encoded.tokens), generates)
        return dataclasses.replace(encoded, encode_seconds=time.perf_counter() - started)

    def remember_answer(self, prompt: EncodedPrompt, answer_tokens: list[int]) -> bool:
        """Let a later chat that holds this answer after this prompt be encoded with the answer's own tokens.

        A model's tokens for its answer (sampled freely, or under a grammar)
        need not be how the tokenizer splits the answer's text; the next turn,
        tokenized afresh, would then stop matching the cached answer where
        they differ. Kept only where the tokens decode to exactly the prompt's
        text plus the answer's (True then). Any thread, like encode.
        """
        if self._memo is None or prompt.text is None or not answer_tokens:
            return False
        detokenizer = self.tokenizer.detokenizer
        pieces, starts, ends, position = [], [], [], 0
        for token in answer_tokens:
            detokenizer.add_token(token)
            piece = detokenizer.last_segment
            starts.append(position)
            position += len(piece)
            ends.append(position)
            pieces.append(piece)
        detokenizer.finalize()
        pieces.append(detokenizer.last_segment)
        ends[-1] += len(pieces[-1])
        answer = "".join(pieces)
        if self.tokenizer.decode(list(prompt.tokens) + list(answer_tokens)) != prompt.text + answer:
            return False  # a tokenizer whose decoding is not the text it encoded (spaces it strips): no shortcut
        return self._memo.extend(prompt.text, answer, list(answer_tokens), starts, ends)

    def check_length(self, num_prompt_tokens: int, generates: bool = True) -> None:
        """A prompt must fit the context, leaving room for one new token when it generates."""
        if num_prompt_tokens == 0:
            raise RpcError(ErrorCode.INVALID_PARAMS, "the prompt is empty")
        if num_prompt_tokens > self._limit(generates):
            raise self._too_long(num_prompt_tokens, generates)

    def min_tokens(self, prompt: PromptInput) -> int:
        """A cheap lower bound on the prompt's token count, computed without the tokenizer.

        Text: no token is longer than the vocabulary's longest token string.
        Chats: that, or each message's share of the template's own tokens
        (measured once per model), whichever is larger.
        """
        if prompt.tokens is not None:
            return len(prompt.tokens)
        if prompt.text is not None:
            return len(prompt.text) // self.max_token_chars()
        messages = prompt.messages
        num_chars = sum(len(m.get("content") or "") for m in messages)
        by_template = max(0, len(messages) - 2) * self.min_tokens_per_message()
        return max(num_chars // self.max_token_chars(), by_template)

    def max_token_chars(self) -> int:
        if self._max_token_chars is None:
            try:
                vocab = self.tokenizer.get_vocab()
                self._max_token_chars = max((len(piece) for piece in vocab), default=1) or 1
            except Exception:  # a tokenizer without a readable vocabulary: no bound from text
                self._max_token_chars = 1 << 30
        return self._max_token_chars

    def min_tokens_per_message(self) -> int:
        """Tokens the template adds per message around empty content (0 when it cannot be told)."""
        if self._min_tokens_per_message is None:
            self._min_tokens_per_message = 0
            try:
                one = [{"role": "user", "content": ""}]
                three = one + [{"role": "assistant", "content": ""}, {"role": "user", "content": ""}]
                sizes = [len(self._encode_with_offsets(self.render_messages(chat, False))[0]) for chat in (one, three)]
                self._min_tokens_per_message = max(0, (sizes[1] - sizes[0]) // 2)
            except Exception:
                pass  # no template, or one that refuses empty messages: no bound from it
        return self._min_tokens_per_message

    def _limit(self, generates: bool) -> int:
        return self.context_length - 1 if generates else self.context_length

    def _too_long(self, num_prompt_tokens: int, generates: bool, at_least: bool = False) -> RpcError:
        room = " and at least one new token" if generates else ""
        size = f"at least {num_prompt_tokens}" if at_least else f"{num_prompt_tokens}"
        return RpcError(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt has {size} tokens; model {self.model_name} has a context of {self.context_length} "
            f"for the prompt{room}",
            {"prompt_tokens": num_prompt_tokens, "context_length": self.context_length},
        )

    def _encode(self, prompt: PromptInput) -> EncodedPrompt:
        if prompt.tokens is not None:
            vocab_size = len(self.tokenizer)
            bad = next((t for t in prompt.tokens if t >= vocab_size), None)
            if bad is not None:
                raise RpcError(
                    ErrorCode.INVALID_PARAMS, f"token id {bad} is outside the vocabulary (size {vocab_size})"
                )
            return EncodedPrompt(list(prompt.tokens))
        if prompt.text is not None:
            return EncodedPrompt(self._encode_raw(prompt.text), prompt.text)
        return self._encode_messages(list(prompt.messages), prompt.add_generation_prompt, prompt.tools)

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: tuple[dict[str, Any], ...] | None = None,
    ) -> str:
        """The chat as the model's template writes it; ``tools`` fill the template's tools section.

        A template with no place for tools gets prefixd's generic tool
        section instead, and the chat's calls and results as plain messages
        (generic_tools.py).
        """
        if not self.tokenizer.has_chat_template:
            raise RpcError(
                ErrorCode.INVALID_PARAMS, f"model {self.model_name} has no chat template; send 'prompt' text instead"
            )
        if self.tools_path == generic_tools.GENERIC:
            messages, tools = generic_tools.generic_messages(messages, tools), None
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                tools=list(tools) if tools else None,
            )
        except Exception as exc:  # a template may reject e.g. an unknown role
            raise RpcError(ErrorCode.INVALID_PARAMS, f"the chat template rejected the messages: {exc}") from None

    @property
    def tools_path(self) -> str:
        """How this model takes tools: through its template, prefixd's generic section, or not at all (no template)."""
        if self._tools_path is None:
            self._tools_path = generic_tools.tools_path(self.tokenizer)
        return self._tools_path

    def _encode_messages(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: tuple[dict[str, Any], ...] | None = None,
    ) -> EncodedPrompt:
        text = self.render_messages(messages, add_generation_prompt, tools)
        token_ids, token_ends = self._encode_with_offsets(text)
        ends = self._message_ends(messages, text, tools)
        spans = tuple(
            MessageSpan(index, messages[index]["role"], bisect.bisect_right(token_ends, end)) for index, end in ends
        )
        return EncodedPrompt(token_ids, text, spans, tools=self.tools_path if tools else None)

    def _message_ends(
        self, messages: list[dict[str, Any]], text: str, tools: tuple[dict[str, Any], ...] | None = None
    ) -> list[tuple[int, int]]:
        """(message index, character offset in ``text`` where it ends), ascending.

        Exact: where the rendering of messages[:index+1] stops agreeing with
        the full rendering (templates that rewrite earlier text, or add a
        default system prompt, are handled too). Before the exact tail of a
        long chat: the end of the message's content, found by a forward scan;
        a message whose content is empty or cannot be found gets no boundary.
        """
        num_exact = len(messages) if len(messages) <= EXACT_BOUNDARY_MESSAGES else EXACT_TAIL_MESSAGES
        first_exact = len(messages) - num_exact
        ends: list[tuple[int, int]] = []
        cursor = 0
        for index in range(first_exact):
            content = messages[index].get("content") or ""
            # A bounded window: a template that rewrites content (trim) must not make this quadratic.
            found = text.find(content, cursor, cursor + len(content) + MAX_MESSAGE_GAP_CHARS) if content else -1
            if found >= 0:
                cursor = found + len(content)
                ends.append((index, cursor))
        for index in range(first_exact, len(messages)):
            partial = self.render_messages(messages[: index + 1], add_generation_prompt=False, tools=tools)
            ends.append((index, common_prefix_length(partial, text)))
        return ends

    def _encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        if self._memo is not None:
            return self._memo.encode(text)
        backend = self._backend
        if backend is None:  # a slow tokenizer: no offsets, so no message boundaries
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return ids, [0] * len(ids)
        encoding = backend.encode(text, add_special_tokens=False)
        return list(encoding.ids), [end for _, end in encoding.offsets]
