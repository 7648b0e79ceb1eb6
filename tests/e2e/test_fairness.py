"""A long chat on the socket does not hold up another client: the bystander keeps being answered.

The real model (SmolLM2) and the real daemon: one client sends a chat of 250
short messages (about 1,400 tokens, several prefill passes on a CPU) while a
bystander on its own connection asks a short greedy question over and over.
Every bystander answer is the one it gets alone, and several of them finish
while the chat is still being prefilled. bench/fairness.py measures the waits.
"""

from __future__ import annotations

import threading

from prefixd.client import Client
from tests.e2e.daemon_process import DaemonProcess

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
