"""Tokenize a rendered chat by reusing the tokens of an earlier one that starts the same way.

Tokenizing is the dear part of encoding a chat (templating a 3k-token chat
takes 0.1 ms here, tokenizing it 16 ms), and a prefix cache's traffic is
texts that start like earlier ones: the same prompt again, the next turn of a
chat, another question on the same system prompt. Tokens cannot be reused at
an arbitrary character (BPE merges across it), but they can up to the start
of a special token such as ``<|im_start|>``: the tokenizer splits the text on
its added special tokens before anything else, so what comes before one is
tokenized without looking past it. So the new text's tokens are the earlier
text's tokens up to the last special token both texts share in full, plus a
fresh tokenization of the rest.

Thread-safe (the fronts encode on two worker threads); pure Python.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from ..common_prefix import common_prefix_length

# ids, start and end character offsets of each token
Tokenized = tuple[list[int], list[int], list[int]]

MAX_ENTRIES = 16  # recent texts kept: each lookup compares against all of them (a C-speed compare each)
MAX_TEXT_CHARS = 1 << 22  # texts longer than this are tokenized and not kept


@dataclass(frozen=True)
class _Entry:
    text: str
    ids: list[int]
    starts: list[int]
    ends: list[int]
    cuts: list[int]  # token indices of special tokens, ascending: where a later text may be cut
    answer_end: bool = False  # ends where a model's answer ended (extend): a cut too, before a special token


class TokenizationMemo:
    def __init__(self, tokenize: Callable[[str], Tokenized], special_tokens: dict[int, str]):
        """``special_tokens``: id -> text of the tokenizer's added special tokens."""
        self._tokenize = tokenize
        self._special_tokens = special_tokens
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.reused_tokens = 0  # for tests and the bench: tokens taken from earlier texts

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        """(token ids, end character offsets) of ``text``, as the tokenizer gives them."""
        with self._lock:
            exact = self._entries.get(text)
            if exact is not None:
                self._entries.move_to_end(text)
                self.reused_tokens += len(exact.ids)
                return list(exact.ids), list(exact.ends)
            base, num_tokens = self._best_base(text)
        if base is None:
            ids, starts, ends = self._tokenize(text)
        else:
            cut = base.starts[num_tokens] if num_tokens < len(base.ids) else len(base.text)
            tail_ids, tail_starts, tail_ends = self._tokenize(text[cut:])
            ids = base.ids[:num_tokens] + tail_ids
            starts = base.starts[:num_tokens] + [s + cut for s in tail_starts]
            ends = base.ends[:num_tokens] + [e + cut for e in tail_ends]
        self._remember(text, ids, starts, ends, num_tokens)
        return list(ids), list(ends)

    def extend(
        self, text: str, more_text: str, more_ids: list[int], more_starts: list[int], more_ends: list[int]
    ) -> bool:
        """Keep ``text + more_text`` as ``text``'s kept tokens followed by ``more_ids``; False when ``text`` is not kept.

        For an answer: the tokens a model generated after a prompt, which a
        later chat holding that answer should get back, even where the
        tokenizer would split the answer's text otherwise. Offsets are
        relative to ``more_text``.
        """
        with self._lock:
            base = self._entries.get(text)
        if base is None:
            return False
        cut = len(text)
        self._remember(
            text + more_text,
            base.ids + list(more_ids),
            base.starts + [s + cut for s in more_starts],
            base.ends + [e + cut for e in more_ends],
            0,
            answer_end=True,
        )
        return True

    def _best_base(self, text: str) -> tuple[_Entry | None, int]:
        """The kept text whose tokens cover most of ``text``, and how many of its tokens to take."""
        best, best_tokens = None, 0
        for entry in self._entries.values():
            agree = common_prefix_length(entry.text, text)
            num_tokens = self._tokens_before(entry, agree)
            if entry.answer_end and agree == len(entry.text) and self._special_at(text, agree):
                # The template closes the answer with a special token (<|im_end|>), which the tokenizer splits
                # on first: every answer token is kept, even where no special token of its own ends it (a
                # forced call's markup written as text, ended by the grammar rather than by the model's EOS).
                num_tokens = len(entry.ids)
            if num_tokens > best_tokens:
                best, best_tokens = entry, num_tokens
        return best, best_tokens

    def _special_at(self, text: str, position: int) -> bool:
        return any(text.startswith(special, position) for special in self._special_tokens.values())

    @staticmethod
    def _tokens_before(entry: _Entry, agree: int) -> int:
        """Tokens of ``entry`` before its last special token lying wholly within the first ``agree`` characters."""
        position = bisect.bisect_right([entry.ends[i] for i in entry.cuts], agree)
        return entry.cuts[position - 1] if position else 0

    def _remember(
        self, text: str, ids: list[int], starts: list[int], ends: list[int], reused: int, answer_end: bool = False
    ) -> None:
        if len(text) > MAX_TEXT_CHARS:
            return
        # Only where the special token's own text stands in the text: an unknown
        # character may map to a special id (<unk>) and is no place to cut.
        special = self._special_tokens
        cuts = [i for i, token in enumerate(ids) if token in special and special[token] in text[starts[i] : ends[i]]]
        with self._lock:
            self.reused_tokens += reused
            self._entries[text] = _Entry(text, ids, starts, ends, cuts, answer_end)
            self._entries.move_to_end(text)
            while len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)
