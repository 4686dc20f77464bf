"""The Prefect API going away while `gpuflow run` runs a flow in this process.

The job keeps running: nothing the job does needs the API. Prefect's client retries the
engine's calls (about a minute each); the run's logs wait in gpuflow's log relay
(gpuflow/logrelay.py) until the API takes them. Once the API has been away for longer than
GPUFLOW_API_OUTAGE_S (default 120 s) and no unit of the job runs any more, waiting longer
helps nobody: the watch tears down what the run holds, keeps its logs and remembers the
run, says so in one sentence and ends the command. The next gpuflow command (or `gpuflow
reap`) delivers the logs and marks the run Crashed once the API is back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from gpuflow.tasks.host import env_number
from gpuflow.tasks.pipeline import inflight
from gpuflow.tasks.pipeline.inflight import snapshot
from gpuflow.tasks.pipeline.stages import keep_outputs, teardown_owned, unreadable
from gpuflow.tasks.platform.api import health_error
from gpuflow.tasks.platform.reap import record_unreported

EXIT_FAILED = 1


def outage_bound_s() -> float:
    """Return how long the API may be away before a run that no longer runs gives up."""
    return env_number("GPUFLOW_API_OUTAGE_S", 120.0, 1.0, 7 * 86400.0)


class OutageWatch:
    """Checks the API's health every `every_s` on a thread of its own while a flow runs
    here; see the module's text for what it does when the API stays away."""

    def __init__(
        self,
        api: Any,
        say: Callable[[str], None],
        fail: Callable[[str], None],
        bound_s: float,
        keep_logs: Callable[[], int] = lambda: 0,
        every_s: float = 2.0,
    ) -> None:
        self.api, self.say, self.fail, self.keep_logs = api, say, fail, keep_logs
        self.bound_s, self.every_s = bound_s, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="api-outage")

    def __enter__(self) -> OutageWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every_s + 10)

    def _watch(self) -> None:
        url = self.api.url
        down_since: float | None = None
        first = ""
        while not self._stop.wait(self.every_s):
            problem = health_error(url, timeout_s=max(1.0, self.every_s))
            if problem is None:
                if down_since is not None:
                    away = time.monotonic() - down_since
                    self.say(f"the Prefect API answers again after {away:.0f} s")
                    logging.raiseExceptions = True
                down_since = None
                continue
            if down_since is None:
                down_since, first = time.monotonic(), problem
                # Prefect's log handler would print each failed batch: this line says it once.
                logging.raiseExceptions = False
                self.say(
                    f"the Prefect API at {url} does not answer ({problem}); the job goes on,"
                    f" and gpuflow waits up to {self.bound_s:.0f} s for the API once it ends"
                )
            runs, units = snapshot()
            if units or time.monotonic() - down_since < self.bound_s or self._stop.is_set():
                continue
            self._give_up(runs, first, time.monotonic() - down_since)
            return

    def _give_up(self, runs: dict[str, Any], problem: str, away_s: float) -> None:
        since = datetime.fromtimestamp(time.time() - away_s).strftime("%H:%M:%S")
        why = f"the Prefect API at {self.api.url} stopped answering at {since} ({problem})"
        for run_id, placements in runs.items():
            record = inflight.recorded(run_id)
            for placement in placements:  # a pool's: each candidate it may have used
                try:
                    if record is not None:  # what the job wrote, first (no API: no secrets
                        # to mask with, so the summaries' files show nothing)
                        for line in keep_outputs(
                            placement, run_id, Path(record.artifacts), unreadable
                        ):
                            self.say(line)
                    teardown_owned(placement, run_id)
                except Exception as exc:  # what is left, the reaper finds by its labels
                    self.say(f"teardown of run {run_id} failed ({type(exc).__name__}: {exc})")
            record_unreported(run_id, self.api.url, why)
            inflight.forget(run_id)  # dealt with here: reap marks it through `unreported`
        kept = self.keep_logs()
        self.fail(
            f"{why} and did not come back within {self.bound_s:.0f} s; the job had ended and"
            f" what the run held was torn down ({kept} log lines kept). The run stays Running in"
            " that API until it answers again: the next gpuflow command, or `gpuflow reap`,"
            " then delivers its logs and marks it Crashed."
        )
        os._exit(EXIT_FAILED)  # the engine's own calls would retry for minutes more
