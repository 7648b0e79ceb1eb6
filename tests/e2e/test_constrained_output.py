"""A generate's ``constraint`` through the real daemon and socket: the answer always matches it.

Even the random-weight tiny models (gibberish unconstrained) answer valid
JSON for a schema, a regex's full match and a Lark grammar's sentence,
greedy and sampled, alone and batched with unconstrained requests (which
answer exactly what they answer alone). A constraint that does not compile
is INVALID_PARAMS and the daemon goes on serving; a repeated constrained
prompt is a cache hit with the same answer. SmolLM2 (a real model) answers
a schema and a JSON object under a chat prompt.
"""

from __future__ import annotations

import json
import re

import pytest

from prefixd.daemon.grammar import forced_tool_call
from prefixd.daemon.models.tool_call_format import LLAMA3_JSON, ToolCallFormat, parse_llama3_json
from tests.e2e.daemon_process import REQUEST, DaemonProcess, RawConnection

INVALID_PARAMS = -32602

# Bounded everywhere (string lengths, numbers, items), so that even a random model ends well within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "home": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "member", "role", "tags", "home"],
    "additionalProperties": False,
}


def check_person(value) -> None:
    """The schema above, checked by hand (jsonschema is not a dependency)."""
    assert isinstance(value, dict) and list(value) == ["name", "age", "member", "role", "tags", "home"]
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["age"]) is int and 0 <= value["age"] <= 150
    assert type(value["member"]) is bool
    assert value["role"] in ("admin", "user", "guest")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(tag, str) and len(tag) <= 5 for tag in value["tags"])
    assert list(value["home"]) == ["zip"] and re.fullmatch("[0-9]{5}", value["home"]["zip"])


def generate(conn: RawConnection, **params) -> dict:
    return conn.result("generate", params, timeout=120)


def test_a_random_model_answers_json_that_matches_the_schema(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        for model, temperature in (("llama", 0.0), ("llama", 1.0), ("lfm2", 0.0), ("lfm2", 0.7)):
            reply = generate(conn, model=model, prompt=f"Describe a person ({model}, {temperature}):",
                             max_tokens=200, temperature=temperature, seed=7,
                             constraint={"json_schema": PERSON})
            assert reply["finish_reason"] == "stop", reply["text"]
            check_person(json.loads(reply["text"]))


def test_a_regex_constraint_is_matched_in_full(shared_daemon):
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{2,4}( \(ok\))?"
    with RawConnection(shared_daemon.socket_path) as conn:
        for model in ("llama", "lfm2"):
            for seed in (1, 2, 3):
                reply = generate(conn, model=model, prompt=f"A code {seed}:", max_tokens=40, temperature=1.5,
                                 seed=seed, constraint={"regex": pattern})
                assert re.fullmatch(pattern, reply["text"]), reply["text"]
                assert reply["finish_reason"] == "stop"


def test_a_lark_grammar_constraint(shared_daemon):
    grammar = """
start: command (";" command){0,2}
command: verb " " object
verb: "open" | "close" | "read"
object: /[a-z]{1,8}/ | NUMBER
NUMBER: /[0-9]{1,3}/
"""
    sentence = re.compile(r"(open|close|read) ([a-z]{1,8}|[0-9]{1,3})(;(open|close|read) ([a-z]{1,8}|[0-9]{1,3})){0,2}")
    with RawConnection(shared_daemon.socket_path) as conn:
        for seed in (4, 5):
            reply = generate(conn, prompt="Commands:", max_tokens=60, temperature=1.0, seed=seed,
                             constraint={"lark": grammar})
            assert sentence.fullmatch(reply["text"]), reply["text"]


def test_streamed_chunks_add_up_to_the_constrained_text(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        msgid = conn.request("generate", {"prompt": "Stream a person:", "max_tokens": 200, "stream": True,
                                          "constraint": {"json_schema": PERSON}})
        chunks, response = conn.reply(msgid, timeout=120)
    assert response[2] is None
    text = response[3]["text"]
    assert "".join(chunk["text"] for chunk in chunks) == text
    check_person(json.loads(text))


@pytest.mark.parametrize("constraint, names", [
    ({"regex": "[0-9"}, ["constraint.regex", "unclosed character class"]),
    ({"lark": "start: undefined_rule"}, ["constraint.lark", "undefined_rule"]),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "frob"}}}}, ["constraint.json_schema", "frob"]),
    ({"json_schema": {"type": "string", "format": "not-a-format"}}, ["constraint.json_schema", "not-a-format"]),
])
def test_a_constraint_that_does_not_compile_is_invalid_params_and_the_daemon_goes_on(shared_daemon, constraint, names):
    with RawConnection(shared_daemon.socket_path) as conn:
        response = conn.call("generate", {"prompt": "Anything", "max_tokens": 8, "constraint": constraint}, timeout=60)
        assert response[3] is None and response[2]["code"] == INVALID_PARAMS
        for name in names:
            assert name in response[2]["message"]
        assert conn.result("ping")["pong"] is True
        after = generate(conn, prompt="Still serving", max_tokens=4)
        assert after["usage"]["completion_tokens"] >= 1


def test_constrained_and_unconstrained_requests_batched_together(shared_daemon):
    plain = {"prompt": "An unconstrained neighbour in the batch", "max_tokens": 48}
    with RawConnection(shared_daemon.socket_path) as conn:
        alone = generate(conn, **plain, cache={"use": False, "store": False})
        # All in one write: they are admitted together and decode as rows of one batch.
        requests = [
            {"prompt": "A constrained row, schema", "max_tokens": 200, "constraint": {"json_schema": PERSON}},
            {**plain, "cache": {"use": False, "store": False}},
            {"prompt": "A constrained row, regex", "max_tokens": 48, "temperature": 0.9, "seed": 11,
             "constraint": {"regex": "[a-f]{10,40}"}},
            {"prompt": "Another unconstrained row", "max_tokens": 40},
        ]
        msgids = [conn.take_msgid() for _ in requests]
        conn.send(*[[REQUEST, msgid, "generate", [params]] for msgid, params in zip(msgids, requests)])
        replies = []
        for msgid in msgids:
            _, response = conn.reply(msgid, timeout=120)
            assert response[2] is None, response[2]
            replies.append(response[3])
    check_person(json.loads(replies[0]["text"]))
    assert replies[1]["text"] == alone["text"]  # the masks of other rows leave it untouched
    assert re.fullmatch("[a-f]{10,40}", replies[2]["text"]), replies[2]["text"]
    assert replies[3]["usage"]["completion_tokens"] >= 1


def test_a_constrained_request_cancelled_at_once_is_answered(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        msgid = conn.take_msgid()
        conn.send([REQUEST, msgid, "generate", [{"prompt": "Cancel me", "max_tokens": 200,
                                                 "constraint": {"json_schema": PERSON}}]],
                  [REQUEST, conn.take_msgid(), "cancel", [{"id": msgid}]])
        _, response = conn.reply(msgid, timeout=60)
        if response[2] is not None:
            assert response[2]["code"] == -32004  # CANCELLED: before it started (its constraint compiling, or queued)
        else:
            assert response[3]["finish_reason"] in ("cancelled", "stop")
        assert generate(conn, prompt="Next", max_tokens=2, constraint={"regex": "[0-9]{2}"})["text"].isdigit()


def test_a_repeated_constrained_prompt_hits_the_cache_with_the_same_answer(shared_daemon):
    params = {"prompt": "The cache remembers constrained prompts too, " * 8, "max_tokens": 200,
              "constraint": {"json_schema": PERSON}}
    with RawConnection(shared_daemon.socket_path) as conn:
        first = generate(conn, **params)
        second = generate(conn, **params)
    assert first["cache"]["hit"] == "miss" and first["cache"]["stored_tokens"] > 0
    assert second["cache"]["hit"] == "exact"
    assert second["cache"]["reused_tokens"] == second["cache"]["prompt_tokens"]  # its first token from stored logits
    assert second["text"] == first["text"]
    check_person(json.loads(first["text"]))


def test_max_tokens_can_cut_a_constrained_answer(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        reply = generate(conn, prompt="Too short a budget", max_tokens=3, constraint={"json_schema": PERSON})
    assert reply["finish_reason"] == "length"  # the grammar was not complete: the text is a prefix of a valid answer
    assert reply["usage"]["completion_tokens"] == 3 and reply["text"].startswith("{")


def test_a_random_model_forced_to_call_a_tool_writes_a_call_that_parses(shared_daemon):
    tools = ({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
                 "additionalProperties": False}}})
    llama3 = ToolCallFormat(LLAMA3_JSON, "", "", parse_llama3_json)
    constraint = forced_tool_call(tools, llama3, function="get_weather")
    with RawConnection(shared_daemon.socket_path) as conn:
        reply = generate(conn, prompt="Call a tool:", max_tokens=120, constraint=constraint.to_wire())
    (call,) = parse_llama3_json(reply["text"])
    assert call.name == "get_weather" and set(call.arguments) == {"city", "days"}
    assert 1 <= call.arguments["days"] <= 7


# -- a real model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_daemon(smollm2_dir, tmp_path_factory):
    daemon = DaemonProcess([smollm2_dir], tmp_path_factory.mktemp("smollm2"))
    daemon.start(timeout=120)
    try:
        yield daemon
    finally:
        daemon.stop()


def test_smollm2_answers_a_schema_and_a_json_object(smollm2_daemon):
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                             "country": {"type": "string", "maxLength": 40}},
            "required": ["city", "country"], "additionalProperties": False}
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON with city and country."}]
    with RawConnection(smollm2_daemon.socket_path) as conn:
        reply = generate(conn, messages=messages, max_tokens=60, constraint={"json_schema": city})
        anything = generate(conn, messages=messages, max_tokens=120, constraint={"json_object": True})
        again = generate(conn, messages=messages, max_tokens=60, constraint={"json_schema": city})
    value = json.loads(reply["text"])
    assert set(value) == {"city", "country"} and all(isinstance(v, str) for v in value.values())
    assert reply["finish_reason"] == "stop"
    assert anything["finish_reason"] == "stop", anything["text"]
    assert isinstance(json.loads(anything["text"]), dict)
    assert again["text"] == reply["text"] and again["cache"]["hit"] == "exact"


def test_the_python_client_sends_a_constraint_and_hello_lists_it(shared_daemon):
    from prefixd.client import Client

    with Client(shared_daemon.socket_path, timeout=60) as client:
        assert {"constraint", "cache.verify", "tools"} <= set(client.hello()["capabilities"])
        reply = client.generate("Digits:", max_tokens=12, constraint={"regex": "[0-9]{3}-[0-9]{2}"})
    assert re.fullmatch("[0-9]{3}-[0-9]{2}", reply["text"]) and reply["finish_reason"] == "stop"
