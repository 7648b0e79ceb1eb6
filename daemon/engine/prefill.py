"""Prompt processing for one sequence: prefix lookup, fork, chunked prefill, storing.

A prompt is fed in chunks that end on checkpoints: absolute multiples of
the chunk size (so a cold and a warm run cut the same prompt at the same
places), chat-message ends, and the prompt's end (len - 1: the last token is
fed by the first decode step). After each chunk the new KV and the
checkpoint go to the store at once, so a concurrent request with the same
prefix, a cancelled request, and the next turn of a chat can all reuse it.
Engine thread only.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from ..cache import CacheReport, PrefixStore
from ..kv.fork import (
    can_capture,
    capture_segment,
    capture_snapshot,
    evaluate_fork,
    fork_cache,
    read_stored_prefix_in_place,
)
from ..kv.segments import segments_source
from ..kv.shared_prefix_cache import tokens_read_in_store
from ..models.loaded_model import LoadedModel
from ..models.prompt_encoding import EncodedPrompt
from .corrupt_fault import corrupted_if_asked
from .faults import fault_point
from .jobs import GenerateJob
from .sequence_state import SequenceState
from .step_plan import PrefillPass

CHECKPOINT_PRIORITY = {"prompt-end": 3, "message": 2, "chunk": 1}
# A hybrid model's pass ends at a stop only when it spans at least this many tokens
# and the next stop is at least this far on (see next_stops).
HYBRID_MIN_PASS_TOKENS = 16
# A pass shortened at a long context (pass_limit) still feeds at least this many tokens.
MIN_SHORTENED_PASS_TOKENS = 32


def pass_limit(position: int, chunk_size: int, depth_scale: int | None) -> int:
    """The most tokens the next pass of an attention model feeds at ``position``.

    A pass's cost grows with the context it attends to: on a CPU a token at
    depth d costs about (1 + d / depth_scale) times one at depth 0 (SmolLM2 on
    2 cores: 512 tokens take 2 s at depth 0 and 10.6 s at depth 4,096). Every
    other client waits for the pass under way, so passes shorten as the
    prompt deepens to keep each about as long as a chunk at depth 0. A
    function of the depth only, so the same prompt is cut the same way every
    time. None (a GPU, where the cost hardly grows at these depths): the chunk.
    """
    if depth_scale is None:
        return chunk_size
    return max(MIN_SHORTENED_PASS_TOKENS, min(chunk_size, chunk_size * depth_scale // (depth_scale + position)))


def plan_prefill(start: int, end: int, chunk_size: int, prompt: EncodedPrompt) -> list[tuple[int, str]]:
    """The (depth, kind) stops of a prefill of tokens [start, end), ascending."""
    kinds: dict[int, str] = {}

    def add(depth: int, kind: str) -> None:
        if start < depth <= end and CHECKPOINT_PRIORITY[kind] > CHECKPOINT_PRIORITY.get(kinds.get(depth, ""), 0):
            kinds[depth] = kind

    for depth in range((start // chunk_size + 1) * chunk_size, end + 1, chunk_size):
        add(depth, "chunk")
    for span in prompt.message_spans:
        add(span.end_token, "message")
    add(end, "prompt-end")
    return sorted(kinds.items())


def make_sequence(job: GenerateJob, loaded: LoadedModel) -> SequenceState:
    """The engine's state for a job; raises RpcError for a prompt that does not fit.

    The fronts encode prompts on worker threads (job.encoded); a job that
    comes without (the inline runner) is encoded here. The answer's length
    (``max_new_tokens``) is ``max_tokens`` cut to what the context has room
    for after the prompt; the request's own parameters stay as they came.
    """
    generates = not job.warm_only
    prompt = job.encoded
    if prompt is None:
        prompt = loaded.encode(job.params.prompt, generates)
    else:
        loaded.encoder.check_length(len(prompt.tokens), generates)
    room = loaded.context_length - len(prompt.tokens)
    max_new_tokens = min(job.params.max_tokens, room) if generates else 0
    return SequenceState(
        job,
        loaded,
        prompt,
        CacheReport(prompt_tokens=len(prompt.tokens), kv=loaded.kv),
        max_new_tokens=max_new_tokens,
        uses_cache=job.params.cache.use,
    )


def uses_store(store: PrefixStore | None, seq: SequenceState) -> bool:
    return store is not None and seq.loaded.layout.is_supported


def start_prefill(seq: SequenceState, store: PrefixStore | None, chunk_size: int) -> None:
    """Find the longest usable stored prefix, fork a private cache from it, plan the rest."""
    loaded = seq.loaded
    started = time.monotonic()
    if seq.lease is not None:  # a second lookup, after waiting for a shared prefix
        store.release(seq.lease)
        seq.lease = None
    match = None
    if not uses_store(store, seq):
        seq.report.turn_off("unsupported-cache")
    elif not seq.uses_cache:
        seq.report.turn_off("disabled")
    else:
        match = store.match(
            loaded.fingerprint,
            seq.tokens,
            max_length=len(seq.tokens) - 1,
            requires_snapshot=loaded.layout.is_hybrid,
            whole_with_logits=True,
        )
        seq.report.record_match(match, seq.prompt, loaded.prefill_tokens_per_s)
        if match.length:
            seq.report.source = segments_source(match.segments)
        seq.lease = match.lease
    seq.reused = match.length if match is not None else 0
    seq.stored_logits = match.logits if match is not None else None
    seq.cache = fork_cache(
        loaded.model,
        loaded.layout,
        list(match.segments) if match else [],
        match.snapshot if match else None,
        seq.reused,
    )
    # A split head (copied_tail_tokens) is this sequence's own copy even when read in place.
    seq.reused_in_store = max(0, tokens_read_in_store(seq.cache) - (match.copied_tail_tokens if match else 0))
    seq.report.in_place_tokens = seq.reads_in_store = seq.reused_in_store
    seq.position = seq.stored_upto = seq.reused
    seq.plan = plan_prefill(seq.reused, len(seq.tokens) - 1, chunk_size, seq.prompt)
    seq.prefill_started_at = started
    seq.lookup_seconds = time.monotonic() - started
    if seq.reused and seq.stored_logits is None:
        evaluate_fork(seq.cache)  # the copy counts as prefill time, as it did when it ran with the first pass
    # With stored logits the first token needs no cache: the copy starts once that token is sampled
    # (model_runner: kv.fork.start_fork_copy), while it goes out (an H100 copies 32k tokens in 4.5-4.9 ms).
    fault_point("start_prefill")


def system_prompt_ends(prompt: EncodedPrompt) -> frozenset[int]:
    """Where the leading system (or developer) messages end: the prefix other conversations share."""
    ends = []
    for span in prompt.message_spans:
        if span.role not in ("system", "developer"):
            break
        ends.append(span.end_token)
    return frozenset(ends)


def next_stops(
    plan: list[tuple[int, str]],
    position: int,
    chunk_size: int,
    is_hybrid: bool,
    pinned: frozenset[int] = frozenset(),
    depth_scale: int | None = None,
) -> list[tuple[int, str]]:
    """Take the stops the next forward pass covers off the front of ``plan``.

    A hybrid model's conv/SSM state can only be snapshotted where a pass ends,
    so its passes end at the stops; but not at stops a few tokens apart: a
    chat turn's tail (the previous answer's closing tokens, the new message,
    the assistant header) would cost three short passes, each at a length the
    device has not run before (on a GPU a first pass at a new length costs
    20-45 ms; lfm2's chat was 1.3x mlx-lm server's warm TTFT, issue 13). A
    stop closer than HYBRID_MIN_PASS_TOKENS to the pass's start or to the next
    stop becomes a label without a snapshot: resuming there later recomputes
    those few tokens from the previous snapshot. The prompt's end always ends
    a pass (the exact-hit checkpoint), and so does each ``pinned`` stop: the
    end of the system prompt (system_prompt_ends), which other sessions share
    and ask something else after, often in fewer than 16 tokens (on the H200
    four sessions on one system prompt each recomputed it: 4,731 tokens
    prefilled where 652 would do, bench/compare.py --quick on lfm2).
    Attention KV can be cut at any depth, so for other models one pass runs
    through every stop within a chunk of ``position`` (message and chunk
    boundaries become labels only): on a CPU where each pass at a long context
    costs a fixed 0.1 s or more, a chat turn's tail then costs one pass
    instead of one per message. At a long context the pass is shortened
    (``pass_limit``); where it then ends before the next stop, its end is a
    chunk checkpoint of its own. Hybrid passes keep their stops (a snapshot is
    taken where a pass ends).
    """
    if not is_hybrid:
        reach = position + pass_limit(position, chunk_size, depth_scale)
        if plan[0][0] > reach:
            return [(reach, "chunk")]
        taken = [plan.pop(0)]
        while plan and plan[0][0] <= reach:
            taken.append(plan.pop(0))
        return taken
    taken = [plan.pop(0)]
    while (
        plan
        and plan[0][0] <= position + chunk_size
        and taken[-1][0] not in pinned
        and (taken[-1][0] - position < HYBRID_MIN_PASS_TOKENS or plan[0][0] - taken[-1][0] < HYBRID_MIN_PASS_TOKENS)
    ):
        taken.append(plan.pop(0))
    return taken


def prefill_step(seq: SequenceState, store: PrefixStore | None, work: PrefillPass) -> mx.array | None:
    """Feed the pass the scheduler planned (next_stops) and store it; the stops it reaches leave ``seq.plan``.

    The plan stops one token short of the prompt's end (the exact-hit
    checkpoint). On an attention-only model the last pass takes that token
    along (``run_to`` is past the last stop) and returns its logits, so the
    first answer token costs no pass of its own; a hybrid model needs the
    pass to end at the checkpoint for its snapshot, and runs the last token
    in ``last_token_logits``.
    """
    fault_point("prefill")
    layout = seq.loaded.layout
    if work.run_to < seq.position:
        raise RuntimeError(f"a prefill pass to {work.run_to} is behind sequence {seq.job.request_id}'s position")
    stops = list(work.stops)
    depth = stops[-1][0]
    takes_last = work.run_to > depth
    started = time.monotonic()
    logits = seq.loaded.model(mx.array(seq.tokens[seq.position : work.run_to])[None], cache=seq.cache)
    last = logits[:, -1, :] if takes_last else None
    mx.eval([c.state for c in seq.cache] + ([last] if takes_last else []))
    seq.loaded.note_prefill_rate(work.run_to - seq.position, time.monotonic() - started)
    seq.position = work.run_to
    reached_planned_stop = False
    while seq.plan and seq.plan[0][0] <= depth:  # the stops it reached (none when pass_limit cut it short)
        seq.plan.pop(0)
        reached_planned_stop = True
    if not work.stores:
        # Plain chunk stops off the store's stride (Scheduler._stores_pass, attention-only models): stored
        # with the next pass that stores, and not as labels there (the store cuts an edge at each label).
        return last
    if not reached_planned_stop and not layout.window_layers:
        # Cut short by the pass limit (a CPU at depth): stored at the next planned stop (a chunk boundary,
        # a message's or the prompt's end) with what follows. Stored at every cut, a long prompt's segments
        # shrank with depth (3,432 tokens: about 20), more than a shared fork reads in place, so every
        # hit on it copied (bench/shared_forks.py). A window layer must be captured before it slides on.
        return last
    for stop, kind in stops:  # only the last can carry a snapshot; hybrid passes take one stop each
        seq.checkpoints[stop] = (kind, capture_snapshot(seq.cache, layout) if stop == seq.position else None)
    store_progress(seq, store, seq.cache, seq.tokens[:depth])
    return last


def read_prompt_in_place(seq: SequenceState, store: PrefixStore | None) -> int:
    """Once its prompt is stored, a sequence reads it from the store and gives its own copy back.

    Its lease holds what it stored, so the store's copy stays while it runs;
    the live cache's copy of those positions goes (kv.fork.read_stored_prefix_in_place),
    and the scheduler reserves only what follows. When: the scheduler's
    (PrefillPass.reads_prompt_in_place: a layout that shares forks, a store
    short of room). Returns the positions it reads from the store now
    (``seq.reads_in_store``).
    """
    layout = seq.loaded.layout
    # Not the prompt's last token (store_prompt_end stored it alone): joined with a short segment before
    # it, it would make the fork copy both (kv.fork joins runs of short segments into one copy).
    depth = min(seq.stored_upto, len(seq.tokens) - 1)
    if store is None or seq.lease is None or not layout.shares_forks or depth <= seq.reads_in_store:
        return seq.reads_in_store
    segments = store.leased_segments(seq.lease, depth)
    if segments is None:
        return seq.reads_in_store
    in_store = read_stored_prefix_in_place(seq.cache, layout, list(segments), depth)
    if in_store:
        seq.reads_in_store = in_store
    return seq.reads_in_store


def store_prompt_end(seq: SequenceState, store: PrefixStore | None, logits: mx.array) -> None:
    """Store the prompt's last token and the logits it gave, once the cache holds exactly the prompt.

    The plan stores the prompt up to its last token (the exact-hit
    checkpoint, where a prompt differing only there can resume); this adds
    that token's KV and, at the node ending the prompt, its logits
    (PrefixStore.attach_logits). An exact repeat then samples its first
    token from them: no pass before it at all, where it ran one token over
    the whole context (on a GPU at 32k tokens, the fork's copy and that
    forward were 2.0-2.3x the in-process floor). The logits cost a few
    tokens' KV (vocabulary x dtype) and come from this very computation, so
    the repeat's first token is the cold one's.
    """
    tokens = seq.tokens
    if store is None or seq.position != len(tokens) or seq.stored_upto >= len(tokens):
        return
    seq.checkpoints[len(tokens)] = ("prompt-end", capture_snapshot(seq.cache, seq.loaded.layout))
    store_progress(seq, store, seq.cache, tokens)
    if seq.stored_upto == len(tokens):
        # A copy: ``logits`` may be a view of the whole pass's logits (tokens x vocabulary).
        store.attach_logits(seq.loaded.fingerprint, tokens, mx.array(logits))


def last_token_logits(seq: SequenceState) -> mx.array:
    """Run what is left of the prompt (its last token, usually) and return the last position's logits."""
    logits = seq.loaded.model(mx.array(seq.tokens[seq.position :])[None], cache=seq.cache)[:, -1, :]
    mx.eval(logits)
    seq.position = len(seq.tokens)
    return logits


def store_progress(seq: SequenceState, store: PrefixStore | None, cache: list[Any], tokens: list[int]) -> None:
    """Give the store what this sequence computed since the last call."""
    depth = len(tokens)
    if not uses_store(store, seq) or not seq.params.cache.store or depth <= seq.stored_upto:
        seq.checkpoints.clear()
        return
    if not can_capture(cache, seq.loaded.layout, seq.stored_upto):
        # A sliding window has dropped the oldest of these positions and kept
        # no record of them (an answer longer than the window, after a prompt
        # tail fed in mlx-lm's batch): what is stored stays exact, the rest is not kept.
        seq.checkpoints.clear()
        return
    segment = corrupted_if_asked(capture_segment(cache, seq.loaded.layout, seq.stored_upto, depth))
    checkpoints = {d: c for d, c in seq.checkpoints.items() if 0 < d <= depth}
    result = store.insert(seq.loaded.fingerprint, tokens, seq.stored_upto, segment, checkpoints)
    seq.report.stored_tokens += result.stored_tokens
    seq.stored_upto = depth
    seq.checkpoints.clear()
    # The lease moves down with the prefill: what this sequence stored must
    # survive until it is done, so its next chunks have a parent to hang from
    # and requests waiting on this prefill get the reuse they waited for.
    lease = store.lease(seq.loaded.fingerprint, tokens)
    if seq.lease is not None:
        store.release(seq.lease)
    seq.lease = lease
