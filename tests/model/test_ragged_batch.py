"""prefixd's ragged decode batch: each row answers what it answers alone, whoever joins or leaves.

Real tiny models through prefixd's loading (its attention routing): rows at
different depths join at different steps, one is taken out, one stops on a
stop sequence, one on its budget; every row's tokens match a plain greedy
loop on its own cache, and a finished row's cache holds every token it was
handed. A model whose attention bypasses the routing is kept padded.
"""

from __future__ import annotations

import pytest

import mlx.core as mx
from mlx_lm.generate import StopSequences
from prefixd.daemon.engine.batch_decoder import greedy
from prefixd.daemon.engine.ragged_batch import RaggedBatch
from prefixd.daemon.kv.fork import live_cache
from prefixd.daemon.models.batch_step import choose_batch_step
from prefixd.daemon.models.loaded_model import load_model

NEVER = StopSequences([[-1]])


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def loaded(request):
    return load_model(str(request.getfixturevalue(f"tiny_{request.param}_dir")), dtype="float32")


def prompt(depth: int, seed: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 200 + 10 for i in range(depth)]


def prefilled(loaded, tokens: list[int]) -> tuple[list, int]:
    """A cache holding the prompt, and the first answer token (greedy) as the scheduler samples it."""
    cache = live_cache(loaded.model, loaded.layout)
    logits = loaded.model(mx.array([tokens]), cache=cache)[:, -1]
    return cache, int(mx.argmax(logits, axis=-1).item())


def alone(loaded, tokens: list[int], count: int) -> list[int]:
    """The tokens after the first answer token, decoded greedily on the row's own cache."""
    cache, token = prefilled(loaded, tokens)
    out = []
    for _ in range(count):
        token = int(mx.argmax(loaded.model(mx.array([[token]]), cache=cache)[:, -1], axis=-1).item())
        out.append(token)
    return out


def join(batch: RaggedBatch, loaded, tokens: list[int], max_tokens: int, stop=NEVER) -> tuple[int, list]:
    cache, first = prefilled(loaded, tokens)
    (uid,) = batch.insert([[first]], [max_tokens], [cache], [greedy], [[]], [stop])
    return uid, cache


def test_rows_joining_and_leaving_answer_as_each_alone(loaded):
    assert loaded.batch_step == "ragged"
    prompts = {name: prompt(depth, seed) for seed, (name, depth) in enumerate([("deep", 90), ("short", 7), ("late", 40), ("gone", 25)])}
    expected = {name: alone(loaded, tokens, 12) for name, tokens in prompts.items()}
    batch = RaggedBatch(loaded.model, sampler=greedy, stream=mx.default_stream(mx.default_device()))
    uids, caches = {}, {}
    for name in ("deep", "short", "gone"):
        uids[name], caches[name] = join(batch, loaded, prompts[name], 10)
    got: dict[str, list[int]] = {name: [] for name in prompts}
    finished = {}
    by_uid = {}
    for step in range(14):
        if step == 3:
            uids["late"], caches["late"] = join(batch, loaded, prompts["late"], 6)
        if step == 5:
            taken = batch.remove([uids["gone"]], return_prompt_caches=True)
            cache, handed = taken[uids["gone"]]
            assert handed == got["gone"] and cache is caches["gone"]
            assert cache[0].offset == len(prompts["gone"]) + 1 + len(got["gone"])  # joining token + each handed out
        by_uid = {uid: name for name, uid in uids.items()}
        _, responses = batch.next()
        for response in responses:
            name = by_uid[response.uid]
            got[name].append(response.token)
            if response.finish_reason:
                finished[name] = (response.finish_reason, response.prompt_cache)
    assert len(batch) == 0
    for name in ("deep", "short"):
        assert got[name] == expected[name][:10], name
        reason, cache = finished[name]
        assert reason == "length" and cache is caches[name]
        assert cache[0].offset == len(prompts[name]) + 1 + 10
    assert got["late"] == expected["late"][:6] and finished["late"][0] == "length"
    assert got["gone"] == expected["gone"][: len(got["gone"])] and "gone" not in finished
    assert len(got["gone"]) == 4  # joined on step 0 (no token), then handed out one a step until removed


def test_a_row_stops_on_its_stop_sequence_the_others_go_on(loaded):
    tokens_a, tokens_b = prompt(30, 1), prompt(12, 2)
    expected_a = alone(loaded, tokens_a, 12)
    stop = StopSequences([expected_a[:3]])  # its third token completes it, at the earliest
    batch = RaggedBatch(loaded.model, sampler=greedy, stream=mx.default_stream(mx.default_device()))
    uid_a, _ = join(batch, loaded, tokens_a, 12, stop)
    uid_b, _ = join(batch, loaded, tokens_b, 8)
    got = {uid_a: [], uid_b: []}
    reasons = {}
    while len(batch):
        for response in batch.next()[1]:
            got[response.uid].append(response.token)
            if response.finish_reason:
                reasons[response.uid] = response.finish_reason
    assert got[uid_a] == expected_a[:3] and reasons[uid_a] == "stop"
    assert got[uid_b] == alone(loaded, tokens_b, 8) and reasons[uid_b] == "length"


def test_a_row_joins_with_one_token_and_a_matching_cache(loaded):
    batch = RaggedBatch(loaded.model, sampler=greedy, stream=mx.default_stream(mx.default_device()))
    cache, _ = prefilled(loaded, prompt(10, 0))
    with pytest.raises(ValueError, match="one token"):
        batch.insert([[5, 6]], [4], [cache], [greedy], [[]], [NEVER])
    with pytest.raises(ValueError, match="max_tokens"):
        batch.insert([[5]], [0], [cache], [greedy], [[]], [NEVER])
    batch.insert([[5]], [4], [cache], [greedy], [[]], [NEVER])
    with pytest.raises(ValueError, match="cache layers"):
        batch.insert([[5]], [4], [cache[:-1]], [greedy], [[]], [NEVER])
    assert len(batch) == 1


def test_a_model_whose_attention_bypasses_the_routing_stays_padded(loaded, monkeypatch):
    from mlx_lm.models import base

    module = __import__("sys").modules[type(loaded.model.layers[0]).__module__]
    monkeypatch.setattr(module, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    choice = choose_batch_step(loaded.model, loaded.layout, wanted=True)
    assert choice.startswith("padded (a ragged step answered differently")


def test_auto_is_ragged_on_a_cpu_and_a_hybrid_model_stays_padded(tiny_lfm2_dir, tiny_llama_dir):
    assert load_model(str(tiny_llama_dir), dtype="float32").batch_step == "ragged"
    assert load_model(str(tiny_llama_dir), dtype="float32", batch_step="padded").batch_step == "padded"
    lfm2 = load_model(str(tiny_lfm2_dir), dtype="float32", batch_step="ragged")
    assert lfm2.batch_step.startswith("padded (conv/SSM state layers")
