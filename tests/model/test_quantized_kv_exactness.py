"""The prefix cache's correctness gate again, at ``--kv-bits`` 8 and 4: cached == uncached at the same setting.

The store holds packed KV, every live pass (cold, warm, batched, solo) attends
to round-tripped KV, and a capture stores the packed form the live cache kept
(kv/quantized_kv.py, kv/round_trip_cache.py). So the suites of
test_cache_exactness.py and test_batching.py, imported here and run with this
module's ``loaded`` fixture, must pass unchanged on quantized models: every
split point, exact repeats, ten-turn chats, stored answers, batches of rows
joining and leaving. Hybrids' state snapshots stay full precision.

Those suites compare a cached run with an uncached one whose prefill passes
are cut elsewhere (a pass ending at the prompt's end, a decode step of one
token, a batch of rows). With MLX's own kernels a pass's float32 results do
not depend on its shape, and every suite passes bit-exactly at 8 and 4 bits
(`PREFIXD_BLAS=none`, below). With OpenBLAS, which the test session and the
daemon load, they depend on it by about 1e-6, and the quantizer turns such a
difference into a whole step wherever a value lies on a rounding boundary:
full precision shrugs 1e-6 off, a quantized cache carries it on (SmolLM2 at
8 bits: last logits 0.6-1.1% apart, and a 12-token greedy answer can
change). So
the imported suites run only with MLX's own BLAS:

    PREFIXD_BLAS=none .venv/bin/python -m pytest tests/model/test_quantized_kv_exactness.py -k "not smollm2"

(tiny models: 90 tests, 11 minutes on 2 cores; SmolLM2 without OpenBLAS is
too slow for a test). Under OpenBLAS, the tests below still pin what the
store itself does: a warm hit whose passes are cut where the cold run cut
them gives bit-identical logits, and the store holds and counts packed KV.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import mlx.core as mx

import tests.model.test_cache_exactness as exactness
from prefixd.daemon.kv.fork import fork_cache
from prefixd.daemon.models.loaded_model import load_model
from tests.model.test_batching import (  # noqa: F401  (collected here, with this module's fixture)
    test_concurrent_greedy_requests_match_solo_runs,
    test_sessions_arriving_together_on_a_warm_prefix_match_solo_runs_and_store_their_prompts,
)
from tests.model.test_cache_exactness import (  # noqa: F401  (collected here, with this module's fixture)
    make_store,
    prompt_tokens,
    run,
    test_exact_repeat_reuses_all_but_one_token_with_identical_logits,
    test_greedy_generation_is_the_same_with_and_without_the_cache,
    test_reused_prefix_gives_cold_logits_at_every_split,
    test_stored_entry_is_unchanged_after_seeding_and_generating,
    test_ten_turn_chat_matches_uncached_and_reuses_every_turn,
    test_the_answer_is_stored_and_the_next_turn_resumes_after_it,
    test_two_sessions_interleaved_on_a_shared_system_prompt,
)

# The imported suites' comparisons hold exactly only where a pass's float results do not depend on its shape.
REFERENCE_BLAS = os.environ.get("PREFIXD_BLAS") == "none"
# The suites' tests imported above (the ones below are this module's own).
IMPORTED_SUITES = frozenset(name for name in tuple(globals()) if name.startswith("test_"))

MODELS = [("llama", 8), ("llama", 4), ("lfm2", 8), ("gemma3", 8), ("gemma3", 4), ("qwen3_moe", 4), ("smollm2", 8)]


@pytest.fixture(scope="module", params=MODELS, ids=[f"{kind}-q{bits}" for kind, bits in MODELS])
def loaded(request):
    kind, bits = request.param
    directory = request.getfixturevalue("smollm2_dir" if kind == "smollm2" else f"tiny_{kind}_dir")
    return load_model(str(directory), dtype="float32", kv_bits=bits)


@pytest.fixture(autouse=True)
def shape_independent_floats(request):
    if request.node.originalname in IMPORTED_SUITES and not REFERENCE_BLAS:
        pytest.skip("exact only with MLX's own BLAS: run with PREFIXD_BLAS=none (module docstring)")


@pytest.fixture(scope="module")
def plain(loaded):
    """The same model at full precision."""
    return load_model(str(loaded.path), dtype="float32")


def test_the_store_holds_packed_kv_and_counts_what_it_holds(loaded, plain):
    tokens = prompt_tokens(loaded, 300)
    store = make_store()
    run(loaded, store, tokens=tokens, warm=True)
    segments = [edge.segment for edge in store.edges(loaded.fingerprint)]
    assert segments and all(segment.bits == loaded.layout.kv_bits for segment in segments)
    stored_per_token = sum(s.nbytes for s in segments) / sum(s.num_tokens for s in segments)
    # float32 KV of head_dim 64 in groups of 64: a head's token in 72 bytes instead of 256 at 8 bits, 40 at 4.
    assert plain.kv_bytes_per_token / stored_per_token == pytest.approx({8: 256 / 72, 4: 256 / 40}[loaded.layout.kv_bits])


def test_a_quantized_model_has_its_own_fingerprint_and_says_its_kv(loaded, plain):
    assert plain.kv == "float32" and plain.fingerprint + f"-q{loaded.layout.kv_bits}" == loaded.fingerprint
    assert loaded.kv == f"q{loaded.layout.kv_bits} (group 64)"
    assert loaded.describe(default=True)["kv"] == loaded.kv


def test_quantized_kv_moves_the_logits(loaded, plain):
    """The round trip is real: the same prompt gives other logits than at full precision (the bench measures by how much)."""
    tokens = mx.array(prompt_tokens(loaded, 300))[None]
    quantized = np.array(loaded.model(tokens, cache=fork_cache(loaded.model, loaded.layout, [], None, 0))[0])
    full = np.array(plain.model(tokens, cache=fork_cache(plain.model, plain.layout, [], None, 0))[0])
    assert not np.array_equal(quantized, full)


def test_a_warm_hit_equals_a_cold_run_cut_at_the_same_places(loaded):
    """The store and the fork add no difference of their own: bit-identical logits, OpenBLAS or not."""
    tokens = prompt_tokens(loaded, 400)
    store = make_store()
    run(loaded, store, tokens=tokens, warm=True, chunk=128)  # stores tokens[:399], in passes ending at 128, 256, 384
    warm, reused = exactness.warm_logits(loaded, store, tokens)
    assert reused == len(tokens) - 1
    cold_cache = fork_cache(loaded.model, loaded.layout, [], None, 0)
    for start, end in ((0, 128), (128, 256), (256, 384), (384, 399)):
        loaded.model(mx.array(tokens[start:end])[None], cache=cold_cache)
    cold = np.array(loaded.model(mx.array(tokens[399:])[None], cache=cold_cache)[0, -1])
    assert np.array_equal(warm, cold)
