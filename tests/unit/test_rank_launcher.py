"""prefixd's launcher for ``--ranks N`` on one machine, with small Python children standing in for ranks.

What a rank is given (MLX_RANK, a ring hostfile as mlx.launch writes it),
how the ranks end (a stop signal goes to rank 0; a failed rank takes the
others down; a rank that outlives the grace is killed; the launcher exits
with the failure's status), and that nothing is left behind when the
launcher itself is killed. The daemon across ranks is in
tests/e2e/test_distributed.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prefixd.daemon.service.rank_launcher import RankSupervisor, ring_hostfile, run_local_ring

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="children are read through /proc")

# A stand-in rank: rank 0 stops on SIGTERM (as the daemon's rank 0 shuts down), the others ignore it
# (as distributed/follower.py does), each writes what it was given, then sleeps until told.
RANK = textwrap.dedent("""
    import json, os, signal, sys, time
    rank = int(os.environ["MLX_RANK"])
    if rank == 0:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
        json.dump({"rank": rank, "hosts": json.load(open(os.environ["MLX_HOSTFILE"])), "pid": os.getpid()}, out)
    exit_code = int(os.environ.get(f"EXIT_{rank}", "-1"))
    if exit_code >= 0:
        sys.exit(exit_code)
    time.sleep(60)
""")


def _wait_for_files(directory: Path, count: int, timeout: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(directory.glob("rank*.json"))
        if len(found) == count:
            try:
                return [json.loads(path.read_text()) for path in found]
            except json.JSONDecodeError:
                pass  # still being written
        time.sleep(0.02)
    raise AssertionError(f"{count} ranks did not start in {timeout} s: {list(directory.iterdir())}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _supervisor(tmp_path: Path, num_ranks: int, env: dict[str, str] | None = None, grace: float = 0.5):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(ring_hostfile(40000, num_ranks)))
    events: list[tuple[str, dict]] = []
    environments = [{**os.environ, **(env or {}), "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}
                    for r in range(num_ranks)]
    supervisor = RankSupervisor([[sys.executable, "-c", RANK, str(tmp_path)]] * num_ranks, environments,
                                lambda event, **fields: events.append((event, fields)), stop_grace_s=grace)
    return supervisor, events


def test_every_rank_gets_its_rank_and_the_ring_hostfile_mlx_launch_writes(tmp_path):
    assert ring_hostfile(32323, 3) == [["127.0.0.1:32323"], ["127.0.0.1:32324"], ["127.0.0.1:32325"]]
    supervisor, events = _supervisor(tmp_path, 3, env={"EXIT_0": "0", "EXIT_1": "0", "EXIT_2": "0"})
    supervisor.start()
    assert supervisor.run() == 0
    ranks = _wait_for_files(tmp_path, 3)
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert all(r["hosts"] == ring_hostfile(40000, 3) for r in ranks)
    assert sorted(fields["rank"] for event, fields in events if event == "rank_exited") == [0, 1, 2]


def test_a_failed_rank_stops_rank_0_kills_the_rest_and_sets_the_exit_status(tmp_path):
    supervisor, events = _supervisor(tmp_path, 3, env={"EXIT_1": "3"})
    supervisor.start()
    started = time.monotonic()
    assert supervisor.run() == 3  # rank 1's failure, not rank 0's clean stop or rank 2's kill
    assert time.monotonic() - started < 10
    codes = {fields["rank"]: fields["code"] for event, fields in events if event == "rank_exited"}
    assert codes[1] == 3
    assert codes[0] == 0  # asked to stop (SIGTERM), it stopped as the daemon's rank 0 does
    assert codes[2] == -signal.SIGKILL  # a follower ignores SIGTERM: killed after the grace
    assert ("rank_killed", {"rank": 2, "after_s": 0.5}) in events


def test_a_rank_killed_by_a_signal_gives_the_shell_s_status(tmp_path):
    supervisor, events = _supervisor(tmp_path, 2)
    supervisor.start()
    pids = {r["rank"]: r["pid"] for r in _wait_for_files(tmp_path, 2)}
    os.kill(pids[1], signal.SIGKILL)
    assert supervisor.run() == 128 + signal.SIGKILL


def test_a_stop_signal_goes_to_rank_0_and_followers_left_behind_are_killed(tmp_path):
    supervisor, events = _supervisor(tmp_path, 2)
    supervisor.start()
    _wait_for_files(tmp_path, 2)
    supervisor.forward(signal.SIGTERM)
    assert supervisor.run() == 0  # rank 0 stopped cleanly; the follower's kill is the launcher's doing
    codes = {fields["rank"]: fields["code"] for event, fields in events if event == "rank_exited"}
    assert codes == {0: 0, 1: -signal.SIGKILL}


def test_the_launcher_waits_without_spinning_and_its_ranks_die_with_it(tmp_path):
    # The launcher in a process of its own, as `prefixd serve --ranks 2` runs it.
    script = textwrap.dedent(f"""
        import sys
        from prefixd.daemon.service.rank_launcher import run_local_ring
        sys.exit(run_local_ring(2, 40100, [sys.executable, "-c", {RANK!r}, {str(tmp_path)!r}], lambda *a, **k: None))
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL)
    try:
        pids = [r["pid"] for r in _wait_for_files(tmp_path, 2)]
        ticks_before = _cpu_ticks(launcher.pid)
        time.sleep(2)
        # mlx.launch used ~2 s of CPU in 2 s here (its relay select()s on always-writable pipes).
        assert _cpu_ticks(launcher.pid) - ticks_before <= 0.1 * os.sysconf("SC_CLK_TCK")
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), "a rank outlived its SIGKILLed launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_the_hostfile_is_removed_when_the_ranks_end(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    monkeypatch.setenv("EXIT_0", "0")
    monkeypatch.setenv("EXIT_1", "0")
    assert run_local_ring(2, 40200, [sys.executable, "-c", RANK, str(tmp_path)], lambda *a, **k: None) == 0
    assert not list(tmp_path.glob("prefixd-ring-*.json"))


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])
