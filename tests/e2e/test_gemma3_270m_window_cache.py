"""Gemma 3 270M's sliding window (512 positions on 15 of its 18 layers) reused exactly, through the daemon.

A prompt longer than the window is a hit when repeated and when a next turn
extends it, with the uncached greedy answer. Slow on a CPU (a few seconds a
prompt): kept to two tests. Skips unless `prefixd setup gemma3-270m` has run.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest

from prefixd.client.sync_client import Client
from prefixd.daemon.models.model_setup import find_model

WINDOW = 512
DOCUMENT = inspect.getsource(textwrap)


@pytest.fixture(scope="module")
def gemma3_dir():
    path = find_model("gemma3-270m")
    if path is None:
        pytest.skip("Gemma 3 270M is not set up: run `prefixd setup gemma3-270m`")
    return path


@pytest.fixture(scope="module")
def daemon(gemma3_dir, tmp_path_factory):
    from tests.e2e.daemon_process import DaemonProcess

    process = DaemonProcess([gemma3_dir], tmp_path_factory.mktemp("gemma3-270m"))
    process.start(timeout=180)
    try:
        yield process
    finally:
        process.stop()


def test_the_window_layers_are_stored(daemon):
    with Client(daemon.socket_path, timeout=120) as client:
        (model,) = client.models()["models"]
    assert model["cache_layers"] == {"kvcache": 3, "rotating": 15, "arrays": 0, "other": 0}


def test_a_prompt_past_the_window_repeats_and_extends_as_hits_with_the_uncached_answer(daemon):
    with Client(daemon.socket_path, timeout=600) as client:
        tokens = client.tokenize(prompt=DOCUMENT)["tokens"][: WINDOW + 200]
        assert len(tokens) == WINDOW + 200
        cold = client.generate(tokens=tokens, max_tokens=8, temperature=0, cache=False)
        first = client.generate(tokens=tokens, max_tokens=8, temperature=0)
        repeat = client.generate(tokens=tokens, max_tokens=8, temperature=0)
        # the next turn: the prompt, its answer, a question (tokenize adds <bos>, id 2: dropped here)
        answer = [t for t in client.tokenize(prompt=first["text"])["tokens"] if t != 2]
        question = [t for t in client.tokenize(prompt="\n\nSummarise the code above in one line:")["tokens"] if t != 2]
        turn = tokens + answer + question
        cached_turn = client.generate(tokens=turn, max_tokens=8, temperature=0)
        plain_turn = client.generate(tokens=turn, max_tokens=8, temperature=0, cache=False)
    assert first["text"] == cold["text"] == repeat["text"]
    assert repeat["cache"]["hit"] == "exact" and repeat["cache"]["reused_tokens"] == len(tokens)  # and its logits
    assert cached_turn["text"] == plain_turn["text"]
    assert cached_turn["cache"]["reused_tokens"] >= len(tokens) - 1, cached_turn["cache"]
