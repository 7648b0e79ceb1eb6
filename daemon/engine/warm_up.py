"""Run once at load the paths a model's first requests would otherwise compile and build while a client waits.

On CUDA a fresh daemon's first requests would otherwise wait for (seconds in all; the figures are in
docs/decisions.md):

* MLX compiling some kernels at their first use in a process (NVRTC; the
  compiled code is cached on disk): the first decode steps, the first step
  of a batch, the first shadow check;
* MLX building CUDA graphs the first time a graph topology is met, cached per
  stream (mlx/backend/cuda/device.cpp). A fork of S stored segments has a
  topology of its own per S (kv/fork.py, ``evaluate_fork``), and so has the
  last-token pass on a fork: each exact hit at a segment count not met before
  costs more than its repeats.

So a model's load ends with: forks of 1 to ``WARM_SEGMENTS`` segments of a few
made-up tokens, each followed by the last-token pass, and forks of up to
``GROUPED_SEGMENTS`` (a longer stored path is joined in groups on CUDA:
kv/fork.py); the first token sampled
greedily and at a temperature; the decode paths the scheduler uses (one
sequence alone, a left-padded batch that rows join and leave, the return to
one alone: batch_decoder.py); and the shadow
check's comparison. Real code paths, made-up tokens; nothing reaches the
prefix store or a client. ``auto`` warms up on a GPU only: a CPU builds no
graphs and compiles nothing at first use that this would catch.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generator

import mlx.core as mx

from ...protocol.methods import parse_generate
from ..kv.fork import FORK_GROUP, capture_segment, capture_snapshot, evaluate_fork, fork_cache
from ..models.loaded_model import LoadedModel
from .batch_decoder import MIN_SOLO_TOKENS_LEFT, BatchDecoder, sample_first
from .faults import fault_point
from .jobs import GenerateJob
from .prefill import make_sequence
from .sequence_state import SequenceState
from .shadow_run import top_logprob_difference

MODES = ("auto", "on", "off")
# Stored prefixes of up to this many segments are forked once at load. A
# segment is a prefill chunk, a chat message's end or an answer, so this covers
# repeated prompts, file contexts and the first turns of a chat.
WARM_SEGMENTS = FORK_GROUP
# Forks of more segments join them in groups on CUDA (kv/fork.py: _join_in_groups),
# each group of 1 to FORK_GROUP segments: forking up to twice that many builds every group.
GROUPED_SEGMENTS = 2 * FORK_GROUP
SEGMENT_TOKENS = 16
WARM_UP_TEXT = "The quick brown fox jumps over the lazy dog. "
DECODE_STEPS = 3  # per phase of the decode batch (_decode_paths)
# The first sequence's answer ends inside the batch, after the others joined;
# theirs are long enough to leave the last one MIN_SOLO_TOKENS_LEFT for the solo path.
FIRST_ANSWER_STEPS = DECODE_STEPS * 3 + 2
LATER_ANSWER_STEPS = FIRST_ANSWER_STEPS + DECODE_STEPS * 2 + MIN_SOLO_TOKENS_LEFT + 2


def resolve_mode(mode: str, on_gpu: bool) -> bool:
    if mode not in MODES:
        raise ValueError(f"warm-up must be one of {', '.join(MODES)}, not {mode!r}")
    return mode == "on" or (mode == "auto" and on_gpu)


def warm_up_steps(loaded: LoadedModel) -> Generator[None, None, float]:
    """The warm-up in steps (the engine decodes other models' requests between them); returns the seconds taken.

    Engine thread (MLX arrays belong to the thread that made them).
    """
    model, layout = loaded.model, loaded.layout
    if not layout.is_supported:
        return 0.0  # no fork is ever made for it
    started = time.perf_counter()
    fault_point("warm_up")
    tokens = _made_up_tokens(loaded, GROUPED_SEGMENTS * SEGMENT_TOKENS + 1)
    cache = fork_cache(model, layout, [], None, 0)
    segments, snapshots = [], []
    for start in range(0, GROUPED_SEGMENTS * SEGMENT_TOKENS, SEGMENT_TOKENS):
        model(mx.array(tokens[start : start + SEGMENT_TOKENS])[None], cache=cache)
        mx.eval([c.state for c in cache])
        segments.append(capture_segment(cache, layout, start, start + SEGMENT_TOKENS))
        snapshots.append(capture_snapshot(cache, layout))
    yield

    def fork(count: int) -> list[Any]:
        forked = fork_cache(model, layout, segments[:count], snapshots[count - 1], count * SEGMENT_TOKENS)
        evaluate_fork(forked)
        return forked

    last_logits = []
    for count in range(1, WARM_SEGMENTS + 1):
        logits = _last_token_logits(model, fork(count), tokens[count * SEGMENT_TOKENS])
        mx.eval(mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1))
        last_logits.append(logits)
        yield
    for count in range(WARM_SEGMENTS + 1, GROUPED_SEGMENTS + 1):  # the grouped joins of a longer path (kv/fork.py)
        fork(count)
    yield
    _decode_paths(loaded, fork, tokens[-1])
    yield
    top_logprob_difference(last_logits[-1], last_logits[-2])
    return time.perf_counter() - started


def run_all(steps: Generator[None, None, Any]) -> Any:
    """A generator's steps back to back; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _decode_paths(loaded: LoadedModel, fork: Callable[[int], list[Any]], last_token: int) -> None:
    """The decode batch's life as concurrent requests live it, from one row to three and back.

    1. a greedy sequence decodes alone (the solo path);
    2. a sampled one joins at a shallower depth, then a third, shallower
       still: the batch is left-padded and attends through an array mask;
    3. the first row's answer ends inside the batch: its cache is extracted
       and the others are filtered and shifted left. On CUDA the first such
       step in a process costs seconds, later ones tens of milliseconds: cold,
       it holds the requests that joined a batch after their leader ended;
    4. a row is taken out (what a stop string or a cancel does);
    5. the last row goes back to the solo path (attention-only models), and is taken out.
    """
    decoder = BatchDecoder(loaded.model, loaded.eos_token_ids, ragged=loaded.batch_step == "ragged")
    joiners = (
        (0.0, WARM_SEGMENTS, FIRST_ANSWER_STEPS),
        (0.7, WARM_SEGMENTS - 1, LATER_ANSWER_STEPS),
        (0.0, WARM_SEGMENTS - 2, LATER_ANSWER_STEPS),
    )
    rows = []
    for temperature, segments, budget in joiners:
        seq = _made_up_sequence(loaded, temperature, budget + 1)
        seq.cache = fork(segments)
        first = sample_first(seq, _last_token_logits(loaded.model, seq.cache, last_token))
        seq.generated.append(first)
        decoder.add(seq, [first], budget)
        rows.append(seq)
        _steps(decoder, DECODE_STEPS)
    leader, taken_out, last = rows
    for _ in range(FIRST_ANSWER_STEPS):
        if not decoder.holds(leader):
            break
        _steps(decoder, 1)
    _steps(decoder, 1)
    if decoder.holds(taken_out):
        decoder.remove(taken_out)
    _steps(decoder, DECODE_STEPS)
    for seq in rows:
        if decoder.holds(seq):
            decoder.remove(seq)


def _steps(decoder: BatchDecoder, count: int) -> None:
    for _ in range(count):
        for event in decoder.step():
            event.seq.generated.append(event.token)


def _made_up_sequence(loaded: LoadedModel, temperature: float, max_tokens: int) -> SequenceState:
    params = parse_generate(
        {"prompt": WARM_UP_TEXT, "max_tokens": max_tokens, "temperature": temperature, "stream": False}
    )
    return make_sequence(GenerateJob("warm-up", None, params, emit=lambda kind, payload: None), loaded)


def _last_token_logits(model: Any, cache: list[Any], token: int) -> mx.array:
    logits = model(mx.array([token])[None], cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


def _made_up_tokens(loaded: LoadedModel, count: int) -> list[int]:
    """Ordinary text's token ids (any ids would do: only shapes matter here)."""
    ids = loaded.tokenizer.encode(WARM_UP_TEXT, add_special_tokens=False) or [0]
    return (ids * (count // len(ids) + 1))[:count]
