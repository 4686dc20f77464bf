"""IdleWatch: a sampler consumer that notices a job holding GPUs it does not use.

The job is idle while every GPU it holds is under `below_pct`; once that has lasted
`for`, the watch warns (a log line and the Prefect event gpuflow.gpu.idle) and, with
action stop, asks the run stage to stop the job. A busy sample re-arms it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from gpuflow.tasks.api_client import emit_run_event
from gpuflow.tasks.spec import IdleGpu

logger = logging.getLogger(__name__)

IDLE_EVENT = "gpuflow.gpu.idle"
_WATCHES: dict[str, IdleWatch] = {}  # flow run id -> its watch, for stages in other tasks
_lock = threading.Lock()


class IdleWatch:
    def __init__(
        self,
        limit: IdleGpu,
        flow_run_id: str,
        job: str,
        warn: Callable[..., None],
        emit: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.limit = limit
        self.flow_run_id = flow_run_id
        self.job = job
        self.warn = warn
        self.emit = emit if emit is not None else send_idle_event
        self.idle_since: float | None = None
        self.warnings = 0
        self.stop_requested = threading.Event()
        self.reason = ""
        self._fired = False

    def __call__(self, sample: dict[str, Any]) -> None:
        utils = [g["DCGM_FI_DEV_GPU_UTIL"] for g in sample["gpus"] if "DCGM_FI_DEV_GPU_UTIL" in g]
        if not utils:
            return  # no GPU seen: nothing to judge
        now = sample["t"]
        if max(utils) >= self.limit.below_pct:
            self.idle_since, self._fired = None, False
            return
        if self.idle_since is None:
            self.idle_since = now
        idle_s = now - self.idle_since
        if self._fired or idle_s < self.limit.for_:
            return
        self._fired = True
        self.warnings += 1
        gpus = ", ".join(str(g["gpu"]) for g in sample["gpus"])
        self.reason = (
            f"its GPUs ({gpus}) were under {self.limit.below_pct:g}% busy for {idle_s:.0f} s"
            f" (limits.idle_gpu: below_pct {self.limit.below_pct:g}, for {self.limit.for_:g} s)"
        )
        stopping = self.limit.action == "stop"
        self.warn(
            "idle GPUs: %s; %s",
            self.reason,
            "stopping the job" if stopping else "the job goes on (action: warn)",
        )
        self.emit(
            {
                "flow_run_id": self.flow_run_id,
                "job": self.job,
                "gpus": [g["gpu"] for g in sample["gpus"]],
                "hostname": sample.get("Hostname", ""),
                "idle_s": round(idle_s, 1),
                "below_pct": self.limit.below_pct,
                "for_s": self.limit.for_,
                "action": self.limit.action,
            }
        )
        if stopping:
            self.stop_requested.set()

    def stopped(self) -> bool:
        return self.stop_requested.is_set()

    def sentence(self) -> str:
        return (
            f"the job was stopped because {self.reason}; make the job use its GPUs, ask for"
            " fewer, or raise limits.idle_gpu.for."
        )

    def __enter__(self) -> IdleWatch:
        with _lock:
            _WATCHES[self.flow_run_id] = self
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            if _WATCHES.get(self.flow_run_id) is self:
                del _WATCHES[self.flow_run_id]


def watch_of(flow_run_id: str) -> IdleWatch | None:
    """Return the watch of a run whose run stage is sampling here, if it has one."""
    with _lock:
        return _WATCHES.get(flow_run_id)


def send_idle_event(payload: dict[str, Any]) -> None:
    """Send gpuflow.gpu.idle about the run in `payload` (flow_run_id, job, ...) to Prefect,
    from a run's own watch or the fleet's reclaim; an API away costs only the event."""
    run_id = payload["flow_run_id"]
    if not emit_run_event(IDLE_EVENT, f"gpuflow.run.{run_id}", payload["job"], run_id, payload):
        logger.warning("the %s event was not sent", IDLE_EVENT)
