"""The run stage: the job's units on the run's backend under its limits (time, budget,
idle GPUs), stop checks (cancelled in the API) and secrets, with the sampler on.

Retries key on error classes: the run task is retried only when its exception says a
retry may succeed (PreemptedError, TransientError).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from gpuflow.tasks import secrets
from gpuflow.tasks.backends.base import AddsNodes, Backend, ServesReplicas
from gpuflow.tasks.backends.registry import backend_for
from gpuflow.tasks.contract import (
    Cluster,
    JobResult,
    LineSink,
    Replicated,
    RunOutcome,
    StopCheck,
    WorkUnit,
    cluster_env,
)
from gpuflow.tasks.errors import (
    ERROR_FILE,
    PREEMPTED_EXIT_CODE,
    PreemptedError,
    ProvisionError,
    retry_unless,
)
from gpuflow.tasks.kinds.registry import kind_of
from gpuflow.tasks.logstream import LineBatcher, job_output_sink
from gpuflow.tasks.metrics import cost as pricing
from gpuflow.tasks.metrics.logmetrics import LogMetrics, rows_file
from gpuflow.tasks.metrics.prometheus import LiveLogPush
from gpuflow.tasks.pipeline.costs import hourly_paid
from gpuflow.tasks.pipeline.failure import failure_context, failure_sentence
from gpuflow.tasks.pipeline.gate import QuotaYield, must_yield
from gpuflow.tasks.pipeline.inflight import unit_running
from gpuflow.tasks.pipeline.sampling import sampling
from gpuflow.tasks.pipeline.stages import retrying
from gpuflow.tasks.pipeline.stopping import idle_stop, stop_check
from gpuflow.tasks.pipeline.usercode import started
from gpuflow.tasks.spec import JobSpec
from gpuflow.tasks.storage import S3Settings, s3_settings


class JobEnvironment:
    """What every unit of a run gets, built once per run: the spec's variables, its
    secrets and, when the spec names a credentials block, storage's; the storage settings
    the run uses; and a redactor that masks every secret among them."""

    def __init__(self, spec: JobSpec) -> None:
        secret_values = secrets.resolve(spec.secret_env)
        self.storage: S3Settings = s3_settings(spec)  # the block's, else this process's AWS_*
        # the nodes get storage's credentials when the spec names them, or when they fetch
        # the run's staged files (job.workdir) from S3 themselves
        staged = (spec.storage.staging or "").startswith("s3://")
        storage_env = self.storage.child_env() if spec.storage.aws_credentials or staged else {}
        self.env = {**storage_env, **spec.env, **secret_values}  # the backend adds its own
        self.redact = secrets.Redactor([*secret_values.values(), *self.storage.secrets()])


def _attempt() -> int:
    """Return which attempt of its task run the caller is (1: the first)."""
    context = TaskRunContext.get()
    return context.task_run.run_count if context is not None else 1


def _retries_left() -> bool:
    """Return True when the task run calling this will be retried if it fails."""
    context = TaskRunContext.get()
    if context is None:
        return False
    return context.task_run.run_count <= (context.task.retries or 0)


@task(name="run", cache_policy=NO_CACHE)
def run(
    spec: JobSpec, cluster: Cluster, prices: pricing.PriceTable, flow_run_id: str
) -> RunOutcome:
    """Run the job's units with the sampler on; raise PreemptedError (retryable) when the
    job says it was interrupted, return other failures in the outcome so collect still runs."""
    logger = get_run_logger()
    environment = JobEnvironment(spec)
    redact = environment.redact
    timeout, stopped_by = time_limit(spec, cluster, prices)

    with (
        LineBatcher(job_output_sink(logger)) as lines,
        sampling(spec, cluster, flow_run_id, logger.warning) as idle,
    ):
        backend, attempt = backend_for(cluster), _attempt()
        units = kind_of(spec).units(spec, cluster)
        units = started(spec, cluster, units, backend, environment.storage, attempt)

        figures = log_metrics(spec, flow_run_id, logger.warning)

        def sink(unit: WorkUnit) -> Callable[[str, str], None]:
            where = f"[{unit.name}] " if len(units) > 1 else ""

            def on_line(stream: str, line: str) -> None:
                tag = "[stderr] " if stream == "stderr" else ""
                lines.add(redact(f"{where}{tag}{line}"))
                if figures is not None:
                    figures(redact(line))

            return on_line

        result = run_units(
            backend,
            cluster,
            units,
            {**environment.env, **cluster_env(cluster, attempt)},
            timeout,
            sink,
            stop_check(flow_run_id),
            spec.limits.stop_grace_s,
        )
    result = result.model_copy(update={"log_tail": [redact(line) for line in result.log_tail]})
    if must_yield(flow_run_id) and (result.cancelled or result.exit_code == PREEMPTED_EXIT_CODE):
        raise QuotaYield(
            "the job gave its borrowed GPUs back (stopped with its grace"
            f"{', after its checkpoint' if result.exit_code == PREEMPTED_EXIT_CODE else ''});"
            " it waits for GPUs again and resumes from what it saved"
        )
    if idle is not None and idle.stopped():  # stopped for idling, not cancelled or preempted
        return RunOutcome(result=result, failure=idle.sentence(), stopped_by="idle_gpu")
    if result.cancelled:  # stopped with its grace: collect keeps what it wrote
        return RunOutcome(result=result)
    if result.exit_code == PREEMPTED_EXIT_CODE:
        raise PreemptedError(
            f"the job was interrupted and saved its state (exit {PREEMPTED_EXIT_CODE}); "
            + (
                "a retry resumes it"
                if _retries_left()
                else "its retries are used up (retry.run.retries); running the same spec again"
                " resumes it"
            )
        )
    error_file = Path(cluster.workspace) / "outputs" / ERROR_FILE
    reason = (
        redact(error_file.read_text(errors="replace").strip()[:2000])
        if error_file.is_file()
        else None
    )
    return RunOutcome(
        result=result,
        failure=failure_sentence(
            result,
            timeout,
            stopped_by,
            reason,
            failure_context(spec, cluster) | {"memory_events": result.memory_events},
        ),
        stopped_by=stopped_by if result.timed_out else None,
    )


def log_metrics(spec: JobSpec, flow_run_id: str, warn: Callable[..., None]) -> LogMetrics | None:
    """Return the run's reader of the job's own figures (metrics.from_log), pushing them
    live when a Pushgateway is set; None when the spec reads none."""
    if not spec.metrics.from_log:
        return None
    push = None
    if spec.metrics.pushgateway:
        push = LiveLogPush(
            spec.metrics.pushgateway, flow_run_id, spec.name, spec.metrics.push_interval_s, warn
        )
    return LogMetrics(spec.metrics.from_log, rows_file(flow_run_id), push, warn)


def run_stage(
    spec: JobSpec,
    cluster: Cluster,
    prices: pricing.PriceTable,
    flow_run_id: str,
    handed_on: tuple[type[Exception], ...] = (),
) -> RunOutcome:
    """The run stage: every unit of the job's kind at once (the `run` task, retried), or,
    for a kind that hands out its own units (render chunks), the kind's schedule through a
    UnitRunner, under the same limits, sampler and stop checks. Errors of `handed_on`
    (a pool's: capacity, a preemption where it moves on) are raised at once, not retried."""
    kind = kind_of(spec)
    if not kind.schedules_units:
        condition = retry_unless(*handed_on)
        return retrying(run, spec.retry.run, condition)(spec, cluster, prices, flow_run_id)
    logger = get_run_logger()
    timeout, stopped_by = time_limit(spec, cluster, prices)
    runner = PipelineRunner(
        spec, cluster, flow_run_id, stopped_by, handed_on, hourly_paid(spec, cluster, prices)
    )
    with sampling(spec, cluster, flow_run_id, logger.warning):
        return kind.schedule(spec, runner, time.time() + timeout)


class PipelineRunner:
    """Runs one unit at a time for a kind that schedules its own units: the run's backend,
    its environment (the same every unit of a run gets), its stop checks (cancelled in the
    API, idle) and grace."""

    def __init__(
        self,
        spec: JobSpec,
        cluster: Cluster,
        flow_run_id: str,
        limit: str = "max_duration",
        handed_on: tuple[type[Exception], ...] = (),
        hourly_usd: float | None = None,
    ) -> None:
        self.cluster, self.spec, self.flow_run_id = cluster, spec, flow_run_id
        self.limit, self.handed_on, self.hourly_usd = limit, handed_on, hourly_usd
        self._nodes_lock = threading.Lock()
        self._stop = stop_check(flow_run_id)
        environment = JobEnvironment(spec)
        self.env, self.storage, self.redactor = (
            {**environment.env, **cluster_env(cluster)},
            environment.storage,
            environment.redact,
        )

    @functools.cached_property
    def backend(self) -> Backend:
        """The backend the run's cluster was made with, once a unit runs (a render with
        nothing left to do has a cluster no backend made, and runs none)."""
        return backend_for(self.cluster)

    def run(
        self,
        unit: WorkUnit,
        on_line: LineSink,
        env: Mapping[str, str],
        deadline: float,
        stop: StopCheck | None = None,
    ) -> JobResult:
        """Run `unit` with the run's variables over `env` until it ends, `deadline`, or
        `stop()` (or the run's own stop check) says so. A unit of the user's own code
        starts in the packed working folder, after job.setup, with `${NAME}` expanded."""
        run_stop = self._stop
        should_stop = run_stop if stop is None else (lambda: stop() or run_stop())
        attempt = _attempt()
        [unit] = started(self.spec, self.cluster, [unit], self.backend, self.storage, attempt)
        return run_one(
            self.backend,
            self.cluster,
            unit,
            {**env, **self.env, **cluster_env(self.cluster, attempt)},
            max(1.0, deadline - time.time()),
            on_line,
            should_stop,
            self.spec.limits.stop_grace_s,
            self.redactor,
        )

    def serve(
        self, app: Replicated, on_change: Callable[[dict[str, Any]], None], deadline: float
    ) -> JobResult:
        """Have the run's backend keep `app` (a backend that serves replicas itself)."""
        backend = self.backend
        if not isinstance(backend, ServesReplicas):
            raise ProvisionError(f"the {self.cluster.backend} backend does not serve replicas")
        with unit_running():
            return backend.serve(
                self.cluster,
                app,
                self.env,
                max(1.0, deadline - time.time()),
                on_change,
                stop_check(self.flow_run_id),
                self.spec.limits.stop_grace_s,
            )

    def add_node(self, deadline: float, stop: StopCheck | None = None) -> int:
        """Claim a node more for the run (a backend that `adds_nodes`); return its index."""
        backend = self.backend
        if not isinstance(backend, AddsNodes):
            raise ProvisionError(f"the {self.cluster.backend} backend does not add nodes")
        added = backend.add_node(self.cluster, deadline, stop)  # the new node is its last
        with self._nodes_lock:  # claims made side by side: the run's cluster knows all
            if len(added.node_addresses) > len(self.cluster.node_addresses):
                self.cluster = self.cluster.model_copy(
                    update={
                        "nodes": added.nodes,
                        "node_names": list(added.node_names),
                        "node_addresses": list(added.node_addresses),
                    }
                )
            return len(added.node_addresses) - 1

    def drop_node(self, node: int) -> None:
        """Give back a node of the run's (its units ended)."""
        backend = self.backend
        if isinstance(backend, AddsNodes):
            backend.drop_node(self.cluster, node)

    def stopping(self) -> bool:
        return self._stop()

    def idle_stop(self) -> str | None:
        return idle_stop(self.flow_run_id)

    def redact(self, text: str) -> str:
        return self.redactor(text)


def run_one(
    backend: Backend,
    cluster: Cluster,
    unit: WorkUnit,
    env: Mapping[str, str],
    timeout_s: float,
    on_line: LineSink,
    should_stop: StopCheck,
    grace_s: float,
    redact: Callable[[str], str] | None = None,
) -> JobResult:
    """The one way into `backend.run`, for every kind: the unit counted as running (the
    API outage watch waits on it), and with `redact` its lines and its result's tail
    masked (the run's `run` task masks its lines in its sink, and passes none)."""
    mask = redact or (lambda text: text)

    def masked(stream: str, line: str) -> None:
        on_line(stream, mask(line))

    with unit_running():
        result = backend.run(cluster, unit, env, timeout_s, masked, should_stop, grace_s)
    return result.model_copy(update={"log_tail": [mask(line) for line in result.log_tail]})


def run_units(
    backend: Backend,
    cluster: Cluster,
    units: list[WorkUnit],
    env: dict[str, str],
    timeout_s: float,
    sink: Callable[[WorkUnit], Callable[[str, str], None]],
    should_stop: Callable[[], bool],
    grace_s: float,
) -> JobResult:
    """Run every unit at once on the backend and return one result for the job. The first
    unit to fail speaks for the job, and the others are stopped (a job is all or nothing:
    a training node left alone would wait at its rendezvous); else the last to end."""
    if len(units) == 1:
        [unit] = units
        return run_one(backend, cluster, unit, env, timeout_s, sink(unit), should_stop, grace_s)
    failed = threading.Event()
    cancelled = threading.Event()

    def stop() -> bool:
        if should_stop():
            cancelled.set()
        return cancelled.is_set() or failed.is_set()

    def one(unit: WorkUnit) -> JobResult:
        return run_one(backend, cluster, unit, env, timeout_s, sink(unit), stop, grace_s)

    results: list[JobResult] = []
    first_failure: JobResult | None = None
    with ThreadPoolExecutor(max_workers=len(units), thread_name_prefix="unit") as pool:
        futures = [pool.submit(one, unit) for unit in units]
        try:
            for future in as_completed(futures):
                result = future.result()
                results.append(result)
                broke = result.exit_code != 0 or result.signal is not None or result.timed_out
                if broke and first_failure is None and not cancelled.is_set():
                    first_failure = result
                    failed.set()
        except BaseException:
            cancelled.set()  # interrupted here: every unit gets SIGTERM and its grace
            raise
    chosen = first_failure or max(results, key=lambda r: r.ended_at)
    started = min(r.started_at for r in results)
    ended = max(r.ended_at for r in results)
    return chosen.model_copy(
        update={
            "started_at": started,
            "ended_at": ended,
            "duration_s": (ended - started).total_seconds(),
            "timed_out": any(r.timed_out for r in results),
            "cancelled": cancelled.is_set(),
        }
    )


def time_limit(spec: JobSpec, cluster: Cluster, prices: pricing.PriceTable) -> tuple[float, str]:
    """Return how long the job may run and which limit says so (max_duration, or
    max_cost_usd when the budget runs out first at this cluster's hourly rate)."""
    hourly = hourly_paid(spec, cluster, prices)
    budget = pricing.budget_seconds(spec.limits.max_cost_usd, hourly)
    if budget is not None and budget < spec.limits.max_duration:
        return budget, "max_cost_usd"
    return spec.limits.max_duration, "max_duration"
