"""--chat-template entries: which model each names, and files that cannot serve stop the daemon with their name."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from prefixd.daemon.models.chat_template_file import (DEFAULT_MODEL, ChatTemplateError, ChatTemplateFile, check_all_used,
                                                      check_renders, parse_entry, read_chat_templates, template_for)
from prefixd.daemon.service.main import main


def test_an_entry_names_a_model_or_the_default_one():
    assert parse_entry("SmolLM2-135M-Instruct=~/t.jinja") == ("SmolLM2-135M-Instruct", Path("~/t.jinja").expanduser())
    assert parse_entry("/tmp/t.jinja") == (DEFAULT_MODEL, Path("/tmp/t.jinja"))
    assert parse_entry("./a=b.jinja") == (DEFAULT_MODEL, Path("./a=b.jinja"))


def test_files_are_read_and_those_that_cannot_serve_are_named(tmp_path):
    good = tmp_path / "t.jinja"
    good.write_text("{{ messages[0]['content'] }}")
    (empty := tmp_path / "empty.jinja").write_text(" \n")
    (binary := tmp_path / "bin.jinja").write_bytes(b"\xff\xfe")
    (file,) = read_chat_templates([f"llama={good}"])
    assert (file.model, file.path, file.source) == ("llama", good, "{{ messages[0]['content'] }}")
    for entry, says in ((str(tmp_path / "missing.jinja"), "does not exist"), (str(empty), "is empty"),
                        (str(binary), "is not UTF-8"), (str(tmp_path), "cannot read")):
        with pytest.raises(ChatTemplateError, match=says) as err:
            read_chat_templates([entry])
        assert entry in str(err.value)
    with pytest.raises(ChatTemplateError, match="two chat templates for model llama"):
        read_chat_templates([f"llama={good}", f"llama={good}"])


def test_each_template_must_name_a_configured_model_once():
    default, named = ChatTemplateFile(DEFAULT_MODEL, Path("d.jinja"), "x"), ChatTemplateFile("llama", Path("l.jinja"), "x")
    assert template_for({"": default}, "llama", is_default=True) is default
    assert template_for({"": default}, "other", is_default=False) is None
    with pytest.raises(ChatTemplateError, match="two chat templates for model llama"):
        template_for({"": default, "llama": named}, "llama", is_default=True)
    check_all_used({"llama": named, "": default}, ["llama"])
    with pytest.raises(ChatTemplateError, match=r"--chat-template llama=l.jinja: no model is named 'llama' \(models: gemma\)"):
        check_all_used({"llama": named}, ["gemma"])


def test_a_template_that_does_not_render_is_refused():
    file = ChatTemplateFile(DEFAULT_MODEL, Path("t.jinja"), "x")

    def failing(*args, **kwargs):
        raise ValueError("unknown filter 'nope'")

    with pytest.raises(ChatTemplateError, match="does not render a one-message chat for model m: ValueError: unknown filter"):
        check_renders(SimpleNamespace(apply_chat_template=failing), file, "m")
    with pytest.raises(ChatTemplateError, match="leaves out a message's content"):
        check_renders(SimpleNamespace(apply_chat_template=lambda *a, **k: "<|im_start|>assistant\n"), file, "m")


def test_serve_stops_at_once_on_a_missing_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert main(["--model", str(tmp_path), "--chat-template", str(tmp_path / "nope.jinja")]) == 2
    assert f"chat template file {tmp_path / 'nope.jinja'} does not exist" in capsys.readouterr().err
