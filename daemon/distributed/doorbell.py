"""A wake-up from rank 0 before every exchange, so a waiting follower sleeps instead of spinning.

A follower waits for rank 0's next iteration inside the exchange's
collective, and MLX's ring backend polls its sockets while it waits: an idle
two-rank daemon kept a whole core busy on its follower (10.0 s of CPU in 10 s,
rank 0 0.08 s; docs/decisions.md). Where prefixd launched the ranks itself
(service/rank_launcher.py: ``--ranks N`` over the ring backend), it gives rank 0
the write end of one pipe per follower and each follower the read end of its
own. Before every exchange rank 0 writes one byte to each, and a follower
blocks on reading it, asleep, before it enters the collective. Ranks started
otherwise (mlx.launch, across machines) have no doorbell and wait in the
collective as before.

Every exchange on rank 0 pairs with one on each follower (the collective
itself keeps them in step), so at most a byte or two is ever in a pipe. A
closed pipe means the rank at its other end is gone: ``RankLost``, as when a
collective fails. A rank that hangs with its pipe open is the watchdog's: the
wait runs inside the iteration it guards.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .channel import RankLost

LEADER_ENV = "PREFIXD_RANK_DOORBELLS"  # rank 0: the write ends, one per follower, in rank order
FOLLOWER_ENV = "PREFIXD_RANK_DOORBELL"  # a follower: the read end of its own pipe


class Doorbell:
    def __init__(self, rank: int, size: int, write_fds: tuple[int, ...] = (), read_fd: int | None = None):
        self.rank, self.size = rank, size
        self._write_fds = write_fds
        self._read_fd = read_fd

    @classmethod
    def from_environment(cls, rank: int, size: int, environ: Mapping[str, str] = os.environ) -> "Doorbell | None":
        """This rank's end of the doorbell its launcher made, or None when it made none."""
        if rank == 0:
            value = environ.get(LEADER_ENV)
            if not value:
                return None
            fds = tuple(int(fd) for fd in value.split(","))
            if len(fds) != size - 1:
                raise ValueError(f"{LEADER_ENV} names {len(fds)} doorbells for {size - 1} followers")
            return cls(rank, size, write_fds=fds)
        value = environ.get(FOLLOWER_ENV)
        return cls(rank, size, read_fd=int(value)) if value else None

    def ring(self) -> None:
        """Rank 0: wake every follower for the exchange that follows."""
        for follower, fd in enumerate(self._write_fds, start=1):
            try:
                os.write(fd, b"\x01")
            except OSError as exc:  # EPIPE: nobody reads it any more
                raise RankLost(
                    f"rank 0 of {self.size}: rank {follower}'s doorbell is closed ({exc.strerror}); "
                    "another rank exited or lost its connection"
                ) from exc

    def wait(self) -> None:
        """A follower: sleep until rank 0 rings for the next exchange."""
        if not os.read(self._read_fd, 1):
            raise RankLost(
                f"rank {self.rank} of {self.size}: rank 0's doorbell closed; another rank exited or lost its connection"
            )
