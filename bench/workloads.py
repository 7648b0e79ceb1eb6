"""The four workloads of bench/compare.py, built deterministically from Python's stdlib sources.

Every system gets the same requests, step by step. A workload hands out one ``Session`` per
system; the driver asks it for the next step (a list of requests: one for sequential
workloads, several for the concurrent one) and gives it the results back, so that a chat can
append the answer that *this* system generated (greedy, so the systems should agree).

Prompt sizes are fitted with the model's own tokenizer (``transformers``; the bench process
never imports mlx) and the chat template, so "~3,000 tokens" means the whole templated prompt.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# One source file per workload: a workload's cold request must not find another workload's
# prefix in a cache (they do share the chat template's first few tokens, as real users do).
SOURCES = {"repeat": "inspect.py", "chat": "argparse.py", "shared": "logging/__init__.py", "editor": "shlex.py"}

REPEAT_QUESTION = "Explain in one short paragraph what the module above is for."
CHAT_QUESTIONS = [
    "What does this module do?", "Which function is the main entry point?",
    "How are errors reported to the caller?", "Name one class defined here and what it is for.",
    "Is any of this code thread-safe?", "Which other standard modules does it import?",
    "How would you test the first function?", "What would you rename, and why?",
    "Give one example call of a public function.", "Summarize our conversation in one sentence.",
]
# Workload 3: two rounds of questions, one per session; round 2 is a second user of the same
# shared prompt asking something else (warm: the shared prompt has been seen in round 1).
SHARED_QUESTIONS = [
    ("What is a Logger?", "How do I log to a file?"),
    ("What does basicConfig do?", "What is the default log level?"),
    ("How are handlers chained?", "What is a Filter for?"),
    ("What is a LogRecord?", "How is the message formatted?"),
    ("Is logging thread-safe?", "What does the lock protect?"),
    ("What does getLogger return?", "How do logger names nest?"),
    ("How do I silence a library's logs?", "What is propagate?"),
    ("What is lastResort?", "When is it used?"),
]
EDITOR_SYSTEM = "You are a code assistant inside a text editor. Answer with code only."


@dataclass
class Request:
    """One generate request, the same for every system."""

    messages: list[dict]
    max_tokens: int
    phase: str  # "cold": nothing of this prompt was sent before; "warm": a prefix was
    label: str


@dataclass
class Sizes:
    """Prompt sizes and counts; --quick uses smaller ones to finish in a few minutes."""

    repeat_tokens: int = 3000
    repeats: int = 3
    repeat_max_tokens: int = 32  # the longest generations: the decode tok/s reference
    chat_system_tokens: int = 1000
    chat_turns: int = 10
    chat_max_tokens: int = 24
    shared_tokens: int = 2000
    sessions: int = 8
    shared_max_tokens: int = 12
    editor_tokens: int = 2000
    edits: int = 4
    editor_max_tokens: int = 12

    @classmethod
    def quick(cls) -> Sizes:
        return cls(repeat_tokens=1000, repeats=2, repeat_max_tokens=16, chat_system_tokens=500, chat_turns=4,
                   chat_max_tokens=12, shared_tokens=600, sessions=4, shared_max_tokens=8, editor_tokens=800,
                   edits=2, editor_max_tokens=8)


# -- tokens ---------------------------------------------------------------------------------------


class Tokens:
    """The model's tokenizer and chat template, for fitting prompts and counting minimal prefills."""

    def __init__(self, model_dir: Path):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def chat(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding here, 4.x a plain list
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class PrefillFloor:
    """The fewest prompt tokens any server must run, over the whole run, in order.

    Each distinct prefix must be computed once: the node count of a token trie over every
    prompt sent so far (the warm-up and earlier workloads included, since the servers' caches
    live across workloads). A prompt that is entirely a prefix of one already seen still
    needs one token run to get its logits (mlx-lm cannot feed zero tokens), so it counts 1.
    Generated tokens are not in the trie: a server that keeps the KV of its own answers can
    go below this floor on a chat.
    """

    def __init__(self):
        self.trie: dict = {}

    def add(self, prompts: list[list[int]]) -> int:
        """Insert the prompts; return how many tokens they added (the minimum for them)."""
        total = 0
        for prompt in prompts:
            node, new = self.trie, 0
            for token in prompt:
                if token not in node:
                    node[token] = {}
                    new += 1
                node = node[token]
            total += max(new, 1)
        return total


def source_lines(name: str) -> list[str]:
    path = Path(sysconfig.get_paths()["stdlib"]) / name
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def fit_lines(tokens: Tokens, lines: list[str], build, target: int) -> int:
    """The largest n such that build(lines[:n]) templates to <= target tokens (binary search)."""
    low, high = 1, len(lines)
    while low < high:
        mid = (low + high + 1) // 2
        if len(tokens.chat(build(lines[:mid]))) <= target:
            low = mid
        else:
            high = mid - 1
    return low


def system_about(lines: list[str]) -> dict:
    return {"role": "system", "content": "Answer questions about this Python source file.\n\n" + "".join(lines)}


# -- sessions -------------------------------------------------------------------------------------


@dataclass
class Session:
    """A fixed list of steps (each a list of requests); ``record`` keeps what each system saw."""

    steps: list[list[Request]]
    sent: list[Request] = field(default_factory=list)
    index: int = 0

    def next_step(self) -> list[Request] | None:
        if self.index >= len(self.steps):
            return None
        step = self.steps[self.index]
        self.index += 1
        return step

    def record(self, requests: list[Request], results: list[dict]) -> None:
        self.sent.extend(requests)


class ChatSession(Session):
    """Each turn appends this system's previous answer and the next question."""

    def __init__(self, system: dict, questions: list[str], max_tokens: int):
        super().__init__(steps=[])
        self.messages, self.questions, self.max_tokens = [system], questions, max_tokens

    def next_step(self) -> list[Request] | None:
        if self.index >= len(self.questions):
            return None
        self.messages.append({"role": "user", "content": self.questions[self.index]})
        self.index += 1
        phase = "cold" if self.index == 1 else "warm"
        return [Request(list(self.messages), self.max_tokens, phase, f"turn {self.index}")]

    def record(self, requests: list[Request], results: list[dict]) -> None:
        super().record(requests, results)
        # A failed turn still needs an assistant message so the next turn stays well-formed.
        self.messages.append({"role": "assistant", "content": results[0].get("text", "")})


# -- workloads ------------------------------------------------------------------------------------


@dataclass
class Workload:
    key: str
    title: str
    concurrent: bool
    make_session: object  # () -> Session
    notes: str = ""


def build_workloads(tokens: Tokens, sizes: Sizes) -> list[Workload]:
    """The four workloads, each with prompts fitted to its target size."""
    return [repeat_workload(tokens, sizes), chat_workload(tokens, sizes),
            shared_workload(tokens, sizes), editor_workload(tokens, sizes)]


def repeat_workload(tokens: Tokens, sizes: Sizes) -> Workload:
    lines = source_lines(SOURCES["repeat"])

    def build(part):
        return [system_about(part), {"role": "user", "content": REPEAT_QUESTION}]

    messages = build(lines[:fit_lines(tokens, lines, build, sizes.repeat_tokens)])
    n = len(tokens.chat(messages))
    steps = [[Request(messages, sizes.repeat_max_tokens, "cold", "cold")]]
    steps += [[Request(messages, sizes.repeat_max_tokens, "warm", f"repeat {i + 1}")] for i in range(sizes.repeats)]
    return Workload("repeat", f"1. {n}-token prompt, cold + {sizes.repeats} identical repeats", False,
                    lambda: Session(steps), f"max_tokens {sizes.repeat_max_tokens}")


def chat_workload(tokens: Tokens, sizes: Sizes) -> Workload:
    lines = source_lines(SOURCES["chat"])

    def build(part):
        return [system_about(part), {"role": "user", "content": CHAT_QUESTIONS[0]}]

    system = build(lines[:fit_lines(tokens, lines, build, sizes.chat_system_tokens)])[0]
    questions = CHAT_QUESTIONS[:sizes.chat_turns]
    n = len(tokens.chat([system]))
    return Workload("chat", f"2. {len(questions)}-turn chat on a {n}-token system prompt", False,
                    lambda: ChatSession(system, questions, sizes.chat_max_tokens), f"max_tokens {sizes.chat_max_tokens}")


def shared_workload(tokens: Tokens, sizes: Sizes) -> Workload:
    lines = source_lines(SOURCES["shared"])
    pairs = SHARED_QUESTIONS[:sizes.sessions]

    def build(part):
        return [system_about(part), {"role": "user", "content": pairs[0][0]}]

    system = build(lines[:fit_lines(tokens, lines, build, sizes.shared_tokens)])[0]
    steps = [[Request([system, {"role": "user", "content": pair[rnd]}], sizes.shared_max_tokens,
                      "cold" if rnd == 0 else "warm", f"round {rnd + 1} session {i + 1}")
              for i, pair in enumerate(pairs)] for rnd in (0, 1)]
    n = len(tokens.chat([system]))
    return Workload("shared", f"3. {len(pairs)} concurrent sessions on one {n}-token system prompt, 2 rounds", True,
                    lambda: Session(steps), f"max_tokens {sizes.shared_max_tokens}; round 1 cold, round 2 warm")


def editor_workload(tokens: Tokens, sizes: Sizes) -> Workload:
    name = SOURCES["editor"]
    lines = source_lines(name)

    def build(part):
        return [{"role": "system", "content": EDITOR_SYSTEM},
                {"role": "user", "content": f"File {name}:\n```python\n{''.join(part)}```\n"
                                            "Suggest how to complete the last line."}]

    text = lines[:fit_lines(tokens, lines, build, sizes.editor_tokens)]
    steps = [[Request(build(text), sizes.editor_max_tokens, "cold", "open file")]]
    for k in range(1, sizes.edits + 1):
        # Like typing near the end of a buffer: each edit keeps the earlier ones and changes a
        # line a little further down, within the last ~10% of the file.
        at = min(len(text) - 1, int(len(text) * 0.9) + 2 * k)
        text = text[:at] + [text[at].rstrip("\n") + f"  # edit {k}\n"] + text[at + 1:]
        steps.append([Request(build(text), sizes.editor_max_tokens, "warm", f"edit {k} (line {at + 1}/{len(text)})")])
    n = len(tokens.chat(steps[0][0].messages))
    return Workload("editor", f"4. editor: {n}-token file, then {sizes.edits} edits near its end", False,
                    lambda: Session(steps), f"max_tokens {sizes.editor_max_tokens}")
