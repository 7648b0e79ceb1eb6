"""Decoding one sequence alone: plain forward passes on its own cache, one step computed ahead.

Most of the time a local daemon serves one request at a time. The batch path
(mlx-lm's BatchGenerator) costs a single sequence padding, attention masks,
per-row arrays and a copy of its cache on the way in; here a step is what
in-process mlx-lm's ``generate_step`` does: feed the last token, sample the
next, and start computing the step after it (``mx.async_eval``) before the
engine turns the token into text and hands it to the front, so the device
never waits for Python.

Invariant between steps: the cache holds the prompt and every token handed
out so far; ``pending`` is the next token, computed (or being computed) and
not handed out yet. A sequence that stops early (stop string, cancel, a
second sequence joining) therefore has an exact cache; the token computed
ahead is dropped or handed out by whoever takes the sequence over.
A constrained sequence (a grammar, constrained_sampling.py) needs each token
on the host before the next step's mask: its step reads the token first and
computes the mask while the forward pass runs.
Engine thread only.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from .constrained_sampling import mask_logits
from .sequence_state import SequenceState

# mlx-lm's generate_step returns freed buffers to the allocator this often.
CLEAR_CACHE_EVERY_STEPS = 256


class SoloDecoder:
    def __init__(
        self,
        model: Any,
        seq: SequenceState,
        last_token: int,
        max_tokens: int,
        sampler: Callable[[mx.array], mx.array],
        eos_token_ids: frozenset[int],
        stream: Any,
    ):
        """Start decoding after ``last_token`` (handed out already, not yet in ``seq.cache``).

        ``max_tokens`` counts the tokens this decoder may still hand out.
        """
        self.seq = seq
        self.cache: list[Any] = seq.cache
        self.remaining = max_tokens
        self._model = model
        self._sampler = sampler
        self._eos_token_ids = eos_token_ids
        self._stream = stream
        self._steps = 0
        self._grammar = seq.grammar
        # last_token was handed out already (or is the prompt's last: index -1)
        self._pending = self._forward(mx.array([[last_token]], dtype=mx.uint32), len(seq.generated) - 1, last_token)

    def _forward(self, inputs: mx.array, index: int, token: int | None) -> mx.array:
        """Feed ``inputs`` (1 x 1; answer token ``index``, value ``token`` when known) and start computing the token after it."""
        with mx.stream(self._stream):
            logits = self._model(inputs, cache=self.cache)[:, -1, :]
            if self._grammar is not None:
                mx.async_eval(logits)  # the forward pass runs while the mask is computed
                logits = mask_logits(self._grammar, logits, index, token)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = self._sampler(logprobs)
        mx.async_eval(token)
        return token

    def take_pending(self) -> tuple[int, bool]:
        """Hand out the token computed ahead without computing another: (token, last of the sequence)."""
        token = int(self._pending.item())
        self._pending = None
        self.remaining -= 1
        return token, token in self._eos_token_ids or self.remaining <= 0

    def step(self) -> tuple[int, bool]:
        """Hand out the next token, with the one after it already on its way: (token, last of the sequence).

        The step after is started before waiting for this token (unless the
        budget ends here), so its forward pass runs while this one's token
        goes through the detokenizer and out to the client. When this token
        turns out to be an end token, that pass is wasted: one step per
        answer, as in mlx-lm. Its input is this token, so the cache then holds
        the end token too, which is what the batch path leaves as well.
        """
        pending = self._pending
        self.remaining -= 1
        known = int(pending.item()) if self._grammar is not None else None  # the mask needs it on the host
        if self.remaining > 0:
            self._pending = self._forward(pending[None], len(self.seq.generated), known)  # handed out next
        else:
            self._pending = None
        token = int(pending.item()) if known is None else known
        self._steps += 1
        if self._steps % CLEAR_CACHE_EVERY_STEPS == 0:
            mx.clear_cache()
        return token, token in self._eos_token_ids or self.remaining <= 0
