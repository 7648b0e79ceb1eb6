"""Continuous batching gives every request what it would get alone.

N greedy requests (different prompts, some sharing prefixes, different
lengths and budgets) decoded together in one batch must produce the same
text as each run alone without the cache, on the tiny llama-style model, the
tiny lfm2 hybrid and SmolLM2; attention-only models in prefixd's ragged
batch (a CPU's default), and the tiny llama-style one in mlx-lm's padded
batch too (lfm2's rows are always padded).
"""

from __future__ import annotations

import pytest

from prefixd.daemon.engine.inline_runner import run_inline, run_one_inline
from prefixd.daemon.engine.jobs import CHUNK, GenerateJob
from prefixd.daemon.models.loaded_model import load_model
from prefixd.daemon.cache import PrefixStore
from prefixd.protocol.methods import CacheOptions, GenerateParams, PromptInput

SOURCE_TEXT = __import__("inspect").getsource(__import__("json.decoder", fromlist=["x"]))


@pytest.fixture(scope="module", params=["llama", "llama-padded", "lfm2", "gemma3", "smollm2"])
def loaded(request):
    family, _, batch_step = request.param.partition("-")
    name = "smollm2_dir" if family == "smollm2" else f"tiny_{family}_dir"
    return load_model(str(request.getfixturevalue(name)), dtype="float32", batch_step=batch_step or "auto")


def make_job(loaded, text: str, max_tokens: int, use_cache: bool = True, events=None) -> GenerateJob:
    params = GenerateParams(prompt=PromptInput(text=text), max_tokens=max_tokens, cache=CacheOptions(use=use_cache, store=use_cache))
    emit = (lambda kind, payload: events.append((kind, payload))) if events is not None else (lambda kind, payload: None)
    return GenerateJob("test", 1, params, emit)


def streamed_job(name: str, text: str, first_token_order: list[str], cache: CacheOptions | None = None) -> GenerateJob:
    """A streamed 3-token request that appends ``name`` to ``first_token_order`` at its first chunk."""
    def emit(kind, payload):
        if kind == CHUNK and name not in first_token_order:
            first_token_order.append(name)

    params = GenerateParams(prompt=PromptInput(text=text), max_tokens=3, stream=True, cache=cache or CacheOptions())
    return GenerateJob(name, 1, params, emit)


def make_store() -> PrefixStore:
    return PrefixStore(max_bytes=2 << 30, max_nodes=100_000, max_pinned_bytes=1 << 28)


def test_concurrent_greedy_requests_match_solo_runs(loaded):
    shared = SOURCE_TEXT[:1800]
    prompts = [
        shared + "\n# question one",
        shared + "\n# another, longer question about the decoder",
        SOURCE_TEXT[3000:3400],
        "A short prompt.",
        shared[:900] + " and a branch in the middle",
        SOURCE_TEXT[5000:7000],
    ]
    budgets = [12, 7, 15, 10, 9, 11]
    store = make_store()
    together = run_inline([make_job(loaded, p, n) for p, n in zip(prompts, budgets)], loaded, store, chunk_size=128)
    for prompt, budget, result in zip(prompts, budgets, together):
        alone = run_one_inline(make_job(loaded, prompt, budget, use_cache=False), loaded, None, chunk_size=128)
        assert result["text"] == alone["text"], prompt[:40]
        assert result["usage"]["completion_tokens"] <= budget
    # The prompts sharing the long prefix computed it once: someone reused it.
    assert sum(r["cache"]["reused_tokens"] for r in together) > 0
    store.check_integrity()


def test_a_request_sharing_an_inflight_prefix_waits_and_reuses_it(loaded):
    shared = SOURCE_TEXT[:2500]
    store = make_store()
    first, second = run_inline(
        [make_job(loaded, shared + "\n# first", 4), make_job(loaded, shared + "\n# second", 4)],
        loaded,
        store,
        chunk_size=64,
    )
    num_shared = first["usage"]["prompt_tokens"] - 10
    assert second["cache"]["reused_tokens"] >= num_shared - 64, (first["cache"], second["cache"])
    assert first["cache"]["reused_tokens"] + second["cache"]["reused_tokens"] > 0


def test_a_waiting_request_resumes_once_the_shared_part_is_stored_not_when_the_leader_ends(loaded):
    """The follower waits for the shared system prompt only, not for the leader's long document after it."""
    first_token_order: list[str] = []
    shared = SOURCE_TEXT[:1200]
    leader, follower = run_inline(
        [streamed_job("leader", shared + SOURCE_TEXT[4000:9000], first_token_order),
         streamed_job("follower", shared + "\n# and this?", first_token_order)],
        loaded, make_store(), chunk_size=64)
    num_shared = follower["usage"]["prompt_tokens"] - 8
    assert follower["cache"]["reused_tokens"] >= num_shared - 64, follower["cache"]
    assert first_token_order[0] == "follower", first_token_order


def test_streamed_chunks_of_a_batched_request_add_up_to_its_text(loaded):
    events: list = []
    jobs = [make_job(loaded, SOURCE_TEXT[:400], 12, events=events), make_job(loaded, SOURCE_TEXT[400:800], 12)]
    jobs[0].params = GenerateParams(prompt=jobs[0].params.prompt, max_tokens=12, stream=True)
    result = run_inline(jobs, loaded, make_store())[0]
    assert "".join(payload["text"] for kind, payload in events if kind == CHUNK) == result["text"]


def test_a_short_request_is_not_stalled_behind_a_long_prefill(loaded):
    """Chunked prefill: the short prompt's first token comes before the long prompt's."""
    first_token_order: list[str] = []
    uncached = CacheOptions(False, False)
    long_job = streamed_job("long", SOURCE_TEXT[:6000], first_token_order, uncached)
    short_job = streamed_job("short", "Hello there.", first_token_order, uncached)
    results = run_inline([long_job, short_job], loaded, None, chunk_size=64)
    assert results[0]["usage"]["prompt_tokens"] > 5 * 64  # many chunks
    assert first_token_order[0] == "short", first_token_order


def test_sessions_arriving_together_on_a_warm_prefix_match_solo_runs_and_store_their_prompts(loaded):
    """Short tails on a stored prefix (one pass each, ahead of the decode steps) stay exact."""
    shared = SOURCE_TEXT[:1500]
    questions = ["\n# what is this?", "\n# who wrote the scanner, and why is it so long?", "\n# ok", "\n# tests?"]
    store = make_store()
    run_one_inline(make_job(loaded, shared, 1), loaded, store, chunk_size=128)  # the shared prefix, stored
    together = run_inline([make_job(loaded, shared + q, 6) for q in questions], loaded, store, chunk_size=128)
    for question, result in zip(questions, together):
        alone = run_one_inline(make_job(loaded, shared + question, 6, use_cache=False), loaded, None, chunk_size=128)
        assert result["text"] == alone["text"], question
        assert result["cache"]["reused_tokens"] > 0
        assert result["cache"]["stored_tokens"] > 0  # prompt tail (and answer) went into the store
    again = run_one_inline(make_job(loaded, shared + questions[1], 6), loaded, store, chunk_size=128)
    assert again["cache"]["hit"] == "exact" and again["text"] == together[1]["text"]
    store.check_integrity()
