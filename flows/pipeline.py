"""gpu_pipeline: provision -> preflight -> run -> collect -> teardown, for any GPU job."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import deployment as current_deployment
from prefect.runtime import flow_run as current_run
from prefect.states import Cancelled, State
from pydantic import BaseModel

from gpuflow.tasks.contract import Cluster, owner_labels
from gpuflow.tasks.errors import InvalidSpec, JobCancelled, JobFailed
from gpuflow.tasks.host import gpuflow_home, signals_deferred
from gpuflow.tasks.metrics.summary import RunMetrics
from gpuflow.tasks.pipeline.checks import check_pool
from gpuflow.tasks.pipeline.collect import collect
from gpuflow.tasks.pipeline.failover import place_on
from gpuflow.tasks.pipeline.gate import gated
from gpuflow.tasks.pipeline.heartbeat import flow_run_heartbeat
from gpuflow.tasks.pipeline.inflight import run_in_flight
from gpuflow.tasks.pipeline.stages import (
    keep_run_outputs,
    nothing_to_do,
    release_unprovisioned,
    retrying,
    teardown,
    teardown_owned,
)
from gpuflow.tasks.pipeline.usercode import pack_code, said
from gpuflow.tasks.platform.admission import gate_for
from gpuflow.tasks.platform.api import hold_if_ours
from gpuflow.tasks.platform.confine import confine
from gpuflow.tasks.platform.state import platform_dir, users_path
from gpuflow.tasks.platform.users import UserBook
from gpuflow.tasks.runscope import run_scope
from gpuflow.tasks.spec import JobSpec, Placement, load_spec, read_placement


class PipelineResult(BaseModel):
    name: str
    flow_run_id: str
    cluster: Cluster
    preflight: str
    exit_code: int | None
    metrics: RunMetrics
    artifacts_dir: str


def artifacts_dir(spec: JobSpec, flow_run_id: str) -> Path:
    """Return the folder this run's artifacts go to."""
    base = spec.storage.artifacts
    root = Path(base.removeprefix("file://")) if base else gpuflow_home() / "runs"
    return root / f"{spec.name}-{flow_run_id[:8]}"


def _teardown_hook(flow: Any, flow_run: Any, state: Any) -> None:
    """on_crashed / on_cancellation: release whatever this run owns, found by its labels
    (on every candidate of a placement list)."""
    spec = flow_run.parameters.get("spec") if flow_run.parameters else None
    if isinstance(spec, JobSpec):
        places = list(spec.candidates) or [spec.placement]
    else:
        given = (spec or {}).get("placement") if isinstance(spec, dict) else None
        listed = given if isinstance(given, list) else [given or {}]
        try:
            places = [read_placement(p) for p in listed]
        except ValueError:  # a spec that never got past validation provisioned nothing
            return
    for where in places:
        try:
            teardown_owned(where, str(flow_run.id))
        except InvalidSpec:  # no such backend: nothing was provisioned
            continue


def _teardown(flow_run_id: str, *places: Placement) -> None:
    for where in places:
        try:
            teardown(where, flow_run_id)
        except Exception:
            teardown_owned(where, flow_run_id)  # the task machinery failed: do it plainly


# Every flow that runs the stages carries these, so teardown runs however the run ends.
TEARDOWN_HOOKS: dict[str, Any] = {
    "on_crashed": [_teardown_hook],
    "on_cancellation": [_teardown_hook],
}


@flow(name="gpu-pipeline", validate_parameters=False, **TEARDOWN_HOOKS)
def gpu_pipeline(spec: JobSpec) -> PipelineResult | State:
    """Run one GPU job through provision, preflight, run, collect and teardown."""
    return run_stages(spec)


def run_kind(spec: JobSpec | dict[str, Any], kind: str) -> PipelineResult | State:
    """Run the stages for a flow that takes one job kind; InvalidSpec for any other."""
    job = load_spec(spec.model_dump() if isinstance(spec, JobSpec) else spec)
    if job.job.kind != kind:
        raise InvalidSpec(
            f"job.kind: the {kind} flow runs {kind} jobs, not {job.job.kind}; use gpu_pipeline."
        )
    return run_stages(job)


def run_stages(spec: JobSpec | dict[str, Any]) -> PipelineResult | State:
    """The pipeline's body, for flows that run it in their own flow run (render, train)
    rather than as a subflow: one flow run less to create and finish. The job's kind
    runs the run stage (its units); nothing here depends on which kind it is."""
    from prefect.settings import PREFECT_API_URL

    hold_if_ours(PREFECT_API_URL.value())  # the platform's port: this process's while it runs
    with run_scope(), flow_run_heartbeat():  # (the caller's scope, when it checked the spec)
        return _checked_stages(spec)


def _checked_stages(spec: JobSpec | dict[str, Any]) -> PipelineResult | State:
    job = load_spec(spec.model_dump() if isinstance(spec, JobSpec) else spec)
    tags = list(current_run.tags or [])
    confine(job, tags, UserBook(users_path()))  # a member's run: not the owner's powers
    pool = check_pool(job)  # every candidate, before anything is provisioned
    run_id = str(current_run.id)
    out = artifacts_dir(pool[0][0], run_id)
    places = [j.placement for j, _ in pool]
    gate = gate_for(job, run_id, tags, platform_dir(), get_run_logger().info)
    if gate is not None:  # waits parked (no process, no worker slot) when its worker can
        gate.admit_or_park(can_park=current_deployment.id is not None)
    # on disk from here: a gpuflow killed at any later moment is found by `gpuflow reap`
    with (
        run_in_flight(run_id, *places, artifacts=out, secret_env=job.secret_env),
        gated(run_id, gate),  # the team's GPU quota's turn, before GPUs are taken
    ):
        job, packed = pack_code(job)  # once per run: every attempt, anywhere, gets these files
        if packed is not None:
            get_run_logger().info(said(packed))
            pool = [(placed.model_copy(update={"job": job.job}), prices) for placed, prices in pool]
        idle = nothing_to_do(pool[0][0])
        return _attempt(pool, run_id, out, owner_labels(run_id, job.name), idle)


def _attempt(
    pool: list[tuple[JobSpec, Any]],
    run_id: str,
    out: Path,
    owner: dict[str, str],
    idle: str | None,
) -> PipelineResult | State:
    """The stages on the job's placement (a pool of one) or its list of candidates:
    placed (provision, preflight, run: tasks/pipeline/failover.py), then collect and
    teardown; whatever happens, what the run made anywhere is torn down."""
    places = [job.placement for job, _ in pool]
    try:
        placed = place_on(pool, run_id, owner, idle)
        job, prices = pool[placed.candidate.index]
        metrics = retrying(collect, job.retry.collect)(
            job, placed.cluster, placed.outcome, prices, run_id, str(out),
            placed.earlier, placed.candidate.name if placed.pooled else None,
        )  # fmt: skip
    except JobCancelled as exc:
        kept = _kept(pool[0][0], run_id, out, places)
        _teardown(run_id, *places)
        return Cancelled(message=f"{exc}{kept}")
    except Exception:
        _kept(pool[0][0], run_id, out, places)
        _teardown(run_id, *places)
        raise
    except BaseException:
        with signals_deferred():  # interrupted: the engine may be going down
            _kept(pool[0][0], run_id, out, places)
            for where in places:
                teardown_owned(where, run_id)
        raise
    finally:
        if idle:
            release_unprovisioned(run_id)
    _teardown(run_id, job.placement)
    return _result(job, run_id, placed.cluster, placed.verdict, placed.outcome, metrics, out)


def _kept(spec: JobSpec, run_id: str, out: Path, places: list[Placement]) -> str:
    """Keep what the job wrote, for a run that ends without collect; return "; " and
    what was kept, to add to the run's last sentence ("" when nothing was)."""
    said = keep_run_outputs(places, run_id, out, spec.secret_env)
    try:
        logger: Any = get_run_logger()
    except Exception:  # outside a run's context
        logger = logging.getLogger("gpuflow")
    for line in said:
        logger.warning("%s", line)
    return "".join(f"; {line}" for line in said)


def _result(
    job: JobSpec,
    run_id: str,
    cluster: Cluster,
    verdict: str,
    outcome: Any,
    metrics: RunMetrics,
    out: Path,
) -> PipelineResult | State:
    if outcome.failure:
        raise JobFailed(outcome.failure)
    get_run_logger().info("artifacts: %s", out)
    if outcome.ended == "cancelled":  # stopped with its grace on the run's cancel, collected
        return Cancelled(
            message=f"the run was cancelled; its job was stopped and what it wrote is in {out}"
        )
    return PipelineResult(
        name=job.name,
        flow_run_id=run_id,
        cluster=cluster,
        preflight=verdict,
        exit_code=outcome.result.exit_code,
        metrics=metrics,
        artifacts_dir=str(out),
    )
