"""The doorbell a launcher gives local ranks (distributed/doorbell.py), over real pipes, without MLX collectives."""

from __future__ import annotations

import os
import threading
import time

import pytest

from prefixd.daemon.distributed.channel import RankLost
from prefixd.daemon.distributed.doorbell import FOLLOWER_ENV, LEADER_ENV, Doorbell
from prefixd.daemon.service import rank_launcher


def test_the_launcher_and_the_ranks_name_the_same_variables():
    assert (rank_launcher.DOORBELL_LEADER_ENV, rank_launcher.DOORBELL_FOLLOWER_ENV) == (LEADER_ENV, FOLLOWER_ENV)


def test_each_rank_finds_its_end_or_none():
    assert Doorbell.from_environment(0, 3, {LEADER_ENV: "7,9"})._write_fds == (7, 9)
    assert Doorbell.from_environment(2, 3, {FOLLOWER_ENV: "5"})._read_fd == 5
    assert Doorbell.from_environment(0, 3, {}) is None  # started by mlx.launch: no doorbell
    assert Doorbell.from_environment(1, 3, {}) is None
    with pytest.raises(ValueError, match="2 followers"):
        Doorbell.from_environment(0, 3, {LEADER_ENV: "7"})


def test_a_follower_sleeps_until_rank_0_rings():
    read, write = os.pipe()
    leader, follower = Doorbell(0, 2, write_fds=(write,)), Doorbell(1, 2, read_fd=read)
    woken = threading.Event()
    waiter = threading.Thread(target=lambda: (follower.wait(), woken.set()))
    waiter.start()
    time.sleep(0.2)
    assert not woken.is_set()
    leader.ring()
    assert woken.wait(5)
    waiter.join(5)
    os.close(read), os.close(write)


def test_a_gone_rank_0_wakes_the_follower_with_rank_lost():
    read, write = os.pipe()
    os.close(write)
    with pytest.raises(RankLost, match="rank 0's doorbell closed"):
        Doorbell(1, 2, read_fd=read).wait()
    os.close(read)


def test_ringing_a_gone_follower_is_rank_lost():
    read, write = os.pipe()
    os.close(read)
    with pytest.raises(RankLost, match="rank 1's doorbell is closed"):
        Doorbell(0, 2, write_fds=(write,)).ring()
    os.close(write)
