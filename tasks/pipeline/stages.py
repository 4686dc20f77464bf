"""The pipeline's stages around the job as Prefect tasks: provision, preflight and
teardown, thin wrappers over backends and preflight (the run stage: running.py; collect:
collect.py).

Retries key on error classes: a task is retried only when its exception says a
retry may succeed (CapacityError, TransientError, PreemptedError).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from gpuflow.tasks.api_client import publish
from gpuflow.tasks.backends.registry import backend_for, get_backend
from gpuflow.tasks.contract import (
    RUN_LABEL,
    Cluster,
    TeardownReport,
)
from gpuflow.tasks.errors import (
    PreflightFailed,
    retry_when_retryable,
)
from gpuflow.tasks.host import gpuflow_home, make_dirs
from gpuflow.tasks.kinds.registry import kind_of
from gpuflow.tasks.outputs import copy_outputs, keep_whole
from gpuflow.tasks.pipeline import preflight as preflight_checks
from gpuflow.tasks.spec import JobSpec, Placement, StageRetry


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


@task(name="provision", cache_policy=NO_CACHE)
def provision(spec: JobSpec, owner: dict[str, str]) -> Cluster:
    """Return the cluster for this run; a retry adopts what an earlier try made."""
    cluster = get_backend(spec.placement.backend, spec.placement).provision(spec, owner)
    logger = get_run_logger()
    verb = "adopted" if cluster.adopted else "provisioned"
    gpus = ",".join(map(str, cluster.gpu_indices)) or "none"
    logger.info(
        "%s %s on %s: workspace %s, GPUs %s",
        verb, cluster.name, cluster.hostname, cluster.workspace, gpus,
    )  # fmt: skip
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


@task(name="preflight", cache_policy=NO_CACHE)
def preflight(spec: JobSpec, cluster: Cluster) -> preflight_checks.PreflightReport:
    """Return the preflight report; raise PreflightFailed when the verdict is fail."""
    if cluster.capabilities.runs_here:
        kind = kind_of(spec)
        facts = preflight_checks.inspect(
            cluster.workspace,
            kind.uses_torch(spec),
            python=kind.interpreter(spec),
            where=backend_for(cluster).job_argv(cluster),
        )
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


@task(name="teardown", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def teardown(placement: Placement, flow_run_id: str) -> list[TeardownReport]:
    """Return what was released for every resource this flow run owns. Idempotent."""
    return teardown_owned(placement, flow_run_id)


def teardown_owned(placement: Placement, flow_run_id: str) -> list[TeardownReport]:
    """Tear down every cluster labelled with `flow_run_id` where `placement` put it (a
    Kubernetes namespace other than the kubeconfig's included); for hooks and reapers too."""
    compute = get_backend(placement.backend, placement)
    return [compute.teardown(c) for c in compute.list_owned({RUN_LABEL: flow_run_id})]


def keep_run_outputs(
    places: list[Placement], run_id: str, artifacts: Path, secret_env: dict[str, str]
) -> list[str]:
    """`keep_outputs` on each of the run's placements, the summaries' secrets masked (the
    run's secrets are read again; when they cannot be, those files show nothing)."""
    from gpuflow.tasks import secrets

    try:
        redact: Callable[[str], str] = secrets.Redactor(secrets.resolve(secret_env).values())
    except Exception:  # its blocks cannot be read now
        redact = unreadable
    return [line for where in places for line in keep_outputs(where, run_id, artifacts, redact)]


def unreadable(text: str) -> str:
    """A redactor for when the run's secrets cannot be read: nothing of the text is shown."""
    return "(not shown: the run's secrets could not be read to mask it)"


def keep_outputs(
    placement: Placement, flow_run_id: str, artifacts: Path, redact: Callable[[str], str]
) -> list[str]:
    """Copy what the job left in its outputs folder, on every cluster this run owns where
    `placement` put it, into the run's artifacts, for a run that ends without collect (a
    preemption with no retry left, an interrupt, a failure after the job ran); return one
    sentence per cluster saying what was kept and where. Never raises: a disk that cannot
    take the copy has the outputs moved out of teardown's reach whole."""
    said: list[str] = []
    try:
        compute = get_backend(placement.backend, placement)
        owned = compute.list_owned({RUN_LABEL: flow_run_id})
    except Exception as exc:  # its service is away: teardown names it too
        logging.getLogger(__name__).warning("outputs not kept from %s: %s", placement.backend, exc)
        return said
    for cluster in owned:
        try:
            with compute.outputs_here(cluster) as outputs:
                kept = _keep_from(outputs, artifacts, redact)
        except _NotKept as exc:
            said.append(str(exc))
        except Exception as exc:  # a host or service that does not answer: named
            said.append(f"the job's outputs could not be brought from {placement.backend}: {exc}")
        else:
            said += [kept] if kept else []
    return said


class _NotKept(Exception):
    """The job's outputs could be neither copied nor moved: where they are stays as is."""


def _keep_from(outputs: Path, artifacts: Path, redact: Callable[[str], str]) -> str | None:
    """Copy the job's `outputs` folder into `artifacts`, or move it whole out of
    teardown's reach when that disk cannot take it; return what was done (None: the job
    wrote nothing). Raises _NotKept when neither could be done."""
    if outputs.is_symlink() or not outputs.is_dir() or not any(outputs.iterdir()):
        return None
    try:
        make_dirs(artifacts)
        left_out = copy_outputs(outputs, artifacts / "outputs", redact)
    except OSError as exc:
        try:
            kept = keep_whole(outputs, gpuflow_home() / "kept")
        except OSError:
            raise _NotKept(f"the job's outputs could not be kept ({exc.strerror or exc})") from exc
        return (
            f"the job's outputs could not be copied to {artifacts} ({exc.strerror or exc});"
            f" they are kept whole in {kept}"
        )
    files = sum(len(names) for _, _, names in os.walk(artifacts / "outputs"))
    left = f" ({len(left_out)} left out: {', '.join(left_out[:3])})" if left_out else ""
    return f"the job's outputs were kept: {files} file(s) in {artifacts / 'outputs'}{left}"
