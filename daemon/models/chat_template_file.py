"""``--chat-template``: a Jinja chat template file that replaces a model's own.

As llama.cpp's ``--chat-template-file`` and mlx-lm server's ``--chat-template``:
for a model whose template lacks something (a place for tools, above all) or
gets it wrong. Given as ``FILE`` (the default model, the first one served) or
``NAME=FILE`` (the model ``prefixd models`` lists as NAME), once per model.

The files are read at start, before any model loads: a missing, unreadable or
empty one stops the daemon with an error naming it. The tokenizer then loads
with the template as its ``chat_template`` (what mlx-lm's server does), so
mlx-lm infers the tool-call format from it and a template that reads tools
takes them natively (generic_tools.py's ``template`` path); each template is
checked once by rendering a one-message chat, and one that fails, or that
names no configured model, stops the daemon too. The template is part of the
model's fingerprint, so its cache entries are its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

DEFAULT_MODEL = ""  # the model of a template given as FILE alone


class ChatTemplateError(ValueError):
    """A ``--chat-template`` that cannot be used; the message names the file (and the model)."""


@dataclass(frozen=True)
class ChatTemplateFile:
    model: str  # a model's name, or DEFAULT_MODEL
    path: Path
    source: str  # the template's text

    @property
    def flag(self) -> str:
        return f"--chat-template {self.model + '=' if self.model else ''}{self.path}"


def parse_entry(entry: str) -> tuple[str, Path]:
    """``NAME=FILE`` or ``FILE``; a NAME holds no ``/`` (so ``./a=b.jinja`` is a file)."""
    name, sep, rest = entry.partition("=")
    if sep and name and "/" not in name:
        return name, Path(rest).expanduser()
    return DEFAULT_MODEL, Path(entry).expanduser()


def read_chat_templates(entries: Iterable[str]) -> tuple[ChatTemplateFile, ...]:
    """The templates of ``--chat-template`` entries, read; ChatTemplateError for a file that cannot serve."""
    files: dict[str, ChatTemplateFile] = {}
    for entry in entries:
        model, path = parse_entry(entry)
        try:
            source = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ChatTemplateError(f"chat template file {path} does not exist (--chat-template {entry})") from None
        except UnicodeDecodeError:
            raise ChatTemplateError(f"chat template file {path} is not UTF-8 text (--chat-template {entry})") from None
        except OSError as exc:
            raise ChatTemplateError(
                f"cannot read chat template file {path}: {exc.strerror} (--chat-template {entry})"
            ) from None
        if not source.strip():
            raise ChatTemplateError(f"chat template file {path} is empty (--chat-template {entry})")
        if model in files:
            which = f"model {model}" if model else "the default model"
            raise ChatTemplateError(f"two chat templates for {which}: {files[model].path} and {path}")
        files[model] = ChatTemplateFile(model, path, source)
    return tuple(files.values())


def template_for(templates: Mapping[str, ChatTemplateFile], name: str, is_default: bool) -> ChatTemplateFile | None:
    """The template given for the model ``name`` (by its name, or as the default model's), if any."""
    named, default = templates.get(name), templates.get(DEFAULT_MODEL) if is_default else None
    if named is not None and default is not None:
        raise ChatTemplateError(
            f"two chat templates for model {name}: {default.path} (the default model's) and {named.path}"
        )
    return named or default


def check_all_used(templates: Mapping[str, ChatTemplateFile], names: Iterable[str]) -> None:
    """Every NAME= names a configured model (a typo must not leave a model on its own template unnoticed)."""
    known = list(names)
    for model, file in templates.items():
        if model != DEFAULT_MODEL and model not in known:
            raise ChatTemplateError(f"{file.flag}: no model is named {model!r} (models: {', '.join(known) or 'none'})")


def check_renders(tokenizer: Any, file: ChatTemplateFile, model: str) -> None:
    """The template, as the model's tokenizer compiles it, renders a one-message chat."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # a Jinja syntax error, an undefined filter, a raise_exception in the template
        raise ChatTemplateError(
            f"{file.flag}: the template does not render a one-message chat for model {model}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if "hello" not in text:
        raise ChatTemplateError(f"{file.flag}: the template leaves out a message's content (model {model})")
