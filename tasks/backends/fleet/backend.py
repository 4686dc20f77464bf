"""The fleet backend: GPU servers that outlive a run (a GpuFleet block's hosts, reached over
SSH), shared by GPU between every gpuflow process that uses them.

A run holds each node's GPUs through gpuflow's host program on that host (`remote serve`,
the local backend there): the claim is made on the host itself, atomically, so two CI jobs,
a worker and a person never get the same GPU, and it is a lease this process renews over
the connection: a killed orchestrator's GPUs come free, and its units stop, once the lease
lapses. A host lost mid-run (its network or sshd gone) ends its units as a preemption.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from gpuflow.tasks.backends import elastic, imaging
from gpuflow.tasks.backends.base import LogTail, UnitBackend
from gpuflow.tasks.backends.fleet import hosts as fleet_hosts
from gpuflow.tasks.backends.fleet.growth import Grower
from gpuflow.tasks.backends.fleet.session import Busy, HostSession
from gpuflow.tasks.backends.fleet.state import (
    PYTHON,
    STAGED,
    FleetPlacement,
    FleetState,
    HostHold,
    api_url,
    fleet_block,
    record_path,
    secret_text,
)
from gpuflow.tasks.backends.fleet.unit import (
    FleetUnit,
    SampleWriter,
    host_status,
    installed_wheel,
    remote_json,
    untar,
)
from gpuflow.tasks.contract import (
    RUN_LABEL,
    Capabilities,
    Cluster,
    Needs,
    Offer,
    ReapReport,
    RunStates,
    StopCheck,
    TeardownReport,
    WorkUnit,
    run_port,
    state_of,
)
from gpuflow.tasks.errors import (
    CapacityError,
    InvalidSpec,
    JobCancelled,
    ProvisionError,
)
from gpuflow.tasks.host import (
    gpuflow_home,
    make_dirs,
    state_records,
    write_atomic,
)
from gpuflow.tasks.metrics.cost import PriceTable, hourly_rate
from gpuflow.tasks.metrics.sampler import NODE_SAMPLES
from gpuflow.tasks.spec import JobSpec, Placement, Resources
from gpuflow.tasks.ssh import public_key_of
from gpuflow.tasks.storage import S3Settings

if TYPE_CHECKING:
    from gpuflow.blocks.gpu_fleet import FleetHost, GpuFleet, HostCheck


# The host programs this process holds, by cluster name: they live from provision to
# teardown (a teardown in another process asks each host to tear the run down instead).
_SESSIONS: dict[str, list[HostSession]] = {}


_DROPPED: dict[str, set[int]] = {}  # by cluster name: its nodes given back (drop_node)


_SESSIONS_LOCK = threading.Lock()


def image_request(spec: JobSpec) -> dict[str, Any]:
    """What a host needs to run the run's units in its image: the pinned reference, whose
    they run as, and the registry's login (sent on the host program's input, never on a
    command line)."""
    if spec.image is None:
        return {}
    username, password = imaging.credentials_of(spec)
    image = spec.image.model_dump(mode="json", include={"ref", "digest", "user", "pull"})
    login = {"username": username, "password": password} if username else None
    return {"image": image, "registry_login": login}


class FleetBackend(UnitBackend):
    """A GpuFleet's hosts over SSH: GPUs claimed on the hosts as leases."""

    name = "fleet"
    capabilities = Capabilities(
        runs_here=False,
        where="the fleet's hosts",
        local_files=False,
        samples_nodes=True,
        node_samples_in_workspace=True,  # the hosts' samples are written here as they come
        adds_nodes=True,  # a service's replicas each claim GPUs on a host of their own
        runs_images=True,  # each host's engine pulls the run's pinned image (image:)
    )
    placement_model: ClassVar[type[Placement]] = FleetPlacement

    def pin_image(self, spec: JobSpec, needs: Needs, say: Callable[[str], None]) -> JobSpec:
        """The image's digest from its registry, asked from here; each host pulls it."""
        return spec if spec.image is None else imaging.pin_by_registry(spec, say)

    @classmethod
    def block_types(cls) -> list[type]:
        from gpuflow.blocks.gpu_fleet import GpuFleet

        return [GpuFleet]

    @classmethod
    def at(cls, placement: Placement | None = None) -> FleetBackend:
        fleet = placement.fleet if isinstance(placement, FleetPlacement) else None
        return cls(fleet)

    @classmethod
    def reaper(cls, block: str | None, namespace: str | None) -> FleetBackend:
        if not block:
            raise InvalidSpec(
                "--block: name the fleet to reap (gpuflow reap --backend fleet --block NAME)."
            )
        return cls(block)

    @classmethod
    def of(cls, cluster: Cluster) -> FleetBackend:
        return cls(state_of(cluster, FleetState).fleet)

    def __init__(self, fleet: str | None = None, block: GpuFleet | None = None) -> None:
        """`block`: the fleet's GpuFleet when it is not saved yet (else read by name)."""
        self.fleet_name = fleet
        self._fleet: GpuFleet | None = block
        self._nodes: list[elastic.Nodes | None] = []
        self._described: tuple[float, list[elastic.Instance]] = (-1e9, [])

    def fleet(self) -> GpuFleet:
        if self._fleet is None:
            if not self.fleet_name:
                raise InvalidSpec("placement.fleet: name the GpuFleet block the job runs on.")
            self._fleet = fleet_block(self.fleet_name)
        return self._fleet

    def nodes(self) -> elastic.Nodes | None:
        """Return the elastic fleet's instances (None for a fleet of listed hosts only)."""
        if not self._nodes:
            fleet = self.fleet()
            section = fleet.elastic
            if section is None:
                self._nodes.append(None)
            else:
                if not fleet.ssh_key:
                    raise InvalidSpec(
                        f"ssh_key: elastic fleet {self.fleet_name!r} has no ssh_key; name the"
                        " Secret block holding the private key its instances will accept."
                    )
                try:
                    public = public_key_of(secret_text(fleet.ssh_key))
                except ValueError as exc:
                    raise InvalidSpec(f"ssh_key: Secret block {fleet.ssh_key!r}: {exc}") from None
                self._nodes.append(
                    elastic.CLOUDS[section.cloud](section, self.fleet_name or "", public)
                )
        return self._nodes[0]

    def hosts(self) -> list[tuple[FleetHost, HostCheck]]:
        """Return the hosts that serve: the listed ones the last apply found fit, and the
        elastic fleet's running instances that have published their host key."""
        from gpuflow.blocks.gpu_fleet import FleetHost, HostCheck

        fleet = self.fleet()
        found = list(fleet.serving())
        nodes = self.nodes()
        section = fleet.elastic
        if nodes is None or section is None:
            return found
        if time.monotonic() - self._described[0] > 1.0:  # asked of the cloud once a second
            self._described = (time.monotonic(), nodes.instances())
        for instance in self._described[1]:
            if instance.state != "running" or not instance.known_hosts:
                continue
            host = FleetHost(
                address=instance.address,
                name=instance.id,
                user=section.user,
                known_hosts=instance.known_hosts,
                gpus=instance.gpus,
            )
            check = HostCheck(
                host=instance.id,
                ok=True,
                gpus=instance.gpus,
                products=[instance.product],
            )
            found.append((host, check))
        return found

    def host(self, label: str) -> FleetHost | None:
        found = self.fleet().host(label)
        if found is None:
            found = next((h for h, _ in self.hosts() if h.label == label), None)
        return found

    # -- before anything is made ---------------------------------------------------------

    def configure(self, spec: JobSpec, prices: PriceTable) -> tuple[JobSpec, PriceTable]:
        """Price a GPU-hour: the fleet's own price, or on an elastic fleet's instances
        their hourly price shared by their GPUs (each run pays its share)."""
        fleet = self.fleet()
        rate = fleet.gpu_hourly_usd
        nodes = self.nodes()
        if nodes is not None and not rate:
            gpus, _product, hourly = nodes.instance_gpus()
            rate = hourly / max(1, gpus)
        return spec, prices.with_gpu_rate(self.name, rate, 0.0)

    def _fitting(self, spec: JobSpec) -> list[tuple[FleetHost, HostCheck]]:
        """Return the serving hosts with the job's GPUs per node, fewest GPUs first (a
        one-GPU run leaves whole hosts to the runs that need them)."""
        res = spec.resources
        fits = [
            (host, check)
            for host, check in self.hosts()
            if check.gpus >= res.gpus
            and (res.gpu_product is None or res.gpu_product in check.products)
        ]
        return sorted(fits, key=lambda pair: (pair[1].gpus, pair[0].label))

    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        """Raise InvalidSpec when the fleet cannot run `spec` (nothing is claimed)."""
        fleet, name, res = self.fleet(), self.fleet_name, spec.resources
        nodes = self.nodes()
        if not fleet.hosts and nodes is None:
            raise InvalidSpec(f"placement.fleet: fleet {name!r} has no hosts; add them.")
        if fleet.hosts and not fleet.checked:
            raise InvalidSpec(
                f"placement.fleet: fleet {name!r} has not been checked yet; run"
                f" `gpuflow fleet apply {name}` first."
            )
        serving = [(h.label, c.gpus, c.products) for h, c in self.hosts()]
        grown = 0
        section = fleet.elastic
        if nodes is not None and section is not None:
            gpus, product, _hourly = nodes.instance_gpus()
            serving.append((f"a new {section.instance_types[0]}", gpus, [product]))
            grown = section.nodes.max
        if not serving:
            why = "; ".join(f"{c.host}: {c.reason}" for c in fleet.checked if not c.ok)
            raise InvalidSpec(
                f"placement.fleet: no host of fleet {name!r} serves ({why}); fix them and run"
                f" `gpuflow fleet apply {name}`."
            )
        largest_host, largest, _ = max(serving, key=lambda row: row[1])
        if res.gpus > largest:
            raise InvalidSpec(
                f"resources.gpus: {res.gpus} GPU(s) per node is more than any host of fleet"
                f" {name!r} has (the largest, {largest_host}, has {largest}); ask"
                f" for at most {largest} per node, or use more nodes."
            )
        fitting = [
            row
            for row in serving
            if row[1] >= res.gpus and (res.gpu_product is None or res.gpu_product in row[2])
        ]
        if res.gpu_product and not fitting:
            products = sorted({p for row in serving for p in row[2]})
            raise InvalidSpec(
                f"resources.gpu_product: no host of fleet {name!r} has {res.gpu_product}; its"
                f" hosts have {', '.join(products) or 'no GPUs'}."
            )
        room = len([row for row in fitting if not row[0].startswith("a new ")])
        if nodes is not None and any(row[0].startswith("a new ") for row in fitting):
            room = len(fleet.serving()) + grown
        if res.nodes > room:
            raise InvalidSpec(
                f"resources.nodes: {res.nodes} nodes with {res.gpus} GPU(s) each, but fleet"
                f" {name!r} {'can have' if grown else 'has'} {room} host(s) with that many; ask for at most"
                f" {room} nodes."
            )

    def offers(self, spec: JobSpec, prices: PriceTable) -> list[Offer]:
        """Return one offer per host of the fleet that fits the job: its GPUs free now
        (asked of the host), whether the job could start now (enough such hosts)."""
        res = spec.resources
        hourly = hourly_rate(
            prices,
            self.name,
            [res.gpu_product or ""] * res.gpus * res.nodes,
            res.cpu or 1.0,
            res.disk,
        )
        where = f"fleet/{self.fleet_name}"
        fitting = self._fitting(spec)
        growth = self._growth_offer(spec, prices)
        if not fitting:
            if growth is not None:
                return [growth]
            return [
                Offer(
                    where=where,
                    hourly_usd=hourly,
                    can_start=False,
                    why_not="no host fits",
                )
            ]
        fleet = self.fleet()
        free = {host.label: host_status(fleet, host) for host, _found in fitting}
        room = [label for label, said in free.items() if said.get("free", 0) >= res.gpus]
        offers = []
        for host, check in fitting:
            said = free[host.label]
            why = ""
            if "error" in said:
                why = said["error"]
            elif said["free"] < res.gpus:
                why = f"{said['free']} of its {check.gpus} GPU(s) free now"
            elif len(room) < res.nodes:
                why = f"{len(room)} host(s) have {res.gpus} GPU(s) free now, the job needs {res.nodes}"
            offers.append(
                Offer(
                    where=f"{where} {host.label}",
                    gpu_product=check.products[0] if check.products else None,
                    gpus_free=said.get("free"),
                    hourly_usd=hourly,
                    can_start=not why,
                    why_not=why,
                )
            )
        # the hosts that could start it first, the emptiest first among them
        offers.sort(key=lambda o: (not o.can_start, -(o.gpus_free or 0)))
        return offers + ([growth] if growth is not None else [])

    def _growth_offer(self, spec: JobSpec, prices: PriceTable) -> Offer | None:
        """Return what growing an elastic fleet for the job would give and cost (its
        instances' share for the job's GPUs), None for a fleet of listed hosts only."""
        nodes, section = self.nodes(), self.fleet().elastic
        if nodes is None or section is None:
            return None
        res = spec.resources
        gpus, product, hourly = nodes.instance_gpus()
        taken = len(nodes.slots())
        room = section.nodes.max - taken
        why = ""
        if gpus < res.gpus:
            why = f"a new instance has {gpus} GPU(s)"
        elif room < res.nodes:
            why = f"the fleet is at {taken} of its max {section.nodes.max} instance(s)"
        return Offer(
            where=f"fleet/{self.fleet_name} +{res.nodes} x {section.instance_types[0]} (new)",
            gpu_product=product,
            gpus_free=None,
            hourly_usd=hourly * res.nodes * res.gpus / max(1, gpus),
            can_start=False,
            why_not=why or "boots a new instance first",
            preemptible=section.market != "on-demand",
        )

    # -- provision -----------------------------------------------------------------------

    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        """Claim each node's GPUs on a host of its own (fewest GPUs that fit first),
        waiting up to placement.gpu_wait for GPUs other runs hold. A retry in this process
        adopts what it holds. CapacityError when the fleet has too few free."""
        name = f"gpuflow-{owner[RUN_LABEL]}"
        fleet, res = self.fleet(), spec.resources
        with _SESSIONS_LOCK:
            held = _SESSIONS.get(name)
        if held and all(s.lost is None and s.down is None for s in held[: res.nodes]):
            return self._cluster(spec, owner, name, held, adopted=True)
        deadline = time.monotonic() + spec.placement.gpu_wait
        request = {
            "resources": {"gpus": res.gpus, "gpu_product": res.gpu_product},
            "owner": dict(owner),
            "job": spec.name,
            "deadline_s": spec.limits.max_duration + spec.limits.stop_grace_s + 60
            if spec.limits.max_duration
            else None,
            "grace_s": spec.limits.stop_grace_s,
            "interval_s": spec.metrics.interval_s,
            **image_request(spec),
        }
        nodes = self.nodes()
        grower = Grower(self, nodes, spec, owner[RUN_LABEL]) if nodes is not None else None
        try:
            while True:
                sessions, why = self._claim(fleet, spec, request)
                if len(sessions) == res.nodes:
                    break
                for session in sessions:
                    session.teardown(30)
                if grower is not None:
                    deadline = max(deadline, grower.step([w.partition(": ")[0] for w in why]))
                if time.monotonic() >= deadline:
                    raise CapacityError(
                        f"fleet {self.fleet_name!r} has not {res.nodes} host(s) with {res.gpus}"
                        f" free GPU(s) now: {'; '.join(why) or 'no host serves yet'}"
                    )
                time.sleep(0.5)
        finally:
            if grower is not None:
                grower.done()
        with _SESSIONS_LOCK:
            _SESSIONS[name] = sessions
        cluster = self._cluster(spec, owner, name, sessions)
        # recorded here: teardown (and its retries, in any process of this user) finds it
        write_atomic(record_path(name), cluster.model_dump_json())
        write_atomic(record_path(name).with_suffix(".api"), os.environ.get("PREFECT_API_URL", ""))
        return cluster

    def _claim(
        self, fleet: GpuFleet, spec: JobSpec, request: dict[str, Any]
    ) -> tuple[list[HostSession], list[str]]:
        sessions: list[HostSession] = []
        why: list[str] = []
        for host, _found in self._fitting(spec):
            if len(sessions) == spec.resources.nodes:
                break
            try:
                session = self._open(fleet, host, request)
            except (Busy, ProvisionError, InvalidSpec, TimeoutError) as exc:
                why.append(f"{host.label}: {exc}")
                continue
            sessions.append(session)
        return sessions, why

    def _open(self, fleet: GpuFleet, host: FleetHost, request: dict[str, Any]) -> HostSession:
        """Start the host program on `host` and claim the request's GPUs there."""
        ssh = fleet_hosts.target(fleet, host, secret_text)
        sha = installed_wheel(fleet, host, ssh)
        session = HostSession(
            ssh,
            host.label,
            host.address,
            lambda argv: fleet_hosts.gpuflow_command(host, sha, argv),
        )
        session.open(request, fleet.lease_s)
        return session

    def _cluster(
        self,
        spec: JobSpec,
        owner: Mapping[str, str],
        name: str,
        sessions: list[HostSession],
        adopted: bool = False,
    ) -> Cluster:
        workspace = gpuflow_home() / "fleet" / "runs" / name
        make_dirs(workspace / "outputs")
        holds = _holds(sessions)
        products = sessions[0].claimed.get("gpu_products", []) if sessions else []
        return Cluster(
            backend=self.name,
            name=name,
            owner=dict(owner),
            hostname=sessions[0].host,
            workspace=str(workspace),
            gpu_indices=list(range(spec.resources.gpus)),
            gpu_products=products,
            nodes=len(sessions),
            node_names=[s.host for s in sessions],
            node_addresses=[s.address for s in sessions],
            # the nodes meet at the first host, on a port of the run's own (hosts serve many)
            rendezvous=f"{sessions[0].address}:{run_port(owner[RUN_LABEL])}",
            capabilities=self.capabilities,
            state=FleetState(
                fleet=self.fleet_name or "", lease_s=self.fleet().lease_s, holds=holds
            ).model_dump(),
            created_at=datetime.now(UTC),
            adopted=adopted,
        )

    # -- run -----------------------------------------------------------------------------

    def start(
        self,
        cluster: Cluster,
        unit: WorkUnit,
        env: Mapping[str, str],
        timeout_s: float,
        tail: LogTail,
    ) -> FleetUnit:
        """Start `unit` on its node's host, through the run's host program there. A node
        whose host was lost gets another host first (its lease lapsed on the lost one,
        so the unit never runs twice), and the unit's addresses move with it."""
        session = self._node(cluster, unit.node)
        moved = _MOVED.get(cluster.name, {})
        unit_id = f"{unit.name}-{uuid.uuid4().hex[:6]}"  # each try a unit of its own
        command = [PYTHON if c == sys.executable else _moved(c, moved) for c in unit.command]
        env = {name: _moved(value, moved) for name, value in env.items()}
        samples = Path(cluster.workspace) / NODE_SAMPLES.replace("*", unit_id)
        writer = SampleWriter(samples)
        watch = session.run(
            unit_id, unit.model_copy(update={"command": command}), env, tail, writer
        )
        return FleetUnit(session, unit_id, watch, cluster, tail, samples)

    def _node(self, cluster: Cluster, node: int) -> HostSession:
        """Return the host program holding `node`'s GPUs, on another host when its own
        was lost."""
        with _SESSIONS_LOCK:
            sessions = _SESSIONS.get(cluster.name)
            dropped = node in _DROPPED.get(cluster.name, set())
        if not sessions:
            raise ProvisionError(
                f"this process holds no hosts for {cluster.name} (it was provisioned by"
                " another process); run it again"
            )
        if dropped:
            raise ProvisionError(f"node {node} of {cluster.name} was given back")
        lost = sessions[node]
        if lost.lost is None:
            return lost
        # fencing: the lost host stops the unit once its lease lapses there, plus the grace
        wait = lost.fenced_at() - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        in_use = {s.host for s in sessions if s is not lost}
        try:
            # another host first; the lost one last (it may be back)
            replacement = self._place(
                cluster,
                lost.request,
                in_use,
                lost.host,
                time.time(),
                f"{cluster.name}-node{node}",
            )
        except CapacityError as exc:
            raise CapacityError(f"{lost.lost}; {exc}") from None
        with _SESSIONS_LOCK:
            sessions[node] = replacement
            _MOVED.setdefault(cluster.name, {})[lost.address] = replacement.address
        self._save(cluster, sessions)
        return replacement

    def _place(
        self,
        cluster: Cluster,
        request: dict[str, Any],
        avoid: set[str],
        last: str | None,
        deadline: float,
        want: str,
        stop: StopCheck | None = None,
    ) -> HostSession:
        """Claim `request`'s GPUs on a host of the fleet not in `avoid` (`last` tried
        last), the files staged for the run put there; keep trying until `deadline`
        (time.time()), an elastic fleet growing for it (`want`: what it waits as).
        CapacityError when no host had room in time; JobCancelled once `stop()` says so."""
        fleet = self.fleet()
        gpus = int(request["resources"]["gpus"])
        nodes = self.nodes()
        grower = None
        until = time.monotonic() + max(0.0, deadline - time.time())
        why: list[str] = []
        try:
            while True:
                hosts = [
                    (host, check)
                    for host, check in self.hosts()
                    if check.gpus >= gpus and host.label not in avoid
                ]
                hosts.sort(
                    key=lambda pair: (
                        pair[0].label == last,
                        pair[1].gpus,
                        pair[0].label,
                    )
                )
                why = []
                for host, _found in hosts:
                    try:
                        session = self._open(fleet, host, request)
                    except (Busy, ProvisionError, InvalidSpec, TimeoutError) as exc:
                        why.append(f"{host.label}: {exc}")
                        continue
                    for staged in _STAGED.get(cluster.name, []):
                        _put_staged(session, staged)
                    return session
                if nodes is not None:
                    if grower is None:  # an elastic fleet grows for it
                        spec = JobSpec.model_construct(  # type: ignore[call-arg]
                            resources=Resources(gpus=gpus, nodes=1),
                            placement=FleetPlacement(fleet=self.fleet_name or "", gpu_wait=0),
                        )
                        grower = Grower(self, nodes, spec, want)
                    until = max(until, grower.step([w.partition(": ")[0] for w in why]))
                if time.monotonic() >= until:
                    break
                if stop is not None and stop():
                    raise JobCancelled(
                        f"the run stopped while it waited for a host of fleet"
                        f" {self.fleet_name!r} with {gpus} free GPU(s)"
                    )
                time.sleep(0.5)
        finally:
            if grower is not None:
                grower.done()
        other = "other " if avoid else ""
        raise CapacityError(
            f"no {other}host of fleet {self.fleet_name!r} has {gpus} free GPU(s) now:"
            f" {'; '.join(why) or 'none fits'}"
        )

    def add_node(self, cluster: Cluster, deadline: float, stop: StopCheck | None = None) -> Cluster:
        """Claim one node more for the run, as its first ones were claimed (each claim a
        run of its own on its host, so a host may hold several); the fleet grows for it.
        JobCancelled once `stop()` says so while it waits for room."""
        with _SESSIONS_LOCK:
            sessions = _SESSIONS.get(cluster.name)
        if not sessions:
            raise ProvisionError(f"this process holds no hosts for {cluster.name}")
        first = sessions[0].request
        tag = uuid.uuid4().hex[:6]
        owner = {**first["owner"], RUN_LABEL: f"{first['owner'][RUN_LABEL]}-{tag}"}
        session = self._place(
            cluster,
            {**first, "owner": owner},
            set(),
            None,
            deadline,
            f"{cluster.name}-{tag}",
            stop,
        )
        with _SESSIONS_LOCK:
            sessions.append(session)
            added = cluster.model_copy(
                update={
                    "nodes": len(sessions),
                    "node_names": [s.host for s in sessions],
                    "node_addresses": [s.address for s in sessions],
                }
            )
        self._save(added, sessions)
        return added

    def drop_node(self, cluster: Cluster, node: int) -> Cluster:
        """Give back `node`'s claim (its host frees the GPUs and the run's folder there)."""
        with _SESSIONS_LOCK:
            sessions = _SESSIONS.get(cluster.name) or []
            dropped = _DROPPED.setdefault(cluster.name, set())
            if node >= len(sessions) or node in dropped:
                return cluster
            dropped.add(node)
            session = sessions[node]
        session.teardown(wait_s=120)
        self._save(cluster, sessions)
        return cluster

    def _save(self, cluster: Cluster, sessions: list[HostSession]) -> None:
        state = state_of(cluster, FleetState)
        with _SESSIONS_LOCK:
            dropped = set(_DROPPED.get(cluster.name, set()))
        state.holds = _holds([s for n, s in enumerate(sessions) if n not in dropped])
        write_atomic(
            record_path(cluster.name),
            cluster.model_copy(update={"state": state.model_dump()}).model_dump_json(),
        )

    def stage(self, cluster: Cluster, path: Path, storage: S3Settings, staging: str | None) -> str:
        """Return where the run's hosts read `path` (a file named by its content): under
        `staging` when given (S3 they reach), else put on each host over SSH, once."""
        if staging:
            return super().stage(cluster, path, storage, staging)
        with _SESSIONS_LOCK:
            dropped = _DROPPED.get(cluster.name, set())
            sessions = [
                s for n, s in enumerate(_SESSIONS.get(cluster.name) or []) if n not in dropped
            ]
            _STAGED.setdefault(cluster.name, []).append(path)
        for session in sessions:
            _put_staged(session, path)
        return f"{STAGED}/{path.name}"

    # -- teardown ------------------------------------------------------------------------

    def teardown(self, cluster: Cluster) -> TeardownReport:
        """Release every host's claim (its units stopped with their grace, its workspace
        removed). From another process, each host is asked to tear the run down."""
        state = state_of(cluster, FleetState)
        report = TeardownReport(name=cluster.name)
        with _SESSIONS_LOCK:
            sessions = _SESSIONS.pop(cluster.name, None)
            dropped = _DROPPED.pop(cluster.name, set())
            _MOVED.pop(cluster.name, None)
            _STAGED.pop(cluster.name, None)
        if sessions is not None:
            for session in [s for n, s in enumerate(sessions) if n not in dropped]:
                said = session.teardown(wait_s=120)
                if said:
                    report.killed_processes += int(said.get("killed_processes", 0))
                    report.released_gpus += list(said.get("released_gpus", []))
                    report.removed_workspace = bool(said.get("removed_workspace"))
        else:
            fleet = self.fleet()
            for hold in state.holds:
                host = self.host(hold.host)
                if host is None:
                    continue
                with contextlib.suppress(InvalidSpec, ProvisionError, TimeoutError):
                    said = remote_json(fleet, host, ["teardown", hold.remote])
                    report.released_gpus += list(said.get("released_gpus", []))
        workspace = Path(cluster.workspace)
        if workspace.is_dir():  # the outputs brought back: collect has taken them
            shutil.rmtree(workspace, ignore_errors=True)
        record_path(cluster.name).unlink(missing_ok=True)
        record_path(cluster.name).with_suffix(".api").unlink(missing_ok=True)
        return report

    @contextlib.contextmanager
    def outputs_here(self, cluster: Cluster) -> Iterator[Path]:
        """Bring what the run's job wrote on each of its hosts (still in its workspace
        there, or set aside when its host program ended without being asked: a killed
        gpuflow) into its folder here and yield that folder; once the caller is done,
        let each host's kept copy go. A host that does not answer raises ProvisionError."""
        fleet, folder = self.fleet(), Path(cluster.workspace) / "outputs"
        taken = []
        for hold in state_of(cluster, FleetState).holds:
            host = self.host(hold.host)
            if host is None:
                continue
            ssh = fleet_hosts.target(fleet, host, secret_text)
            try:
                argv = ["outputs", hold.remote]
                done = ssh.run(
                    fleet_hosts.gpuflow_command(host, installed_wheel(fleet, host, ssh), argv)
                )
            finally:
                ssh.close()
            if done.returncode == fleet_hosts.SSH_FAILED:
                raise ProvisionError(ssh.failure(done.stderr.decode(errors="replace")))
            if done.returncode == 0 and done.stdout:
                untar(done.stdout, folder)
                taken.append((host, hold.remote))
        yield folder
        for host, remote in taken:
            with contextlib.suppress(InvalidSpec, ProvisionError, TimeoutError):
                remote_json(fleet, host, ["let-go", remote])

    def list_owned(self, selector: Mapping[str, str]) -> list[Cluster]:
        """Return the runs on this fleet recorded here whose owner labels include `selector`."""
        found = []
        for _, data in state_records(record_path("x").parent):
            try:
                cluster = Cluster.model_validate(data)
            except ValueError:
                continue
            if self.fleet_name and state_of(cluster, FleetState).fleet != self.fleet_name:
                continue
            if all(cluster.owner.get(k) == v for k, v in selector.items()):
                found.append(cluster)
        return found

    def reap(self, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
        """Ask each host of the fleet to tear down what dead host programs left there (a
        live one ends itself once its lease lapses); then forget the runs recorded here
        that no host holds any more: their gpuflow died (a live one renews its claims), so
        their flow runs are to be marked Crashed."""
        report = ReapReport(counts={"clusters": 0})
        fleet = self.fleet()
        held: set[str] = set()
        answered: set[str] = set()
        instances = [h for h, _ in self.hosts() if fleet.host(h.label) is None]
        for host in [*fleet.hosts, *instances]:
            argv = ["reap", "--dry-run"] if dry_run else ["reap"]
            try:
                said = remote_json(fleet, host, argv)
                status = remote_json(fleet, host, ["status"])
            except (InvalidSpec, ProvisionError, TimeoutError) as exc:
                say(f"{host.label}: {exc}")
                continue
            answered.add(host.label)
            for line in said.get("said", []):
                say(f"{host.label}: {line}")
            report.counts["clusters"] += int(said.get("counts", {}).get("clusters", 0))
            held |= {
                f"{host.label}/{run['name']}"
                for run in status.get("runs", [])
                if run["server_alive"]
            }
        for cluster in self.list_owned({}):
            holds = state_of(cluster, FleetState).holds
            if any(h.host not in answered for h in holds):
                continue  # a host that did not answer may still hold it
            if any(f"{h.host}/{h.remote}" in held for h in holds):
                continue  # its gpuflow still renews its claims
            say(f"{'would forget' if dry_run else 'forgetting'} {cluster.name}: no host holds it")
            report.counts["clusters"] += 1
            report.crashed.append((cluster.owner[RUN_LABEL], api_url(cluster.name)))
            if not dry_run:
                shutil.rmtree(cluster.workspace, ignore_errors=True)
                record_path(cluster.name).unlink(missing_ok=True)
                record_path(cluster.name).with_suffix(".api").unlink(missing_ok=True)
        return report


def _holds(sessions: list[HostSession]) -> list[HostHold]:
    return [
        HostHold(
            host=s.host,
            address=s.address,
            remote=s.claimed.get("name", ""),
            gpu_indices=s.claimed.get("gpu_indices", []),
            workspace=s.claimed.get("workspace", ""),
        )
        for s in sessions
    ]


# a run's nodes that moved to another host: old address -> new, for its units' commands
_MOVED: dict[str, dict[str, str]] = {}


def _moved(text: str, moved: dict[str, str]) -> str:
    for old, new in moved.items():
        if old in text:
            text = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w.])", new, text)
    return text


# files staged for a run's units, put again on a host that replaces a lost one
_STAGED: dict[str, list[Path]] = {}


# Put a file on the host under its staged folder, whole or not at all, once; the user's
# alone there (a user's code: other users of the host read none of it).
_PUT = (
    'umask 077; D="${GPUFLOW_HOME:-$HOME/.gpuflow}/fleet/staged"; F="$D/$1";'
    ' [ -f "$F" ] && exit 0; mkdir -p "$D" && cat > "$F.part.$$" && mv "$F.part.$$" "$F"'
)


def _put_staged(session: HostSession, path: Path) -> None:
    """Put `path` on the session's host (ProvisionError with the host's words)."""
    with open(path, "rb") as data:
        done = session.ssh.run(
            f"sh -c {shlex.quote(_PUT)} put {shlex.quote(path.name)}", data.read(), 300
        )
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()
        raise ProvisionError(f"could not put {path.name} on {session.ssh}: {said or 'no message'}")
