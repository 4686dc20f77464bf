"""What this process has under way: the runs it orchestrates (and where they are placed)
and how many of their units run now. A watch that must never act while a job runs (the
API outage watch of `gpuflow run`) reads it from another thread.

Each run is also recorded on disk (GPUFLOW_HOME/inflight/<run id>.json) from its first
moment, before its folder is packed or anything is provisioned, until it ends: a gpuflow
killed at any stage leaves the record, and `gpuflow reap` finds the run by it (keeps what
its job wrote, marks it Crashed, removes what the dead process half-wrote)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import psutil
from pydantic import BaseModel

from gpuflow.tasks.host import (
    StateFileError,
    alive,
    gpuflow_home,
    read_state_json,
    state_records,
    write_atomic,
)
from gpuflow.tasks.spec import Placement, PlacementSection


class InFlight(BaseModel):
    """A run a gpuflow process orchestrates, as recorded on disk."""

    run_id: str
    pid: int
    started: float  # the process's start time: a reused PID is not it
    api_url: str | None = None  # the Prefect API that records the run
    artifacts: str  # where its artifacts (and what a reap keeps) go
    # each read as its backend's own model: a fleet's name, a namespace, kept
    placements: list[Annotated[Placement, PlacementSection]]
    secret_env: dict[str, str] = {}  # the secrets' names (never their values): to mask them


def records_dir() -> Path:
    return gpuflow_home() / "inflight"


def recorded(run_id: str) -> InFlight | None:
    """Return the record of `run_id` this machine keeps, or None."""
    try:
        data = read_state_json(records_dir() / f"{run_id}.json")
        return None if data is None else InFlight.model_validate(data)
    except (StateFileError, ValueError):
        return None


def forget(run_id: str) -> None:
    """Remove the record of `run_id`: its gpuflow has dealt with what it left."""
    (records_dir() / f"{run_id}.json").unlink(missing_ok=True)


def orphans() -> list[tuple[Path, InFlight]]:
    """Return the recorded runs whose gpuflow process is gone (killed, or its machine
    rebooted), with their records' paths."""
    found = []
    for path, data in state_records(records_dir()):
        try:
            run = InFlight.model_validate(data)
        except ValueError:
            continue
        if not alive(run.pid, run.started):
            found.append((path, run))
    return found


_LOCK = threading.Lock()
_RUNS: dict[str, tuple[Placement, ...]] = {}
_UNITS = [0]


@contextlib.contextmanager
def run_in_flight(
    run_id: str,
    *placements: Placement,
    artifacts: Path | None = None,
    secret_env: dict[str, str] | None = None,
) -> Iterator[None]:
    """Note a run this process orchestrates and where it may be placed, until it ends;
    with `artifacts`, on disk too (see the module's words)."""
    with _LOCK:
        _RUNS[run_id] = placements
    record = records_dir() / f"{run_id}.json"
    if artifacts is not None:
        made = InFlight(
            run_id=run_id,
            pid=os.getpid(),
            started=psutil.Process().create_time(),
            api_url=os.environ.get("PREFECT_API_URL"),
            artifacts=str(artifacts),
            placements=list(placements),
            secret_env=dict(secret_env or {}),
        )
        write_atomic(record, made.model_dump_json())
    try:
        yield
    finally:
        with _LOCK:
            _RUNS.pop(run_id, None)
        if artifacts is not None:
            record.unlink(missing_ok=True)


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
