"""gpuflow's Python API: GPU jobs from a Prefect user's own flows.

Called inside a flow, `gpu_job` runs the whole pipeline (provision, preflight, run,
collect, teardown) as a subflow of it, shown as one in the UI; `gpu_jobs` fans several out
at once, each its own subflow, and waits on all of them. Called outside any flow, a job
runs as its own flow run, against the Prefect API `gpuflow run` would use (PREFECT_API_URL,
the local platform, or a temporary API).

A spec is a JobSpec built from the same typed models the YAML uses, a dict, or a YAML/JSON
file's path; a mistake in it is InvalidSpec, one sentence naming the field, before anything
is made. A job that fails raises the error the CLI maps to its exit code (JobFailed,
PreflightFailed, ...), or with `return_state=True` returns Prefect's state instead; either
way what the job held is torn down.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import import_module
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from gpuflow.tasks.errors import GpuflowError, InvalidSpec, JobCancelled
from gpuflow.tasks.metrics.summary import RunMetrics
from gpuflow.tasks.pipeline import plugins as _plugins  # noqa: F401 - kinds and backends are read
from gpuflow.tasks.spec import JobSpec, load_spec

SpecLike = JobSpec | Mapping[str, Any] | str | os.PathLike[str]

__all__ = ["JobRun", "gpu_job", "gpu_job_async", "gpu_jobs", "job_spec", "offers"]


class JobRun(BaseModel):
    """What one GPU job came to: its flow run, how it ended, what it measured and cost,
    where its artifacts are and its page in the Prefect UI."""

    name: str
    flow_run_id: str
    state: str  # Prefect's state name: Completed, Failed, Cancelled, Crashed
    exit_code: int | None = None
    metrics: RunMetrics | None = None
    artifacts_dir: Path | None = None
    url: str | None = None  # None where the API has no UI (a temporary API)

    @property
    def gpu_hours(self) -> float:
        return self.metrics.gpu_hours if self.metrics else 0.0

    @property
    def cost_usd(self) -> float:
        return self.metrics.cost_usd if self.metrics else 0.0

    @property
    def gpu_util_mean(self) -> float | None:
        return self.metrics.gpu_util_mean if self.metrics else None


def job_spec(spec: SpecLike) -> JobSpec:
    """Return `spec` as a validated JobSpec: a JobSpec, a dict, or a YAML/JSON file's path.
    InvalidSpec, one sentence, for anything else or a mistake in it."""
    if isinstance(spec, JobSpec):
        return spec
    if isinstance(spec, os.PathLike | str):
        path = Path(spec)
        if not path.is_file():
            raise InvalidSpec(
                f"spec: {str(spec)!r} is not a file; give the path of a job's YAML, a dict, or"
                " a JobSpec."
            )
        return load_spec(path)
    if isinstance(spec, Mapping):
        return load_spec(dict(spec))
    raise InvalidSpec(
        f"spec: a {type(spec).__name__} is not a job spec; give a JobSpec, a dict or the path"
        " of a job's YAML."
    )


def checked(spec: JobSpec) -> JobSpec:
    """Return the spec with its placement applied, once every check before provisioning
    passed (InvalidSpec otherwise)."""
    from gpuflow.tasks.pipeline.checks import check_spec

    spec, _ = check_spec(spec)
    return spec


def flow_for(spec: JobSpec) -> Any:
    """Return the Prefect flow that runs the spec's kind: its own, else gpu_pipeline."""
    from gpuflow.tasks.kinds.registry import kind_of

    where = kind_of(spec).flow or "gpuflow.flows.pipeline:gpu_pipeline"
    module, name = where.split(":")
    return getattr(import_module(module), name)


def gpu_job(spec: SpecLike, *, return_state: bool = False) -> JobRun | Any:
    """Run one GPU job through the pipeline and return what it came to.

    Inside a flow it is a subflow of that flow; outside any, a flow run of its own. A job
    that does not complete raises its error (InvalidSpec, PreflightFailed, JobFailed,
    JobCancelled, ...) unless `return_state` is True, which returns the Prefect state.

    Examples:
        >>> from gpuflow import gpu_job, JobSpec, CommandJob, Resources
        >>> run = gpu_job(JobSpec(name="hello", job=CommandJob(command=["nvidia-smi"]),
        ...                       resources=Resources(gpus=1)))
        >>> run.state, run.exit_code, run.gpu_hours
    """
    from gpuflow.tasks.runscope import run_scope

    job = job_spec(spec)
    with run_scope(), _api_for_a_run(), _sentences_on_console():
        state = _run(job)
    return state if return_state else outcome(state)


async def gpu_job_async(spec: SpecLike, *, return_state: bool = False) -> JobRun | Any:
    """`gpu_job` for async flows: the job runs on a worker thread (as a subflow of the
    calling flow), so the event loop goes on; gather several to run them at once."""
    job = job_spec(spec)
    context = contextvars.copy_context()
    return await asyncio.to_thread(context.run, gpu_job, job, return_state=return_state)


def gpu_jobs(
    specs: Sequence[SpecLike], *, return_state: bool = False, at_once: int | None = None
) -> list[JobRun | Any]:
    """Run several GPU jobs at once, each its own subflow, and wait on all of them; return
    their outcomes in the order given. `at_once` caps how many run together (default:
    all); the GPUs themselves are shared out by each backend (on this machine, the `gpu`
    concurrency limit and GPU claims). Every spec is checked before any job starts; once
    all have ended, the first failure is raised unless `return_state` is True."""
    if isinstance(specs, str | bytes | os.PathLike | Mapping | JobSpec):
        raise InvalidSpec(
            f"specs: gpu_jobs takes a list of specs, not one {type(specs).__name__}; give"
            " [spec], or call gpu_job(spec)."
        )
    if at_once is not None and (isinstance(at_once, bool) or not isinstance(at_once, int)):
        raise InvalidSpec(
            f"at_once: {at_once!r} is not a whole number; give how many jobs run together"
            " (1 or more), or None for all."
        )
    if at_once is not None and at_once < 1:
        raise InvalidSpec(f"at_once: {at_once} is below 1; give at least 1, or None for all.")
    from gpuflow.tasks.runscope import Scope

    jobs = [job_spec(s) for s in specs]
    if not jobs:
        return []
    with (
        _api_for_a_run(),
        _sentences_on_console(),
        ThreadPoolExecutor(
            max_workers=min(at_once or len(jobs), len(jobs)), thread_name_prefix="gpuflow-job"
        ) as pool,
    ):
        scopes = [Scope() for _ in jobs]  # a run each: checked in it now, run in it later
        jobs = [_checked_in(scope, job) for scope, job in zip(scopes, jobs, strict=True)]
        futures = [
            pool.submit(contextvars.copy_context().run, _run_in, scope, job)
            for scope, job in zip(scopes, jobs, strict=True)
        ]
        states = [f.result() for f in futures]
    if return_state:
        return states
    return [outcome(state) for state in states]


def offers(spec: SpecLike) -> list[tuple[Any, list[Any]]]:
    """Ask every candidate of the spec's placement what it could give the job now (nothing
    is made): a list of (candidate, its offers), candidates in the order the spec's policy
    would try them. A candidate that cannot be asked says why in `candidate.error`."""
    from gpuflow.tasks.pipeline.checks import check_pool
    from gpuflow.tasks.pipeline.failover import offers_of
    from gpuflow.tasks.pipeline.pool import order

    job = job_spec(spec)
    with _api_for_a_run(needed=_needs_api(job)):
        asked = offers_of(check_pool(job))
    ranked = order(job.placement_policy.choose, [c for c, _ in asked])
    found = {c.index: listed for c, listed in asked}
    return [(c, found[c.index]) for c in ranked]


def outcome(state: Any) -> JobRun:
    """Return the JobRun of a finished job's state; raise its error when it did not
    complete."""
    # _sync: in a worker thread of an async flow Prefect would hand back a coroutine
    if state.is_completed():
        result = state.result(_sync=True)
        return JobRun(
            name=result.name,
            flow_run_id=result.flow_run_id,
            state=state.name,
            exit_code=result.exit_code,
            metrics=result.metrics,
            artifacts_dir=Path(result.artifacts_dir),
            url=_link(result.flow_run_id),
        )
    error = state.result(raise_on_failure=False, _sync=True)
    if isinstance(error, BaseException):
        raise error
    if state.is_cancelled():
        raise JobCancelled(state.message or "the run was cancelled")
    raise GpuflowError(f"the run ended {state.name}: {state.message or 'no reason given'}")


def _run(job: JobSpec) -> Any:
    """Run `job` through its kind's flow; return the state it ended in."""
    return flow_for(job)(checked(job), return_state=True)


def _checked_in(scope: Any, job: JobSpec) -> JobSpec:
    with scope:
        return checked(job)


def _run_in(scope: Any, job: JobSpec) -> Any:
    with scope:
        return _run(job)


def _needs_api(job: JobSpec) -> bool:
    from gpuflow.tasks import placement

    return placement.needs_api(job)


def _in_a_flow() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


@contextlib.contextmanager
def _api_for_a_run(needed: bool = True) -> Iterator[None]:
    """Inside a flow: nothing to do, the flow's API is used. Outside any: the API `gpuflow
    run` would use (PREFECT_API_URL, the local platform, else a temporary API kept for the
    next command), chosen once and set for this process while the job runs."""
    if not needed:
        yield
        return
    if _in_a_flow():
        _say_where_the_flow_records()
        yield
        return
    from gpuflow.session import say, settings_checked
    from gpuflow.tasks.host import secure_home
    from gpuflow.tasks.platform import api as prefect_api

    secure_home()
    settings_checked()
    chosen = prefect_api.choose(say)
    with prefect_api.using(chosen):
        yield


_SAID: set[str] = set()  # what a process was told once about its flows' API


def _say_where_the_flow_records() -> None:
    """Say, once a process, that a running local platform is not the API this flow uses."""
    from prefect.settings import PREFECT_API_URL

    from gpuflow.session import say
    from gpuflow.tasks.platform import api as prefect_api

    sentence = prefect_api.platform_elsewhere(PREFECT_API_URL.value(), in_a_flow=True)
    if sentence and sentence not in _SAID:
        _SAID.add(sentence)
        say(sentence)


def _link(flow_run_id: str) -> str | None:
    """Return the run's page in the Prefect UI, where the API has one."""
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}" if ui else None


_CONSOLE_LOCK = threading.Lock()
_console: list[Any] = []  # the context that formats the console, while jobs run


@contextlib.contextmanager
def _sentences_on_console() -> Iterator[None]:
    """While any job runs, the console shows gpuflow's errors as their one sentence (the
    run's log in Prefect keeps the traceback); jobs on several threads share one."""
    from gpuflow.session import sentences_on_console

    with _CONSOLE_LOCK:
        if not _console:
            entered = sentences_on_console()
            entered.__enter__()
            _console.append(entered)
        _console.append(None)
    try:
        yield
    finally:
        with _CONSOLE_LOCK:
            _console.pop()
            if len(_console) == 1:
                _console.pop().__exit__(None, None, None)
