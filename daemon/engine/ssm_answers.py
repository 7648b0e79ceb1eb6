"""Answers of pure SSM models (Mamba, Mamba 2: conv/SSM state layers only), stored for the next turn.

An answer is stored at the depth its live cache holds, read from an attention
layer's offset; a pure SSM cache has none, and how many answer tokens the
decode paths fed before the sequence ended (the token computed ahead, an end
token, a batch row taken out) differs from path to path. So the answer's
state is computed again instead: fork at the deepest stored snapshot of the
prompt (its last-but-one token, stored by the prefill), run the prompt's rest
and the whole answer in passes of ``chunk_size`` tokens, as a cold prefill of
the next turn would, and store the state after them as the ``answer-end``
checkpoint. It costs one prefill of the answer's length at the end of the
request (a pure SSM pass is linear in its length), before the reply goes out,
as every answer's store does. Engine thread only.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache import PrefixStore
from ..kv.fork import capture_snapshot, fork_cache
from .prefill import store_progress
from .sequence_state import SequenceState


def store_replayed_answer(seq: SequenceState, store: PrefixStore | None, chunk_size: int) -> None:
    """Store prompt + answer for a model without attention layers (see the module's doc)."""
    layout = seq.loaded.layout
    tokens = seq.all_tokens()
    if store is None or not seq.params.cache.store or len(tokens) <= seq.stored_upto:
        return
    match = store.match(seq.loaded.fingerprint, tokens, max_length=len(tokens) - 1, requires_snapshot=True)
    try:
        if match.length == 0:
            return  # nothing of the prompt stored (evicted meanwhile): a replay would be a whole prefill
        cache = fork_cache(seq.loaded.model, layout, list(match.segments), match.snapshot, match.length)
        for start in range(match.length, len(tokens), chunk_size):
            seq.loaded.model(mx.array(tokens[start : start + chunk_size])[None], cache=cache)
            mx.eval([c.state for c in cache])
        seq.checkpoints[len(tokens)] = ("answer-end", capture_snapshot(cache, layout))
        store_progress(seq, store, cache, tokens)
    finally:
        store.release(match.lease)
