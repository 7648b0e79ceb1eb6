"""Fill-in-the-middle (llama.cpp's /infill as llama.vim sends it, /v1/completions with suffix) and /metrics."""

from __future__ import annotations

import json

import pytest

from tests.support.http_daemon import http_daemon

openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

EXTRA = [{"filename": "util.py", "text": "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n", "time": 1700000000},
         {"filename": "shapes.py", "text": "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n", "time": 1700000001}]
PREFIX = "import math\n\n\ndef distance(a, b):\n    dx = a.x - b.x\n    dy = a.y - b.y\n"
SUFFIX = "\n\nprint(distance(Point(0, 0), Point(3, 4)))\n"


def llama_vim_request(prompt: str, **overrides) -> dict:
    """The body llama.vim's llama#fim sends (autoload/llama.vim), with its default settings."""
    return {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": prompt,
            "n_predict": 16, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"],
            "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/predicted_n", "tokens_cached",
                                "prefixd_cache"], "model": "llama-fim", **overrides}


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory):
    with http_daemon(tiny_llama_dir, tmp_path_factory.mktemp("infill")) as live:
        yield live


def test_llama_vim_warm_up_then_completions_in_one_file_keep_hitting_the_cache(daemon):
    # The ring buffer's warm-up: extra context only, n_predict 0; nothing is generated, the cache fills.
    status, warm = daemon.post_json("/infill", {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": EXTRA,
                                                "prompt": "", "n_predict": 0, "cache_prompt": True, "t_max_prompt_ms": 1,
                                                "t_max_predict_ms": 1, "model": "llama-fim"})
    assert status == 200 and warm["content"] == "" and warm["tokens_predicted"] == 0
    extra_tokens = warm["prefixd_cache"]["stored_tokens"]
    assert extra_tokens > 20

    status, first = daemon.post_json("/infill", llama_vim_request("    return math.sq"))
    assert status == 200, first
    assert set(first) == {"content", "timings/prompt_n", "timings/prompt_ms", "timings/predicted_n", "tokens_cached", "prefixd_cache"}
    assert first["tokens_cached"] >= extra_tokens - 8  # the extra chunks came from the warm-up
    # The user types on: everything before the cursor line is reused, only the line and the suffix run again.
    status, second = daemon.post_json("/infill", llama_vim_request("    return math.sqrt(dx"))
    assert status == 200
    cache = second["prefixd_cache"]
    assert cache["reused_tokens"] > first["tokens_cached"] and cache["prefilled_tokens"] < 40
    assert second["timings/prompt_n"] == cache["prefilled_tokens"]


def test_infill_streams_pieces_then_the_whole_object(daemon):
    status, data = daemon.post("/infill", llama_vim_request("    return ", stream=True, response_fields=[]))
    events = [json.loads(line[len("data: "):]) for line in data.decode().split("\n\n") if line.startswith("data: ")]
    assert status == 200 and events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
    assert events[-1]["prefixd_cache"]["reused_tokens"] > 0
    assert any("id_slot" in note for note in events[-1]["prefixd_notes"])


@pytest.mark.parametrize("overrides, field", [
    ({"model": "llama"}, "input_prefix"),  # a model without FIM tokens
    ({"grammar": "root ::= \"x\""}, "grammar"),
    ({"temperature": 0.8}, "top_k"),  # top_k only where it cannot change the answer
    ({"repeat_penalty": 1.1}, "repeat_penalty"),
    ({"input_extra": [{"filename": "a.py", "text": "x", "language": "py"}]}, "input_extra[0].language"),
])
def test_infill_refuses_what_it_cannot_honour_naming_the_field(daemon, overrides, field):
    status, error = daemon.post_json("/infill", llama_vim_request("x", **overrides))
    assert status == 400 and error["error"]["param"] == field, error


def test_openai_completion_with_suffix(daemon):
    with openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=daemon.token, max_retries=0, timeout=60) as client:
        reply = client.completions.create(model="llama-fim", prompt=PREFIX, suffix=SUFFIX, max_tokens=6)
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="llama", prompt=PREFIX, suffix=SUFFIX, max_tokens=6)
    assert err.value.body["param"] == "suffix" and "FIM tokens" in err.value.body["message"]


def test_metrics_parse_as_prometheus_text_and_count_what_replies_reported(daemon):
    for _ in range(2):
        status, _reply = daemon.post_json("/v1/completions", {"model": "llama", "prompt": "A metrics test prompt, " * 8, "max_tokens": 3})
        assert status == 200
    families = {family.name: family for family in prometheus_parser.text_string_to_metric_families(daemon.get_text("/metrics"))}
    samples = [sample for family in families.values() for sample in family.samples]

    def value(name: str, **labels) -> float:
        found = [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        assert found, f"no sample {name} {labels}"
        return sum(s.value for s in found)

    assert value("prefixd_requests_total", model="llama") >= 2
    assert value("prefixd_reused_tokens_total", model="llama") > 0  # the second prompt repeated the first
    assert value("prefixd_prefilled_tokens_total", model="llama") > 0
    assert 0 < value("prefixd_prompt_reuse_ratio", model="llama") < 1
    assert value("prefixd_time_to_first_token_seconds_count", model="llama") >= 2
    assert value("prefixd_queue_seconds_count", model="llama") >= 2
    assert value("prefixd_store_bytes", model="llama") > 0
    assert "prefixd_store_evictions" in families and "prefixd_sequences_running" in families
    assert value("prefixd_sequences_queued") == 0
