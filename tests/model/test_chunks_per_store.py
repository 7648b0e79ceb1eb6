"""Stores every few chunks (the daemon's setting on CUDA): fewer, longer segments, the same answers.

A pass stays one chunk long; only when its KV goes to the store changes
(Scheduler._stores_pass). These run the real scheduler and a tiny model on
the CPU with ``chunks_per_store`` set as the engine sets it on CUDA.
"""

from __future__ import annotations

import pytest

from prefixd.daemon.cache import PrefixStore
from prefixd.daemon.engine import model_runner
from prefixd.daemon.engine.inline_runner import run_inline
from prefixd.daemon.engine.jobs import GenerateJob
from prefixd.daemon.models.loaded_model import load_model
from prefixd.protocol.methods import CacheOptions, GenerateParams, PromptInput

SOURCE_TEXT = (__import__("inspect").getsource(__import__("argparse")))[:20000]
CHUNK = 64
PER_STORE = 4  # stored every 256 tokens


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32")


@pytest.fixture(scope="module")
def prompt(llama) -> list[int]:
    tokens = llama.tokenizer.encode(SOURCE_TEXT)[:600]
    assert len(tokens) == 600
    return tokens


def job(tokens, job_id=1, max_tokens=6, use=True) -> GenerateJob:
    params = GenerateParams(
        prompt=PromptInput(tokens=tuple(tokens)), max_tokens=max_tokens, cache=CacheOptions(use=use, store=use)
    )
    return GenerateJob("test", job_id, params, emit=lambda kind, payload: None)


def make_store() -> PrefixStore:
    return PrefixStore(max_bytes=2 << 30, max_nodes=100_000, max_pinned_bytes=1 << 28)


def prompt_edges(store: PrefixStore, loaded, prompt_length: int) -> list[tuple[int, int]]:
    """(start, end) of the stored edges that hold the prompt (not the answer after it)."""
    edges = sorted(store.edges(loaded.fingerprint), key=lambda edge: edge.start_depth)
    return [
        (edge.start_depth, edge.start_depth + len(edge.key)) for edge in edges if edge.start_depth < prompt_length - 1
    ]


def test_an_attention_prompt_is_stored_every_few_chunks_and_answers_as_every_chunk(llama, prompt):
    every_chunk, every_fourth = make_store(), make_store()
    one = run_inline([job(prompt)], llama, every_chunk, CHUNK)[0]
    four = run_inline([job(prompt)], llama, every_fourth, CHUNK, chunks_per_store=PER_STORE)[0]
    assert four["text"] == one["text"]  # the passes are cut in the same places
    assert [end for _, end in prompt_edges(every_chunk, llama, 600)][:9] == [64 * n for n in range(1, 10)]
    assert prompt_edges(every_fourth, llama, 600) == [(0, 256), (256, 512), (512, 599)]
    cold = run_inline([job(prompt + [7, 8], use=False)], llama, None, CHUNK)[0]
    exact = run_inline([job(prompt)], llama, every_fourth, CHUNK, chunks_per_store=PER_STORE)[0]
    assert exact["text"] == one["text"] and exact["cache"]["reused_tokens"] == 600  # and its stored logits
    # A hit inside a long segment reuses its head, and answers as a cold run does.
    longer = run_inline([job(prompt + [7, 8])], llama, every_fourth, CHUNK, chunks_per_store=PER_STORE)[0]
    assert longer["cache"]["reused_tokens"] == 600 and longer["text"] == cold["text"]
    branch = prompt[:300] + [9, 10, 11]
    cold_branch = run_inline([job(branch, use=False)], llama, None, CHUNK)[0]
    warm_branch = run_inline([job(branch)], llama, every_fourth, CHUNK, chunks_per_store=PER_STORE)[0]
    assert warm_branch["cache"]["reused_tokens"] == 300 and warm_branch["text"] == cold_branch["text"]


def test_a_pass_someone_waits_on_is_stored_at_once(llama, prompt):
    """A second session sharing the first's prefix wakes as soon as the chunk holding it is done."""
    store = make_store()
    other = prompt[:300] + [9, 10, 11]
    first, second = run_inline(
        [job(prompt, job_id=1), job(other, job_id=2)], llama, store, CHUNK, chunks_per_store=PER_STORE
    )
    assert second["cache"]["reused_tokens"] == 300
    ends = [end for _, end in prompt_edges(store, llama, 600)]
    assert 320 in ends  # the chunk stop past the 300 shared tokens, off the stride: stored for the waiter
    cold = run_inline([job(other, use=False)], llama, None, CHUNK)[0]
    assert second["text"] == cold["text"]


def test_a_hybrid_model_is_stored_at_every_chunk(tiny_lfm2_dir):
    """Its conv state is snapshotted where a pass ends: every chunk stop stays a stored checkpoint."""
    hybrid = load_model(str(tiny_lfm2_dir), dtype="float32")
    tokens = hybrid.tokenizer.encode(SOURCE_TEXT)[:400]
    store = make_store()
    run_inline([job(tokens, max_tokens=1)], hybrid, store, CHUNK, chunks_per_store=PER_STORE)
    ends = [end for _, end in prompt_edges(store, hybrid, 400)]
    assert ends[:6] == [64, 128, 192, 256, 320, 384]


def test_a_prompt_cancelled_between_stores_keeps_what_it_computed(llama, prompt, monkeypatch):
    """Cancelled after 3 passes, none stored yet (every 4 chunks): its 192 tokens are stored as it ends."""
    passes = []
    real_step = model_runner.prefill_step

    def cancelling_step(seq, store, work):
        logits = real_step(seq, store, work)
        passes.append(work.run_to)
        if len(passes) == 3:
            seq.job.cancel()
        return logits

    monkeypatch.setattr(model_runner, "prefill_step", cancelling_step)
    store = make_store()
    cancelled = run_inline([job(prompt)], llama, store, CHUNK, chunks_per_store=PER_STORE)[0]
    assert cancelled["finish_reason"] == "cancelled" and passes == [64, 128, 192]
    assert cancelled["cache"]["stored_tokens"] == 192
    assert prompt_edges(store, llama, 600) == [(0, 192)]
    monkeypatch.setattr(model_runner, "prefill_step", real_step)
    again = run_inline([job(prompt)], llama, store, CHUNK, chunks_per_store=PER_STORE)[0]
    assert again["cache"]["reused_tokens"] == 192
    assert again["text"] == run_inline([job(prompt, use=False)], llama, None, CHUNK)[0]["text"]
