"""A run's stop checks: cancelled in the API (one poll thread per run, whatever its units)
or stopped by its idle watch (limits.idle_gpu with action stop)."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable

from gpuflow.tasks.metrics.idle import watch_of
from gpuflow.tasks.pipeline.gate import must_yield
from gpuflow.tasks.runscope import once


class CancelRequested:
    """A check, cheap to call often, that says whether the run was cancelled in the API
    (UI, `prefect flow-run cancel`): a run started by `gpuflow run` has no worker to kill
    it, so the run stage stops the job itself. The API is asked on a thread of its own:
    an API that is away or slow (its client retries for a minute) never holds up the loop
    that follows the job. The thread ends once the check is no longer called, and starts
    again when it is (a retry after a pause): one thread per run, whatever its units."""

    def __init__(self, flow_run_id: str, every_s: float = 2.0) -> None:
        self.flow_run_id, self.every_s = flow_run_id, every_s
        self.cancelled = threading.Event()
        self.last_called = time.monotonic()
        self.lock = threading.Lock()
        self.context = contextvars.copy_context()  # the API this run uses (settings are context)
        self.thread: threading.Thread | None = None
        self._start()

    def _start(self) -> None:
        self.thread = threading.Thread(
            target=self.context.copy().run, args=(self._poll,), daemon=True, name="cancel-check"
        )
        self.thread.start()

    def _poll(self) -> None:
        from uuid import UUID

        from prefect.client.schemas.objects import StateType

        from gpuflow.tasks.api_client import api_client

        while time.monotonic() - self.last_called < 5 * self.every_s + 10:
            time.sleep(self.every_s)
            try:
                with api_client() as client:
                    state = client.read_flow_run(UUID(self.flow_run_id)).state
            except Exception:  # the API being away is no reason to stop a job
                continue
            if state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED):
                self.cancelled.set()
                return

    def __call__(self) -> bool:
        with self.lock:
            self.last_called = time.monotonic()
            if (
                not self.cancelled.is_set()
                and self.thread is not None
                and not self.thread.is_alive()
            ):
                self._start()
        return self.cancelled.is_set()


def cancel_requested(flow_run_id: str, every_s: float = 2.0) -> Callable[[], bool]:
    """Return the run's CancelRequested check: one per run (tasks/runscope.py)."""
    return once(("cancel-check", flow_run_id), lambda: CancelRequested(flow_run_id, every_s))


def stop_check(flow_run_id: str) -> Callable[[], bool]:
    """Return the run stage's stop check: the run was cancelled in the API, its idle
    watch (limits.idle_gpu with action stop) says so, or its gate asks for its GPUs back."""
    cancelled = cancel_requested(flow_run_id)

    def check() -> bool:
        watch = watch_of(flow_run_id)
        stopped = watch is not None and watch.stopped()
        return stopped or cancelled() or must_yield(flow_run_id)

    return check


def idle_stop(flow_run_id: str) -> str | None:
    """Return why the idle watch stopped this run's job, if it did."""
    watch = watch_of(flow_run_id)
    return watch.sentence() if watch is not None and watch.stopped() else None
