"""One answer's grammar matcher: the tokens sampled so far go in, the mask of allowed next tokens comes out.

The engine feeds a token to the matcher where it first knows it: the batch's
logits processor and the solo decoder feed each token as it goes into the
model, the scheduler as it goes out to the client. Either may come first (a
token computed ahead is fed before it is handed out; the first answer token
is handed out before it is fed), and a row moving between the solo path and
the batch feeds its last token again. So ``consume`` is keyed by the token's
index in the answer and is a no-op for an index already fed.

Never raises on the decode path: a grammar that fails mid-answer (a token it
refuses, a parser limit) records ``error`` and from then on allows only the
end tokens, so the row ends at its next step and the scheduler fails that one
request with the message. End tokens are never fed (the answer ends there).
Engine thread only (one sequence's state, not thread-safe); no MLX.
"""

from __future__ import annotations

import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask


class GrammarState:
    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]):
        self._matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's; a model's logits may have more rows (padding)
        self.eos_token_ids = eos_token_ids
        self._bitmask = allocate_token_bitmask(1, vocab_size)
        self._consumed: list[int] = []
        self.error: str | None = None
        self.num_masks = 0

    @property
    def num_consumed(self) -> int:
        return len(self._consumed)

    def consume(self, index: int, token: int) -> None:
        """Feed the answer's token number ``index`` (0-based) unless it was fed already."""
        if self.error is not None or index < 0:
            return
        if index < len(self._consumed):
            if self._consumed[index] != token:
                self._fail(f"answer token {index} was {self._consumed[index]}, now {token}")
            return
        if index != len(self._consumed):
            self._fail(f"answer token {index} fed before token {len(self._consumed)}")
            return
        self._consumed.append(token)
        if token in self.eos_token_ids or self._matcher.is_stopped():
            return  # the answer ends here; nothing more to match
        try:
            if not self._matcher.consume_token(token):
                self._fail(f"token {token} does not fit: {self._matcher.get_error()}")
        except Exception as exc:  # an API-level misuse: still this request's failure only
            self._fail(f"{type(exc).__name__}: {exc}")

    def allowed(self, num_logits: int) -> np.ndarray:
        """A boolean row of ``num_logits``: which tokens may come next (rows past the tokenizer's vocabulary never).

        Never empty: where the grammar allows nothing (it failed, or it is
        complete) the end tokens are allowed, so a row computed ahead still
        samples something harmless.
        """
        self.num_masks += 1
        bits = None
        if self.error is None:
            try:
                fill_next_token_bitmask(self._matcher, self._bitmask)
                if self._matcher.is_error():
                    self._fail(self._matcher.get_error())
                else:
                    bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little").view(bool)
            except Exception as exc:
                self._fail(f"{type(exc).__name__}: {exc}")
        row = np.zeros(num_logits, dtype=bool)
        if bits is not None:
            n = min(bits.size, num_logits)
            row[:n] = bits[:n]
        if not row.any():
            for token in self.eos_token_ids:
                if token < num_logits:
                    row[token] = True
        return row

    @property
    def is_finished(self) -> bool:
        """The answer is complete: the grammar allows nothing more (but an end token)."""
        return self.error is None and self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What came so far is a whole answer (it may still go on)."""
        return self.error is None and self._matcher.is_accepting()

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message.strip() or "the grammar failed"
