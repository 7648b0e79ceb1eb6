"""Engine events reach the loop in order, batched, from any thread; none is lost."""

from __future__ import annotations

import asyncio
import threading

from prefixd.daemon.front.event_mailbox import EventMailbox


async def test_events_from_two_threads_arrive_in_order_per_queue():
    loop = asyncio.get_running_loop()
    mailbox = EventMailbox(loop)
    queues = [asyncio.Queue(), asyncio.Queue()]

    def producer(index: int) -> None:
        for n in range(2000):
            mailbox.post(queues[index].put_nowait, n)

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for queue in queues:
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(2000)]
        assert got == list(range(2000))
    for t in threads:
        t.join()


async def test_a_burst_costs_one_wake_up():
    loop = asyncio.get_running_loop()
    mailbox = EventMailbox(loop)
    scheduled = []
    original = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda cb, *a: (scheduled.append(cb), original(cb, *a))[1]
    try:
        queue = asyncio.Queue()
        threading.Thread(target=lambda: [mailbox.post(queue.put_nowait, n) for n in range(50)]).start()
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(50)]
    finally:
        loop.call_soon_threadsafe = original
    assert got == list(range(50))
    assert 1 <= len(scheduled) < 50


def test_posting_after_the_loop_closed_is_dropped_quietly():
    loop = asyncio.new_event_loop()
    mailbox = EventMailbox(loop)
    loop.close()
    mailbox.post(asyncio.Queue().put_nowait, "late")  # no exception: the daemon is exiting
    mailbox.post(asyncio.Queue().put_nowait, "later")
