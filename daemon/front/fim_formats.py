"""Fill-in-the-middle prompts, for models whose tokenizer has FIM tokens.

Detected from the tokenizer's added tokens: the ``<|fim_prefix|>`` family
(Qwen2.5-Coder, CodeGemma), StarCoder's ``<fim_prefix>`` family and
DeepSeek-Coder's ``<｜fim▁begin｜>``. A tokenizer without one of these sets
cannot fill in the middle (SmolLM2's has StarCoder's ``<file_sep>`` and
``<repo_name>`` but no ``<fim_*>`` tokens; Gemma 3's has none), and the
fronts answer such a request with a 400.

The prompt is laid out for the prefix cache, like llama.cpp's /infill:
extra context first (other files' chunks, which change least), then the
file's text before the cursor, the suffix last but one, and the middle token
last. Consecutive completions in one file then share everything up to the
line being typed; a request that only adds an extra chunk at the end of the
list (llama.vim's ring buffer) reuses all the chunks before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

# llama.cpp's names for these, so a prompt here is the prompt llama.cpp's /infill builds
REPO_NAME = "myproject"
CURRENT_FILE = "filename"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks when the model has no file separator token


@dataclass(frozen=True)
class FimFormat:
    name: str
    prefix: str
    suffix: str
    middle: str
    file_separator: str | None = None
    repo_name: str | None = None
    stops: tuple[str, ...] = ()  # tokens that end a middle when the model's end-of-sequence is something else

    def prompt(self, prefix: str, suffix: str, extra: Iterable[tuple[str, str]] = (), with_files: bool = False) -> str:
        """The FIM prompt text: extra (filename, text) chunks first, then prefix, suffix, and the middle token last.

        ``with_files``: add the repository and current-file headers llama.cpp's
        /infill adds (for /infill; a plain prompt + suffix gets none).
        """
        parts: list[str] = []
        if with_files and self.repo_name:
            parts.append(f"{self.repo_name}{REPO_NAME}\n")
        for filename, text in extra:
            parts.append(
                f"{self.file_separator}{filename}\n{text}" if self.file_separator else f"{SNIPPET_SEPARATOR}{text}"
            )
        if with_files and self.file_separator:
            parts.append(f"{self.file_separator}{CURRENT_FILE}\n")
        parts.append(f"{self.prefix}{prefix}{self.suffix}{suffix}{self.middle}")
        return "".join(parts)


_KNOWN = (
    FimFormat(
        "fim-pipes",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        None,
        "<|repo_name|>",
        ("<|fim_pad|>", "<|endoftext|>", "<|file_sep|>", "<|file_separator|>", "<|fim_prefix|>"),
    ),
    FimFormat(
        "starcoder",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        "<file_sep>",
        "<repo_name>",
        ("<|endoftext|>", "<file_sep>", "<fim_pad>", "<fim_prefix>"),
    ),
    FimFormat(
        "deepseek",
        "<｜fim▁begin｜>",
        "<｜fim▁hole｜>",
        "<｜fim▁end｜>",
        None,
        None,
        ("<｜end▁of▁sentence｜>", "<|EOT|>"),
    ),
)
_PIPE_SEPARATORS = ("<|file_sep|>", "<|file_separator|>")  # Qwen2.5-Coder's and CodeGemma's


def detect_fim_format(special_tokens: Iterable[str]) -> FimFormat | None:
    """The FIM format a tokenizer's added tokens spell, or None if it has none."""
    tokens = set(special_tokens)
    for known in _KNOWN:
        if {known.prefix, known.suffix, known.middle} <= tokens:
            separator = known.file_separator if known.file_separator in tokens else None
            if known.name == "fim-pipes":
                separator = next((s for s in _PIPE_SEPARATORS if s in tokens), None)
            return FimFormat(
                known.name,
                known.prefix,
                known.suffix,
                known.middle,
                separator,
                known.repo_name if known.repo_name in tokens else None,
                tuple(s for s in known.stops if s in tokens),
            )
    return None
