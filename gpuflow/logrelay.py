"""The run's logs on their way to the Prefect API, kept while the API does not answer.

Prefect's own log worker drops a batch the API refuses after its client's retries (about
a minute): an outage longer than that loses the lines the job printed meanwhile. While
`gpuflow run` runs a flow, every log the flow's loggers send to the API goes through one
relay instead: a thread that posts them in order, in batches, and keeps what the API did
not take, retrying until it answers. What is still held when the command ends (the API
stayed away past GPUFLOW_API_OUTAGE_S, or did not take the last batch in time) is written
under $GPUFLOW_HOME/unreported, and the next gpuflow command (or `gpuflow reap`) delivers
it once the API answers. Memory held is bounded: past HELD_BYTES the oldest logs go to that
file at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson

from gpuflow.tasks.platform.reap import spill_logs

BATCH_BYTES = 2 * 1024 * 1024
HELD_BYTES = 128 * 1024 * 1024
DRAIN_S = 60.0


class LogRelay:
    """Posts the run's logs to the API from a thread of its own; see the module's text."""

    def __init__(self, api_url: str, say: Callable[[str], None]) -> None:
        self._client: Any = None
        self.api_url, self.say = api_url, say
        self._held: deque[tuple[int, str, bytes]] = deque()
        self._next = 0
        self._bytes = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._closing = False
        self.failures = 0
        self._thread = threading.Thread(target=self._send_loop, daemon=True, name="log-relay")

    def __enter__(self) -> LogRelay:
        from prefect.logging.handlers import set_api_log_sink

        from gpuflow.tasks.api_client import api_client

        self._client = api_client().__enter__()  # this command's API
        self._thread.start()
        set_api_log_sink(self.send)
        return self

    def __exit__(self, *exc: object) -> None:
        from prefect.logging.handlers import set_api_log_sink

        set_api_log_sink(None)
        self.drain(DRAIN_S)
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=15)
        if kept := self.spill():
            self.say(
                f"{kept} log lines were not taken by the Prefect API at {self.api_url} in time;"
                " they are kept under $GPUFLOW_HOME/unreported and the next gpuflow command"
                " delivers them once it answers"
            )
        with contextlib.suppress(Exception):
            self._client.__exit__(None, None, None)

    def send(self, log: dict[str, Any]) -> None:
        """Take one log (a LogCreate-shaped dict from Prefect's API log handler)."""
        body = orjson.dumps({k: v for k, v in log.items() if k != "__payload_size__"})
        run_id = str(log.get("flow_run_id") or "")
        with self._lock:
            self._held.append((self._next, run_id, body))
            self._next += 1
            self._bytes += len(body)
            self._idle.clear()
            over = self._bytes > HELD_BYTES
        if over:  # the API has been away long: the oldest half goes to disk now
            self._spill_oldest(self._bytes // 2)
        self._wake.set()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every held log to be taken by the API."""
        return self._idle.wait(timeout_s)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def spill(self) -> int:
        """Write every log still held to $GPUFLOW_HOME/unreported; return how many."""
        return self._spill_oldest(None)

    def _spill_oldest(self, limit_bytes: int | None) -> int:
        taken: dict[str, list[bytes]] = {}
        count = moved = 0
        with self._lock:
            while self._held and (limit_bytes is None or moved < limit_bytes):
                _, run_id, body = self._held.popleft()
                taken.setdefault(run_id, []).append(body)
                moved += len(body)
                count += 1
            self._bytes -= moved
            if not self._held:
                self._idle.set()
        for run_id, bodies in taken.items():
            if not run_id:
                continue
            try:
                spill_logs(run_id, self.api_url, bodies)
            except OSError as exc:
                count -= len(bodies)
                self.say(f"{len(bodies)} log lines of run {run_id} are lost: {exc.strerror or exc}")
        return count

    def _batch(self) -> tuple[int, list[bytes]]:
        """Return the oldest held logs, up to BATCH_BYTES, and the number of the last."""
        with self._lock:
            batch: list[bytes] = []
            size, last = 0, -1
            for number, _, body in self._held:
                if batch and size + len(body) > BATCH_BYTES:
                    break
                batch.append(body)
                size += len(body)
                last = number
            return last, batch

    def _send_loop(self) -> None:
        backoff = 0.5
        while not self._closing:
            self._wake.wait(1.0)
            self._wake.clear()
            while True:
                last, batch = self._batch()
                if not batch:
                    break
                try:
                    response = self._client.request(
                        "POST",
                        "/logs/",
                        content=b"[" + b",".join(batch) + b"]",
                        headers={"Content-Type": "application/json"},
                    )
                    response.raise_for_status()
                except Exception:
                    self.failures += 1
                    if self._closing:
                        return
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                backoff = 0.5
                with self._lock:  # (some of the batch may have been spilled meanwhile)
                    while self._held and self._held[0][0] <= last:
                        self._bytes -= len(self._held.popleft()[2])
                    if not self._held:
                        self._idle.set()
