"""A fork of a long stored path joined in groups (kv/fork.py, the CUDA form) is the plain fork, value for value.

A chat's stored path gains segments every turn; on CUDA the fork joins them
FORK_GROUP at a time so that its evaluations keep the shapes built at load.
The cache it gives must hold exactly what the one-step concatenation holds,
answer the same, and never alias the store.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from prefixd.daemon.cache import PrefixStore
from prefixd.daemon.engine.inline_runner import run_one_inline
from prefixd.daemon.engine.jobs import GenerateJob
from prefixd.daemon.kv import fork
from prefixd.daemon.models.loaded_model import load_model
from prefixd.protocol.methods import CacheOptions, GenerateParams, PromptInput


@pytest.fixture(scope="module", params=["llama", "lfm2", "gemma3"])
def loaded(request):
    return load_model(str(request.getfixturevalue(f"tiny_{request.param}_dir")), dtype="float32")


def job(tokens: list[int], use: bool = True) -> GenerateJob:
    params = GenerateParams(prompt=PromptInput(tokens=tuple(tokens)), max_tokens=6, cache=CacheOptions(use=use, store=use))
    return GenerateJob("test", 1, params, emit=lambda kind, payload: None)


def stored_path(loaded, tokens: list[int]):
    """A store holding ``tokens`` as many segments (16-token chunks), and the match of a longer prompt on it."""
    store = PrefixStore(max_bytes=1 << 30, max_nodes=100_000, max_pinned_bytes=1 << 28)
    run_one_inline(job(tokens), loaded, store, 16)
    match = store.match(loaded.fingerprint, tokens + [7, 8, 9], max_length=len(tokens) + 2,
                        requires_snapshot=loaded.layout.is_hybrid)
    return store, match


def test_a_grouped_fork_holds_what_the_plain_fork_holds_and_answers_the_same(loaded, monkeypatch):
    tokens = [(i * 37) % 1500 + 20 for i in range(400)]
    store, match = stored_path(loaded, tokens)
    assert len(match.segments) > 2 * fork.FORK_GROUP  # three groups or more
    joins = []
    original = fork._join_in_groups
    monkeypatch.setattr(fork, "_join_in_groups", lambda parts: joins.append(len(parts[0])) or original(parts))

    def forked(grouped: bool):
        monkeypatch.setattr(fork, "GROUPED_FORK", grouped)
        cache = fork.fork_cache(loaded.model, loaded.layout, list(match.segments), match.snapshot, match.length)
        fork.evaluate_fork(cache)
        return cache

    plain, grouped = forked(False), forked(True)
    assert joins == [len(match.segments)]
    plain_arrays = tree_flatten([c.state for c in plain])
    grouped_arrays = tree_flatten([c.state for c in grouped])
    assert len(plain_arrays) == len(grouped_arrays)
    for (_, x), (_, y) in zip(plain_arrays, grouped_arrays):
        assert (x is None and y is None) or mx.array_equal(x, y).item()
    tail = mx.array([[7, 8, 9]])
    assert mx.array_equal(loaded.model(tail, cache=plain), loaded.model(tail, cache=grouped)).item()
    store.release(match.lease)


def test_a_grouped_fork_never_aliases_the_store(loaded, monkeypatch):
    monkeypatch.setattr(fork, "GROUPED_FORK", True)
    tokens = [(i * 41) % 1500 + 20 for i in range(300)]
    store, match = stored_path(loaded, tokens)
    before = [mx.array(s.keys[0]) for s in match.segments]
    cache = fork.fork_cache(loaded.model, loaded.layout, list(match.segments), match.snapshot, match.length)
    loaded.model(mx.array([[5] * 40]), cache=cache)  # writes into the fork, past and over its headroom
    layer = loaded.layout.attention_layers[0]
    cache[layer].keys[..., :5, :] = 0.0
    mx.eval([c.state for c in cache])
    assert all(mx.array_equal(b, s.keys[0]).item() for b, s in zip(before, match.segments))
    store.release(match.lease)


def test_answers_through_grouped_forks_equal_answers_through_plain_forks(loaded, monkeypatch):
    """The same requests on two stores filled alike: grouped forks answer what plain forks answer, token for token.

    Against an uncached run the passes are cut differently (a warm tail
    starts at the stored prompt's end), and OpenBLAS's sums depend on a pass's
    shape by about 1e-6; the exactness suite compares those within its
    tolerance (test_cache_exactness.py). Here only the fork's form differs.
    """
    tokens = [(i * 43) % 1500 + 20 for i in range(420)]
    stores = {}
    for grouped in (True, False):
        monkeypatch.setattr(fork, "GROUPED_FORK", grouped)
        stores[grouped] = PrefixStore(max_bytes=1 << 30, max_nodes=100_000, max_pinned_bytes=1 << 28)
        run_one_inline(job(tokens), loaded, stores[grouped], 16)
    for prompt in (tokens, tokens + [11, 12, 13, 14, 15]):
        answers = {}
        for grouped in (True, False):
            monkeypatch.setattr(fork, "GROUPED_FORK", grouped)
            answers[grouped] = run_one_inline(job(prompt), loaded, stores[grouped], 16)
            assert answers[grouped]["cache"]["reused_tokens"] >= 400
        assert answers[True]["text"] == answers[False]["text"]
