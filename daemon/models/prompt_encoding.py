"""Prompts to token ids: text, chat messages (through the model's chat template) or ids as given.

A chat prompt also records where each message ends in the tokens, so the
prefill can checkpoint there and a reply can say which message a miss
diverged in. Pure Python on the tokenizer (no MLX).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from ...protocol.errors import ErrorCode, RpcError
from ...protocol.methods import PromptInput
from ..common_prefix import common_prefix_length


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

    def message_at(self, token_index: int) -> MessageSpan | None:
        """The message whose tokens include ``token_index`` (chat prompts only)."""
        ends = [span.end_token for span in self.message_spans]
        position = bisect.bisect_right(ends, token_index)
        if position < len(self.message_spans):
            return self.message_spans[position]
        return None


class PromptEncoder:
    """Encodes prompts for one model's tokenizer (an mlx-lm TokenizerWrapper)."""

    def __init__(self, tokenizer: Any, model_name: str):
        self.tokenizer = tokenizer
        self.model_name = model_name

    def encode(self, prompt: PromptInput) -> EncodedPrompt:
        """Token ids for a prompt given as text, chat messages or ids."""
        if prompt.tokens is not None:
            vocab_size = len(self.tokenizer)
            bad = next((t for t in prompt.tokens if t >= vocab_size), None)
            if bad is not None:
                raise RpcError(ErrorCode.INVALID_PARAMS, f"token id {bad} is outside the vocabulary (size {vocab_size})")
            return EncodedPrompt(list(prompt.tokens))
        if prompt.text is not None:
            return EncodedPrompt(self.tokenizer.encode(prompt.text), prompt.text)
        return self._encode_messages(list(prompt.messages), prompt.add_generation_prompt)

    def render_messages(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if not self.tokenizer.has_chat_template:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"model {self.model_name} has no chat template; send 'prompt' text instead")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # a template may reject e.g. an unknown role
            raise RpcError(ErrorCode.INVALID_PARAMS, f"the chat template rejected the messages: {exc}") from None

    def _encode_messages(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> EncodedPrompt:
        text = self.render_messages(messages, add_generation_prompt)
        token_ids, token_ends = self._encode_with_offsets(text)
        spans = []
        for index in range(len(messages)):
            # A message boundary is where the rendering of messages[:index+1]
            # stops agreeing with the full rendering: templates that rewrite
            # earlier text (or add a default system prompt) are handled too.
            partial = self.render_messages(messages[: index + 1], add_generation_prompt=False)
            agree = common_prefix_length(partial, text)
            end_token = bisect.bisect_right(token_ends, agree)
            spans.append(MessageSpan(index, messages[index]["role"], end_token))
        return EncodedPrompt(token_ids, text, tuple(spans))

    def _encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        backend = getattr(self.tokenizer._tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer: no offsets, so no message boundaries
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return ids, [0] * len(ids)
        encoding = backend.encode(text, add_special_tokens=False)
        return list(encoding.ids), [end for _, end in encoding.offsets]
