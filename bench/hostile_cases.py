"""The hostile inputs of bench/hostile.py: what a careless or hostile local client sends.

Each case opens its own connection(s), sends something, and says what came
back: a proper error reply, a result, or the connection closed without a
reply (which counts against the daemon where the protocol promises one).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgpack

REQUEST = 0


@dataclass
class Outcome:
    case: str
    replies_expected: int  # replies the protocol promises for what was sent
    replies: int  # replies received (results or errors)
    errors: dict[int, int]  # error code -> count
    closed_without_reply: int  # promised replies that never came because the connection closed
    timed_out: int = 0  # promised replies that did not come within the timeout, the connection still open


class Wire:
    """A raw msgpack-RPC connection that sends whatever bytes it is given."""

    def __init__(self, path: Path, timeout: float = 30.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=256 << 20)
        self.closed = False

    def send_bytes(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            pass  # the daemon closed early (an oversized frame): its reply may still be there to read

    def send(self, message: Any) -> None:
        self.send_bytes(msgpack.packb(message, use_bin_type=True))

    def responses(self, count: int, timeout: float = 60.0) -> list[Any]:
        """Up to ``count`` responses (notifications skipped) before the timeout or the end of the stream."""
        found: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(found) < count and not self.closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                break
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            self.unpacker.feed(data)
            found.extend(m for m in self.unpacker if isinstance(m, list) and m and m[0] == 1)
        return found

    def close(self) -> None:
        self.sock.close()


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


def _request(msgid: int, method: str, params: Any) -> list:
    return [REQUEST, msgid, method, [params]]


# (name, frames to send, replies the protocol promises)
def frame_cases(num_vocab: int) -> list[tuple[str, list[bytes], int]]:
    pack = lambda m: msgpack.packb(m, use_bin_type=True)  # noqa: E731
    return [
        ("not msgpack", [b"\xc1\xc1\xc1 garbage"], 1),
        ("a bare integer", [pack(5)], 1),
        ("a string", [pack("hello")], 1),
        ("an empty map", [pack({})], 1),
        ("a request with a string msgid", [pack([0, "x", "ping", []])], 1),
        ("a request of five fields", [pack([0, 1, "ping", [], 9])], 1),
        ("an unknown method", [pack(_request(1, "explode", {}))], 1),
        ("params that are not a map", [pack([0, 1, "generate", ["text"]])], 1),
        ("max_tokens as a string", [pack(_request(1, "generate", {"prompt": "a", "max_tokens": "9"}))], 1),
        ("negative max_tokens", [pack(_request(1, "generate", {"prompt": "a", "max_tokens": -1}))], 1),
        ("temperature as a map", [pack(_request(1, "generate", {"prompt": "a", "temperature": {}}))], 1),
        ("both prompt and messages", [pack(_request(1, "generate", {"prompt": "a", "messages": []}))], 1),
        ("messages of numbers", [pack(_request(1, "generate", {"messages": [1, 2, 3]}))], 1),
        ("an unknown model", [pack(_request(1, "generate", {"prompt": "a", "model": "nope"}))], 1),
        ("token ids outside the vocabulary", [pack(_request(1, "generate", {"tokens": [num_vocab + 5]}))], 1),
        ("negative token ids", [pack(_request(1, "generate", {"tokens": [-1, 2]}))], 1),
        ("a 15 MiB prompt", [pack(_request(1, "generate", {"prompt": "y" * (15 << 20), "max_tokens": 1}))], 1),
        ("a map with an array key", [b"\x81\x91\x01\x01"], 1),
        ("a map with a map key", [b"\x81\x81\x01\x01\x01"], 1),
        ("a field nested 1,000 deep", [pack(_request(1, "generate", {"prompt": _nested(1000)}))], 1),
        ("a thousand empty messages",
         [pack(_request(1, "generate", {"messages": [{"role": "user", "content": ""}] * 1000, "max_tokens": 1}))], 1),
        ("a temperature of 1e-300", [pack(_request(1, "generate", {"prompt": "hot", "max_tokens": 2,
                                                                    "temperature": 1e-300}))], 1),
        ("stop strings of 10,000 items", [pack(_request(1, "generate", {"prompt": "s", "max_tokens": 2,
                                                                        "stop": ["z"] * 10000}))], 1),
        ("a cancel of nothing", [pack(_request(1, "cancel", {"id": 424242}))], 1),
        ("an oversized frame", [b"\xc6" + (17 << 20).to_bytes(4, "big") + b"\0" * (17 << 20)], 1),
        ("half a frame, then gone", [pack(_request(1, "generate", {"prompt": "z" * 1000}))[:300]], 0),
    ]


def run_frames(path: Path, name: str, frames: list[bytes], expected: int) -> Outcome:
    wire = Wire(path)
    try:
        for frame in frames:
            wire.send_bytes(frame)
        got = wire.responses(expected, timeout=300) if expected else []  # a long legit prefill on a CPU takes minutes
    finally:
        wire.close()
    errors: dict[int, int] = {}
    for response in got:
        if response[2] is not None:
            code = response[2].get("code") if isinstance(response[2], dict) else -1
            errors[code] = errors.get(code, 0) + 1
    missing = expected - len(got)
    return Outcome(name, expected, len(got), errors, missing if wire.closed else 0, 0 if wire.closed else missing)


def run_together(path: Path, name: str, make: Callable[[int], Any], num: int) -> Outcome:
    """``num`` connections send one request each at the same moment."""
    barrier = threading.Barrier(num)
    outcomes: list[list[Any]] = [[] for _ in range(num)]
    closed = [False] * num

    def one(index: int) -> None:
        wire = Wire(path)
        try:
            barrier.wait()
            wire.send(make(index))
            outcomes[index] = wire.responses(1, timeout=120)
            closed[index] = wire.closed
        finally:
            wire.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(num)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    got = [r for rs in outcomes for r in rs]
    errors: dict[int, int] = {}
    for response in got:
        if response[2] is not None:
            errors[response[2]["code"]] = errors.get(response[2]["code"], 0) + 1
    return Outcome(name, num, len(got), errors, sum(1 for i in range(num) if closed[i] and not outcomes[i]),
                   sum(1 for i in range(num) if not closed[i] and not outcomes[i]))


def run_cancel_storm(path: Path, num: int) -> Outcome:
    """Start ``num`` streams on one connection and cancel each right away."""
    wire = Wire(path)
    try:
        for msgid in range(1, num + 1):
            wire.send(_request(msgid, "generate", {"prompt": f"storm {msgid}", "max_tokens": 500, "stream": True}))
            wire.send(_request(10_000 + msgid, "cancel", {"id": msgid}))
        got = wire.responses(2 * num, timeout=120)
    finally:
        wire.close()
    errors: dict[int, int] = {}
    for response in got:
        if response[2] is not None:
            errors[response[2]["code"]] = errors.get(response[2]["code"], 0) + 1
    return Outcome("a cancel storm", 2 * num, len(got), errors, 0 if len(got) == 2 * num else 2 * num - len(got))


def run_connection_flood(path: Path, num: int) -> Outcome:
    """Open ``num`` connections at once, ping on each, close them all."""
    wires = []
    for _ in range(num):
        try:
            wires.append(Wire(path, timeout=30))
        except OSError:
            break
    for index, wire in enumerate(wires):
        wire.send(_request(index, "ping", {}))
    got = sum(len(wire.responses(1, timeout=30)) for wire in wires)
    for wire in wires:
        wire.close()
    return Outcome("a connection flood", num, got, {}, num - got)


def run_vanishing_stream(path: Path) -> Outcome:
    """Start a long stream and close the connection mid-way (no reply expected)."""
    wire = Wire(path)
    wire.send(_request(1, "generate", {"prompt": "walks away", "max_tokens": 2000, "stream": True}))
    time.sleep(0.3)
    wire.close()
    return Outcome("a client that vanishes mid-stream", 0, 0, {}, 0)
