"""An elastic fleet: instances a cloud makes for the fleet as runs wait for GPUs, served
like any other host (SSH, the host program, claims as leases), ended when idle.

The fleet's shared records live where every orchestrator reaches them (under the cloud
settings block's control prefix in its object storage), so growth is decided the same way by every process:

    fleets/<name>/slots/<k>        one per instance the fleet may have (k < nodes.max),
                                   made with a conditional write (if none exists): the
                                   fleet never has more than max, and two processes that
                                   decide to grow at once take different slots or none
    fleets/<name>/wants/<run>      a run waiting for GPUs: per node, nodes, since when
    fleets/<name>/hosts/slot-<k>.pub  the slot's instance's SSH host key line, written
                                   by the instance at boot (never in its user-data)
    fleets/<name>/ended/<instance> what an ended instance cost and how much of it was used

`plan_growth` is pure: how many new instances the waiting runs need beyond the slots that
are booting. `Nodes` is what a cloud gives: gpuflow.tasks.backends.instances.fleet over
any instance backend's provider (EC2, Alibaba Cloud ECS, Tencent Cloud CVM), connected by
the backends' registry, since no backend imports another.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from pydantic import BaseModel


class Instance(BaseModel):
    """One instance of an elastic fleet, as the cloud and its slot record say."""

    id: str
    slot: int | None = None
    address: str = ""
    instance_type: str = ""
    gpus: int = 0
    product: str = ""
    market: str = ""
    state: str = ""  # pending | running
    launched_at: datetime
    known_hosts: str | None = None  # its host key line, once it published it
    hourly_usd: float = 0.0


class Want(BaseModel):
    """A run waiting for GPUs on the fleet."""

    run: str
    gpus: int  # per node
    nodes: int
    since: float  # epoch seconds
    until: float  # epoch seconds: it gives up then (a want past it is stale)
    tried: list[str] = []  # the hosts its last try found busy


class Decision(BaseModel):
    """One thing the scaler did or chose not to do, and why."""

    action: str  # grow | shrink | keep
    instance: str = ""
    why: str


class Nodes(Protocol):
    """What a cloud provides an elastic fleet."""

    def instance_gpus(self) -> tuple[int, str, float]:
        """Return a new instance's GPUs, product and hourly price (its first type's)."""
        ...

    def instances(self) -> list[Instance]:
        """Return the fleet's instances that are pending or running."""
        ...

    def boot_timeout_s(self) -> float:
        """Return how long an instance may take to publish its host key."""
        ...

    def launch(self, slot: int, say: Callable[[str], None]) -> Instance: ...

    def end(self, instance_ids: list[str], say: Callable[[str], None]) -> None: ...

    def slots(self) -> dict[int, dict[str, Any]]: ...

    def take_slot(self, slot: int, record: dict[str, Any]) -> bool:
        """Make the slot's record if none exists; False when another process has it."""
        ...

    def set_slot(self, slot: int, record: dict[str, Any]) -> None: ...

    def free_slot(self, slot: int) -> None: ...

    def wants(self) -> list[Want]: ...

    def want(self, want: Want) -> None: ...

    def unwant(self, run: str) -> None: ...

    def ended(self, instance_id: str, record: dict[str, Any]) -> None: ...

    def ledger(self) -> list[dict[str, Any]]: ...

    def remove_all(self, say: Callable[[str], None]) -> None:
        """Remove what the fleet made besides instances (its security group, records)."""
        ...


# The clouds an elastic fleet can grow on: name -> a maker of its Nodes from the fleet's
# section (GpuFleet.ec2, .alibaba, .tencent), the fleet's name and the public key its instances let in.
# Filled by the backends' registry.
CLOUDS: dict[str, Callable[[Any, str, str], Nodes]] = {}


def cost_of(instance: Instance, usage: dict[str, float], now: float) -> dict[str, Any]:
    """Return what `instance` has cost by `now`: hours up, GPU-hours used by claims (its
    host's `usage`), cost and idle cost (the hours no claim used, at its price)."""
    hours = max(0.0, now - instance.launched_at.timestamp()) / 3600
    used = float(usage.get("used_gpu_s", 0.0)) / 3600 / max(1, instance.gpus)
    return {
        "instance": instance.id,
        "instance_type": instance.instance_type,
        "market": instance.market,
        "state": instance.state,
        "hours": hours,
        "used_hours": used,
        "cost_usd": hours * instance.hourly_usd,
        "idle_cost_usd": max(0.0, hours - used) * instance.hourly_usd,
    }


def plan_growth(
    wants: list[Want],
    booting: int,  # instances that will serve waiting runs: booting, or ready and untried
    taken: int,
    most: int,
    per_instance: int,
    now: float,
    grow_after_s: float,
) -> tuple[int, str]:
    """Return how many instances to launch for the runs that have waited `grow_after_s` or
    longer, beyond `booting` ones that will serve them, never above `most` slots in all
    (`taken` now), and why. Each node takes an instance with per_instance GPUs, several
    nodes of different runs share one when they fit (a run's own nodes never do)."""
    ready = [w for w in wants if now - w.since >= grow_after_s and w.until > now]
    if not ready:
        return 0, "no run has waited for GPUs long enough to grow"
    needed = len(_packed(ready, per_instance))
    launch = max(0, min(needed - booting, most - taken))
    waiting = f"{len(ready)} run(s) waiting need {needed} instance(s), {booting} booting"
    if launch == 0 and needed > booting:
        return 0, f"{waiting}; the fleet is at its max of {most}"
    return launch, waiting


def _packed(wants: list[Want], per_instance: int) -> list[tuple[int, set[str]]]:
    """Return the instances the wants' nodes fill (first fit, largest nodes first): each
    its free GPUs and the runs on it; a run's nodes go on different instances."""
    bins: list[tuple[int, set[str]]] = []
    for w in sorted(wants, key=lambda w: -w.gpus):
        for _node in range(w.nodes):
            for i, (free, runs) in enumerate(bins):
                if free >= w.gpus and w.run not in runs:
                    bins[i] = (free - w.gpus, runs | {w.run})
                    break
            else:
                bins.append((per_instance - w.gpus, {w.run}))
    return bins
