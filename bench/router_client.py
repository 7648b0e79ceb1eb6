"""The multi-tenant chat workload of bench/router_workload.py and the streaming client that sends it.

Tenants each have a long system prompt of their own (distinct from the first
character, as real ones are: the router compares request text). Each tenant
has several sessions; a session's turn 2 repeats turn 1 with its answer and
asks again. Turns arrive interleaved across tenants in a seeded random order
(never a fixed cycle: with 6 tenants on 3 daemons a fixed cycle would make
round-robin stick each tenant to one daemon by accident).

Every request names its tenant in ``TENANT_KEY_HEADER`` (smg's routing-key
header), in every run: the policies that do not read it ignore it, so each
policy sees the same requests.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

TENANT_NAMES = ("Acme Freight", "Borealis Bank", "Cobalt Clinics", "Dunmore Legal", "Ember Games", "Fjord Energy",
                "Garnet Retail", "Halcyon Air")
WORDS = ("policy", "customer", "invoice", "shipment", "refund", "account", "ticket", "schedule", "warranty", "contract",
         "audit", "balance", "appointment", "delivery", "priority", "escalate", "verify", "document", "region", "tariff",
         "compliance", "renewal", "dispatch", "inventory", "claim", "patient", "booking", "license", "outage", "meter")
TENANT_KEY_HEADER = "x-smg-routing-key"
QUESTIONS = ("How do I change my delivery address?", "What is the refund window?", "Can you escalate my ticket?",
             "Which documents do I need?", "When is the next available slot?", "Why was I charged twice?")


def system_prompt(tenant: int, num_words: int) -> str:
    """A long, tenant-specific system prompt: a name, then seeded rules of thumb."""
    rng = random.Random(f"tenant-{tenant}")
    rules = []
    while sum(len(rule.split()) for rule in rules) < num_words:
        rules.append(f"Rule {len(rules) + 1}: " + " ".join(rng.choice(WORDS) for _ in range(12)) + ".")
    return f"{TENANT_NAMES[tenant]} assistant. Answer in one short sentence. " + " ".join(rules)


@dataclass
class Turn:
    """One request of the workload: ``turn`` 0 opens session ``session`` of ``tenant``; later turns follow it."""

    tenant: int
    session: int
    turn: int
    done: threading.Event = field(default_factory=threading.Event)
    answer: str = ""


def workload(num_tenants: int, num_sessions: int, num_turns: int, seed: int = 0) -> list[Turn]:
    """Every turn in arrival order: each round of turns is a fresh shuffle of all sessions."""
    rng = random.Random(seed)
    sessions = [(t, s) for t in range(num_tenants) for s in range(num_sessions)]
    order: list[Turn] = []
    for turn in range(num_turns):
        rng.shuffle(sessions)
        order += [Turn(t, s, turn) for t, s in sessions]
    return order


def messages_for(turn: Turn, turns: dict[tuple[int, int, int], Turn], system: str) -> list[dict[str, str]]:
    """The chat so far: the system prompt, earlier turns with their answers, this turn's question."""
    messages = [{"role": "system", "content": system}]
    for k in range(turn.turn + 1):
        question = QUESTIONS[(turn.session * 3 + k) % len(QUESTIONS)] + f" (session {turn.session}, turn {k})"
        messages.append({"role": "user", "content": question})
        if k < turn.turn:
            messages.append({"role": "assistant", "content": turns[(turn.tenant, turn.session, k)].answer})
    return messages


def stream_chat(base_url: str, token: str, body: dict[str, Any], timeout: float,
                headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One streamed chat completion: time to the first token, the usage and cache map, the daemon it went to.

    Never raises for a failed request: the record says ``error`` (the status
    and message, a cut stream, or no answer within ``timeout``).
    """
    url = urlsplit(base_url)
    started = time.perf_counter()
    record: dict[str, Any] = {"ok": False, "ttft_s": None, "worker": None, "error": None, "text": ""}
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}}),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {token}", **(headers or {})})
        response = conn.getresponse()
        record["worker"] = response.getheader("x-smg-routed-worker-id")
        record["status"] = response.status
        if response.status != 200:
            record["error"] = f"{response.status}: {response.read()[:300].decode(errors='replace')}"
            return record
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                record["ok"] = record["error"] is None
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                record["error"] = f"stream error: {chunk['error']}"
            for choice in chunk.get("choices", ()):
                if choice.get("delta", {}).get("content"):
                    record["ttft_s"] = record["ttft_s"] or time.perf_counter() - started
                    record["text"] += choice["delta"]["content"]
            if chunk.get("usage"):
                record["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                record["cached_tokens"] = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                record["cache"] = chunk.get("prefixd_cache")
                record["server_ttft_s"] = (chunk.get("prefixd_timings") or {}).get("ttft_ms", 0) / 1000
        else:
            record["error"] = record["error"] or "the stream ended without [DONE]"
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        record["total_s"] = time.perf_counter() - started
    return record


def run_turns(base_url: str, token: str, model: str, order: list[Turn], system_words: int, max_tokens: int, concurrency: int,
              timeout: float, stop: threading.Event | None = None) -> list[dict[str, Any]]:
    """Send ``order`` with ``concurrency`` clients; a turn waits for its session's previous one. One record per turn."""
    turns = {(t.tenant, t.session, t.turn): t for t in order}
    systems = {t: system_prompt(t, system_words) for t in {turn.tenant for turn in order}}
    first_of_tenant = {}
    for index, turn in enumerate(order):
        first_of_tenant.setdefault(turn.tenant, index)

    def send(index: int) -> dict[str, Any]:
        turn = order[index]
        if turn.turn:
            turns[(turn.tenant, turn.session, turn.turn - 1)].done.wait()
        body = {"model": model, "messages": messages_for(turn, turns, systems[turn.tenant]), "max_tokens": max_tokens,
                "temperature": 0}
        sent_at = time.monotonic()
        tenant_key = {TENANT_KEY_HEADER: TENANT_NAMES[turn.tenant]}
        record = (stream_chat(base_url, token, body, timeout, tenant_key) if stop is None or not stop.is_set()
                  else {"ok": False, "skipped": True})
        turn.answer = record.get("text", "")
        turn.done.set()
        return {**record, "tenant": turn.tenant, "session": turn.session, "turn": turn.turn, "sent_at": sent_at,
                "first_of_tenant": first_of_tenant[turn.tenant] == index}

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(send, range(len(order))))
