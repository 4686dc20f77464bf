"""The batcher between a job's pipes and the run's log: nothing lost, nothing reordered."""

from __future__ import annotations

import threading

from gpuflow.tasks.logstream import LineBatcher


def test_every_line_arrives_once_in_order_in_few_batches():
    batches: list[str] = []
    with LineBatcher(batches.append, max_delay_s=60, max_bytes=1000) as lines:
        for n in range(2000):
            lines.add(str(n))
    received = "\n".join(batches).split("\n")
    assert received == [str(n) for n in range(2000)]
    assert 8 <= len(batches) <= 20  # full batches of ~1,000 bytes, and the rest at close


def test_lines_from_two_threads_keep_each_threads_order():
    batches: list[str] = []
    with LineBatcher(batches.append, max_delay_s=0.01, max_bytes=500) as lines:

        def feed(stream: str) -> None:
            for n in range(3000):
                lines.add(f"{stream} {n}")

        threads = [threading.Thread(target=feed, args=(s,)) for s in ("out", "err")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    received = "\n".join(batches).split("\n")
    assert len(received) == 6000
    for stream in ("out", "err"):
        mine = [int(line.split()[1]) for line in received if line.startswith(stream)]
        assert mine == list(range(3000))


def test_a_quiet_job_still_reaches_the_log_without_waiting_for_the_end():
    batches: list[str] = []
    arrived = threading.Event()
    with LineBatcher(lambda text: (batches.append(text), arrived.set()), max_delay_s=0.05) as lines:
        lines.add("one line")
        assert arrived.wait(timeout=30)  # the ticker hands it on; close has not run
    assert batches == ["one line"]
