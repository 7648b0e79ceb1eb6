"""The collectives the ranks speak through: MLX's own (``mx.distributed``), nothing home-made.

Rank 0 broadcasts bytes as mlx-lm's server does: an ``all_sum`` in which
every other rank contributes zeros. Engine thread only (MLX streams belong to
the thread that made them). A collective that fails means a rank is gone
(the ring backend raises "connection to a peer was lost" within about a
second of a peer exiting); it becomes ``RankLost``. A collective that never
returns (a rank that stopped answering) is the watchdog's (watchdog.py).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:  # doorbell.py imports RankLost from here
    from .doorbell import Doorbell

INLINE_BYTES = 2048  # an iteration's inputs up to this size travel with the header: one collective
# How MLX's distributed backends begin their errors ("[ring] connection to a peer was lost").
BACKEND_ERROR = re.compile(r"\[(ring|nccl|jaccl|mpi)\]")


def is_collective_failure(error: BaseException | str) -> bool:
    """Did this error come out of one of MLX's collectives (a lost rank), rather than the request itself?

    A model pass holds collectives too (tensor parallel: an all_sum per layer;
    pipeline: send/recv and an all_gather), and when a peer is gone MLX raises a
    RuntimeError with its backend's tag from whatever evaluates the pass. The
    engine would answer that as its own INTERNAL failure; the lock-step engine
    asks this instead and ends (ENGINE_DEAD), as for a failed exchange.
    """
    return isinstance(error, RankLost) or bool(BACKEND_ERROR.search(str(error)))


class RankLost(BaseException):
    """A collective failed: another rank exited or lost its connection.

    A BaseException on purpose: the engine's loop recovers from an Exception
    by failing the running requests and going on, which cannot help once the
    ranks can no longer agree; this ends the engine (every request gets
    ENGINE_DEAD, the daemon exits 1).
    """


class RanksDiverged(RankLost):
    """The ranks' engine states differ: their KV shards no longer belong to the same requests."""


class Channel:
    def __init__(self, group: mx.distributed.Group, doorbell: Doorbell | None = None):
        """``doorbell``: where the launcher made one, a follower waits for each exchange asleep on it,
        rather than polling inside the collective."""
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.doorbell = doorbell

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def exchange(self, payload: bytes | None, digest: int) -> tuple[bytes, list[int]]:
        """Rank 0's ``payload`` on every rank, and every rank's ``digest`` (a 64-bit state summary).

        One ``all_sum`` of bytes in which each part has a single contributor,
        so the sum is exact: rank 0's payload size, one 8-byte slot per rank
        for its digest, then the payload when it fits INLINE_BYTES (an
        iteration's inputs are about 150 bytes). A larger payload takes a
        second ``all_sum``.
        """
        if self.doorbell is not None:
            self.doorbell.ring() if self.is_leader else self.doorbell.wait()
        payload = payload or b""
        head = 8 * (1 + self.size)
        buffer = bytearray(head + INLINE_BYTES)
        if self.is_leader:
            buffer[0:8] = len(payload).to_bytes(8, "little")
            if len(payload) <= INLINE_BYTES:
                buffer[head : head + len(payload)] = payload
        slot = 8 * (1 + self.rank)
        buffer[slot : slot + 8] = (digest & ((1 << 64) - 1)).to_bytes(8, "little")
        summed = bytes(
            memoryview(
                self._run(mx.distributed.all_sum(mx.array(memoryview(buffer), dtype=mx.uint8), group=self.group))
            )
        )
        size = int.from_bytes(summed[0:8], "little")
        digests = [int.from_bytes(summed[8 * (1 + r) : 8 * (2 + r)], "little") for r in range(self.size)]
        if size <= INLINE_BYTES:
            return summed[head : head + size], digests
        if self.is_leader:
            data = mx.array(memoryview(payload), dtype=mx.uint8)
        else:
            data = mx.zeros((size,), dtype=mx.uint8)
        return bytes(memoryview(self._run(mx.distributed.all_sum(data, group=self.group)))), digests

    def agree(self, value: int) -> int:
        """Rank 0's ``value`` on every rank: a decision rank 0 takes from its own clock."""
        mine = value if self.is_leader else 0
        return int(self._run(mx.distributed.all_sum(mx.array([mine], dtype=mx.int64), group=self.group)).item())

    def gather(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order, on every rank."""
        sizes = self._run(mx.distributed.all_gather(mx.array([len(payload)], dtype=mx.int32), group=self.group))
        sizes = [int(s) for s in sizes.tolist()]
        width = max(max(sizes), 1)
        padded = bytes(payload) + b"\0" * (width - len(payload))
        rows = self._run(
            mx.distributed.all_gather(mx.array(memoryview(padded), dtype=mx.uint8)[None], group=self.group)
        )
        flat = bytes(memoryview(rows.reshape(-1)))
        return [flat[r * width : r * width + sizes[r]] for r in range(self.size)]

    def _run(self, array: mx.array) -> mx.array:
        try:
            mx.eval(array)
        except RuntimeError as exc:
            raise RankLost(
                f"rank {self.rank} of {self.size}: a collective failed ({exc}); another rank "
                "exited or lost its connection"
            ) from exc
        return array
