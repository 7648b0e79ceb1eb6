"""The text of bench/agent_workload.py: a coding agent's system prompt and its tools' results.

Everything is built deterministically, with no network: the instructions and ~18 tool
specifications (JSON schemas, written into the system prompt as plain text, because SmolLM2's
chat template has no place for ``tools``), a repository map of the stdlib's modules to pad the
prompt to its target size, and per agent and turn a tool result (a file read, a grep, a test
run, a diff) cut from the stdlib's own sources. The same Python gives the same text.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])

INSTRUCTIONS = """You are a coding agent working in the user's repository through the tools listed below.
You operate non-interactively: plan briefly, call tools, read their results, and continue until the task is done.

# Rules
- Read a file before you edit it; never guess its contents. Keep edits minimal and in the file's style.
- Prefer `grep` and `glob` over reading whole directories. Quote paths exactly as the tools print them.
- Run the tests that cover what you changed (`run_tests` with a path or -k expression), never the whole suite
  unless asked. A failing test you did not touch is reported, not fixed silently.
- Never run destructive commands (`rm -rf`, `git reset --hard`, `git push --force`) and never commit unless the
  user asks. Secrets, tokens and credentials are never printed or written to files.
- Answer in short paragraphs; code in fenced blocks with the language named. No apologies, no filler.
- When a tool fails, read the error, fix the call and try again at most twice, then explain what failed.
- Keep a todo list with `todo_write` for tasks of more than three steps; mark items done as you go.

# Calling tools
Call a tool by answering with one block per call:
<tool_call>
{"name": "<tool name>", "arguments": {<arguments as the tool's JSON schema says>}}
</tool_call>
The result comes back in the next message inside <tool_response>...</tool_response>. Several calls in one
answer run in parallel; calls that depend on each other go in separate answers.

# Tools
"""

# (name, description, {parameter: (JSON type, description)}, required parameters)
TOOLS = [
    ("read_file", "Read a text file from the repository. Returns numbered lines. Use offset and limit for large files; "
     "binary files are refused.", {"path": ("string", "Path relative to the repository root."),
                                   "offset": ("integer", "First line to return (1-based)."),
                                   "limit": ("integer", "How many lines to return (default 400).")}, ["path"]),
    ("write_file", "Create or overwrite a file with the given content. Parent directories are created. Prefer `edit` "
     "for changes to existing files.", {"path": ("string", "Path relative to the repository root."),
                                        "content": ("string", "The whole new content of the file.")}, ["path", "content"]),
    ("edit", "Replace one exact occurrence of old_string with new_string in a file. Fails if old_string occurs zero "
     "or several times; include enough context to make it unique.", {
         "path": ("string", "File to edit."), "old_string": ("string", "Exact text to replace, whitespace included."),
         "new_string": ("string", "Replacement text."),
         "replace_all": ("boolean", "Replace every occurrence instead of exactly one.")}, ["path", "old_string", "new_string"]),
    ("multi_edit", "Apply several edits to one file atomically: either all apply or none.", {
        "path": ("string", "File to edit."),
        "edits": ("array", "List of {old_string, new_string} objects, applied in order.")}, ["path", "edits"]),
    ("apply_patch", "Apply a unified diff to the working tree. Paths in the diff are relative to the repository root.",
     {"patch": ("string", "The unified diff, with ---/+++ headers and @@ hunks.")}, ["patch"]),
    ("list_dir", "List a directory's entries with their sizes; directories end with a slash.", {
        "path": ("string", "Directory relative to the repository root."),
        "ignore": ("array", "Glob patterns to leave out.")}, ["path"]),
    ("glob", "Find files whose path matches a glob pattern, newest first.", {
        "pattern": ("string", "Glob such as src/**/*.py."), "path": ("string", "Directory to search in.")}, ["pattern"]),
    ("grep", "Search file contents with a regular expression (ripgrep syntax). Returns path:line:text lines.", {
        "pattern": ("string", "Regular expression."), "path": ("string", "File or directory to search."),
        "glob": ("string", "Only files matching this glob."), "context": ("integer", "Lines of context around matches."),
        "case_insensitive": ("boolean", "Ignore case.")}, ["pattern"]),
    ("search_symbols", "Find definitions of a class, function or variable by name across the repository.", {
        "name": ("string", "Symbol name or prefix."), "kind": ("string", "One of class, function, variable.")}, ["name"]),
    ("bash", "Run a shell command in the repository root and return its exit status, stdout and stderr. Commands "
     "time out after 120 s. No network access.", {
         "command": ("string", "The command line."), "timeout": ("integer", "Seconds before the command is killed."),
         "description": ("string", "Five to ten words saying what the command does.")}, ["command"]),
    ("run_tests", "Run the project's tests with pytest and return the summary and failures.", {
        "path": ("string", "Test file or directory."), "keyword": ("string", "pytest -k expression."),
        "verbose": ("boolean", "One line per test.")}, []),
    ("python", "Evaluate a short Python snippet in a fresh interpreter and return what it prints.", {
        "code": ("string", "Python source to run.")}, ["code"]),
    ("format_code", "Format files with the project's formatter and return the files it changed.", {
        "paths": ("array", "Files or directories to format.")}, ["paths"]),
    ("git_status", "Show the working tree's status: staged, modified and untracked files.", {}, []),
    ("git_diff", "Show the diff of the working tree or between two revisions.", {
        "paths": ("array", "Limit the diff to these paths."), "staged": ("boolean", "Diff of the index instead."),
        "base": ("string", "Revision to compare against.")}, []),
    ("git_log", "Show recent commits, newest first.", {
        "path": ("string", "Only commits touching this path."), "limit": ("integer", "How many commits.")}, []),
    ("todo_write", "Replace the task's todo list. Each item has content, status (pending, in_progress, done) and id.",
     {"todos": ("array", "The whole new list.")}, ["todos"]),
    ("ask_user", "Ask the user one question and wait for the answer. Only when the task cannot go on without it.", {
        "question": ("string", "The question, self-contained.")}, ["question"]),
]

TASKS = [
    "The test tests/test_parser.py::test_nested_quotes fails since the last change to the tokenizer. Find why and fix it.",
    "Add a --dry-run option to the command-line tool that prints what would change without writing files.",
    "The log output repeats every message twice when the library is imported from a plugin. Find the cause.",
    "Rename the helper `load_cfg` to `load_config` everywhere and keep a deprecated alias for one release.",
    "Profile the import time of the package and remove the slowest import from the startup path.",
    "Write tests for the retry logic in the HTTP client: timeouts, 5xx answers and the backoff limit.",
    "The CSV export drops rows whose last field is empty. Reproduce it with a test, then fix it.",
    "Document the public functions of the config module with docstrings in the project's style.",
]


def tool_spec(name: str, description: str, params: dict, required: list[str]) -> str:
    schema = {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {p: {"type": t, "description": d} for p, (t, d) in params.items()},
        "required": required}}}
    return json.dumps(schema, indent=2) + "\n"


def repository_map() -> list[str]:
    """One line per stdlib module: path, size and the first line of its docstring (an aider-style map)."""
    lines = ["\n# Repository map (path, lines, summary)\n"]
    packages = sorted(p for p in STDLIB.glob("*/*.py") if p.parent.name != "site-packages")
    for path in sorted(STDLIB.glob("*.py")) + packages:
        text = path.read_text(encoding="utf-8", errors="replace")
        doc = next((ln.strip(' "\'r') for ln in text.splitlines()[:40] if ln.strip(' "\'r')), "")
        lines.append(f"- src/{path.relative_to(STDLIB)} ({text.count(chr(10))} lines): {doc[:100]}\n")
    return lines


def system_sections() -> list[str]:
    """The system prompt in whole pieces: instructions, each tool, then map lines; a prefix of it is fitted."""
    return [INSTRUCTIONS] + [tool_spec(*tool) for tool in TOOLS] + repository_map()


# -- tool results -----------------------------------------------------------------------------------

SOURCES = sorted(p for p in STDLIB.glob("*.py") if p.stat().st_size > 20_000)
KINDS = ["read_file", "grep", "run_tests", "git_diff"]


def tool_result_lines(agent: int, turn: int) -> tuple[str, dict, list[str]]:
    """(tool name, arguments, output lines) for an agent's turn; the caller cuts the lines to size."""
    rng = random.Random(f"agent {agent} turn {turn}")
    source = SOURCES[(agent * 7 + turn) % len(SOURCES)]
    lines = source.read_text(encoding="utf-8", errors="replace").splitlines()
    start = rng.randrange(max(1, len(lines) - 400))
    name = f"src/{source.name}"
    kind = KINDS[(agent + turn) % len(KINDS)]
    if kind == "read_file":
        out = [f"{start + i + 1:6}\t{ln}" for i, ln in enumerate(lines[start:start + 400])]
        return kind, {"path": name, "offset": start + 1}, out
    if kind == "grep":
        word = rng.choice(["return", "self", "if ", "def ", "raise", "import", "None"])
        hits = [f"src/{p.name}:{i + 1}:{ln.strip()}" for p in SOURCES[agent::3]
                for i, ln in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines()) if word in ln]
        return kind, {"pattern": word.strip(), "path": "src"}, hits[rng.randrange(max(1, len(hits) - 200)):]
    if kind == "run_tests":
        names = [ln.split("(")[0].split()[-1] for ln in lines if ln.startswith("def ")] or ["main"]
        out = ["============================= test session starts ==============================",
               f"collected {len(names)} items", ""]
        failing = rng.randrange(len(names))
        out += [f"tests/test_{source.stem}.py::test_{n} {'FAILED' if i == failing else 'PASSED'}"
                for i, n in enumerate(names)]
        out += ["", "=================================== FAILURES ===================================",
                f"____________________________ test_{names[failing]} ____________________________"]
        out += [f"    {ln}" for ln in lines[start:start + 30]] + ["E   AssertionError: values differ",
                                                                      f"{name}:{start + 30}: AssertionError"]
        return kind, {"path": f"tests/test_{source.stem}.py"}, out
    hunk = lines[start:start + 120]
    out = [f"diff --git a/{name} b/{name}", f"--- a/{name}", f"+++ b/{name}", f"@@ -{start + 1},{len(hunk)} +{start + 1},{len(hunk)} @@"]
    for i, ln in enumerate(hunk):  # every 17th line rewritten
        out += ["-" + ln, "+" + ln.replace("self", "this")] if i % 17 == 5 else [" " + ln]
    return kind, {"paths": [name]}, out


def tool_message(kind: str, arguments: dict, body: str) -> str:
    """The user message carrying a tool's result (Hermes style, as agents do for models without tool roles)."""
    call = json.dumps({"name": kind, "arguments": arguments})
    return f"<tool_response>\n{call}\n{body}\n</tool_response>"
