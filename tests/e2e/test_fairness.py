"""A big request does not hold up another client: the bystander keeps being answered.

The real model (SmolLM2) and the real daemon: one client sends a chat of 250
short messages (about 1,400 tokens, several prefill passes on a CPU) while a
bystander on its own connection asks a short greedy question over and over.
Every bystander answer is the one it gets alone, and several of them finish
while the chat is still being prefilled. And a burst of HTTP connections from
one program is one client: a socket client arriving behind the whole burst is
answered after one or two of its requests, not after all of them.
bench/fairness.py measures the waits.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from prefixd.client import Client
from tests.e2e.daemon_process import DaemonProcess
from tests.support.http_daemon import http_daemon

QUESTION = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0.0,
            "cache": {"use": False, "store": False}}


def long_chat(num_messages: int) -> list[dict]:
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"ok {i}"} for i in range(num_messages)]
    messages[-1] = {"role": "user", "content": "and now?"}
    return messages


def test_a_bystander_is_answered_while_a_long_chat_prefills(smollm2_dir, tmp_path):
    with DaemonProcess([smollm2_dir], tmp_path / "daemon") as daemon:
        with Client(daemon.socket_path, timeout=300) as bystander:
            alone = bystander.generate(**QUESTION)["text"]
            chat_reply: dict = {}

            def send_chat() -> None:
                with Client(daemon.socket_path, timeout=300) as chatter:
                    chat_reply.update(chatter.generate(messages=long_chat(250), max_tokens=2,
                                                       cache={"use": False, "store": False}))
            chatter = threading.Thread(target=send_chat)
            chatter.start()
            answers_during_chat = []
            while chatter.is_alive():
                answer = bystander.generate(**QUESTION)
                if chatter.is_alive():
                    answers_during_chat.append(answer["text"])
            chatter.join()
        assert chat_reply["usage"]["prompt_tokens"] > 1000
        assert len(answers_during_chat) >= 3, answers_during_chat
        assert set(answers_during_chat) == {alone}


def test_a_socket_client_behind_an_http_burst_waits_for_one_turn_not_the_burst(smollm2_dir, tmp_path):
    finished: list[str] = []  # who finished, in order
    refused: list[str] = []
    lock = threading.Lock()
    # 16 places in line (beyond them: 503, OVERLOADED): the burst's program may hold 12 of them, the last quarter is kept for other clients.
    flags = ["--max-active", "1", "--max-queued", "16"]
    with http_daemon(smollm2_dir, tmp_path / "daemon", model_dirs=[smollm2_dir], extra_args=flags) as daemon:
        body = json.dumps({"prompt": "Count from one to fifty: one, two,", "max_tokens": 8, "temperature": 0}).encode()

        def one_http_request(index: int) -> None:
            request = urllib.request.Request(daemon.base_url + "/v1/completions", data=body, method="POST",
                                             headers={**daemon.headers(), "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    assert response.status == 200
            except urllib.error.HTTPError as error:
                assert error.code == 503 and b"other clients" in error.read(), error
                with lock:
                    refused.append(f"http{index}")
                return
            with lock:
                finished.append(f"http{index}")

        def wait_for_queued(conn: Client, count: int) -> None:
            deadline = time.monotonic() + 60
            while conn.stats()["requests"]["queued"] < count:
                assert time.monotonic() < deadline, conn.stats()["requests"]
                time.sleep(0.02)

        with Client(daemon.socket_path, timeout=120) as holder, Client(daemon.socket_path, timeout=120) as bystander:
            # The one running place is held while the line forms, so the order of admissions is the inbox's alone.
            hold = holder.stream(prompt="Count from one to a thousand: one, two,", max_tokens=2000, temperature=0)
            next(iter(hold))
            burst = [threading.Thread(target=one_http_request, args=(i,)) for i in range(16)]
            for thread in burst:
                thread.start()
            wait_for_queued(holder, 12)
            answered = threading.Thread(target=lambda: (bystander.generate(**QUESTION), finished.append("bystander")))
            answered.start()
            wait_for_queued(holder, 13)
            hold.close()  # cancels it: the line moves
            answered.join(timeout=120)
            for thread in burst:
                thread.join(timeout=120)
    assert len(refused) == 4 and len(finished) == 13, (refused, finished)
    # The burst's lane had its turn first; then the bystander's: one of the twelve before it, not twelve.
    assert finished.index("bystander") == 1, finished
