"""``prefixd verify``: ask the daemon to prove its cache on a prompt set, and print what it found.

Every checked request is sent with ``cache.verify``: the daemon answers it
from the cache as usual, then runs it again without the cache and puts the
comparison in the reply's ``verify`` map (docs/protocol.md). This command only
chooses the prompts and tabulates the maps; the comparison is the daemon's.

The built-in set covers the ways a prompt reuses the store: an exact repeat,
partial hits at a quarter, half and three quarters of a long document, a
chat's next turn (reusing the stored answer) and an edit near the end of a
long context. Each run starts its prompts with a fresh nonce, so what an
earlier run stored never stands in for what this one stores.
"""

from __future__ import annotations

import argparse
import json
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

from .sync_client import Client

STATUSES = ("match", "mismatch", "not-checked", "dropped", "failed")
DOCUMENT_SENTENCES = 60  # ~1,000 tokens: past a prefill chunk on a CPU, so chunk checkpoints are reused too


@dataclass
class Check:
    """One verified request: where it came from and the daemon's verdict."""

    scenario: str
    checkpoint: str | None  # the reply's cache.checkpoint: the kind of stored point reused
    reused_tokens: int
    verify: dict[str, Any]

    @property
    def status(self) -> str:
        return self.verify.get("status", "failed")


def add_verify_parser(sub: Any) -> None:
    verify = sub.add_parser(
        "verify", help="re-run cached prompts without the cache and compare (the shadow check, on demand)"
    )
    verify.add_argument("--model", help="model name (default: the daemon's default model)")
    verify.add_argument(
        "--prompts",
        metavar="FILE",
        help="JSON lines: a string (a prompt) or a map with one of "
        "prompt, messages, tokens; each is sent verified (twice when nothing was cached yet)",
    )
    verify.add_argument("--max-tokens", type=int, default=16, help="answer tokens compared per request (default 16)")
    verify.add_argument("--json", action="store_true", help="print every check as a JSON line instead of the table")


def run_verify(client: Client, args: argparse.Namespace) -> int:
    options = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0.0}
    if args.prompts:
        checks = list(_file_checks(client, args.prompts, options))
    else:
        checks = list(builtin_checks(client, options, secrets.token_hex(4)))
    if args.json:
        for check in checks:
            print(
                json.dumps(
                    {
                        "scenario": check.scenario,
                        "checkpoint": check.checkpoint,
                        "reused_tokens": check.reused_tokens,
                        **check.verify,
                    }
                )
            )
    else:
        print(format_table(checks))
    return 1 if any(check.status in ("mismatch", "failed") for check in checks) else 0


# -- the prompts ---------------------------------------------------------------------------


def builtin_checks(client: Client, options: dict[str, Any], nonce: str) -> Iterator[Check]:
    def send(scenario: str, verify: bool = True, **request: Any) -> dict[str, Any]:
        reply = client.generate(**request, **options, cache={"verify": True} if verify else None)
        if verify:
            checks.append(_check(scenario, reply))
        return reply

    checks: list[Check] = []
    repeat = f"[prefixd verify {nonce}] A sentence that is sent twice, word for word, to test an exact repeat."
    send("repeat", verify=False, prompt=repeat)
    send("repeat", prompt=repeat)

    document = f"[prefixd verify {nonce}] " + " ".join(_sentence(i) for i in range(DOCUMENT_SENTENCES))
    send("partial", verify=False, prompt=document + "\nSummary:")
    for share in (0.25, 0.5, 0.75):
        cut = document[: int(len(document) * share)]
        send(f"partial {int(share * 100)}%", prompt=cut + f"\nQuestion {int(share * 100)}: what came just before?")

    messages = [
        {"role": "system", "content": f"[prefixd verify {nonce}] You answer in one short sentence."},
        {"role": "user", "content": "What is a prefix cache?"},
    ]
    first = send("chat next turn", verify=False, messages=messages)
    send(
        "chat next turn",
        messages=messages
        + [
            {"role": "assistant", "content": first.get("text", "")},
            {"role": "user", "content": "And why does it help an agent loop?"},
        ],
    )

    context = f"[prefixd verify {nonce}] " + " ".join(_sentence(i + 100) for i in range(DOCUMENT_SENTENCES))
    send("edit near end", verify=False, prompt=context + " The last word is apple.")
    send("edit near end", prompt=context + " The last word is pear.")
    yield from checks


def _sentence(index: int) -> str:
    subjects = ("The radix tree", "A checkpoint", "The engine thread", "Each client", "The store", "A stale entry")
    verbs = ("keeps", "replaces", "shares", "counts", "forgets", "returns")
    objects = ("the prompt's keys", "a state snapshot", "the next turn", "its answer tokens", "the oldest branch")
    return (
        f"{subjects[index % len(subjects)]} {verbs[(index // 3) % len(verbs)]} "
        f"{objects[(index // 7) % len(objects)]} in step {index}."
    )


def _file_checks(client: Client, path: str, options: dict[str, Any]) -> Iterator[Check]:
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            request = _file_request(line, f"{path}:{number}")
            scenario = f"line {number}"
            reply = client.generate(**request, **options, cache={"verify": True})
            if reply.get("verify", {}).get("status") == "not-checked":
                # Nothing of it was cached yet; now its own first run is.
                reply = client.generate(**request, **options, cache={"verify": True})
            yield _check(scenario, reply)


def _file_request(line: str, where: str) -> dict[str, Any]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"prefixd verify: {where}: not JSON ({exc})") from None
    if isinstance(item, str):
        return {"prompt": item}
    keys = [key for key in ("prompt", "messages", "tokens") if isinstance(item, dict) and key in item]
    if len(keys) != 1:
        raise SystemExit(f"prefixd verify: {where}: expected a string or a map with one of prompt, messages, tokens")
    return {keys[0]: item[keys[0]]}


def _check(scenario: str, reply: dict[str, Any]) -> Check:
    cache = reply.get("cache") or {}
    verify = reply.get("verify") or {"status": "failed", "reason": "the reply has no verify map (an older daemon?)"}
    return Check(scenario, cache.get("checkpoint"), cache.get("reused_tokens", 0), verify)


# -- the report ----------------------------------------------------------------------------


def format_table(checks: list[Check]) -> str:
    by_kind: dict[str, Counter[str]] = {}
    for check in checks:
        by_kind.setdefault(check.checkpoint or "(none)", Counter())[check.status] += 1
    header = f"{'checkpoint':<12} {'checks':>6} {'match':>6} {'mismatch':>8} {'not checked':>11} {'dropped/failed':>14}"
    rows = [header]
    for kind in sorted(by_kind):
        counts = by_kind[kind]
        rows.append(
            f"{kind:<12} {sum(counts.values()):>6} {counts['match']:>6} {counts['mismatch']:>8} "
            f"{counts['not-checked']:>11} {counts['dropped'] + counts['failed']:>14}"
        )
    mismatch = next((check for check in checks if check.status == "mismatch"), None)
    if mismatch is None:
        rows.append("no mismatch" if any(c.status == "match" for c in checks) else "nothing was compared")
    else:
        v = mismatch.verify
        where = (
            f"answer token {v['first_difference']}: cached {v.get('cached_token')} vs uncached {v.get('uncached_token')}"
            if v.get("first_difference") is not None
            else f"the prompt's last log-probabilities differ by {v.get('max_logprob_difference') or 0:.3g} nats "
            f"(tolerance {v.get('tolerance')})"
        )
        rows.append(
            f"first mismatch: {mismatch.scenario}: {where}; reused {mismatch.reused_tokens} tokens "
            f"at a {mismatch.checkpoint} checkpoint from {v.get('source')}"
        )
    for check in checks:
        if check.status in ("not-checked", "dropped", "failed"):
            rows.append(f"{check.status}: {check.scenario}: {check.verify.get('reason')}")
    return "\n".join(rows)
