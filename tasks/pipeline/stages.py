"""The pipeline's stages as Prefect tasks: thin wrappers over backends, preflight and metrics.

Retries key on error classes: a task is retried only when its exception says a
retry may succeed (CapacityError, TransientError, PreemptedError).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import TaskRunContext
from prefect.tasks import exponential_backoff

from gpuflow.tasks import secrets
from gpuflow.tasks.api_client import publish
from gpuflow.tasks.backends.registry import get_backend
from gpuflow.tasks.contract import (
    RUN_LABEL,
    Cluster,
    JobResult,
    LineSink,
    RunOutcome,
    TeardownReport,
    WorkUnit,
)
from gpuflow.tasks.diagnose import diagnose
from gpuflow.tasks.errors import (
    ERROR_FILE,
    PREEMPTED_EXIT_CODE,
    CollectError,
    JobCancelled,
    PreemptedError,
    PreflightFailed,
    TransientError,
    retry_unless,
    retry_when_retryable,
)
from gpuflow.tasks.host import gpuflow_home, make_dirs, signals_held
from gpuflow.tasks.kinds.registry import kind_of
from gpuflow.tasks.logstream import LineBatcher, job_output_sink
from gpuflow.tasks.metrics import cost as pricing
from gpuflow.tasks.metrics.idle import IdleWatch, watch_of
from gpuflow.tasks.metrics.plot import utilisation_png
from gpuflow.tasks.metrics.prometheus import LivePush, delete, exposition, push
from gpuflow.tasks.metrics.sampler import NODE_SAMPLES, SAMPLES, Sampler, SampleTail, read_samples
from gpuflow.tasks.metrics.summary import IDLE_PCT, RunMetrics, summarise
from gpuflow.tasks.outputs import OutputsKept, copy_outputs, keep_whole
from gpuflow.tasks.pictures import picture
from gpuflow.tasks.pipeline import preflight as preflight_checks
from gpuflow.tasks.pipeline.inflight import unit_running
from gpuflow.tasks.pipeline.pool import Use
from gpuflow.tasks.spec import JobSpec, Placement, StageRetry
from gpuflow.tasks.storage import s3_settings


def _retries_left() -> bool:
    """Return True when the task run calling this will be retried if it fails."""
    context = TaskRunContext.get()
    if context is None:
        return False
    return context.task_run.run_count <= (context.task.retries or 0)


def retrying(stage: Any, policy: StageRetry, condition: Any = retry_when_retryable) -> Any:
    """Return `stage` with the policy's retries: exponential backoff with jitter, for the
    errors `condition` retries (default: the retryable ones)."""
    if policy.retries == 0:
        return stage.with_options(retries=0)
    return stage.with_options(
        retries=policy.retries,
        retry_delay_seconds=exponential_backoff(backoff_factor=max(policy.delay_s, 0.01))(
            policy.retries
        ),
        retry_jitter_factor=policy.jitter or None,
        retry_condition_fn=condition,
    )


@task(name="provision", cache_policy=None)
def provision(spec: JobSpec, owner: dict[str, str]) -> Cluster:
    """Return the cluster for this run; a retry adopts what an earlier try made."""
    cluster = get_backend(spec.placement.backend, spec.placement).provision(spec, owner)
    logger = get_run_logger()
    verb = "adopted" if cluster.adopted else "provisioned"
    gpus = ",".join(map(str, cluster.gpu_indices)) or "none"
    logger.info("%s %s: workspace %s, GPUs %s", verb, cluster.name, cluster.workspace, gpus)
    return cluster


def nothing_to_do(spec: JobSpec) -> str | None:
    """Return why the job's kind has nothing left to do where the spec places it (a render
    whose frames are all in storage); None when there is work to provision for."""
    where = get_backend(spec.placement.backend, spec.placement).capabilities
    return kind_of(spec).nothing_to_do(spec, where)


def unprovisioned(spec: JobSpec, owner: dict[str, str]) -> Cluster:
    """Return a cluster that holds nothing, for a job with nothing to do: the run stage
    and collect work in a folder on this host and no backend is asked for anything."""
    backend = get_backend(spec.placement.backend, spec.placement)
    workspace = _unprovisioned_folder(owner[RUN_LABEL])
    (workspace / "outputs").mkdir(parents=True, exist_ok=True)
    return Cluster(
        backend=backend.name,
        name=f"{spec.name}-unprovisioned",
        owner=owner,
        hostname=socket.gethostname(),
        workspace=str(workspace),
        nodes=spec.resources.nodes,
        created_at=datetime.now(UTC),
        capabilities=backend.capabilities,
    )


def release_unprovisioned(flow_run_id: str) -> None:
    """Remove the folder `unprovisioned` made for this run, if it did."""
    shutil.rmtree(_unprovisioned_folder(flow_run_id), ignore_errors=True)


def _unprovisioned_folder(flow_run_id: str) -> Path:
    return gpuflow_home() / "unprovisioned" / flow_run_id


@task(name="preflight", cache_policy=None)
def preflight(spec: JobSpec, cluster: Cluster) -> preflight_checks.PreflightReport:
    """Return the preflight report; raise PreflightFailed when the verdict is fail."""
    if cluster.capabilities.runs_here:
        facts = preflight_checks.inspect(cluster.workspace, kind_of(spec).uses_torch(spec))
        report = preflight_checks.verdict(spec, facts, cluster.gpu_indices)
    else:  # the job's machines are elsewhere: the scheduler matches their GPUs
        facts = preflight_checks.inspect(".", False)
        where = preflight_checks.Check(
            name="nodes",
            level="pass",
            message=f"{cluster.nodes} {cluster.backend} node(s) x {cluster.gpus_per_node} GPU(s)"
            f"{' of ' + cluster.gpu_products[0] if cluster.gpu_products else ''}, placed by"
            " the cluster's scheduler.",
        )
        report = preflight_checks.PreflightReport(
            verdict="pass", checks=[where], facts=facts, gpus_reserved=cluster.gpu_indices
        )
    extra = kind_of(spec).preflight_rows(spec, cluster)
    if extra:
        checks = [*report.checks, *(preflight_checks.Check(**c) for c in extra)]
        levels = {c.level for c in checks}
        worst = "fail" if "fail" in levels else "warn" if "warn" in levels else "pass"
        report = report.model_copy(update={"checks": checks, "verdict": worst})
    publish(
        create_table_artifact,
        key="gpuflow-preflight",
        table=[{"check": c.name, "level": c.level, "message": c.message} for c in report.checks],
        description=f"Preflight for {spec.name}: {report.verdict}",
    )
    logger = get_run_logger()
    for check in report.checks:
        log = logger.warning if check.level != "pass" else logger.info
        log("preflight %s [%s] %s", check.name, check.level, check.message)
    if report.verdict == "fail":
        raise PreflightFailed(" ".join(c.message for c in report.failures()))
    return report


def cancel_requested(flow_run_id: str, every_s: float = 2.0) -> Callable[[], bool]:
    """Return a check, cheap to call often, that says whether the run was cancelled in the
    API (UI, `prefect flow-run cancel`): a run started by `gpuflow run` has no worker to
    kill it, so the run stage stops the job itself. The API is asked on a thread of its
    own: an API that is away or slow (its client retries for a minute) never holds up
    the loop that follows the job; the thread ends once the check is no longer called."""
    from uuid import UUID

    from prefect.client.schemas.objects import StateType

    from gpuflow.tasks.api_client import api_client

    cancelled = threading.Event()
    last_called = [time.monotonic()]

    def poll() -> None:
        while time.monotonic() - last_called[0] < 5 * every_s + 10:
            time.sleep(every_s)
            try:
                with api_client() as client:
                    state = client.read_flow_run(UUID(flow_run_id)).state
            except Exception:  # the API being away is no reason to stop a job
                continue
            if state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED):
                cancelled.set()
                return

    context = contextvars.copy_context()  # the API this run uses (settings are context)
    threading.Thread(target=context.run, args=(poll,), daemon=True, name="cancel-check").start()

    def check() -> bool:
        last_called[0] = time.monotonic()
        return cancelled.is_set()

    return check


@task(name="run", cache_policy=None)
def run(
    spec: JobSpec, cluster: Cluster, prices: pricing.PriceTable, flow_run_id: str
) -> RunOutcome:
    """Run the job's units with the sampler on; raise PreemptedError (retryable) when the
    job says it was interrupted, return other failures in the outcome so collect still runs."""
    logger = get_run_logger()
    secret_values = secrets.resolve(spec.secret_env)
    s3 = s3_settings(spec)  # the block's, else the AWS_* variables this process has
    storage_env = s3.child_env() if spec.storage.aws_credentials else {}
    redact = secrets.Redactor([*secret_values.values(), *s3.secrets()])
    env = {**storage_env, **spec.env, **secret_values}  # the backend adds its own
    timeout, stopped_by = time_limit(spec, cluster, prices)

    with (
        LineBatcher(job_output_sink(logger)) as lines,
        sampling(spec, cluster, flow_run_id, logger.warning) as idle,
    ):
        units = kind_of(spec).units(spec, cluster)

        def sink(unit: WorkUnit) -> Callable[[str, str], None]:
            where = f"[{unit.name}] " if len(units) > 1 else ""

            def on_line(stream: str, line: str) -> None:
                tag = "[stderr] " if stream == "stderr" else ""
                lines.add(redact(f"{where}{tag}{line}"))

            return on_line

        result = run_units(
            get_backend(cluster.backend),
            cluster,
            units,
            env,
            timeout,
            sink,
            stop_check(flow_run_id),
            spec.limits.stop_grace_s,
        )
    result = result.model_copy(update={"log_tail": [redact(line) for line in result.log_tail]})
    if idle is not None and idle.stopped():  # stopped for idling, not cancelled or preempted
        return RunOutcome(result=result, failure=idle.sentence(), stopped_by="idle_gpu")
    if result.cancelled:
        raise JobCancelled("the run was cancelled while the job ran; the job was stopped")
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
        failure=_failure(
            result,
            timeout,
            stopped_by,
            reason,
            failure_context(spec, cluster) | {"memory_events": result.memory_events},
        ),
        stopped_by=stopped_by if result.timed_out else None,
    )


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
    runner = PipelineRunner(spec, cluster, flow_run_id, handed_on)
    with sampling(spec, cluster, flow_run_id, logger.warning):
        outcome = kind.schedule(spec, runner, time.time() + timeout)
    if (
        outcome.failure
        and "limits.max_duration" in outcome.failure
        and stopped_by != "max_duration"
    ):
        failure = outcome.failure.replace("limits.max_duration", f"limits.{stopped_by}")
        outcome = outcome.model_copy(update={"failure": failure})
    return outcome


class PipelineRunner:
    """Runs one unit at a time for a kind that schedules its own units: the run's backend,
    its variables and secrets, its stop checks (cancelled in the API, idle) and grace."""

    def __init__(
        self,
        spec: JobSpec,
        cluster: Cluster,
        flow_run_id: str,
        handed_on: tuple[type[Exception], ...] = (),
    ) -> None:
        self.cluster = cluster
        self.handed_on = handed_on
        self.spec = spec
        self.flow_run_id = flow_run_id
        self.backend = get_backend(cluster.backend)
        secret_values = secrets.resolve(spec.secret_env)
        self.env = {**spec.env, **secret_values}  # the backend adds its own
        s3 = s3_settings(spec)
        self.redactor = secrets.Redactor([*secret_values.values(), *s3.secrets()])

    def run(
        self, unit: WorkUnit, on_line: LineSink, env: Mapping[str, str], deadline: float
    ) -> JobResult:
        """Run `unit` with the run's variables over `env` until it ends or `deadline`."""
        with unit_running():
            return self.backend.run(
                self.cluster,
                unit,
                {**env, **self.env},
                max(1.0, deadline - time.time()),
                on_line,
                stop_check(self.flow_run_id),
                grace_s=self.spec.limits.stop_grace_s,
            )

    def idle_stop(self) -> str | None:
        return idle_stop(self.flow_run_id)

    def redact(self, text: str) -> str:
        return self.redactor(text)


def run_units(
    backend: Any,
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
        with unit_running():
            return backend.run(cluster, unit, env, timeout_s, sink(unit), should_stop, grace_s)
    from concurrent.futures import ThreadPoolExecutor, as_completed

    failed = threading.Event()
    cancelled = threading.Event()

    def stop() -> bool:
        if should_stop():
            cancelled.set()
        return cancelled.is_set() or failed.is_set()

    def one(unit: WorkUnit) -> JobResult:
        with unit_running():
            return backend.run(cluster, unit, env, timeout_s, sink(unit), stop, grace_s)

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


@contextlib.contextmanager
def sampling(
    spec: JobSpec, cluster: Cluster, flow_run_id: str, warn: Callable[..., None]
) -> Iterator[IdleWatch | None]:
    """Sample GPU/host metrics into the workspace (and push them live when a Pushgateway
    is configured) while the body runs; yield the idle watch when limits.idle_gpu is set."""
    idle = spec.limits.idle_gpu
    nodes_write_here = cluster.capabilities.node_samples_in_workspace and (
        Path(cluster.workspace).is_dir()  # the cluster's shared filesystem, seen from here
    )
    if cluster.capabilities.samples_nodes and not nodes_write_here:
        if idle is not None:
            warn(
                "limits.idle_gpu is not enforced on %s: its nodes sample themselves and"
                " this machine does not see their samples as they come",
                cluster.backend,
            )
        yield None
        return
    consumers: list[Callable[[dict[str, Any]], None]] = []
    if spec.metrics.pushgateway:
        consumers.append(
            LivePush(
                spec.metrics.pushgateway, flow_run_id, spec.name, spec.metrics.push_interval_s, warn
            )
        )
    watch = IdleWatch(idle, flow_run_id, spec.name, warn) if idle is not None else None
    if watch is not None:
        consumers.append(watch)

    def on_sample(sample: dict[str, Any]) -> None:
        for consume in consumers:
            consume(sample)

    if nodes_write_here:  # the nodes' samplers write into the workspace: read them there
        tail = SampleTail(Path(cluster.workspace), NODE_SAMPLES, on_sample, spec.metrics.interval_s)
        with tail, watch if watch is not None else contextlib.nullcontext():
            yield watch
        return
    samples = Path(cluster.workspace) / SAMPLES
    sampler = Sampler(samples, cluster.gpu_indices, spec.metrics.interval_s, on_sample=on_sample)
    try:
        with sampler, watch if watch is not None else contextlib.nullcontext():
            yield watch
    finally:
        if sampler.write_error:
            warn(
                "%d metric sample(s) were lost: %s; the metrics cover only the rest",
                sampler.lost,
                sampler.write_error,
            )


def stop_check(flow_run_id: str) -> Callable[[], bool]:
    """Return the run stage's stop check: the run was cancelled in the API, or its idle
    watch (limits.idle_gpu with action stop) says so."""
    cancelled = cancel_requested(flow_run_id)

    def check() -> bool:
        watch = watch_of(flow_run_id)
        return (watch is not None and watch.stopped()) or cancelled()

    return check


def idle_stop(flow_run_id: str) -> str | None:
    """Return why the idle watch stopped this run's job, if it did."""
    watch = watch_of(flow_run_id)
    return watch.sentence() if watch is not None and watch.stopped() else None


def hourly_paid(spec: JobSpec, cluster: Cluster, prices: pricing.PriceTable) -> float:
    """Return what `cluster` is paid per hour: the backend's own figure where it knows it
    (an EC2 offer's spot price), else the price table's for what it holds."""
    if cluster.hourly_usd is not None:
        return cluster.hourly_usd
    return pricing.hourly_rate(prices, **_priced(spec, cluster))


def cost_of(
    spec: JobSpec, cluster: Cluster, prices: pricing.PriceTable, seconds: float
) -> pricing.Cost:
    """Return what holding `cluster` for `seconds` cost, at the price it is paid."""
    if cluster.hourly_usd is None:
        return pricing.run_cost(prices, **_priced(spec, cluster), seconds=seconds)
    paid = cluster.hourly_usd
    return pricing.Cost(
        usd=paid * seconds / 3600,
        hourly_usd=paid,
        breakdown={"gpu" if cluster.gpu_indices else "cpu": paid * seconds / 3600},
    )


def _priced(spec: JobSpec, cluster: Cluster) -> dict[str, Any]:
    """Return what is priced: the backend, the GPUs held, CPU cores and disk."""
    return {
        "backend": cluster.backend,
        "products": cluster.gpu_products * cluster.nodes,
        "cpu_cores": spec.resources.cpu or 1.0,
        "disk_bytes": spec.resources.disk,
    }


def _product(cluster: Cluster) -> str:
    """Return the GPU product the run held ("none" for CPU only, "A + B" for several)."""
    products = sorted(set(cluster.gpu_products))
    return "none" if not cluster.gpu_indices or not products else " + ".join(products)


def failure_context(spec: JobSpec, cluster: Cluster) -> dict[str, Any]:
    """Return what makes a diagnosis precise: the GPU memory peak the samples saw and the
    job's batch size."""
    peaks = [
        gpu.get("DCGM_FI_DEV_FB_USED") or 0.0
        for sample in read_samples(Path(cluster.workspace) / SAMPLES)
        for gpu in sample.get("gpus", [])
    ]
    return {
        "peak_gpu_memory_mib": max(peaks, default=0.0),
        "batch_size": getattr(spec.job, "batch_size", None),
    }


def _failure(
    result: JobResult,
    timeout: float,
    stopped_by: str,
    reason: str | None,
    context: dict[str, Any] | None = None,
) -> str | None:
    if result.timed_out:
        return (
            f"the job ran past limits.{stopped_by} ({timeout:.0f} s) and was stopped;"
            f" raise limits.{stopped_by} or make the job shorter."
        )
    lines = [*result.log_tail, reason] if reason else result.log_tail
    known = diagnose(result.exit_code, result.signal, lines, context)
    if known is not None:
        code = (
            f"signal {result.signal}" if result.signal is not None else f"exit {result.exit_code}"
        )
        return f"the job failed ({code}): {known.message}"
    if result.signal is not None:
        hint = " (SIGKILL often means the out-of-memory killer)" if result.signal == 9 else ""
        return f"the job was killed by signal {result.signal}{hint}; see the last lines of its log."
    if result.exit_code and reason:
        return f"the job failed (exit {result.exit_code}): {reason}"
    if result.exit_code:
        last = " | ".join(result.log_tail[-3:])
        return f"the job exited with code {result.exit_code}; last lines: {last}"
    return None


RESULT_LIMIT = 1 << 20  # result.json holds figures, not data


def _copy_outputs(outputs: Path, out: Path, redact: Callable[[str], str], logger: Any) -> None:
    """Copy the job's outputs folder into the artifacts `out` as the job left it (never
    following it when the job swapped it for a link); what was left out is logged. A signal
    waits for the copy; a disk that cannot take it keeps the outputs whole (CollectError)."""
    if outputs.is_symlink():
        logger.warning(
            "outputs is a link (to %s), not the job's folder: nothing of it was copied to the"
            " artifacts",
            os.readlink(outputs),
        )
        return
    if not outputs.is_dir():
        return
    # A completed job's outputs are not cut short by Ctrl-C: teardown (which removes the
    # workspace) runs after the copy.
    with signals_held("the job's outputs are copied to the artifacts"):
        try:
            left_out = copy_outputs(outputs, out / "outputs", redact)
        except OSError as exc:  # a full or read-only artifacts disk: collect names it
            raise OutputsKept(exc, keep_whole(outputs, gpuflow_home() / "kept")) from None
    for left in left_out:
        logger.warning("outputs/%s was not copied to the artifacts", left)


def _job_figures(result_file: Path, logger: Any) -> dict[str, Any]:
    """Return the figures of the job's result.json (one JSON object; its text made
    printable), {} without one or for one over RESULT_LIMIT (kept, not shown)."""
    if not result_file.is_file():
        return {}
    if result_file.stat().st_size > RESULT_LIMIT:
        logger.warning(
            "outputs/result.json is %.1f MiB: gpuflow shows the figures of a result.json of"
            " up to %d MiB; it is in the artifacts, its figures are not shown (write large"
            " data to other files)",
            result_file.stat().st_size / 2**20,
            RESULT_LIMIT // 2**20,
        )
        return {}
    try:
        figures = json.loads(result_file.read_text(errors="replace"))
    except (ValueError, RecursionError) as exc:  # not JSON, or nested past the parser
        raise CollectError(f"the job wrote an unreadable result.json: {exc}") from None
    if not isinstance(figures, dict):
        raise CollectError(
            "the job wrote a result.json that is not a JSON object: write its figures as"
            ' {"name": value, ...}'
        )
    return secrets.printable_json(figures)  # type: ignore[return-value]


@task(name="collect", cache_policy=None)
def collect(
    spec: JobSpec,
    cluster: Cluster,
    outcome: RunOutcome,
    prices: pricing.PriceTable,
    flow_run_id: str,
    artifacts_dir: str,
    earlier: list[Use] | None = None,
    candidate: str | None = None,
) -> RunMetrics:
    """Return the run's metrics and write its artifacts: samples, PNG, Prometheus text,
    the job's outputs; push to the Pushgateway when one is configured. A run placed on a
    list of candidates adds what the `earlier` candidates it used held and cost (this
    one is `candidate`). A folder that cannot be written (a full disk) is one sentence
    that names it; the job's own end is kept in that sentence."""
    try:
        return _collect(
            spec, cluster, outcome, prices, flow_run_id, artifacts_dir, earlier, candidate
        )
    except OSError as exc:
        code = outcome.result.exit_code
        kept = f"; its outputs are kept whole in {exc.kept}" if isinstance(exc, OutputsKept) else ""
        raise CollectError(
            f"the run's artifacts could not be written to {artifacts_dir} ({exc.strerror or exc});"
            " free space there or set storage.artifacts to another folder. The job itself"
            f" ended with {'exit code ' + str(code) if code is not None else 'a signal'}{kept}."
        ) from None


def _split(
    cluster: Cluster, outcome: RunOutcome, metrics: RunMetrics, earlier: list[Use], candidate: str
) -> RunMetrics:
    """Return the metrics with the GPU-hours and cost of every candidate the run used
    (earlier ones from their making to their teardown, this one for the job's run)."""
    last = {
        "candidate": candidate,
        "backend": cluster.backend,
        "ended": "failed" if outcome.failure else "completed",
        "gpu_hours": round(metrics.gpu_hours, 6),
        "usd_per_hour": round(metrics.cost_hourly_usd, 4),
        "cost_usd": round(metrics.cost_usd, 6),
    }
    rows = [*(use.row() for use in earlier), last]
    return metrics.model_copy(
        update={
            "by_placement": rows,
            "gpu_hours": sum(r["gpu_hours"] for r in rows),
            "cost_usd": sum(r["cost_usd"] for r in rows),
        }
    )


def _collect(
    spec: JobSpec,
    cluster: Cluster,
    outcome: RunOutcome,
    prices: pricing.PriceTable,
    flow_run_id: str,
    artifacts_dir: str,
    earlier: list[Use] | None,
    candidate: str | None,
) -> RunMetrics:
    logger = get_run_logger()
    out = Path(artifacts_dir)
    make_dirs(out)  # this user's alone under GPUFLOW_HOME; elsewhere as the user makes folders
    samples_path = Path(cluster.workspace) / SAMPLES
    samples = read_samples(samples_path)
    if samples_path.exists():
        shutil.copyfile(samples_path, out / "samples.jsonl")
    redact = secrets.Redactor(secrets.resolve(spec.secret_env).values())
    _copy_outputs(Path(cluster.workspace) / "outputs", out, redact, logger)
    job_result = _job_figures(out / "outputs" / "result.json", logger)
    run_cost = cost_of(spec, cluster, prices, outcome.result.duration_s)
    idle = spec.limits.idle_gpu
    metrics = summarise(
        samples,
        outcome.result.duration_s,
        len(cluster.gpu_indices),
        run_cost,
        idle_pct=idle.below_pct if idle is not None else IDLE_PCT,
    )
    metrics = metrics.model_copy(update={"job": job_result})
    if candidate is not None:
        metrics = _split(cluster, outcome, metrics, earlier or [], candidate)
    (out / "metrics.json").write_text(metrics.model_dump_json(indent=2))
    ended = "failed" if outcome.failure else "completed"
    text = exposition(samples[-1] if samples else None, metrics, flow_run_id, spec.name, ended)
    (out / "metrics.prom").write_text(text)
    png = (
        utilisation_png(samples, out / "utilisation.png", f"{spec.name} {flow_run_id[:8]}")
        if spec.metrics.plot
        else None
    )
    pushed = None
    if spec.metrics.pushgateway:
        try:
            totals = exposition(None, metrics, flow_run_id, spec.name, ended)  # no GPU gauges
            pushed = push(spec.metrics.pushgateway, totals, flow_run_id, spec.name)
            delete(spec.metrics.pushgateway, flow_run_id, spec.name, "run")
        except TransientError as exc:
            logger.warning("metrics not pushed: %s", exc)
    kind_report = kind_of(spec).report(spec, cluster, out, f"{spec.name} {flow_run_id[:8]}")
    rows = [
        {"metric": k, "value": v}
        for k, v in metrics.model_dump(exclude={"job", "cost_breakdown", "by_placement"}).items()
    ]
    rows += [{"metric": f"job.{k}", "value": v} for k, v in job_result.items()]
    rows += [  # what the cost report groups by
        {"metric": "run.job", "value": spec.name},
        {"metric": "run.backend", "value": cluster.backend},
        {"metric": "run.gpu_product", "value": _product(cluster)},
        {"metric": "run.outcome", "value": ended},
    ]
    rows += kind_report.rows
    publish(
        create_table_artifact,
        key="gpuflow-metrics",
        table=rows,
        description=f"Metrics for {spec.name}",
    )
    lines = [
        f"# {spec.name}: {'failed' if outcome.failure else 'completed'}",
        "",
        f"- duration: {outcome.result.duration_s:.1f} s, exit code {outcome.result.exit_code}",
        f"- GPUs: {len(cluster.gpu_indices)} ({', '.join(cluster.gpu_products) or 'none'}); {metrics.note or 'GPU metrics sampled'}",
        f"- cost: ${metrics.cost_usd:.4f} at ${metrics.cost_hourly_usd:.4f}/h",
        f"- artifacts: `{out}`",
    ]
    lines[2:2] = kind_report.headline
    lines += [
        f"- on {r['candidate']} ({r['ended']}): {r['gpu_hours']:.4f} GPU-hours,"
        f" ${r['cost_usd']:.4f} at ${r['usd_per_hour']:.4f}/h"
        for r in metrics.by_placement
    ]
    if png:
        lines.append(picture("utilisation plot", png))
    lines += kind_report.lines
    if pushed:
        lines.append(f"- pushed to {pushed}")
    if outcome.failure:
        lines.append(f"- failure: {outcome.failure}")
    publish(
        create_markdown_artifact,
        key="gpuflow-summary",
        markdown="\n".join(lines),
        description=spec.name,
    )
    return metrics


@task(name="teardown", cache_policy=None, retries=2, retry_delay_seconds=2)
def teardown(placement: Placement, flow_run_id: str) -> list[TeardownReport]:
    """Return what was released for every resource this flow run owns. Idempotent."""
    return teardown_owned(placement, flow_run_id)


def teardown_owned(placement: Placement, flow_run_id: str) -> list[TeardownReport]:
    """Tear down every cluster labelled with `flow_run_id` where `placement` put it (a
    Kubernetes namespace other than the kubeconfig's included); for hooks and reapers too."""
    compute = get_backend(placement.backend, placement)
    return [compute.teardown(c) for c in compute.list_owned({RUN_LABEL: flow_run_id})]
