"""Continuous batching of decode steps, one batch per model: prefixd's ragged batch or mlx-lm's BatchGenerator.

Every step advances all of a model's decoding sequences together, each
with its own sampler and token budget; sequences join after their prefill
and leave when they finish, between steps. The prompt is prefilled by
prefill.py (with checkpoints and storing), so a sequence joins with its
cache already holding all but the last prompt token.

A sequence that decodes alone takes the solo path (solo_decoder.py): plain
forward passes on its own cache, pipelined like mlx-lm's generate_step, with
none of the batch's padding, masks and per-row bookkeeping. When a second
sequence joins, the solo one moves into the batch without a copy of its own.

The batch is prefixd's own (ragged_batch.py: each row keeps its own cache)
where the model's batch step is ragged (models/batch_step.py), mlx-lm's
left-padded BatchGenerator otherwise; both hand out tokens alike.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import apply_top_p, make_sampler

from ..kv.shared_prefix_cache import batch_rows
from .constrained_sampling import batch_processor, mask_logits
from .ragged_batch import RaggedBatch
from .faults import fault_point
from .sequence_state import SequenceState
from .solo_decoder import SoloDecoder

# Generous ceilings: admission (scheduler.py) is what limits the batch.
MAX_BATCH = 64
# The last row of a batch returns to the solo path when at least this many tokens are left to it.
MIN_SOLO_TOKENS_LEFT = 8


class StepEvent(NamedTuple):
    seq: SequenceState
    token: int
    done_by_batch: bool  # eos or max_tokens reached inside the batch
    cache: list[Any] | None  # the sequence's cache when it left the batch


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


# Below this temperature sampling is argmax in all but name, and dividing the
# logits by it overflows float32 (1e-300 gave random text): such requests are greedy.
MIN_SAMPLING_TEMPERATURE = 1e-4


def sampler_for(seq: SequenceState) -> Callable[[mx.array], mx.array]:
    """The sequence's own sampler: greedy, seeded (its own random key), or from the global generator."""
    if seq.sampler is None:
        params = seq.params
        top_p = params.top_p if params.top_p < 1 else 0.0
        if params.temperature < MIN_SAMPLING_TEMPERATURE:
            seq.sampler = greedy
        elif params.seed is not None:
            seq.sampler = seeded_sampler(params.temperature, top_p, params.seed)
        else:
            seq.sampler = make_sampler(params.temperature, top_p)
    return seq.sampler


def seeded_sampler(temperature: float, top_p: float, seed: int) -> Callable[[mx.array], mx.array]:
    """Sampling from a key of its own, split once per token.

    The same seed gives the same tokens whatever else runs in the batch, and
    seeding one request never touches MLX's global random state that every
    other sampling request draws from.
    """
    key = mx.random.key(seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, step_key = mx.random.split(key)
        if top_p:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1 / temperature), key=step_key)

    return sample


def sample_first(seq: SequenceState, logits: mx.array) -> int:
    """The first answer token from the prompt's last logits, as the batch would sample it."""
    if seq.grammar is not None:
        logits = mask_logits(seq.grammar, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return int(sampler_for(seq)(logprobs).item())


class BatchDecoder:
    """The decode batch of one model."""

    def __init__(self, model: Any, eos_token_ids: frozenset[int], stream: Any = None, ragged: bool = False):
        """``ragged``: rows keep their own caches (ragged_batch.py); else mlx-lm's padded BatchGenerator."""
        # A stream made on this (the engine) thread: MLX streams are thread-bound. Ranks in
        # lock-step pass the one stream every other pass and collective runs on, so that each
        # rank's collectives run in program order (on two streams they could pair up wrongly).
        stream = stream if stream is not None else mx.new_stream(mx.default_device())
        self._ragged = ragged
        if ragged:
            self._generator = RaggedBatch(model, sampler=greedy, stream=stream)
        else:
            self._generator = BatchGenerator(
                model,
                sampler=greedy,
                completion_batch_size=MAX_BATCH,
                prefill_batch_size=MAX_BATCH,
                stream=stream,
            )
        self._stop = StopSequences([[token] for token in sorted(eos_token_ids)])
        self._by_uid: dict[int, SequenceState] = {}
        self._model = model
        self._eos_token_ids = eos_token_ids
        self._solo: SoloDecoder | None = None
        # Events of a solo sequence's last token, taken when it moved into the batch;
        # handed out first by the next step, so every sequence's tokens stay in order.
        self._carried: list[StepEvent] = []
        # Rows that have had a token from the generator: only those are in its generation
        # stage, where an extracted cache holds every token handed out (see _leave_batch_alone).
        self._generating: set[int] = set()

    def __len__(self) -> int:
        return len(self._by_uid) + (self._solo is not None)

    def add(self, seq: SequenceState, inputs: list[int], max_tokens: int) -> None:
        """Join the batch: ``inputs`` are the tokens the cache does not hold yet.

        The scheduler passes the first answer token, sampled from the
        prompt's last logits. More tokens (the rest of a prompt) would be
        prefilled by mlx-lm's generator in its batched prompt path, which the
        scheduler no longer uses: on a GPU its first pass in a process cost
        seconds (scheduler._prefill_short_tails).
        """
        if self._solo is None and not self._by_uid and not self._carried and len(inputs) == 1:
            self._solo = SoloDecoder(
                self._model, seq, inputs[0], max_tokens, sampler_for(seq), self._eos_token_ids, self._generator.stream
            )
            seq.cache = None  # the solo decoder owns it now
            return
        if self._solo is not None:
            self._move_solo_to_batch()
        self._insert(seq, inputs, max_tokens)

    def _insert(
        self, seq: SequenceState, inputs: list[int], max_tokens: int, last_input_index: int | None = None
    ) -> None:
        """``last_input_index``: the answer index of ``inputs[-1]`` (default: the last token handed out; -1: a prompt token)."""
        # The generator would take a missing cache for an empty one and answer from no context at all.
        if seq.cache is None:
            raise RuntimeError(f"sequence {seq.job.request_id} joins the batch without its cache")
        processors = []
        if seq.grammar is not None:  # a masked row of its own; the other rows stay as they are
            index = len(seq.generated) - 1 if last_input_index is None else last_input_index
            processors.append(batch_processor(seq.grammar, index))
        (uid,) = self._generator.insert(
            [inputs],
            max_tokens=[max_tokens],
            # A ragged row keeps its cache as it is; mlx-lm merges each layer by its first row's class.
            caches=[seq.cache if self._ragged else batch_rows(seq.cache, seq.loaded.layout.shares_forks)],
            samplers=[sampler_for(seq)],
            logits_processors=[processors],
            stop_sequences=[self._stop],
        )
        seq.uid = uid
        seq.cache = None  # the batch owns it now
        self._by_uid[uid] = seq

    def _move_solo_to_batch(self) -> None:
        """A second sequence joins: the solo one becomes a batch row, its next token handed out first."""
        solo, self._solo = self._solo, None
        token, done = solo.take_pending()
        if done:
            self._carried.append(StepEvent(solo.seq, token, True, solo.cache))
            return
        self._carried.append(StepEvent(solo.seq, token, False, None))
        solo.seq.cache = solo.cache  # handed to the batch (and taken off the sequence) by _insert
        self._insert(solo.seq, [token], solo.remaining, last_input_index=len(solo.seq.generated))  # not handed out yet

    def step(self) -> list[StepEvent]:
        """One decode step for every sequence in the batch."""
        fault_point("decode_step")
        events, self._carried = self._carried, []
        if self._solo is None and len(self._by_uid) == 1:
            self._leave_batch_alone()
        if self._solo is not None:
            token, done = self._solo.step()
            solo = self._solo
            if done:
                self._solo = None
            events.append(StepEvent(solo.seq, token, done, solo.cache if done else None))
            return events
        if not self._by_uid:
            return events
        _, responses = self._generator.next()
        for response in responses:
            seq = self._by_uid.get(response.uid)
            if seq is None:
                continue
            finished = response.finish_reason is not None
            self._generating.add(response.uid)
            if finished:
                del self._by_uid[response.uid]
                self._generating.discard(response.uid)
            events.append(StepEvent(seq, int(response.token), finished, response.prompt_cache))
        return events

    def _leave_batch_alone(self) -> None:
        """The last row of a batch goes back to the solo path, if enough of its answer is left.

        On a GPU a batch step of even two rows cost as much as two solo steps
        (bench/probes/batch_probe.py), so the one left after the others finished would
        decode at half speed to its end. The move costs one copy of its KV
        (the batch's row without padding) and one step computed again: the
        batch had fed the row's last token already, so the copy is trimmed by
        one and the solo decoder feeds it anew. Attention-only caches only
        (a conv/SSM state cannot be trimmed).
        """
        ((uid, seq),) = self._by_uid.items()
        remaining = seq.max_new_tokens - len(seq.generated)
        layout = seq.loaded.layout
        if (
            remaining < MIN_SOLO_TOKENS_LEFT
            or uid not in self._generating
            or layout.is_hybrid
            or not layout.is_supported
        ):
            return  # a row not yet generating still has its input tokens unfed: its cache is not the answer's
        entry = self._generator.remove([uid], return_prompt_caches=True).get(uid)
        del self._by_uid[uid]
        self._generating.discard(uid)
        cache = entry[0]
        for layer in cache:
            layer.trim(1)
        seq.cache = cache
        self._solo = SoloDecoder(
            self._model,
            seq,
            seq.generated[-1],
            remaining,
            sampler_for(seq),
            self._eos_token_ids,
            self._generator.stream,
        )
        seq.cache = None  # the solo decoder owns it now

    def holds(self, seq: SequenceState) -> bool:
        return (self._solo is not None and self._solo.seq is seq) or self._by_uid.get(seq.uid) is seq

    def remove(self, seq: SequenceState) -> list[Any] | None:
        """Take a sequence out of the batch (stop string, cancel); returns its cache."""
        if self._solo is not None and self._solo.seq is seq:
            solo, self._solo = self._solo, None
            return solo.cache  # holds every token handed out; the token computed ahead is dropped
        if seq.uid not in self._by_uid or self._by_uid[seq.uid] is not seq:
            return None
        del self._by_uid[seq.uid]
        self._generating.discard(seq.uid)
        caches = self._generator.remove([seq.uid], return_prompt_caches=True)
        entry = caches.get(seq.uid)
        return entry[0] if entry else None
