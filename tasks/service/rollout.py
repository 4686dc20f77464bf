"""A new version of a service rolled out while it serves: offered (versions.propose),
taken or refused, then replicas replaced one at a time (a surge replica of the new version
first where a slot is free), rolled back when the new version's replica never becomes
ready."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuflow.tasks.service import proxy, versions
from gpuflow.tasks.service.model import ServiceJob
from gpuflow.tasks.service.scaling import Targets

if TYPE_CHECKING:
    from gpuflow.tasks.service.serve import Service


def take_offer(service: Service) -> None:
    """Take a new version of the job offered (versions.propose), or say why not."""
    service._offer_ns, offer, unreadable = versions.offered(service.folder, service._offer_ns)
    if offer is None and unreadable is None:
        return
    why = unreadable or versions.refusal(service.job, offer)  # type: ignore[arg-type]
    if why is not None or offer is None:
        service._say("warning", f"new version refused: {why}")
        _answer(service, "refused", str(why))
        return
    service._previous = (service.version, service.job)
    service._latest += 1
    service.version, service.job = service._latest, versions.taken(service.job, offer)
    service.scaler.targets = targets(service.job)
    said = f"version {service.version} rolling out: replicas replaced one at a time"
    service._say("info", said)
    service.event(
        "gpuflow.service.rolling",
        {"version": service.version, "command": service.job.command},
    )
    _answer(service, "rolling", said)


def roll(service: Service, runtime: proxy.Runtime) -> None:
    """One step of a roll to the current version: start a replica of it where a slot
    is free, and once it is ready retire one replica of another version (drained);
    with no slot free, retire one first. A replica of the new version that ends
    without ever being ready rolls the service back to the version before."""
    counted = [r for r in service.replicas if r.counted]
    stale = [r for r in counted if r.version != service.version]
    failed = [
        r
        for r in service.replicas
        if r.version == service.version
        and r.state == "ended"
        and r.ready_at is None
        and r.why_ended not in ("scaled down", "the service ended")
    ]
    if failed and service._previous is not None and stale:
        version, job = service._previous
        why = f"{failed[0].name} of version {service.version} never became ready ({failed[0].why_ended})"
        service._say("warning", f"rolled back to version {version}: {why}")
        service.event("gpuflow.service.rolled_back", {"version": version, "why": why})
        _answer(service, "rolled back", why)
        service.version, service.job = version, job
        service._previous, service._surge = None, None
        service.scaler.targets = targets(job)
        return
    if not stale:
        if service._previous is not None:
            said = f"version {service.version} serves on every replica"
            service._say("info", said)
            service.event("gpuflow.service.rolled", {"version": service.version})
            _answer(service, "done", said)
            service._previous, service._surge = None, None
        return
    if any(r.version == service.version and r.state == "starting" for r in counted):
        return  # its successor is still starting
    victims = sorted(stale, key=lambda r: (r.state == "ready", r.started))
    replaced = f"replaced by version {service.version}"
    if service._surge is not None and service._surge.state == "ready":
        service._surge = None
        service._submit(service._end, victims[0], runtime, replaced, True)  # drained
        return
    taken = {r.slot for r in service.replicas if r.state != "ended"}
    free = [slot for slot in range(service.job.replicas.max) if slot not in taken]
    if free:
        service._start_replica(runtime, free[0])
        service._surge = service.replicas[-1]
    elif not any(r.state == "draining" for r in service.replicas):
        # every slot serves: one replica out first, the scaler refills its slot
        service._submit(service._end, victims[0], runtime, replaced, True)


def targets(job: ServiceJob) -> Targets:
    """Return what the scaler aims at for `job` (its replicas and scaling sections)."""
    return Targets(
        least=job.replicas.min,
        most=job.replicas.max,
        gpu_util=job.scaling.gpu_util,
        rps=job.scaling.rps,
        connections=job.scaling.connections,
        down_after_s=job.scaling.down_after_s,
        to_zero_after_s=job.idle_to_zero_s,
    )


def _answer(service: Service, state: str, said: str) -> None:
    """Tell whoever offered the version how its roll stands (versions.propose waits on it)."""
    versions.answer(
        service.folder,
        versions.Answer(offer=service._offer_ns, version=service.version, state=state, said=said),
    )
