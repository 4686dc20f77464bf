"""One exception hierarchy; retry policies key on these classes, never on strings."""

from __future__ import annotations

from typing import Any

# A job that saved its state and exited because it was told to stop (SIGTERM,
# spot notice) exits with this code; the pipeline retries it instead of failing.
PREEMPTED_EXIT_CODE = 75
# A job that fails may explain why in one sentence in $GPUFLOW_OUTPUT_DIR/error.txt;
# the pipeline shows that instead of the last lines of the log.
ERROR_FILE = "error.txt"


class GpuflowError(Exception):
    """Base class: the message is one sentence a user can act on."""

    retryable = False


class InvalidSpec(GpuflowError):
    """The user's input is wrong; nothing was provisioned."""


class InvalidValue(InvalidSpec, ValueError):
    """A spec's section built with a wrong value (`Resources(gpus=-1)`, `model_validate`):
    the sentence of InvalidSpec, and the ValueError pydantic's own error is."""


class ProvisionError(GpuflowError):
    """The backend could not make the resources for a reason retrying won't fix."""


class CapacityError(GpuflowError):
    """No GPUs (or concurrency slots) are free right now; worth retrying later."""

    retryable = True


class TransientError(GpuflowError):
    """A network or API hiccup; worth retrying."""

    retryable = True


class Unreachable(TransientError):
    """A service a placement needs (a cloud's API, a cluster) did not answer; the message
    names it and the real cause. In a placement list it makes that candidate one that
    cannot start, not a refusal of the job."""


class PreflightFailed(GpuflowError):
    """The host cannot run this job as asked (no GPU, driver too old, disk full)."""


class JobFailed(GpuflowError):
    """The job itself failed deterministically (non-zero exit, timeout)."""


class JobCancelled(GpuflowError):
    """Someone cancelled the run (Prefect UI, API, CLI) while the job ran; it was stopped."""


class PreemptedError(GpuflowError):
    """The job was interrupted and saved its state; rerunning resumes it."""

    retryable = True


class CollectError(GpuflowError):
    """Metrics or artifacts could not be gathered after the job ran."""


def is_retryable(exc: BaseException | None) -> bool:
    """Return True when the error class says a retry may succeed."""
    return isinstance(exc, GpuflowError) and exc.retryable


def retry_when_retryable(task: Any, task_run: Any, state: Any) -> bool:
    """A Prefect retry condition: retry a task only when its exception says a retry may
    succeed (`is_retryable`)."""
    try:
        state.result()
    except Exception as exc:
        return is_retryable(exc)
    return False


def retry_unless(*moved: type[Exception]) -> Any:
    """Return a Prefect retry condition like `retry_when_retryable` that does not retry the
    errors of `moved`: a pool hands those to its next candidate instead."""

    def condition(task: Any, task_run: Any, state: Any) -> bool:
        try:
            state.result()
        except Exception as exc:
            return is_retryable(exc) and not isinstance(exc, moved)
        return False

    return condition
