"""Stored responses of the Responses API: ``store`` / ``previous_response_id``, GET and DELETE.

Bounded in count and in bytes; the least recently used response goes first.
Each stored response keeps the whole conversation that its next turn
continues (the items before it, its own input and its output), as a list
that shares its items with its predecessor's: a chain of N turns costs each
item once, and a predecessor's eviction never breaks a successor.

Kept in memory only, unless the daemon has a disk cache: then each response is
also a small JSON file in ``directory`` holding only what it added (its input
and output items, and the id it continued), written off the event loop, and
the chains are rebuilt at start, so a conversation survives a restart like
the prefix cache it would reuse does.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import structlog

log = structlog.get_logger("prefixd.responses")
DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 256 << 20


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object, as GET returns it
    input_items: list[dict[str, Any]]  # the items this request sent (GET .../input_items)
    conversation: list[dict[str, Any]]  # what the next turn continues: everything before it, its input, its output
    num_bytes: int  # what this response added (its input, output and object), as JSON


def _size(*objects: Any) -> int:
    return sum(len(json.dumps(obj, separators=(",", ":"))) for obj in objects)


class ResponseStore:
    """The daemon's stored responses, by id. Event-loop only."""

    def __init__(
        self,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        directory: Path | None = None,
    ):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.directory = directory
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0
        self._writes: set[asyncio.Task] = set()
        self._file_work: dict[str, asyncio.Task] = {}  # the last file work queued for each response

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        stored = self.get(response_id)
        return stored.conversation if stored is not None else None

    def put(self, response: dict[str, Any], history: list[dict[str, Any]], input_items: list[dict[str, Any]]) -> None:
        """Store a finished response; ``history`` the conversation it continued."""
        output = response["output"]
        stored = StoredResponse(response, input_items, history + input_items + output, _size(response, input_items))
        self._add(response["id"], stored)
        if self.directory is not None:
            record = {"response": response, "input_items": input_items}
            self._write(response["id"], record)

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        self.num_bytes -= stored.num_bytes
        self._unlink(response_id)
        return True

    def _add(self, response_id: str, stored: StoredResponse) -> None:
        self._responses[response_id] = stored
        self.num_bytes += stored.num_bytes
        while len(self._responses) > self.max_responses or (
            self.num_bytes > self.max_bytes and len(self._responses) > 1
        ):
            old_id, old = self._responses.popitem(last=False)
            self.num_bytes -= old.num_bytes
            self._unlink(old_id)
            log.info("response_evicted", response_id=old_id, num_stored=len(self._responses))

    # -- on disk ---------------------------------------------------------------------------

    def _path(self, response_id: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{response_id}.json"

    def _write(self, response_id: str, record: dict[str, Any]) -> None:
        self._in_order(response_id, lambda: _write_atomically(self._path(response_id), record))

    def _unlink(self, response_id: str) -> None:
        if self.directory is None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # load(), on its thread: no loop to hand the file to
            self._path(response_id).unlink(missing_ok=True)
            return
        self._in_order(response_id, lambda: self._path(response_id).unlink(missing_ok=True))

    def _in_order(self, response_id: str, work: Callable[[], Any]) -> None:
        """Run ``work`` on a thread after the earlier file work on the same response.

        A response deleted (or evicted) right after it was stored has its write
        and its unlink in flight together; on two threads the unlink could land
        first and the deleted response would come back at the next start.
        """
        earlier = self._file_work.get(response_id)

        async def after_earlier() -> None:
            if earlier is not None:
                await asyncio.gather(earlier, return_exceptions=True)
            await asyncio.to_thread(work)

        task = asyncio.ensure_future(after_earlier())
        self._file_work[response_id] = task
        self._writes.add(task)

        def done(finished: asyncio.Task) -> None:
            self._writes.discard(finished)
            if self._file_work.get(response_id) is finished:
                del self._file_work[response_id]
            if not finished.cancelled() and finished.exception() is not None:
                log.warning("response_file_failed", response_id=response_id, error=str(finished.exception()))

        task.add_done_callback(done)

    async def flush(self) -> None:
        """Wait for the files being written (at shutdown)."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    def load(self) -> int:
        """Read the stored responses of an earlier run (oldest first, so chains rebuild); the number loaded.

        Blocking: call it in a thread at start, before the front serves.
        """
        if self.directory is None:
            return 0
        self.directory.mkdir(parents=True, exist_ok=True)
        records = []
        for path in self.directory.glob("resp_*.json"):
            try:
                record = json.loads(path.read_text())
                records.append((record["response"]["created_at"], path.stat().st_mtime, record))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("response_file_unreadable", path=str(path), error=str(exc))
        num_loaded = 0
        for _, _, record in sorted(records, key=lambda entry: entry[:2]):
            response, input_items = record["response"], record["input_items"]
            previous = response.get("previous_response_id")
            history = self._responses[previous].conversation if previous in self._responses else None
            if previous is not None and history is None:
                continue  # its predecessor is gone: nothing to continue
            conversation = (history or []) + input_items + response["output"]
            self._add(response["id"], StoredResponse(response, input_items, conversation, _size(response, input_items)))
            num_loaded += 1
        return num_loaded


def _write_atomically(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, separators=(",", ":")))
    os.replace(temporary, path)
