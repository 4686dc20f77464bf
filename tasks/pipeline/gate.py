"""Admission before a run takes GPUs: the pipeline asks a run's gate (if its platform set
one: tasks/platform/admission.py) to wait until the run may hold its GPUs, checks while
the job runs whether it must give them back (its stop check), and hands them back when
asked or done. The pipeline knows only this protocol; quotas and fair sharing are the
platform's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

from gpuflow.tasks.errors import GpuflowError


class Gate(Protocol):
    def wait(self, stop: Callable[[], bool]) -> None:
        """Return once the run may hold its GPUs; JobCancelled when `stop()` says the run
        was cancelled while it waited."""

    def must_yield(self) -> bool:
        """Return True when the run must give its GPUs back (cheap: called often)."""

    def requeue(self) -> None:
        """The run gave its GPUs back: it waits again, in its place."""

    def release(self) -> None:
        """The run holds and waits for nothing any more (idempotent)."""


class QuotaYield(GpuflowError):
    """The run's job was stopped (its grace, a checkpoint, exit 75) to give borrowed GPUs
    back: it waits in its queue again and resumes when admitted. Not retried in place."""


_GATES: dict[str, Gate] = {}


@contextlib.contextmanager
def gated(run_id: str, gate: Gate | None) -> Iterator[None]:
    """Let the pipeline's stages find `gate` for `run_id` until this ends, then release it."""
    if gate is None:
        yield
        return
    _GATES[run_id] = gate
    try:
        yield
    finally:
        _GATES.pop(run_id, None)
        gate.release()


def gate_of(run_id: str) -> Gate | None:
    return _GATES.get(run_id)


def must_yield(run_id: str) -> bool:
    gate = _GATES.get(run_id)
    return gate is not None and gate.must_yield()
