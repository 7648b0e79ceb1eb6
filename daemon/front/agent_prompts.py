"""What coding agents put in their prompts that changes between requests without telling the model anything.

Claude Code opens its system prompt with a block of one line,
``x-anthropic-billing-header: cc_version=2.1.197.683; cc_entrypoint=sdk-cli;``:
a label for Anthropic's billing whose version suffix changes with the task
(``.123`` for one, ``.683`` for the next; other versions add a per-request
``cch=<hash>``). Rendered into the prompt it sits a few tokens from the start,
so a token-exact prefix cache would reuse only those few tokens of the next
task's request: the 10-30k tokens of instructions and tool specifications
after it, the same for every task, would be prefilled again each time. It is
removed before templating (vllm-mlx and exo strip it too); the setting
``keep_billing_header`` (``--keep-billing-header``) keeps it.

Measured on real requests of Claude Code 2.1.197 (tests/fixtures/claude_code),
nothing else needs this: between the turns of one session the line itself, the
system blocks, the tools and their order, and the ``<system-reminder>`` blocks
stay the same; what moves is where the ``cache_control`` markers sit and
whether the last user turn is a string or a text block, neither of which
reaches the template. So nothing else is touched: the model sees what the
client sent, less the billing line.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import structlog

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
ANTHROPIC_BILLING_HEADER = "anthropic_billing_header"  # its name in replies (prefixd_cache.normalized), stats and logs
MAX_REMEMBERED_CLIENTS = 1024  # clients already told about in the log; beyond this the set starts again

log = structlog.get_logger("prefixd.http")


@dataclass
class PromptNormalizer:
    """Removes the billing line from Anthropic requests' system prompts, counts it, and logs it once per client.

    ``counts``: how many prompts were normalised, by what was removed (the
    daemon's ``stats`` shows them under ``prompts_normalized``).
    """

    keep_billing_header: bool = False
    counts: Counter = field(default_factory=Counter)  # shared with Handlers.prompts_normalized (stats, metrics)
    _told: set[tuple[str, str]] = field(default_factory=set)

    def anthropic_system(self, system: Any, client: str) -> tuple[Any, list[str]]:
        """``system`` (a string or text blocks) without its billing line, and what was removed (names).

        ``client`` names the sender for the once-per-client log line (its
        User-Agent, say). A system prompt of another shape is returned as it
        is, for the request's own validation to judge.
        """
        if self.keep_billing_header:
            return system, []
        stripped, line = strip_billing_header(system)
        if line is None:
            return system, []
        self.counts[ANTHROPIC_BILLING_HEADER] += 1
        if self.first_time(client, ANTHROPIC_BILLING_HEADER):
            log.info(
                "prompt_normalized",
                what=ANTHROPIC_BILLING_HEADER,
                client_agent=client,
                removed=line,
                reason="it changes from task to task and tells the model nothing; kept, it would stop the "
                "prefix cache a few tokens in",
                hint="--keep-billing-header keeps it",
            )
        return stripped, [ANTHROPIC_BILLING_HEADER]

    def first_time(self, client: str, what: str) -> bool:
        """True the first time ``client`` is seen with ``what``: a line then says so; repeats would only fill the log."""
        if (client, what) in self._told:
            return False
        if len(self._told) >= MAX_REMEMBERED_CLIENTS:
            self._told.clear()
        self._told.add((client, what))
        return True


def strip_billing_header(system: Any) -> tuple[Any, str | None]:
    """``system`` without a first line ``x-anthropic-billing-header: ...``, and that line (None: there was none).

    A string loses its first line; a list of text blocks loses its first
    block's first line, and that block when nothing else is in it.
    """
    if isinstance(system, str):
        rest, line = _without_first_line(system)
        return (rest, line) if line is not None else (system, None)
    if not isinstance(system, list) or not system:
        return system, None
    first = system[0]
    if not isinstance(first, dict) or first.get("type") != "text" or not isinstance(first.get("text"), str):
        return system, None
    rest, line = _without_first_line(first["text"])
    if line is None:
        return system, None
    blocks = system[1:] if not rest.strip() else [{**first, "text": rest}, *system[1:]]
    return blocks, line


def _without_first_line(text: str) -> tuple[str, str | None]:
    if not text.startswith(BILLING_HEADER_PREFIX):
        return text, None
    line, newline, rest = text.partition("\n")
    return rest, line
