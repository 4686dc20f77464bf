"""Profiling a window of training steps on rank 0 with torch.profiler: a Chrome trace
(openable in Perfetto or chrome://tracing), the operators that took the most time, and
each recorded step split into waiting for data and computing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROFILE_DIR = "profile"
TOP_OPERATORS = 15


class StepProfiler:
    """Use as a context manager around the loop and call `step` after every optimiser step."""

    def __init__(self, wait: int, warmup: int, active: int, outputs: Path, cuda: bool) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.folder = outputs / PROFILE_DIR
        self.cuda = cuda
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.profiler = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._ready,
        )
        self.first = wait + warmup
        self.last = self.first + active
        self.index = 0
        self.steps: list[dict[str, Any]] = []

    def __enter__(self) -> StepProfiler:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.profiler.__exit__(*exc)
        (self.folder / "steps.json").write_text(json.dumps(self.steps, indent=1))

    def step(self, step: int, data_wait_s: float, total_s: float) -> None:
        """Record one optimiser step's split (when it is in the window) and move on."""
        if self.first <= self.index < self.last:
            self.steps.append(
                {
                    "step": step,
                    "data_wait_ms": round(data_wait_s * 1000, 3),
                    "compute_ms": round(max(0.0, total_s - data_wait_s) * 1000, 3),
                }
            )
        self.index += 1
        self.profiler.step()

    def _ready(self, profiler: Any) -> None:
        profiler.export_chrome_trace(str(self.folder / "trace.json"))
        events = profiler.key_averages()

        def device_us(event: Any) -> float:
            return float(getattr(event, "self_device_time_total", 0) or 0)

        top = sorted(events, key=lambda e: e.self_cpu_time_total + device_us(e), reverse=True)[
            :TOP_OPERATORS
        ]
        rows = [
            {
                "operator": e.key,
                "calls": e.count,
                "self_cpu_ms": round(e.self_cpu_time_total / 1000, 3),
                "self_device_ms": round(device_us(e) / 1000, 3),
            }
            for e in top
        ]
        (self.folder / "top_operators.json").write_text(json.dumps(rows, indent=1))


def read(outputs: Path) -> tuple[list[dict], list[dict]] | None:
    """Return (top operators, steps) a profiled run left in `outputs`, else None."""
    folder = outputs / PROFILE_DIR
    if not (folder / "top_operators.json").is_file():
        return None
    steps = folder / "steps.json"
    return (
        json.loads((folder / "top_operators.json").read_text()),
        json.loads(steps.read_text()) if steps.is_file() else [],
    )
