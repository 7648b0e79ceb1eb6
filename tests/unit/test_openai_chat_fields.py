"""/v1/chat/completions fields: each honoured, accepted where it cannot change the answer, or a 400 naming it."""

from __future__ import annotations

import pytest

from prefixd.daemon.front.openai_shapes import chat_request
from prefixd.protocol.errors import RpcError

CHAT = [{"role": "user", "content": "Hi"}]


def test_labels_and_neutral_or_greedy_exact_extras_are_accepted():
    params = chat_request({"messages": CHAT, "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                           "presence_penalty": 0, "frequency_penalty": 0.0, "top_k": 40, "min_p": 0.05, "logit_bias": {}})
    assert params.temperature == 0.0


@pytest.mark.parametrize("extra, field", [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"top_k": 40, "temperature": 0.8}, "top_k"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_what_would_change_the_answer_or_is_unknown_is_refused_by_name(extra, field):
    with pytest.raises(RpcError) as err:
        chat_request({"messages": CHAT, **extra})
    assert f"'{field}'" in err.value.message
