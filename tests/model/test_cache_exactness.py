"""The correctness gate of the prefix cache, in process with real (small) models.

Reusing a stored prefix must give what a cold prefill gives: last-position
logits within 1e-4 relative, and the same greedy tokens. These tests drive
the engine's own pieces (GenerationRun, PrefixStore, fork_cache) on the
engine's thread model: everything runs on the test's thread.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
from prefixd.daemon.engine.inline_runner import run_one_inline
from prefixd.daemon.engine.jobs import GenerateJob
from prefixd.daemon.kv.fork import fork_cache
from prefixd.daemon.models.loaded_model import load_model
from prefixd.daemon.cache import PrefixStore
from prefixd.protocol.methods import CacheOptions, GenerateParams, PromptInput

RELATIVE_TOLERANCE = 1e-4
SOURCE_TEXT = (__import__("inspect").getsource(__import__("argparse")))[:40000]


@pytest.fixture(scope="module", params=["llama", "lfm2", "gemma3", "qwen3_moe", "mamba", "smollm2"])
def loaded(request):
    if request.param == "smollm2":
        directory = request.getfixturevalue("smollm2_dir")
    else:
        directory = request.getfixturevalue(f"tiny_{request.param}_dir")
    return load_model(str(directory), dtype="float32")


def make_store() -> PrefixStore:
    return PrefixStore(max_bytes=2 << 30, max_nodes=100_000, max_pinned_bytes=1 << 28)


def run(loaded, store, *, prompt=None, messages=None, tokens=None, max_tokens=8, use=True, warm=False, chunk=128):
    params = GenerateParams(
        prompt=PromptInput(text=prompt, messages=tuple(messages) if messages else None, tokens=tuple(tokens) if tokens else None),
        max_tokens=max_tokens,
        cache=CacheOptions(use=use, store=use),
    )
    job = GenerateJob("test", 1, params, emit=lambda kind, payload: None, warm_only=warm)
    return run_one_inline(job, loaded, store, chunk)


def prompt_tokens(loaded, num_tokens: int) -> list[int]:
    tokens = loaded.tokenizer.encode(SOURCE_TEXT)
    assert len(tokens) >= num_tokens
    return tokens[:num_tokens]


def cold_logits(loaded, tokens: list[int]) -> np.ndarray:
    cache = fork_cache(loaded.model, loaded.layout, [], None, 0)
    logits = loaded.model(mx.array(tokens)[None], cache=cache)[0, -1]
    return np.array(logits.astype(mx.float32))


def warm_logits(loaded, store, tokens: list[int]) -> tuple[np.ndarray, int]:
    match = store.match(loaded.fingerprint, tokens, max_length=len(tokens) - 1, requires_snapshot=loaded.layout.is_hybrid)
    try:
        cache = fork_cache(loaded.model, loaded.layout, list(match.segments), match.snapshot, match.length)
        logits = loaded.model(mx.array(tokens[match.length :])[None], cache=cache)[0, -1]
        return np.array(logits.astype(mx.float32)), match.length
    finally:
        store.release(match.lease)


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


@pytest.mark.parametrize("chunk", [64, 128, 512])
def test_reused_prefix_gives_cold_logits_at_every_split(loaded, chunk):
    tokens = prompt_tokens(loaded, 700)
    store = make_store()
    run(loaded, store, tokens=tokens[:600], warm=True, chunk=chunk)
    for split in (1, 37, chunk, chunk + 5, 333, 599):
        prompt = tokens[:split] + tokens[650:700]  # shares exactly `split` tokens with what is stored
        warm, reused = warm_logits(loaded, store, prompt)
        if loaded.layout.is_hybrid:
            # Conv state is only usable where it was snapshotted: chunk ends and the prompt's end.
            checkpoints = {0, 599} | set(range(chunk, 600, chunk))
            assert reused == max(k for k in checkpoints if k <= split), (split, reused)
        else:
            assert reused == split  # attention caches are usable at any depth
        assert relative_difference(warm, cold_logits(loaded, prompt)) < RELATIVE_TOLERANCE, (split, reused)
    store.check_integrity()


def test_exact_repeat_reuses_all_but_one_token_with_identical_logits(loaded):
    tokens = prompt_tokens(loaded, 400)
    store = make_store()
    run(loaded, store, tokens=tokens, warm=True)
    warm, reused = warm_logits(loaded, store, tokens)
    assert reused == len(tokens) - 1
    assert relative_difference(warm, cold_logits(loaded, tokens)) < RELATIVE_TOLERANCE


def test_greedy_generation_is_the_same_with_and_without_the_cache(loaded):
    tokens = prompt_tokens(loaded, 500)
    store = make_store()
    cold = run(loaded, store, tokens=tokens, max_tokens=12, use=False)
    first = run(loaded, store, tokens=tokens, max_tokens=12)
    repeat = run(loaded, store, tokens=tokens, max_tokens=12)
    extended = run(loaded, store, tokens=tokens + tokens[:40], max_tokens=12)
    reference = run(loaded, store, tokens=tokens + tokens[:40], max_tokens=12, use=False)
    assert first["text"] == cold["text"] == repeat["text"]
    # The first request stored its last token's logits: the repeat runs nothing before its first token.
    assert repeat["cache"]["hit"] == "exact" and repeat["cache"]["prefilled_tokens"] == 0, repeat["cache"]
    assert extended["text"] == reference["text"]
    assert extended["cache"]["reused_tokens"] > 0
    store.check_integrity()


def test_a_prompt_differing_only_in_its_last_token_resumes_one_token_short(loaded):
    tokens = prompt_tokens(loaded, 300)
    store = make_store()
    run(loaded, store, tokens=tokens, max_tokens=4)
    other = tokens[:-1] + [tokens[-1] + 1]
    cached = run(loaded, store, tokens=other, max_tokens=8)
    reference = run(loaded, store, tokens=other, max_tokens=8, use=False)
    assert cached["text"] == reference["text"]
    assert cached["cache"]["prefilled_tokens"] == 1, cached["cache"]
    again = run(loaded, store, tokens=other, max_tokens=8)  # and it kept its own logits
    assert again["text"] == reference["text"] and again["cache"]["prefilled_tokens"] == 0, again["cache"]


def test_stored_entry_is_unchanged_after_seeding_and_generating(loaded):
    tokens = prompt_tokens(loaded, 300)
    store = make_store()
    run(loaded, store, tokens=tokens, warm=True)
    match = store.match(loaded.fingerprint, tokens, requires_snapshot=loaded.layout.is_hybrid)
    before = stored_arrays(match.segments)
    snapshot_before = [np.array(a) for layer in (match.snapshot.states if match.snapshot else []) for a in layer if a is not None]
    store.release(match.lease)
    # Two sessions seeded from the same entry diverge; neither touches the entry.
    run(loaded, store, tokens=tokens + tokens[:30], max_tokens=6)
    run(loaded, store, tokens=tokens + tokens[100:130], max_tokens=6)
    match = store.match(loaded.fingerprint, tokens, requires_snapshot=loaded.layout.is_hybrid)
    after = stored_arrays(match.segments)
    snapshot_after = [np.array(a) for layer in (match.snapshot.states if match.snapshot else []) for a in layer if a is not None]
    store.release(match.lease)
    assert len(before) == len(after)
    for a, b in zip(before + snapshot_before, after + snapshot_after):
        assert np.array_equal(a, b)


def stored_arrays(segments) -> list[np.ndarray]:
    """Every array the segments hold (a --kv-bits segment's layers are packed: codes, scales, biases)."""
    return [np.array(a) for s in segments for layer in s.keys + s.values for a in (layer if isinstance(layer, tuple) else (layer,))]


def chat_turns(system: str, questions: list[str]):
    return [{"role": "system", "content": system}], questions


def test_ten_turn_chat_matches_uncached_and_reuses_every_turn(loaded):
    if not loaded.tokenizer.has_chat_template:
        pytest.skip("model without a chat template")
    store = make_store()
    messages = [{"role": "system", "content": SOURCE_TEXT[:1500]}]
    for turn in range(10):
        messages.append({"role": "user", "content": f"Question {turn}: what does line {turn * 7} do?"})
        cached = run(loaded, store, messages=messages, max_tokens=10)
        plain = run(loaded, store, messages=messages, max_tokens=10, use=False)
        assert cached["text"] == plain["text"], turn
        if turn > 0:
            cache = cached["cache"]
            assert cache["reused_tokens"] > 0.8 * cache["prompt_tokens"], (turn, cache)
        messages.append({"role": "assistant", "content": cached["text"]})
    store.check_integrity()


def test_two_sessions_interleaved_on_a_shared_system_prompt(loaded):
    if not loaded.tokenizer.has_chat_template:
        pytest.skip("model without a chat template")
    store = make_store()
    system = {"role": "system", "content": SOURCE_TEXT[2000:3500]}
    sessions = {"a": [system], "b": [system]}
    for turn in range(3):
        for name, messages in sessions.items():
            messages.append({"role": "user", "content": f"{name} asks question {turn}"})
            cached = run(loaded, store, messages=messages, max_tokens=6)
            plain = run(loaded, store, messages=messages, max_tokens=6, use=False)
            assert cached["text"] == plain["text"], (name, turn)
            if (name, turn) != ("a", 0):
                assert cached["cache"]["reused_tokens"] > 0
            messages.append({"role": "assistant", "content": cached["text"]})
    store.check_integrity()


def test_a_second_session_reuses_the_whole_system_prompt_before_its_short_question(loaded):
    """With a GPU's 2,048-token chunks there is no chunk checkpoint inside a 400-token system prompt: a hybrid
    model resumes from the snapshot at the system prompt's end, which must exist although a short question
    ends the prompt a few tokens later (prefill.next_stops, pinned stops)."""
    if not loaded.tokenizer.has_chat_template:
        pytest.skip("model without a chat template")
    store = make_store()
    system = {"role": "system", "content": SOURCE_TEXT[2000:3500]}
    first = run(loaded, store, messages=[system, {"role": "user", "content": "Why?"}], max_tokens=4, chunk=2048)
    second = run(loaded, store, messages=[system, {"role": "user", "content": "How?"}], max_tokens=4, chunk=2048)
    plain = run(loaded, store, messages=[system, {"role": "user", "content": "How?"}], max_tokens=4, use=False)
    assert second["text"] == plain["text"]
    assert second["cache"]["reused_tokens"] >= second["cache"]["prompt_tokens"] - 16, (first["cache"], second["cache"])


def stored_sequences(store: PrefixStore, namespace: str) -> list[list[int]]:
    """Every root-to-edge token sequence the store holds for a model."""
    full: dict[int, list[int]] = {}
    for edge in store.edges(namespace):
        full[edge.edge_id] = (full[edge.parent_id] if edge.parent_id is not None else []) + list(edge.key)
    return list(full.values())


def test_the_answer_is_stored_and_the_next_turn_resumes_after_it(loaded):
    tokens = prompt_tokens(loaded, 300)
    store = make_store()
    first = run(loaded, store, tokens=tokens, max_tokens=12)
    deepest = max(stored_sequences(store, loaded.fingerprint), key=len)
    assert deepest[:len(tokens)] == tokens
    assert len(deepest) >= len(tokens) + first["usage"]["completion_tokens"] - 1  # the answer, stored
    follow_up = deepest + tokens[:40]
    cached = run(loaded, store, tokens=follow_up, max_tokens=12)
    plain = run(loaded, store, tokens=follow_up, max_tokens=12, use=False)
    assert cached["text"] == plain["text"]
    assert cached["cache"]["reused_tokens"] == len(deepest) and cached["cache"]["checkpoint"] == "answer-end"
    store.check_integrity()
