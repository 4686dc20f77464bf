"""A job's output lines on their way to the console and the run's log: in order, in batches.

One log record costs Prefect's console and API handlers about half a millisecond, so a
record per line caps a chatty job at ~2,000 lines/s and the pipe backs up. The batcher
joins the lines that arrive within `max_delay_s` (up to `max_bytes`) into one record,
keeping their order across stdout and stderr, and hands everything on before `close`
returns. Prefect's console handler colours every number of a record (about 80,000
lines/s at best), so job output goes to the console as it is, and to the API alone.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any


class LineBatcher:
    """Collects lines from any thread; `emit` gets them joined by newlines, in order."""

    def __init__(
        self,
        emit: Callable[[str], None],
        max_delay_s: float = 0.25,
        max_bytes: int = 256 * 1024,
    ) -> None:
        self._emit = emit
        self._max_delay_s = max_delay_s
        self._max_bytes = max_bytes
        self._lines: list[str] = []
        self._size = 0
        self._lock = threading.Lock()  # guards the buffer
        self._emitting = threading.Lock()  # keeps batches in order
        self._closed = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="gpuflow-log-batches", daemon=True)
        self._ticker.start()

    def add(self, line: str) -> None:
        """Queue one line; a full batch is handed on at once (by this thread)."""
        with self._lock:
            self._lines.append(line)
            self._size += len(line) + 1
            full = self._size >= self._max_bytes
        if full:
            self.flush()

    def flush(self) -> None:
        """Hand on whatever is queued, now."""
        with self._emitting:
            with self._lock:
                lines, self._lines, self._size = self._lines, [], 0
            if lines:
                self._emit("\n".join(lines))

    def close(self) -> None:
        """Stop the ticker and hand on the rest; later lines are handed on one by one."""
        self._closed.set()
        self._ticker.join()
        self.flush()
        self._max_bytes = 0

    def _tick(self) -> None:
        while not self._closed.wait(self._max_delay_s):
            self.flush()

    def __enter__(self) -> LineBatcher:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def job_output_sink(run_logger: Any) -> Callable[[str], None]:
    """Return where a batch of the job's lines goes: this process's stdout as the job wrote
    them, and the run's log in the API (through a logger that skips the console)."""
    from prefect.logging.handlers import APILogHandler
    from prefect.logging.loggers import PrefectLogAdapter

    api_only = logging.getLogger("gpuflow.job_output")
    if not any(isinstance(h, APILogHandler) for h in api_only.handlers):
        api_only.addHandler(APILogHandler())
        api_only.setLevel(logging.INFO)
        api_only.propagate = False
    to_api = PrefectLogAdapter(api_only, extra=dict(run_logger.extra))

    def emit(text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        to_api.info("%s", text)

    return emit
