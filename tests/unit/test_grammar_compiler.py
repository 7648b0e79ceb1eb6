"""Constraints compiled for a tokenizer, without a model: grammar texts, errors, the LRU, the matcher state, tool calls.

The tokenizer is the tiny models' byte-level BPE (trained in well under a
second, no MLX): what llguidance needs of a model is only its tokenizer.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from prefixd.daemon.grammar import ConstraintError, GrammarCompiler, forced_tool_call, grammar_text
from prefixd.daemon.models.tool_call_format import LLAMA3_JSON, ToolCallFormat, parse_llama3_json
from prefixd.protocol.errors import ErrorCode
from prefixd.protocol.methods import Constraint
from tests.support.tiny_models import EOS_TOKEN, build_tokenizer

HERMES = ToolCallFormat("json_tools", "<tool_call>", "</tool_call>", lambda text: [])
LLAMA3 = ToolCallFormat(LLAMA3_JSON, "", "", parse_llama3_json)
TOOLS = (
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/number"}},
        "required": ["a", "b"], "$defs": {"number": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: any object
)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def compiler(hf_tokenizer):
    return GrammarCompiler(hf_tokenizer, [hf_tokenizer.convert_tokens_to_ids(EOS_TOKEN)], "tiny")


def feed(state, tokens):
    for index, token in enumerate(tokens):
        state.consume(index, token)
    return state


def accepts(compiler, hf_tokenizer, constraint, text) -> bool:
    state = feed(compiler.start(constraint), hf_tokenizer.encode(text))
    return state.error is None and state.is_accepting


def test_grammar_text_for_each_kind():
    for constraint in (Constraint.json_schema({"type": "object"}), Constraint.json_object(),
                       Constraint.regex("[0-9]+"), Constraint.lark('start: "a"')):
        assert isinstance(grammar_text(constraint), str) and grammar_text(constraint)


def test_json_schema_is_strict_and_written_like_json_dumps(compiler, hf_tokenizer):
    schema = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                                     "required": ["a", "b"], "additionalProperties": False})
    assert accepts(compiler, hf_tokenizer, schema, json.dumps({"a": 1, "b": "x"}))
    assert not accepts(compiler, hf_tokenizer, schema, '{"a": 1}')  # b is required
    assert not accepts(compiler, hf_tokenizer, schema, '{"a": 1, "b": "x", "c": 2}')
    assert not accepts(compiler, hf_tokenizer, schema, '{"a":1,"b":"x"}')  # one way of writing it: json.dumps's
    assert not accepts(compiler, hf_tokenizer, schema, '{"a": "1", "b": "x"}')


def test_json_object_is_any_object_and_only_an_object(compiler, hf_tokenizer):
    anything = Constraint.json_object()
    assert accepts(compiler, hf_tokenizer, anything, json.dumps({"k": [1, {"n": None}], "s": "t"}))
    assert not accepts(compiler, hf_tokenizer, anything, "[1, 2]")
    assert not accepts(compiler, hf_tokenizer, anything, '"text"')


def test_a_complete_answer_finishes_the_matcher(compiler, hf_tokenizer):
    state = feed(compiler.start(Constraint.regex("[0-9]{3}")), hf_tokenizer.encode("123"))
    assert state.is_accepting and state.is_finished
    open_ended = feed(compiler.start(Constraint.regex("[0-9]+")), hf_tokenizer.encode("123"))
    assert open_ended.is_accepting and not open_ended.is_finished


@pytest.mark.parametrize("constraint, names", [
    (Constraint.regex("[0-9"), ("'constraint.regex' does not compile", "unclosed character class")),
    (Constraint.lark("start: missing_rule"), ("'constraint.lark' does not compile", "missing_rule")),
    (Constraint.json_schema({"type": "frob"}), ("'constraint.json_schema' does not compile", "frob")),
    (Constraint.json_schema({"type": "string", "format": "no-such-format"}), ("no-such-format",)),
    (Constraint.json_schema({"type": "object", "patternProperties": {"[": {}}}), ("'constraint.json_schema'",)),
])
def test_a_constraint_that_does_not_compile_is_invalid_params_naming_it(compiler, constraint, names):
    with pytest.raises(ConstraintError) as caught:
        compiler.start(constraint)
    assert caught.value.code == ErrorCode.INVALID_PARAMS
    for name in names:
        assert name in caught.value.message


def test_compiled_grammars_are_cached_with_a_bound(hf_tokenizer):
    compiler = GrammarCompiler(hf_tokenizer, [2], "tiny", max_grammars=2)
    first = compiler.compile(Constraint.regex("a+"))
    assert compiler.compile(Constraint.regex("a+")) is first
    compiler.compile(Constraint.regex("b+"))
    compiler.compile(Constraint.regex("c+"))
    assert compiler.num_cached == 2
    assert compiler.compile(Constraint.regex("a+")) is not first  # evicted, compiled again
    # Each answer gets its own matcher: one answer's tokens do not move another's.
    one, two = compiler.start(Constraint.regex("ab")), compiler.start(Constraint.regex("ab"))
    one.consume(0, hf_tokenizer.encode("a")[0])
    assert one.num_consumed == 1 and two.num_consumed == 0


def test_the_mask_allows_the_grammar_and_eos_only_when_accepting(compiler, hf_tokenizer):
    eos = hf_tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    digit_tokens = set(hf_tokenizer.encode("7"))
    state = compiler.start(Constraint.regex("[0-9]{1,2}"))
    first = state.allowed(2048 + 64)  # logits may have padding rows past the vocabulary
    assert first.shape == (2112,) and not first[2048:].any()
    assert digit_tokens <= set(first.nonzero()[0]) and not first[eos]
    allowed_texts = {hf_tokenizer.decode([t]) for t in first.nonzero()[0]}
    assert all(text.isdigit() for text in allowed_texts)
    state.consume(0, hf_tokenizer.encode("7")[0])
    assert state.allowed(2048)[eos]  # "7" is a whole answer: the end may come


def test_consume_is_keyed_by_answer_index(compiler, hf_tokenizer):
    tokens = hf_tokenizer.encode("42")
    state = compiler.start(Constraint.regex("[0-9]+"))
    state.consume(0, tokens[0])
    state.consume(0, tokens[0])  # fed again (a row moving between the solo path and the batch): a no-op
    assert state.num_consumed == 1 and state.error is None
    state.consume(0, tokens[0] + 1)
    assert "answer token 0" in state.error


def test_a_failed_grammar_records_the_error_and_allows_only_the_end(compiler, hf_tokenizer):
    eos = hf_tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    state = compiler.start(Constraint.regex("[0-9]+"))
    state.consume(0, hf_tokenizer.encode("x")[0])  # not a digit: refused, never raised
    assert state.error and not state.is_finished
    mask = state.allowed(2048)
    assert mask[eos] and mask.sum() == 1


def test_end_tokens_are_never_fed(compiler, hf_tokenizer):
    eos = hf_tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    state = feed(compiler.start(Constraint.regex("[0-9]+")), hf_tokenizer.encode("5"))
    state.consume(1, eos)
    assert state.error is None


# -- forced tool calls ----------------------------------------------------------------------

def test_a_forced_hermes_call_compiles_and_accepts_a_call(compiler, hf_tokenizer):
    constraint = forced_tool_call(TOOLS, HERMES)
    assert constraint.kind == "lark"
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    state = feed(compiler.start(constraint), hf_tokenizer.encode(text))
    assert state.error is None and state.is_finished
    assert accepts(compiler, hf_tokenizer, constraint,
                   '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')  # $defs hoisted
    assert accepts(compiler, hf_tokenizer, constraint, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert not accepts(compiler, hf_tokenizer, constraint,
                       '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>')
    assert not accepts(compiler, hf_tokenizer, constraint, '{"name": "now", "arguments": {}}')  # the markers are required


def test_a_named_function_is_the_only_call_allowed(compiler, hf_tokenizer):
    constraint = forced_tool_call(TOOLS, HERMES, function="add")
    assert accepts(compiler, hf_tokenizer, constraint,
                   '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    assert not accepts(compiler, hf_tokenizer, constraint,
                       '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    with pytest.raises(ValueError, match="not among the tools"):
        forced_tool_call(TOOLS, HERMES, function="missing")


def test_a_forced_llama3_call_is_a_bare_object_with_parameters(compiler, hf_tokenizer):
    constraint = forced_tool_call(TOOLS, LLAMA3, function="get_weather")
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    state = feed(compiler.start(constraint), hf_tokenizer.encode(text))
    assert state.error is None and state.is_finished
    assert [call.name for call in parse_llama3_json(text)] == ["get_weather"]
    assert not accepts(compiler, hf_tokenizer, constraint, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')


def test_a_marker_that_is_a_special_token_is_written_as_one(compiler, hf_tokenizer):
    # The tiny tokenizer's <|im_start|>/<|endoftext|> stand in for Qwen's special <tool_call> tokens.
    special = ToolCallFormat("json_tools", "<|im_start|>", "<|endoftext|>", lambda text: [])
    constraint = forced_tool_call(TOOLS[:1], special, special_tokens={"<|im_start|>", "<|endoftext|>"})
    assert constraint.source.startswith('start: <|im_start|> "\\n" call "\\n" <|endoftext|>')
    ids = (hf_tokenizer.convert_tokens_to_ids(["<|im_start|>"])
           + hf_tokenizer.encode('\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n')
           + hf_tokenizer.convert_tokens_to_ids(["<|endoftext|>"]))
    state = feed(compiler.start(constraint), ids[:-1])
    assert state.error is None and not state.is_finished
    assert state.allowed(2048)[ids[-1]]  # the closing special token is what comes next


def test_formats_without_a_forced_call_grammar_are_refused():
    with pytest.raises(ValueError, match="no forced-call grammar"):
        forced_tool_call(TOOLS, ToolCallFormat("mistral", "[TOOL_CALLS]", "", lambda text: []))
