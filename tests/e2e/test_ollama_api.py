"""Ollama's API, driven by the official ``ollama`` package against a real daemon (tiny models)."""

from __future__ import annotations

import json
import time
import urllib.request
from datetime import datetime, timezone

import pytest

ollama = pytest.importorskip("ollama")

from tests.support.http_daemon import http_daemon  # noqa: E402

CHAT = [
    {"role": "system", "content": "You are the terse assistant of an Ollama client test."},
    {"role": "user", "content": "Which endpoints does an Ollama client call first?"},
]


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory):
    with http_daemon(tiny_llama_dir, tmp_path_factory.mktemp("ollama")) as live:
        yield live


@pytest.fixture
def client(daemon):
    return ollama.Client(host=daemon.base_url, headers=daemon.headers(), timeout=60)


def test_chat_reports_ollama_counters_and_reuses_the_prefix_on_a_repeat(daemon, client):
    options = {"num_predict": 8, "temperature": 0, "seed": 1}
    first = client.chat(model="llama", messages=CHAT, options=options, stream=False)
    again = client.chat(model="llama", messages=CHAT, options=options, stream=False)
    assert first.done and first.done_reason in ("stop", "length")
    assert first.message.role == "assistant" and first.message.content == again.message.content  # greedy
    assert first.eval_count == again.eval_count and 0 < first.eval_count <= 8
    assert first.prompt_eval_count == again.prompt_eval_count > 20
    assert first.total_duration > 0 and first.prompt_eval_duration > 0 and first.load_duration == 0
    # The typed reply drops prefixd's own fields: the same request, raw, shows the cache map beside the counters.
    status, raw = daemon.post_json("/api/chat", {"model": "llama", "messages": CHAT, "options": options, "stream": False})
    assert status == 200 and raw["message"]["content"] == first.message.content
    assert raw["prefixd_cache"]["reused_tokens"] > 0 and raw["prefixd_cache"]["prompt_tokens"] == raw["prompt_eval_count"]


def test_chat_streams_ndjson_and_the_last_chunk_carries_the_counters(daemon, client):
    messages = CHAT + [{"role": "user", "content": "Stream it."}]
    chunks = list(client.chat(model="llama", messages=messages, options={"num_predict": 12}, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert chunks[-1].eval_count >= len([c for c in chunks[:-1] if c.message.content])
    assert "".join(c.message.content for c in chunks)  # some text came
    status, data = daemon.post("/api/chat", {"model": "llama", "messages": messages, "options": {"num_predict": 12}})
    lines = [json.loads(line) for line in data.decode().splitlines()]
    assert status == 200 and lines[-1]["done"] and not any(line["done"] for line in lines[:-1])
    assert lines[-1]["prefixd_cache"]["prompt_tokens"] == lines[-1]["prompt_eval_count"]
    assert "".join(line["message"]["content"] for line in lines) == "".join(c.message.content for c in chunks)


def test_generate_plain_and_raw(client):
    templated = client.generate(model="llama", prompt="Name a prime.", system="Answer with digits.", options={"num_predict": 4})
    raw = client.generate(model="llama", prompt="def main():\n", raw=True, options={"num_predict": 4}, stream=False)
    assert templated.done and raw.done
    assert raw.prompt_eval_count < templated.prompt_eval_count  # no chat template around a raw prompt


def test_generate_with_suffix_fills_in_the_middle_on_a_fim_model(client):
    reply = client.generate(model="llama-fim", prompt="def add(a, b):\n    ", suffix="\n\nprint(add(1, 2))\n",
                            options={"num_predict": 6})
    assert reply.done and reply.eval_count > 0
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model="llama", prompt="def add(a, b):\n", suffix="\n")
    assert err.value.status_code == 400 and "FIM tokens" in err.value.error


def test_tags_show_ps_version(client):
    names = sorted(m.model for m in client.list().models)
    assert names == ["llama", "llama-fim"]
    shown = client.show("llama-fim")
    assert "insert" in shown.capabilities and "insert" not in client.show("llama").capabilities
    assert any(key.endswith(".context_length") for key in shown.modelinfo)
    running = client.ps().models  # the loaded models: llama, the default, at least
    assert "llama" in [m.model for m in running] and all(m.size > 0 for m in running)
    assert client.show("llama").details.format == "mlx"
    with pytest.raises(ollama.ResponseError) as err:
        client.show("no-such-model")
    assert err.value.status_code == 404


def test_version_and_load_requests(daemon, client):
    request = urllib.request.Request(daemon.base_url + "/api/version", headers=daemon.headers())
    assert json.loads(urllib.request.urlopen(request).read())["version"]
    loaded = client.generate(model="llama", prompt="", keep_alive="10m")  # Ollama's "load this model"
    assert loaded.done and loaded.done_reason == "load"
    status, raw = daemon.post_json("/api/generate", {"model": "llama", "keep_alive": "soon"})
    assert status == 400 and "keep_alive" in raw["error"]


def test_keep_alive_loads_and_unloads_a_model_as_ps_shows(daemon, client):
    def running() -> dict:
        return {m.model: m for m in client.ps().models}

    unloaded = client.generate(model="llama-fim", prompt="", keep_alive=0)  # Ollama's "unload this model"
    assert unloaded.done and unloaded.done_reason == "unload"
    assert "llama-fim" not in running() and "llama" in running()
    assert sorted(m.model for m in client.list().models) == ["llama", "llama-fim"]  # tags: loaded or not

    reply = client.generate(model="llama-fim", prompt="def f():", keep_alive="5m", options={"num_predict": 2})
    assert reply.done
    entry = running()["llama-fim"]
    remaining = (entry.expires_at - datetime.now(timezone.utc)).total_seconds()
    assert 240 < remaining <= 300 and entry.size > 0

    client.chat(model="llama-fim", messages=CHAT, keep_alive=0, options={"num_predict": 2})  # unloads once done
    assert "llama-fim" not in running()

    assert client.generate(model="llama-fim", prompt="", keep_alive=-1).done_reason == "load"  # for good
    assert running()["llama-fim"].expires_at.year > 2300
    request = urllib.request.Request(daemon.base_url + "/v1/models", headers=daemon.headers())
    listed = {m["id"]: m["prefixd_residency"] for m in json.loads(urllib.request.urlopen(request).read())["data"]}
    assert listed["llama-fim"]["loaded"] and listed["llama-fim"]["keep_alive"] == "forever"
    assert listed["llama-fim"]["resident_bytes"] > 0 and listed["llama-fim"]["loaded_at"] <= time.time()


@pytest.mark.parametrize("kwargs, field", [
    ({"options": {"repeat_penalty": 1.3}}, "options.repeat_penalty"),
    ({"options": {"top_k": 40, "temperature": 0.7}}, "options.top_k"),
    ({"options": {"num_predict": 0}}, "options.num_predict"),
    ({"options": {"no_such_option": 1}}, "options.no_such_option"),
    ({"keep_alive": "a while"}, "keep_alive"),
    ({"tools": [{"type": "function", "function": {"description": "no name", "parameters": {"type": "object"}}}]},
     "tools[0].function.name"),
])
def test_unsupported_fields_are_400_naming_the_field(client, kwargs, field):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="llama", messages=CHAT, stream=False, **kwargs)
    assert err.value.status_code == 400 and f"'{field}'" in err.value.error


def test_options_that_cannot_change_a_greedy_answer_are_accepted_and_noted(daemon):
    options = {"num_predict": 2, "top_k": 40, "num_ctx": 4096, "num_thread": 2, "repeat_penalty": 1.0}
    status, reply = daemon.post_json("/api/chat", {"model": "llama", "messages": CHAT, "stream": False, "options": options})
    assert status == 200
    notes = " ".join(reply["prefixd_notes"])
    assert "options.top_k" in notes and "options.num_ctx" in notes and "options.num_thread" in notes
