"""One prefixd across several ranks (--ranks N, ring backend over loopback, CPU), seen from its clients.

What a user notices: the same greedy answers as one process, a repeated
prompt reused whole with the same answer, the cache map in every reply,
concurrent sessions and cancellation as on one process; a rank that dies
ends the daemon with a clear error within seconds; a rank started with
another model is refused at start; a model whose heads do not divide over
the ranks is refused with the rank counts that would work. The same in
pipeline mode (--parallel pipeline: whole layers per rank) on a tiny
ministral3, whose mlx-lm code offers it, and a model that lacks the mode asked
for is refused naming the one it has.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.daemon_process import DaemonProcess, RawConnection, daemon_command
from tests.e2e.ranked_daemon import RankedDaemon, mlx_launcher
from tests.e2e.test_tool_calls import TOOLS
from tests.support.tiny_models import ensure_tiny_model

pytestmark = pytest.mark.skipif(not Path(mlx_launcher()).is_file(), reason="mlx.launch is not installed")

ENGINE_DEAD = -32009
LONG_PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 24
REQUESTS = [
    {"prompt": "The quick brown fox", "max_tokens": 16},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
     "max_tokens": 16, "stream": True},
    {"prompt": LONG_PROMPT, "max_tokens": 8},  # more than one 512-token prefill chunk
    {"prompt": LONG_PROMPT + "# and now something else", "max_tokens": 8},  # a partial hit on the one before
]


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir, tmp_path_factory):
    with DaemonProcess([tiny_llama_dir], tmp_path_factory.mktemp("one")) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def tiny_ministral3_dir(tiny_models_root):
    """A random-weight ministral3 (4 layers, KVCache only): mlx-lm splits it by layers (pipeline) or heads."""
    return ensure_tiny_model("ministral3", tiny_models_root)


@pytest.fixture(scope="module")
def ministral3_one_process(tiny_ministral3_dir, tmp_path_factory):
    with DaemonProcess([tiny_ministral3_dir], tmp_path_factory.mktemp("m1")) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def ministral3_pipeline(tiny_ministral3_dir, tmp_path_factory):
    with RankedDaemon([tiny_ministral3_dir], tmp_path_factory.mktemp("m2"), num_ranks=2,
                      extra_args=["--parallel", "pipeline"]) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def two_ranks(tiny_llama_dir, tmp_path_factory):
    with RankedDaemon([tiny_llama_dir], tmp_path_factory.mktemp("two"), num_ranks=2) as daemon:
        yield daemon


def generate(conn: RawConnection, params: dict) -> dict:
    chunks, response = conn.reply(conn.request("generate", params))
    assert response[2] is None, response[2]
    result = response[3]
    if params.get("stream"):
        assert "".join(chunk["text"] for chunk in chunks) == result["text"]
    return result


def test_two_ranks_answer_as_one_process_and_reuse_the_cache_the_same_way(one_process, two_ranks):
    with RawConnection(one_process.socket_path) as one, RawConnection(two_ranks.socket_path) as two:
        for params in REQUESTS:
            expected, got = generate(one, params), generate(two, params)
            assert got["text"] == expected["text"]
            assert got["cache"] == {**expected["cache"], "age_s": got["cache"]["age_s"],
                                    "saved_ms_est": got["cache"]["saved_ms_est"]}
            again = generate(two, params)
            assert again["text"] == got["text"]
            assert again["cache"]["hit"] == "exact"
            assert again["cache"]["reused_tokens"] == again["cache"]["prompt_tokens"]  # and the stored logits
        assert got["cache"]["hit"] == "partial" and got["cache"]["reused_tokens"] >= 512  # the last one
        stats = two.result("stats")
        assert stats["ranks"]["num_ranks"] == 2 and stats["ranks"]["iterations"] > 0
        assert stats["cache"]["total"]["num_sequences"] >= 3
        assert stats["requests"]["failed"] == 0
    assert {line["rank"] for line in two_ranks.events("model_loaded")} == {0, 1}  # each line says its rank


def test_sampling_is_the_same_on_every_rank(one_process, two_ranks):
    seeded = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.9, "seed": 11}
    unseeded = {"prompt": "In a land far away", "max_tokens": 24, "temperature": 1.0}
    constrained = {"prompt": "Call me at", "max_tokens": 24, "constraint": {"regex": "[0-9]{3}-[0-9]{4}"}}
    with RawConnection(one_process.socket_path) as one, RawConnection(two_ranks.socket_path) as two:
        assert generate(two, seeded)["text"] == generate(one, seeded)["text"]
        assert generate(two, constrained)["text"] == generate(one, constrained)["text"]  # every rank masks alike
        # Unseeded draws come from MLX's global generator: a rank that drew otherwise would
        # feed another token and the ranks' digests would differ (the daemon would stop).
        for _ in range(2):
            assert generate(two, unseeded)["cache"]["prompt_tokens"] > 0
        assert two.result("stats")["requests"]["failed"] == 0


def sessions_on_one_system_prompt(subject: str, noun: str) -> list[dict]:
    """Four chat requests sharing a system prompt about ``subject``, each with its own question."""
    system = {"role": "system", "content": f"You answer questions about {subject}, briefly. " * 8}
    return [{"messages": [system, {"role": "user", "content": f"{noun} number {i}?"}], "max_tokens": 20}
            for i in range(4)]


def answers_one_at_a_time(daemon, sessions: list[dict]) -> list[str]:
    with RawConnection(daemon.socket_path) as conn:
        return [generate(conn, params)["text"] for params in sessions]


def test_concurrent_sessions_cancellation_and_pins(one_process, two_ranks):
    sessions = sessions_on_one_system_prompt("caches", "Question")
    expected = answers_one_at_a_time(one_process, sessions)
    conns = [RawConnection(two_ranks.socket_path) for _ in sessions]
    try:
        victim_conn = RawConnection(two_ranks.socket_path)
        victim = victim_conn.request("generate", {"prompt": "a request that is cancelled", "max_tokens": 4000,
                                                  "stream": True})
        victim_conn.read()  # its first chunk: it runs
        msgids = [conn.request("generate", params) for conn, params in zip(conns, sessions)]
        assert victim_conn.result("cancel", {"id": victim}) == {"cancelled": True}
        _, cancelled = victim_conn.reply(victim)
        assert cancelled[2] is None and cancelled[3]["finish_reason"] == "cancelled"
        assert cancelled[3]["usage"]["completion_tokens"] < 4000
        answers = [conn.reply(msgid)[1] for conn, msgid in zip(conns, msgids)]
        assert [answer[3]["text"] for answer in answers] == expected
        system = sessions[0]["messages"][0]
        pinned = victim_conn.result("cache.pin", {"messages": [system], "add_generation_prompt": False})
        assert pinned["pinned_tokens"] > 0  # a store change made on every rank
        victim_conn.result("cache.warm", {"prompt": "a warmed prompt " * 20})
        warmed = generate(victim_conn, {"prompt": "a warmed prompt " * 20, "max_tokens": 4})
        assert warmed["cache"]["hit"] == "exact"
        stats = victim_conn.result("stats")
        assert stats["requests"]["cancelled"] >= 1 and stats["requests"]["active"] == 0
        assert stats["cache"]["total"]["pinned_bytes"] > 0
    finally:
        for conn in conns:
            conn.close()
        victim_conn.close()


def test_ranks_started_by_mlx_launch_serve_as_well(tiny_llama_dir, tmp_path):
    # The other tests start their ranks with `prefixd serve --ranks N`; across machines, mlx.launch starts them.
    with RankedDaemon([tiny_llama_dir], tmp_path / "mlx", num_ranks=2, launcher="mlx") as daemon:
        with RawConnection(daemon.socket_path) as conn:
            assert generate(conn, {"prompt": "started by mlx.launch", "max_tokens": 4})["usage"]["completion_tokens"] > 0
        assert daemon.rank_pid(0) != daemon.rank_pid(1)


def test_every_model_is_loaded_on_every_rank_at_start(tiny_llama_dir, tiny_tools_dir, tmp_path):
    with RankedDaemon([tiny_llama_dir, tiny_tools_dir], tmp_path / "two-models", num_ranks=2) as daemon:
        with RawConnection(daemon.socket_path) as conn:
            models = conn.result("models")["models"]
            assert [m["loaded"] for m in models] == [True, True]  # models on demand would load on one rank alone
            for model in models:
                generate(conn, {"model": model["name"], "prompt": "which model answers", "max_tokens": 4})
            # a tool loop's next turn reuses the previous one, answer included, on ranks too
            tools_model = next(m["name"] for m in models if m["name"] != "llama")
            messages = [{"role": "user", "content": "What is the weather in Paris this week?"}]
            first = generate(conn, {"model": tools_model, "messages": messages, "tools": TOOLS, "max_tokens": 100,
                                    "tool_choice": "required"})
            (call,) = first["tool_calls"]
            messages += [{"role": "assistant", "content": first["text"], "tool_calls": first["tool_calls"]},
                         {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "clear"}'}]
            second = generate(conn, {"model": tools_model, "messages": messages, "tools": TOOLS, "max_tokens": 4})
            assert second["cache"]["reused_tokens"] >= first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]


@pytest.mark.parametrize("model_fixture, parallel", [("tiny_llama_dir", "tensor"), ("tiny_ministral3_dir", "pipeline")])
def test_eviction_under_a_small_budget_keeps_the_ranks_together(model_fixture, parallel, request, tmp_path):
    model = request.getfixturevalue(model_fixture)
    # Either way a rank holds half of each entry's KV (half the KV heads of every layer, or every head of
    # half the layers), so the same budget evicts.
    with RankedDaemon([model], tmp_path / "small", num_ranks=2,
                      extra_args=["--cache-bytes", "3M", "--parallel", parallel]) as daemon:
        with RawConnection(daemon.socket_path) as conn:
            prompts = [f"Document {i}: " + "the cache evicts what it cannot keep. " * 12 for i in range(8)]
            answers = [generate(conn, {"prompt": prompt, "max_tokens": 8})["text"] for prompt in prompts]
            again = generate(conn, {"prompt": prompts[-1], "max_tokens": 8})
            stats = conn.result("stats")
    assert again["cache"]["hit"] == "exact" and again["text"] == answers[-1]
    assert stats["cache"]["total"]["num_evictions"] > 0  # both ranks evicted the same leaves: no divergence
    assert stats["requests"]["failed"] == 0


@pytest.mark.parametrize("model_fixture, parallel", [("tiny_llama_dir", "tensor"), ("tiny_ministral3_dir", "pipeline")])
def test_killing_a_rank_ends_the_daemon_with_a_clear_error(model_fixture, parallel, request, tmp_path):
    model = request.getfixturevalue(model_fixture)
    # A short --rank-timeout: MLX's ring backend, on losing a peer, fails its pending tasks, but now and
    # then the engine thread stays blocked inside mx.async_eval behind the dead collective (seen with
    # py-spy, about 1 kill in 10 on a loaded machine); then the watchdog is what ends the daemon.
    daemon = RankedDaemon([model], tmp_path / "killed", num_ranks=2,
                          extra_args=["--parallel", parallel, "--rank-timeout", "5"])
    daemon.start()
    try:
        with RawConnection(daemon.socket_path, timeout=20) as conn:
            msgid = conn.request("generate", {"prompt": "a long answer", "max_tokens": 4000, "stream": True})
            conn.read()  # it runs
            killed_at = time.monotonic()
            daemon.kill_rank(1)
            _, response = conn.reply(msgid)
        assert response[2] is not None, "the request finished although a rank died"
        # Whichever collective meets the lost peer first (the iteration's exchange, or one inside the model
        # pass, which MLX fails with "[ring] connection to a peer was lost"), the answer is the same.
        assert response[2]["code"] == ENGINE_DEAD, response[2]
        message = response[2]["message"]
        assert "another rank exited or lost its connection" in message or "stopped answering" in message, message
        assert time.monotonic() - killed_at < 15
        daemon.wait(timeout=30)  # rank 0 exits (the launcher stops the other ranks when one fails), then the launcher
        assert not daemon.answers_ping()
    finally:
        daemon.kill()


def test_a_rank_that_stops_answering_ends_the_daemon_after_the_rank_timeout(tiny_llama_dir, tmp_path):
    daemon = RankedDaemon([tiny_llama_dir], tmp_path / "stopped", num_ranks=2, extra_args=["--rank-timeout", "3"])
    daemon.start()
    try:
        with RawConnection(daemon.socket_path, timeout=30) as conn:
            msgid = conn.request("generate", {"prompt": "a long answer", "max_tokens": 4000, "stream": True})
            conn.read()  # it runs
            stopped_at = time.monotonic()
            os.kill(daemon.rank_pid(1), signal.SIGSTOP)  # alive, silent: no collective fails, they wait
            _, response = conn.reply(msgid)
        assert response[2] is not None and response[2]["code"] == ENGINE_DEAD
        assert "stopped answering" in response[2]["message"]
        assert time.monotonic() - stopped_at < 15
        rank0 = daemon.rank_pid(0)
        deadline = time.monotonic() + 20
        while _alive(rank0) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank0), "rank 0 did not exit after its watchdog fired"
    finally:
        daemon.kill()  # SIGKILL reaches the stopped rank too


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_a_rank_with_another_model_is_refused_at_start(tiny_llama_dir, tmp_path):
    other = ensure_tiny_model("llama", tmp_path / "other", seed=1)  # the same shapes, other weights
    wrapper = tmp_path / "rank_with_other_model.py"
    wrapper.write_text(
        "import os, runpy, sys\n"
        f"if os.environ['MLX_RANK'] == '1':\n    sys.argv = [{str(other)!r} if a == {str(tiny_llama_dir)!r} else a for a in sys.argv]\n"
        "runpy.run_module('prefixd.daemon', run_name='__main__')\n")
    daemon = RankedDaemon([tiny_llama_dir], tmp_path / "mismatch", num_ranks=2, launcher="mlx")  # its --python
    command = daemon_command([tiny_llama_dir], daemon.socket_path, ["--rank-timeout", "30"])
    daemon.args = daemon.args[: daemon.args.index("--python") + 2] + [str(wrapper), *command[3:]]
    with pytest.raises(RuntimeError, match="exited"):
        daemon.start(timeout=60)
    log = daemon.stderr_text()
    assert "the 2 ranks differ after loading: models" in log
    daemon.kill()


@pytest.mark.parametrize("option, message", [
    (["--disk-cache-bytes", "64M"], "--disk-cache-bytes is not available on a daemon spanning several ranks"),
    (["--batch-step", "ragged"], "--batch-step ragged is not available on a daemon spanning several ranks"),
])
def test_what_does_not_work_across_ranks_is_refused_with_a_clear_message(tiny_llama_dir, tmp_path, option, message):
    daemon = RankedDaemon([tiny_llama_dir], tmp_path / "refused", num_ranks=2, extra_args=option)
    with pytest.raises(RuntimeError, match="exited"):
        daemon.start(timeout=60)
    assert message in daemon.stderr_text()
    daemon.kill()


def test_smollm2_does_not_split_over_two_ranks_and_says_what_would(smollm2_dir, tmp_path):
    daemon = RankedDaemon([smollm2_dir], tmp_path / "smol2", num_ranks=2)
    with pytest.raises(RuntimeError, match="exited"):
        daemon.start(timeout=120)
    assert "num_attention_heads = 9 does not divide over 2 ranks" in daemon.stderr_text()
    assert "rank counts that work for this model: 3" in daemon.stderr_text()
    daemon.kill()


def test_smollm2_on_three_ranks_answers_as_one_process(smollm2_dir, tmp_path):
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 10}
    with DaemonProcess([smollm2_dir], tmp_path / "smol1") as single:
        with RawConnection(single.socket_path, timeout=60) as conn:
            expected = generate(conn, chat)
    with RankedDaemon([smollm2_dir], tmp_path / "smol3", num_ranks=3) as ranked:
        with RawConnection(ranked.socket_path, timeout=120) as conn:
            got = generate(conn, chat)
            again = generate(conn, chat)
    assert "Paris" in expected["text"]
    assert got["text"] == expected["text"] and again["text"] == expected["text"]
    assert again["cache"]["hit"] == "exact"


def test_pipeline_ranks_answer_as_one_process_and_each_holds_half_of_the_kv(ministral3_one_process, ministral3_pipeline):
    seeded = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.9, "seed": 11}
    with RawConnection(ministral3_one_process.socket_path) as one, RawConnection(ministral3_pipeline.socket_path) as two:
        for params in [*REQUESTS, seeded]:
            expected, got = generate(one, params), generate(two, params)
            assert got["text"] == expected["text"]
            assert got["cache"] == {**expected["cache"], "age_s": got["cache"]["age_s"],
                                    "saved_ms_est": got["cache"]["saved_ms_est"]}
            again = generate(two, params)
            assert again["text"] == got["text"] and again["cache"]["hit"] == "exact"
        assert generate(two, REQUESTS[3])["cache"]["hit"] == "exact"
        one_stats, two_stats = one.result("stats"), two.result("stats")
    assert two_stats["ranks"]["parallel"] == "pipeline" and two_stats["requests"]["failed"] == 0
    # Each rank runs 2 of the 4 layers, makes caches for those alone, and stores only their KV: the same
    # entries at half the bytes. Every rank keeps each prompt end's next-token logits whole (each samples
    # the first token of a repeat from them): 5 prompts x 2,048 float32 logits.
    loaded = ministral3_pipeline.events("model_loaded")
    assert sorted((line["rank"], line["cache_layers"]["kvcache"]) for line in loaded) == [(0, 2), (1, 2)]
    one_total, two_total = one_stats["cache"]["total"], two_stats["cache"]["total"]
    assert two_total["num_sequences"] == one_total["num_sequences"]
    logits_bytes = (len(REQUESTS) + 1) * 2048 * 4
    assert (two_total["num_bytes"] - logits_bytes) * 2 == one_total["num_bytes"] - logits_bytes


def test_pipeline_ranks_serve_concurrent_sessions_as_one_process(ministral3_one_process, ministral3_pipeline):
    sessions = sessions_on_one_system_prompt("pipelines", "Stage")
    expected = answers_one_at_a_time(ministral3_one_process, sessions)
    conns = [RawConnection(ministral3_pipeline.socket_path) for _ in sessions]
    try:
        msgids = [conn.request("generate", params) for conn, params in zip(conns, sessions)]
        answers = [conn.reply(msgid)[1] for conn, msgid in zip(conns, msgids)]
        assert [answer[3]["text"] for answer in answers] == expected
        stats = conns[0].result("stats")
        assert stats["requests"]["failed"] == 0 and stats["requests"]["active"] == 0
    finally:
        for conn in conns:
            conn.close()


def test_a_model_without_the_parallel_mode_asked_for_is_refused_naming_what_it_has(tiny_llama_dir, tmp_path):
    daemon = RankedDaemon([tiny_llama_dir], tmp_path / "no-pipeline", num_ranks=2, extra_args=["--parallel", "pipeline"])
    with pytest.raises(RuntimeError, match="exited"):
        daemon.start(timeout=60)
    assert "llama (llama) cannot run pipeline-parallel over ranks: mlx-lm's code for it offers tensor only" \
        in daemon.stderr_text()
    daemon.kill()
