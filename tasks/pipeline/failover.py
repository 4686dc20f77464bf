"""A pool's choice, asked and told: each candidate's offer read at once (the `place`
task), the placement table artifact, its log lines and the events an automation can
follow (gpuflow.placement.chosen, gpuflow.placement.failover); and what each candidate
the run used cost it. The order and the words are tasks/pipeline/pool.py's."""

from __future__ import annotations

import contextvars
import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from gpuflow.tasks.api_client import emit_run_event, publish
from gpuflow.tasks.backends.registry import get_backend
from gpuflow.tasks.contract import Cluster, Offer, RunOutcome
from gpuflow.tasks.errors import (
    CapacityError,
    GpuflowError,
    PreemptedError,
    Unreachable,
    retry_unless,
)
from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.pipeline.costs import hourly_paid
from gpuflow.tasks.pipeline.gate import QuotaYield, gate_of
from gpuflow.tasks.pipeline.pool import (
    Candidate,
    Use,
    candidate_name,
    moves_on_preempt,
    next_after,
    none_left,
    order,
    placed_line,
    table,
)
from gpuflow.tasks.pipeline.running import run_stage
from gpuflow.tasks.pipeline.stages import (
    preflight,
    provision,
    retrying,
    teardown_owned,
    unprovisioned,
)
from gpuflow.tasks.pipeline.stopping import cancel_requested
from gpuflow.tasks.spec import JobSpec

CHOSEN_EVENT = "gpuflow.placement.chosen"
FAILOVER_EVENT = "gpuflow.placement.failover"
logger = logging.getLogger(__name__)


def offers_of(pool: list[tuple[JobSpec, PriceTable]]) -> list[tuple[Candidate, list[Offer]]]:
    """Return each candidate (with its best offer) and all its offers now, every backend
    asked at once; one that fails to answer is a candidate that says why."""

    def ask(index: int) -> tuple[Candidate, list[Offer]]:
        job, prices = pool[index]
        name = candidate_name(job.placement)
        try:
            found = get_backend(job.placement.backend, job.placement).offers(job, prices)
        except GpuflowError as exc:
            return Candidate(index=index, name=name, error=str(exc)), []
        except Exception as exc:  # an offer is advice: a backend's bug must not stop the run
            logger.warning("offers of %s failed", name, exc_info=True)
            return Candidate(index=index, name=name, error=f"{type(exc).__name__}: {exc}"), []
        best = found[0] if found else None
        error = "" if found else "no offer"
        return Candidate(index=index, name=name, offer=best, error=error), found

    # each asks in the caller's context: its run scope holds what the checks read already
    contexts = [contextvars.copy_context() for _ in pool]
    with ThreadPoolExecutor(max_workers=len(pool), thread_name_prefix="offers") as asking:
        return list(asking.map(lambda i: contexts[i].run(ask, i), range(len(pool))))


@task(name="place", cache_policy=NO_CACHE)
def place(pool: list[tuple[JobSpec, PriceTable]]) -> list[Candidate]:
    """Return the pool's candidates in the order its policy tries them, each with its best
    offer now (every backend asked at once; one that fails to answer says why)."""
    spec = pool[0][0]
    candidates = [c for c, _ in offers_of(pool)]
    ranked = order(spec.placement_policy.choose, candidates)
    log = get_run_logger()
    for c in ranked:
        offer = c.offer
        said = (
            f"{offer.where}, ${offer.hourly_usd:.2f}/h,"
            f" {'can start now' if offer.can_start else 'cannot start now: ' + offer.why_not}"
            if offer
            else f"no offer: {c.error}"
        )
        log.info("candidate [%d] %s: %s", c.index, c.name, said)
    return ranked


def publish_table(spec: JobSpec, candidates: list[Candidate]) -> None:
    """Publish the placement table: each candidate, its offer, the verdict and why."""
    hours = spec.limits.max_duration / 3600
    publish(
        create_table_artifact,
        key="gpuflow-placement",
        table=table(candidates, spec.placement_policy, hours),
        description=f"Placement of {spec.name} ({spec.placement_policy.choose})",
    )


def tell(
    spec: JobSpec, candidates: list[Candidate], run_id: str, event: str, **payload: Any
) -> None:
    """Publish the placement table and send `event` with the candidates' names."""
    publish_table(spec, candidates)
    named = [c.name for c in sorted(candidates, key=lambda c: c.index)]
    said = {"flow_run_id": run_id, "job": spec.name, "candidates": named, **payload}
    if not emit_run_event(event, f"gpuflow.run.{run_id}", spec.name, run_id, said):
        logger.warning("the %s event was not sent", event)


def use_of(
    candidate: Candidate, spec: JobSpec, cluster: Cluster, prices: PriceTable, ended: str
) -> Use:
    """Return what `cluster` held from its making until now, at the price it is paid (the
    backend's, an EC2 offer's spot price, else the price table's)."""
    held = max(0.0, (datetime.now(UTC) - cluster.created_at).total_seconds())
    return Use(
        candidate=candidate.name,
        backend=cluster.backend,
        ended=ended,
        held_s=held,
        gpus=len(cluster.gpu_indices) * cluster.nodes,
        hourly_usd=hourly_paid(spec, cluster, prices),
    )


class Placed(BaseModel):
    """Where a pool's job ran to its end: the candidate, its cluster, preflight's
    verdict, the run's outcome, and what earlier candidates it used held and cost."""

    candidate: Candidate
    cluster: Cluster
    verdict: str
    outcome: RunOutcome
    earlier: list[Use] = []
    pooled: bool = True  # placed among several candidates (its summary splits the cost)


def place_on(
    pool: list[tuple[JobSpec, PriceTable]],
    run_id: str,
    owner: dict[str, str],
    idle: str | None = None,
) -> Placed:
    """Run the job on the first candidate, in the policy's order, that gives it its GPUs
    and runs it to its end; one placement is a pool of one. A candidate that cannot give
    the GPUs within its gpu_wait (CapacityError at provision or while its units wait) is
    given up and what it made removed; a job preempted where the policy moves it on
    resumes on the next candidate that can start it (at most retry.run.retries moves).
    CapacityError naming every candidate's reason when none is left. A pool of one has no
    next: its stages retry what may succeed on a retry, and its errors are its own. With
    `idle` (why there is nothing to do), nothing is provisioned: the run stage and collect
    work in a folder here."""
    alone = len(pool) == 1 or idle is not None
    spec = pool[0][0]
    ranked = [Candidate(index=0, name=candidate_name(spec.placement))] if alone else place(pool)
    queue = list(ranked)
    earlier: list[Use] = []
    moves = 0
    while queue:
        candidate = queue.pop(0)
        job, prices = pool[candidate.index]
        moving = not alone and moves_on_preempt(spec.placement_policy, candidate.offer)
        # a pool hands capacity (and, where it moves on, a preemption) to the next
        # candidate instead of retrying the same one
        handed_on: tuple[type[Exception], ...] = (
            () if alone else (CapacityError, Unreachable, *([PreemptedError] if moving else []))
        )
        cluster: Cluster | None = None
        gate = gate_of(run_id)
        try:
            if gate is not None and idle is None:  # its quota's turn before any GPU is taken
                gate.wait(cancel_requested(run_id))
            cluster, verdict = _provisioned(job, owner, idle, handed_on)
            if not alone:
                candidate.verdict, candidate.reason = "chosen", _chosen_reason(candidate, moves)
                get_run_logger().info("%s", placed_line(candidate, ranked))
                tell(spec, ranked, run_id, CHOSEN_EVENT, chosen=candidate.name)
            outcome = run_stage(job, cluster, prices, run_id, handed_on)
        except (CapacityError, Unreachable) as exc:  # full, or its service is away
            if alone:
                raise
            _give_up(spec, ranked, candidate, queue, exc, run_id)
            _release(job, run_id, cluster, candidate, prices, "given up", earlier)
            continue
        except QuotaYield as exc:  # borrowed GPUs given back: wait again, resume here
            _release(job, run_id, cluster, candidate, prices, "preempted", earlier)
            get_run_logger().warning("%s", exc)
            if gate is not None:
                gate.requeue()
            queue.insert(0, candidate)
            continue
        except PreemptedError as exc:
            if not moving or moves >= spec.retry.run.retries or cluster is None:
                raise
            moves += 1
            candidate.verdict, candidate.reason = "preempted", str(exc).split(";")[0]
            _release(job, run_id, cluster, candidate, prices, "preempted", earlier)
            queue = next_after(ranked, candidate)
            get_run_logger().warning(
                "failover: %s was preempted; the job resumes on %s", candidate.name, queue[0].name
            )
            tell(spec, ranked, run_id, FAILOVER_EVENT, preempted=candidate.name, next=queue[0].name)
            continue
        if moves:
            tell(spec, ranked, run_id, CHOSEN_EVENT, chosen=candidate.name, ended=True)
        return Placed(
            candidate=candidate,
            cluster=cluster,
            verdict=verdict,
            outcome=outcome,
            earlier=earlier,
            pooled=not alone,
        )
    sentence = none_left(ranked)
    get_run_logger().error("%s", sentence)
    publish_table(spec, ranked)
    raise CapacityError(sentence)


def _provisioned(
    job: JobSpec, owner: dict[str, str], idle: str | None, handed_on: tuple[type[Exception], ...]
) -> tuple[Cluster, str]:
    """Return the candidate's cluster and preflight's verdict: provisioned and checked,
    or, for a job with nothing to do, a folder here and "skipped"."""
    if idle:  # a rerun with nothing left to do: nothing is provisioned for it
        get_run_logger().info("nothing to provision: %s", idle)
        return unprovisioned(job, owner), "skipped"
    condition = retry_unless(*handed_on)
    cluster = retrying(provision, job.retry.provision, condition)(job, owner)
    return cluster, retrying(preflight, job.retry.preflight)(job, cluster).verdict


def _give_up(
    spec: JobSpec,
    ranked: list[Candidate],
    candidate: Candidate,
    queue: list[Candidate],
    why: Exception,
    run_id: str,
) -> None:
    """Mark a candidate that cannot give the GPUs (or whose service is away) given up,
    and say which is next."""
    candidate.verdict, candidate.reason = "given up", str(why).rstrip(".")
    following = queue[0].name if queue else "none left"
    get_run_logger().warning("failover: %s gave up (%s); next: %s", candidate.name, why, following)
    tell(spec, ranked, run_id, FAILOVER_EVENT, given_up=candidate.name, next=following)


def _chosen_reason(candidate: Candidate, moves: int) -> str:
    if moves:
        return "resumed here after a preemption"
    if candidate.can_start:
        return "can start now"
    return "gave the GPUs within its gpu_wait"


def _release(
    job: JobSpec,
    run_id: str,
    cluster: Cluster | None,
    candidate: Candidate,
    prices: PriceTable,
    ended: str,
    earlier: list[Use],
) -> None:
    """Tear down what a candidate given up or preempted made, noting what it held. One
    whose service does not answer is named: its owner labels and deadlines stand, and
    `gpuflow reap` finds what it made once it answers."""
    if cluster is not None and ended == "preempted":
        earlier.append(use_of(candidate, job, cluster, prices, ended))
    try:
        teardown_owned(job.placement, run_id)
    except Unreachable as exc:
        get_run_logger().warning(
            "%s: what this run made there could not be checked now (%s); `gpuflow reap` removes"
            " it once it answers",
            candidate.name,
            exc,
        )
