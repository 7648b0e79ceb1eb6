"""A tiny msgpack-RPC server that answers like prefixd, for testing client plumbing.

It runs its own event loop in a thread, so blocking and asyncio clients can
both talk to it. Canned behaviour, chosen by the prompt of a generate:

    "delay:S"   answer after S seconds (responses then arrive out of order)
    "forever"   stream one chunk, then wait for a cancel and finish "cancelled"
    "drop"      close the connection without answering
    "garbage"   answer with an error whose msgid is nil, then close
    anything    answer "echo:<prompt>"; streamed as "Hel", "lo" -> "Hello"

model "nope" gives MODEL_NOT_FOUND. Streams also receive notifications that
are not theirs (another method, another id), which clients must ignore.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from prefixd.protocol import ErrorCode, Notification, Request, Response, RpcError, StreamDecoder, encode

CACHE = {
    "prompt_tokens": 1310, "reused_tokens": 1204, "prefilled_tokens": 106, "stored_tokens": 131,
    "hit": "partial", "checkpoint": "message", "age_s": 3.5, "saved_ms_est": 800.0, "source": "memory",
    "miss_reason": "diverged", "diverged_at": 1204, "diverged_message": {"index": 3, "role": "user"},
}
TIMINGS = {"queue_ms": 0.1, "encode_ms": 0.05, "lookup_ms": 0.2, "ttft_ms": 210.0, "prefill_ms": 200.0, "decode_ms": 52.0, "total_ms": 262.0,
           "decode_tokens_per_s": 38.5}


def make_result(text: str, finish_reason: str = "stop", session: str | None = None) -> dict[str, Any]:
    return {"model": "fake", "session": session, "text": text, "finish_reason": finish_reason,
            "usage": {"prompt_tokens": 1310, "completion_tokens": 2}, "cache": dict(CACHE), "timings": dict(TIMINGS)}


class FakeDaemon:
    """Start with ``with FakeDaemon(path) as daemon``; ``daemon.requests`` lists (msgid, method, params)."""

    def __init__(self, path: Path):
        self.path = path
        self.requests: list[tuple[int, str, dict[str, Any]]] = []
        self.reply_order: list[int] = []  # msgids in the order their responses were written
        self.num_connections = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    def __enter__(self) -> FakeDaemon:
        self._thread.start()
        assert self._ready.wait(5), "fake daemon did not start"
        return self

    def __exit__(self, *exc_info) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)

    def methods_seen(self) -> list[str]:
        return [method for _, method, _ in self.requests]

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_unix_server(self._connection, str(self.path))
        self._ready.set()
        await self._stop.wait()
        server.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        decoder, running, tasks = StreamDecoder(), {}, set()
        while data := await reader.read(65536):
            decoder.feed(data)
            for message in decoder:
                if isinstance(message, Request):
                    params = message.params[0] if message.params else {}
                    self.requests.append((message.msgid, message.method, params))
                    task = asyncio.create_task(self._answer(writer, running, message.msgid, message.method, params))
                    tasks.add(task)  # keep a reference until it is done
                    task.add_done_callback(tasks.discard)
        for event in running.values():
            event.set()  # a disconnect cancels what was running, as the real daemon does
        writer.close()

    def _send(self, writer: asyncio.StreamWriter, msgid: int | None, error: Any = None, result: Any = None) -> None:
        if msgid is not None:
            self.reply_order.append(msgid)
        writer.write(encode(Response(msgid, error, result)))

    async def _answer(self, writer, running: dict[int, asyncio.Event], msgid: int, method: str, params: dict) -> None:
        if method == "ping":
            self._send(writer, msgid, result={"pong": True, "time": time.time()})
        elif method == "cancel":
            event = running.get(params["id"])
            if event is not None:
                event.set()
            self._send(writer, msgid, result={"cancelled": event is not None})
        elif method == "generate":
            await self._generate(writer, running, msgid, params)
        else:
            self._send(writer, msgid, error=RpcError(ErrorCode.METHOD_NOT_FOUND, f"no method {method!r}").to_wire())

    async def _generate(self, writer, running: dict[int, asyncio.Event], msgid: int, params: dict) -> None:
        prompt = params.get("prompt") or ""
        if params.get("model") == "nope":
            error = RpcError(ErrorCode.MODEL_NOT_FOUND, "no model named 'nope'", {"models": ["fake"]})
            return self._send(writer, msgid, error=error.to_wire())
        if prompt == "drop":
            return writer.close()
        if prompt == "garbage":
            self._send(writer, None, error=RpcError(ErrorCode.PARSE_ERROR, "not valid msgpack").to_wire())
            return writer.close()
        cancelled = running[msgid] = asyncio.Event()
        try:
            if prompt.startswith("delay:"):
                try:
                    await asyncio.wait_for(cancelled.wait(), float(prompt[6:]))
                except TimeoutError:
                    pass
            if not params.get("stream"):
                finish = "cancelled" if cancelled.is_set() else "stop"
                return self._send(writer, msgid, result=make_result(f"echo:{prompt}", finish, params.get("session")))
            self._chunk(writer, msgid, "Hel", 0)
            writer.write(encode(Notification("nvim_error_event", [0, "not for you"])))
            self._chunk(writer, 999_999, "stray", 0)
            if prompt == "forever":
                await cancelled.wait()
                return self._send(writer, msgid, result=make_result("Hel", "cancelled", params.get("session")))
            self._chunk(writer, msgid, "lo", 1)
            self._send(writer, msgid, result=make_result("Hello", "stop", params.get("session")))
        finally:
            running.pop(msgid, None)

    def _chunk(self, writer, msgid: int, text: str, index: int) -> None:
        chunk = {"id": msgid, "text": text, "tokens": [index + 10], "index": index}
        writer.write(encode(Notification("generate.chunk", [chunk])))
