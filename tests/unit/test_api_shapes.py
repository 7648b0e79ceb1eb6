"""The pure parts of the Ollama, Anthropic and infill fronts: FIM formats, answer cuts, field checks."""

from __future__ import annotations

import time

import pytest

from prefixd.daemon.front.fim_formats import detect_fim_format
from prefixd.daemon.front.infill_shapes import AnswerCut
from prefixd.daemon.front.ollama_shapes import chat_request
from prefixd.daemon.front.sampling_fields import check_sampling_extras
from prefixd.protocol import RpcError

SMOLLM2_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
                 "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
                 "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>"]


def test_fim_formats_are_detected_from_the_added_tokens():
    assert detect_fim_format(SMOLLM2_ADDED) is None  # repository tokens, but no <fim_*>
    qwen = detect_fim_format(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"])
    assert qwen.file_separator == "<|file_sep|>" and "<|fim_pad|>" in qwen.stops
    starcoder = detect_fim_format(["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"])
    assert starcoder.name == "starcoder" and starcoder.repo_name is None


def test_fim_prompt_puts_the_extra_context_first_and_the_cursor_last():
    fim = detect_fim_format(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>", "<|repo_name|>"])
    prompt = fim.prompt("def f():\n    ", "\nf()\n", [("a.py", "A = 1\n")], with_files=True)
    assert prompt == ("<|repo_name|>myproject\n<|file_sep|>a.py\nA = 1\n<|file_sep|>filename\n"
                      "<|fim_prefix|>def f():\n    <|fim_suffix|>\nf()\n<|fim_middle|>")
    assert fim.prompt("p", "s") == "<|fim_prefix|>p<|fim_suffix|>s<|fim_middle|>"


def test_answer_cut_at_a_line_indented_less_than_n_indent():
    cut = AnswerCut(n_indent=4, t_max_predict_ms=0)
    pieces = [cut.feed(p) for p in ("x = 1\n", "    y = 2\n", "\n", "  ", "  z\n", "w = 3\n", "more")]
    assert "".join(pieces) == "x = 1\n    y = 2\n\n    z\n" and cut.cut
    assert pieces[-1] == ""


def test_answer_cut_after_the_time_limit_waits_for_a_newline():
    cut = AnswerCut(n_indent=0, t_max_predict_ms=0.001)
    assert cut.feed("abc") == "abc"
    time.sleep(0.01)
    assert cut.feed("def") == "def" and not cut.cut  # past the limit, but no newline yet
    assert cut.feed("\nxyz") == "\nxyz" and cut.cut


def test_sampling_extras_pass_only_where_they_cannot_change_the_answer():
    assert check_sampling_extras({"top_k": 40}, 0.0, "options.")
    with pytest.raises(RpcError, match="'options.top_k'"):
        check_sampling_extras({"top_k": 40}, 0.7, "options.")
    assert check_sampling_extras({"repeat_penalty": 1.0, "repeat_last_n": 64}, 0.7) == []
    with pytest.raises(RpcError, match="'mirostat'"):
        check_sampling_extras({"mirostat": 2}, 0.0)


def test_ollama_chat_names_unknown_fields_and_options():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(RpcError, match="'options.num_gqa'"):
        chat_request({**base, "options": {"num_gqa": 8}}, "m")
    with pytest.raises(RpcError, match="'messages\\[0\\].images'"):
        chat_request({**base, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "m")
    parsed = chat_request({**base, "options": {"num_predict": -1, "stop": "\n"}}, "m")
    assert parsed.stream and parsed.params.stop == ("\n",) and parsed.params.max_tokens > 1000
