"""When the store is short of room, a sequence reads its stored prompt in place instead of keeping a copy.

Real (tiny) models in float32 with --fork share, the real scheduler
(run_inline), and a KV budget with room for the prompt stored and its
running reservation but not for a second copy of it: a cold prompt and a
prompt after a hit answer as before, their live caches read the stored
segments in place, their reservation drops to what follows the prompt, and
the store's arrays are never written. With room to spare the copy stays.
"""

from __future__ import annotations

import numpy as np
import pytest

from prefixd.daemon.cache import PrefixStore
from prefixd.daemon.cache.kv_budget import KvBudget
from prefixd.daemon.engine import model_runner, prefill
from prefixd.daemon.engine.inline_runner import run_inline, run_one_inline
from prefixd.daemon.engine.jobs import GenerateJob
from prefixd.daemon.kv.shared_prefix_cache import SharedPrefixKVCache
from prefixd.daemon.models.loaded_model import load_model
from prefixd.protocol.methods import CacheOptions, GenerateParams, PromptInput

SOURCE_TEXT = (__import__("inspect").getsource(__import__("argparse")))[:20000]
MAX_TOKENS = 8
CHUNK = 128  # stored segments this long are read in place (fork.SHARED_PIECE_MIN_TOKENS)


@pytest.fixture(scope="module", params=["llama", "lfm2", "gemma3"])
def shared(request):
    return load_model(str(request.getfixturevalue(f"tiny_{request.param}_dir")), dtype="float32", fork="share")


@pytest.fixture
def adopted(monkeypatch):
    """Each sequence's cache right after read_prompt_in_place (when the scheduler asked for it), and what it reads in place."""
    seen = []

    def watching(seq, store):
        in_store = prefill.read_prompt_in_place(seq, store)
        if store is not None:  # cold reference runs have no store
            seen.append((len(seq.tokens), in_store, [type(layer) for layer in seq.cache]))
        return in_store

    monkeypatch.setattr(model_runner, "read_prompt_in_place", watching)
    return seen


@pytest.fixture
def reservations(monkeypatch):
    taken = []
    original = KvBudget.reserve_running

    def recording(self, running_bytes):
        taken.append(running_bytes)
        return original(self, running_bytes)

    monkeypatch.setattr(KvBudget, "reserve_running", recording)
    return taken


def job(tokens, job_id=1, use=True, warm_only=False) -> GenerateJob:
    params = GenerateParams(
        prompt=PromptInput(tokens=tuple(tokens)), max_tokens=MAX_TOKENS, cache=CacheOptions(use=use, store=use)
    )
    return GenerateJob("test", job_id, params, emit=lambda kind, payload: None, warm_only=warm_only)


def make_store(max_bytes: int = 2 << 30) -> PrefixStore:
    return PrefixStore(max_bytes=max_bytes, max_nodes=100_000, max_pinned_bytes=0)


def short_of_room(loaded, prompts: list[list[int]]) -> PrefixStore:
    """A store whose budget holds the prompts stored and their rows' reservations, with less than a prompt to spare."""
    probe = make_store()
    for index, tokens in enumerate(prompts):
        run_one_inline(job(tokens, index, warm_only=True), loaded, probe, CHUNK)  # stores each prompt, no answer
    longest = max(len(tokens) for tokens in prompts)
    reserved = len(prompts) * ((longest + MAX_TOKENS + 256) * loaded.kv_bytes_per_token + loaded.state_bytes_per_sequence)
    return make_store(reserved + probe.num_bytes + 32 * loaded.kv_bytes_per_token)


def global_layers(loaded) -> list[int]:
    return [i for i in loaded.layout.attention_layers if i not in loaded.layout.window_layers]


def test_a_cold_prompt_reads_itself_in_place_answers_as_before_and_reserves_only_what_follows(
    shared, adopted, reservations
):
    tokens = shared.tokenizer.encode(SOURCE_TEXT)[:600]
    cold = run_one_inline(job(tokens, use=False), shared, None, CHUNK)
    store = short_of_room(shared, [tokens])
    first = run_one_inline(job(tokens), shared, store, CHUNK)
    assert first["text"] == cold["text"]
    (length, in_store, layer_types), = adopted
    assert length == 600 and in_store == 599  # everything stored but the last token, read in place
    assert all(layer_types[i] is SharedPrefixKVCache for i in global_layers(shared))
    if not shared.layout.window_layers:  # a window model reserves its whole prefix anyway (scheduler._reserved_tokens)
        per_token, state = shared.kv_bytes_per_token, shared.state_bytes_per_sequence
        before, after = reservations[-3:-1]  # admission/lookup, then once the prompt is read in place
        assert before == (600 + MAX_TOKENS + 256) * per_token + state
        assert after == (1 + MAX_TOKENS + 256) * per_token + state
    # A longer prompt reuses what the first stored and answers as a cold run.
    longer = tokens + tokens[:30]
    warm = run_one_inline(job(longer), shared, store, CHUNK)
    assert warm["cache"]["reused_tokens"] >= 599
    assert warm["text"] == run_one_inline(job(longer, use=False), shared, None, CHUNK)["text"]


def test_with_room_to_spare_a_prompt_keeps_its_copy(shared, adopted):
    tokens = shared.tokenizer.encode(SOURCE_TEXT)[:600]
    answer = run_one_inline(job(tokens), shared, make_store(), CHUNK)
    assert adopted == [] and answer["cache"]["in_place_tokens"] == 0  # the scheduler did not ask for it


def test_a_row_read_in_place_decodes_in_a_batch_as_its_cold_run_and_never_writes_the_store(shared, adopted):
    text = shared.tokenizer.encode(SOURCE_TEXT)
    first, second = text[:500], text[:300] + text[900:1150]  # the second shares 300 tokens with the first
    store = short_of_room(shared, [first, second])
    answers = run_inline([job(first, 1), job(second, 2)], shared, store, CHUNK)
    assert [a["text"] for a in answers] == [
        run_one_inline(job(p, use=False), shared, None, CHUNK)["text"] for p in (first, second)
    ]
    in_place = dict((length, in_store) for length, in_store, _ in adopted)
    # The first prompt done reads itself in place; the room that gives back is enough for the second's copy.
    assert in_place == {500: 499}
    match = store.match(shared.fingerprint, first, max_length=499)
    stored = [np.array(a) for s in match.segments for a in s.keys + s.values]
    store.release(match.lease)
    # Another round decodes on those very arrays; they stay as they were.
    run_inline([job(first + [5, 6], 3), job(second + [7, 8], 4)], shared, store, CHUNK)
    match = store.match(shared.fingerprint, first, max_length=499)
    after = [np.array(a) for s in match.segments for a in s.keys + s.values]
    store.release(match.lease)
    assert len(after) == len(stored) and all(np.array_equal(a, b) for a, b in zip(stored, after))
