"""What this process has under way: the runs it orchestrates (and where they are placed)
and how many of their units run now. A watch that must never act while a job runs (the
API outage watch of `gpuflow run`) reads it from another thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from gpuflow.tasks.spec import Placement

_LOCK = threading.Lock()
_RUNS: dict[str, tuple[Placement, ...]] = {}
_UNITS = [0]


@contextlib.contextmanager
def run_in_flight(run_id: str, *placements: Placement) -> Iterator[None]:
    """Note a run this process orchestrates and where it may be placed, until it ends."""
    with _LOCK:
        _RUNS[run_id] = placements
    try:
        yield
    finally:
        with _LOCK:
            _RUNS.pop(run_id, None)


@contextlib.contextmanager
def unit_running() -> Iterator[None]:
    """Note a unit of a job that runs now (a backend's run call), until it ends."""
    with _LOCK:
        _UNITS[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _UNITS[0] -= 1


def snapshot() -> tuple[dict[str, tuple[Placement, ...]], int]:
    """Return the runs under way and how many units run now."""
    with _LOCK:
        return dict(_RUNS), _UNITS[0]
