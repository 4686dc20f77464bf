"""An elastic fleet grows and shrinks: runs waiting for GPUs record what they want
(`Grower`), `grow` launches instances for them, `scale` keeps the fleet within its bounds
and retires idle instances."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuflow.tasks.backends import elastic
from gpuflow.tasks.backends.base import say_in_run
from gpuflow.tasks.backends.fleet.session import Busy
from gpuflow.tasks.backends.fleet.unit import host_status
from gpuflow.tasks.contract import (
    RUN_LABEL,
)
from gpuflow.tasks.errors import (
    InvalidSpec,
    ProvisionError,
)
from gpuflow.tasks.spec import JobSpec

if TYPE_CHECKING:
    from gpuflow.blocks.gpu_fleet import FleetHost, GpuFleet
    from gpuflow.tasks.backends.fleet.backend import FleetBackend


class Grower:
    """A run waiting for GPUs on an elastic fleet: its want is recorded where every
    orchestrator sees it, and each step grows the fleet by what all waiting runs need
    (`elastic.plan_growth`), taking slots by conditional writes."""

    every_s = 2.0

    def __init__(self, backend: FleetBackend, nodes: elastic.Nodes, spec: JobSpec, run: str):
        section = backend.fleet().elastic
        assert section is not None
        self.backend, self.nodes, self.section = backend, nodes, section
        self.boot_s = nodes.boot_timeout_s()
        now = time.time()
        self.want = elastic.Want(
            run=run,
            gpus=spec.resources.gpus,
            nodes=spec.resources.nodes,
            since=now,
            until=now + spec.placement.gpu_wait + section.grow_after_s + self.boot_s + 60,
        )
        nodes.want(self.want)
        self.next_at = 0.0
        self.deadline = time.monotonic()

    def step(self, refused: list[str]) -> float:
        """Grow the fleet if the waiting runs need it; return until when this run waits
        (a launch gives it the boot timeout). `refused`: the hosts this run's last try
        found busy (an instance it has not tried yet may still serve it)."""
        if sorted(refused) != self.want.tried:
            self.want.tried = sorted(refused)
            self.nodes.want(self.want)
        if time.monotonic() < self.next_at:
            return self.deadline
        self.next_at = time.monotonic() + self.every_s
        if grow(self.backend, self.nodes, say_in_run):
            self.deadline = time.monotonic() + self.boot_s + 30
        if self.booting():
            self.deadline = max(self.deadline, time.monotonic() + 5)
        elif time.time() - self.want.since < self.section.grow_after_s + self.every_s:
            self.deadline = max(
                self.deadline,
                time.monotonic() + self.section.grow_after_s + self.every_s,
            )
        return self.deadline

    def booting(self) -> bool:
        return any(not i.known_hosts or i.state != "running" for i in self.nodes.instances())

    def done(self) -> None:
        with contextlib.suppress(Exception):
            self.nodes.unwant(self.want.run)


def grow(backend: FleetBackend, nodes: elastic.Nodes, say: Callable[[str], None]) -> list[str]:
    """Launch the instances the fleet's waiting runs need, beyond those booting; return
    their ids. Every process that runs this at once takes different slots (or none)."""
    section = backend.fleet().elastic
    assert section is not None
    gpus, _product, _hourly = nodes.instance_gpus()
    live = {i.id: i for i in nodes.instances()}
    for instance_id in _forget_gone(nodes, set(live)):
        say(f"fleet {backend.fleet_name}: {instance_id} is no longer running; its slot is free")
    slots = nodes.slots()
    wants = nodes.wants()
    booting = sum(
        1
        for record in slots.values()
        if not record.get("instance")
        or (
            record["instance"] not in live and time.time() - record.get("at", 0) < 30
        )  # launched, not described yet
        or (record["instance"] in live and not live[record["instance"]].known_hosts)
    )
    # a ready instance some waiting run has not tried yet may serve it: capacity to come
    booting += sum(
        1
        for i in live.values()
        if i.known_hosts and i.state == "running" and any(i.id not in w.tried for w in wants)
    )
    count, why = elastic.plan_growth(
        wants,
        booting,
        len(slots),
        section.nodes.max,
        gpus,
        time.time(),
        section.grow_after_s,
    )
    launched: list[str] = []
    free = [k for k in range(section.nodes.max) if k not in slots]
    for slot in free[:count]:
        instance = _launch_into(nodes, slot, say)
        if instance is None:
            continue  # another process took it: it launches that one
        launched.append(instance.id)
        say(f"fleet {backend.fleet_name}: grew by {instance.id} ({why})")
    return launched


def scale(backend: FleetBackend, say: Callable[[str], None]) -> list[elastic.Decision]:
    """One period of an elastic fleet's scaler; return what it decided and why.

    - slots whose instance is gone (ended elsewhere, a spot reclaim) are freed, and wants
      past their time forgotten;
    - an instance that has not published its host key within the boot timeout is ended;
    - the fleet grows for the runs that have waited longer than `grow_after_s`, and up to
      `nodes.min`;
    - an instance with no claim for `idle_duration_s` (since its last claim ended, or its
      launch) is ended, down to `nodes.min`: its GPUs are claimed first, so no run takes
      it meanwhile; what it cost and how much of it runs used goes to the fleet's ledger.

    The hysteresis: growth needs a wait of `grow_after_s`, an end an idle time of
    `idle_duration_s` (at least 10 s, 600 by default), so an instance launched for a burst
    serves every run that comes within idle_duration_s of the last one."""
    nodes, section = backend.nodes(), backend.fleet().elastic
    if nodes is None or section is None:
        raise InvalidSpec(
            f"fleet {backend.fleet_name!r} has no cloud to grow on (ec2:, alibaba: or"
            " tencent:): nothing to scale."
        )
    now = time.time()
    live = {i.id: i for i in nodes.instances()}
    decisions = _tidy(nodes, live, now, say)
    for instance_id in grow(backend, nodes, say):
        decisions.append(elastic.Decision(action="grow", instance=instance_id, why="runs waited"))
    while len(slots := nodes.slots()) < section.nodes.min:
        free = [k for k in range(section.nodes.max) if k not in slots]
        made = _launch_into(nodes, free[0], say) if free else None
        if made is None:
            break
        decisions.append(
            elastic.Decision(action="grow", instance=made.id, why=f"below min {section.nodes.min}")
        )
    fleet = backend.fleet()
    ready = {h.label: h for h, _ in backend.hosts() if h.label in live}
    count = len(live)
    for instance in sorted(live.values(), key=lambda i: i.launched_at):
        host = ready.get(instance.id)
        if host is None:
            continue
        said = host_status(fleet, host)
        usage = said.get("usage", {})
        idle = now - max(instance.launched_at.timestamp(), float(usage.get("last_release", 0)))
        why = kept_because(said, idle, section, count)
        if why is None and not _retire(backend, fleet, host, instance, nodes, say, usage, now):
            why = "a run claimed it meanwhile"
        if why is not None:
            decisions.append(elastic.Decision(action="keep", instance=instance.id, why=why))
            continue
        count -= 1
        decisions.append(
            elastic.Decision(action="shrink", instance=instance.id, why=f"idle for {idle:.0f} s")
        )
    return decisions


def kept_because(said: dict[str, Any], idle: float, section: Any, count: int) -> str | None:
    """Return why an instance stays (its host's answer `said`, idle for `idle` s, the fleet
    at `count` instances), None when it is to be ended."""
    if "error" in said:
        return str(said["error"])
    if said.get("runs"):
        return f"{len(said['runs'])} run(s) hold its GPUs"
    if idle < section.idle_duration_s:
        return f"idle {idle:.0f} s of idle_duration {section.idle_duration_s:.0f} s"
    if count <= section.nodes.min:
        return f"the fleet's min is {section.nodes.min}"
    return None


def _tidy(
    nodes: elastic.Nodes,
    live: dict[str, elastic.Instance],
    now: float,
    say: Callable[[str], None],
) -> list[elastic.Decision]:
    """Free the slots of instances gone elsewhere, forget wants past their time, end the
    instances that did not publish their host key within the boot timeout (out of `live`)."""
    decisions = [
        elastic.Decision(
            action="forget",
            instance=instance_id,
            why="it is no longer running (ended outside the fleet, or a spot reclaim)",
        )
        for instance_id in _forget_gone(nodes, set(live))
    ]
    for want in nodes.wants():
        if want.until < now:
            nodes.unwant(want.run)
    boot_s = nodes.boot_timeout_s()
    for instance in list(live.values()):
        if not instance.known_hosts and now - instance.launched_at.timestamp() > boot_s:
            nodes.end([instance.id], say)
            _forget(nodes, instance)
            live.pop(instance.id)
            why = f"it did not publish its host key within the boot timeout ({boot_s:.0f} s)"
            decisions.append(elastic.Decision(action="shrink", instance=instance.id, why=why))
    return decisions


def _launch_into(
    nodes: elastic.Nodes, slot: int, say: Callable[[str], None]
) -> elastic.Instance | None:
    """Take `slot` and launch its instance; None when another process took it first."""
    if not nodes.take_slot(slot, {"at": time.time(), "by": os.getpid()}):
        return None
    try:
        instance = nodes.launch(slot, say)
    except Exception:
        nodes.free_slot(slot)
        raise
    nodes.set_slot(slot, {"at": time.time(), "instance": instance.id})
    return instance


def _forget_gone(nodes: elastic.Nodes, live: set[str]) -> list[str]:
    """Free the slots whose instance no longer runs (ended outside the fleet, a spot
    reclaim) or was never launched (its launcher died); return those instances."""
    now, gone = time.time(), []
    for slot, record in sorted(nodes.slots().items()):
        instance = record.get("instance")
        if instance and instance not in live and now - record.get("at", now) > 30:
            nodes.free_slot(slot)
            gone.append(instance)
        elif not instance and now - record.get("at", now) > 120:
            nodes.free_slot(slot)
    return gone


def _retire(
    backend: FleetBackend,
    fleet: GpuFleet,
    host: FleetHost,
    instance: elastic.Instance,
    nodes: elastic.Nodes,
    say: Callable[[str], None],
    usage: dict[str, float],
    now: float,
) -> bool:
    """Claim every GPU of an idle instance (no run can take it meanwhile), end it and
    record what it cost; False when a run holds a GPU of it now."""
    request = {
        "resources": {"gpus": instance.gpus},
        "owner": {RUN_LABEL: f"fleet-scale-{uuid.uuid4().hex[:8]}"},
        "job": "fleet-scale",
        "counts": False,
    }
    try:
        session = backend._open(fleet, host, request)
    except (Busy, ProvisionError, InvalidSpec, TimeoutError):
        return False
    try:
        nodes.end([instance.id], say)
    finally:
        session.close()
    _forget(nodes, instance)
    nodes.ended(instance.id, elastic.cost_of(instance, usage, now) | {"ended_at": now})
    return True


def _forget(nodes: elastic.Nodes, instance: elastic.Instance) -> None:
    if instance.slot is not None:
        nodes.free_slot(instance.slot)
