"""The EC2 backend: a run rents GPU instances, whose agents pull its units from S3.

- `provision` ranks the offers (gpuflow.tasks.backends.ec2.catalog), keeps the run's variables and
  the agent's Prefect token in a Secrets Manager secret (never in user-data), makes a
  security group with no inbound rule from outside (nodes of one run reach each other),
  launches (gpuflow.tasks.backends.ec2.launch) with user-data that installs gpuflow and starts its
  agent, and waits until every agent says it is ready. From then until teardown this
  process rewrites the run's heartbeat; agents that stop seeing it terminate themselves.
- `run` writes the unit into the node's mailbox and follows its log lines, its end and its
  instance. A spot interruption (the agent saw the notice, or the instance is gone) is a
  preemption (exit 75): the run stage retries, and the retry finds the instances lost,
  launches new ones (on-demand after `placement.on_demand_after` interruptions when the
  market allows) and resumes the job from its checkpoint.
- `teardown` terminates the instances, deletes their volumes, the security group, the
  placement group, the secret and the mailbox, and confirms by describing them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel

from gpuflow.tasks import contract, own_wheel
from gpuflow.tasks.backends import imaging
from gpuflow.tasks.backends.base import LogTail, UnitBackend, join_samples, say_in_run
from gpuflow.tasks.backends.ec2 import launch as launching
from gpuflow.tasks.backends.ec2 import reap as reaping
from gpuflow.tasks.backends.ec2.agent import PYTHON, AgentConfig, UnitSpec
from gpuflow.tasks.backends.ec2.catalog import (
    Fleet,
    Offer,
    aws_client,
    aws_error,
    ec2_client,
    find_offers,
    fleet_named,
)
from gpuflow.tasks.backends.ec2.mailbox import HEARTBEAT, Mailbox, unit_key
from gpuflow.tasks.backends.ec2.placement import Ec2Ask, Ec2Placement
from gpuflow.tasks.backends.ec2.reap import (
    CONTROL_TAG,
    ORPHAN_TAG,
    prefect_api_url,
    remove_leftovers,
    secret_name,
)
from gpuflow.tasks.contract import (
    RUN_LABEL,
    Capabilities,
    Cluster,
    Needs,
    ReapReport,
    RunStates,
    StopReason,
    TeardownReport,
    UnitEnd,
    WorkUnit,
    run_port,
    state_of,
)
from gpuflow.tasks.errors import PREEMPTED_EXIT_CODE, CapacityError, InvalidSpec, ProvisionError
from gpuflow.tasks.host import gpuflow_home
from gpuflow.tasks.metrics.cost import ListPrices, PriceTable
from gpuflow.tasks.metrics.sampler import SAMPLES
from gpuflow.tasks.placement import prices_for, resolve
from gpuflow.tasks.spec import Image, JobSpec, Limits, MetricsSettings, Placement, placement_as
from gpuflow.tasks.storage import S3Settings

STATE_EVERY_S = 5.0
_heartbeats: dict[str, Heartbeat] = {}
_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()


def group_name(run_id: str) -> str:
    return f"gpuflow-{run_id}"


def local_folder(run_id: str) -> Path:
    """Return this host's folder for the run: outputs its units send back, samples."""
    return gpuflow_home() / "ec2" / run_id


class Heartbeat:
    """Rewrites the run's heartbeat in its mailbox every `every_s` in a thread, until
    stopped; the agents terminate their instances when it stops changing."""

    def __init__(self, mailbox: Mailbox, every_s: float) -> None:
        self.mailbox, self.every_s = mailbox, every_s
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True, name="gpuflow-heartbeat")
        self.thread.start()

    def _beat(self) -> None:
        seq = 0
        while not self.stopping.is_set():
            seq += 1
            with contextlib.suppress(Exception):  # S3 away for a moment: the next beat
                self.mailbox.put_json(
                    HEARTBEAT, {"seq": seq, "at": datetime.now(UTC).isoformat(), "pid": os.getpid()}
                )
            self.stopping.wait(self.every_s)

    def stop(self) -> None:
        self.stopping.set()


def user_data(fleet: Fleet, config: AgentConfig, wheel: tuple[str, str]) -> str:
    """Return the instance's boot script: where this gpuflow's own wheel is (`wheel`: its
    s3:// URL beside the run's mailbox and its SHA-256), the fleet's install step, then the
    agent. Its settings are base64 JSON with nothing secret in them."""
    url, digest = wheel
    return "\n".join(
        [
            "#!/bin/bash",
            f"# gpuflow: the agent of run {config.run_id}; it pulls the run's work from"
            f" {config.control}",
            "set -euo pipefail",
            "GPUFLOW_PYTHON=python3",
            "# the orchestrator's own build of gpuflow, to be checked by its SHA-256",
            f"export GPUFLOW_WHEEL_URL={shlex.quote(url)}",
            f"export GPUFLOW_WHEEL_SHA256={digest}",
            f"export GPUFLOW_WHEEL=/var/tmp/{shlex.quote(url.rsplit('/', 1)[1])}",
            "# install gpuflow (sets GPUFLOW_PYTHON); a step that fails ends the boot here",
            "{",
            fleet.install or ":",
            "} || { echo 'gpuflow: the install step failed; the agent is not started' >&2; exit 1; }",
            'exec "$GPUFLOW_PYTHON" -m gpuflow.tasks.backends.ec2.agent --config '
            + config.encode(),
            "",
        ]
    )


class Ec2Node(BaseModel):
    """One node of a run: the instance and the address its agent said it has."""

    instance_id: str
    address: str


class Ec2State(BaseModel):
    """What the EC2 backend keeps on its cluster record."""

    block: str | None = None
    control: str = ""  # the run's mailbox
    security_group: str | None = None
    # what each unit's start reads (typed, never the spec re-read)
    job: str = ""  # the job's name, in its metrics
    metrics: MetricsSettings = MetricsSettings()
    # what EC2 is asked for: read to launch the instances again after a loss (never the spec)
    ask: Ec2Ask | None = None
    tags: dict[str, str] = {}  # put on everything the run makes
    instances: list[Ec2Node] = []  # node 0 first
    offer: Offer | None = None  # what the instances were launched from
    # the run's image, pinned (image:): each agent's engine pulls it, its units run in it
    image: Image | None = None


class Ec2Backend(UnitBackend):
    name = "ec2"
    # each agent samples its instance; the run stage samples nothing here
    capabilities = Capabilities(
        runs_here=False,
        where="rented instances",
        local_files=False,
        samples_nodes=True,
        runs_images=True,  # each agent's engine pulls the run's pinned image (image:)
    )
    placement_model: ClassVar[type[Placement]] = Ec2Placement

    def pin_image(self, spec: JobSpec, needs: Needs, say: Callable[[str], None]) -> JobSpec:
        """The image's digest from its registry, asked from here; each instance pulls it."""
        return spec if spec.image is None else imaging.pin_by_registry(spec, say)

    extra: ClassVar[str | None] = "aws"
    # on-demand list prices per GPU (an instance's price divided by its GPUs)
    list_prices = ListPrices(
        gpu_hourly_usd={
            "Tesla-T4": 0.526,
            "NVIDIA-A10G": 1.006,
            "NVIDIA-L4": 0.805,
            "NVIDIA-L40S": 1.861,
            "Tesla-V100-SXM2-16GB": 3.06,
            "NVIDIA-A100-SXM4-40GB": 4.096,
            "NVIDIA-A100-SXM4-80GB": 5.121,
            "NVIDIA-H100-80GB-HBM3": 12.29,
            "NVIDIA-H200": 13.86,
        },
        cpu_core_hourly_usd=0.048,
        disk_gb_month_usd=0.08,
    )

    @classmethod
    def block_types(cls) -> list[type]:
        from gpuflow.blocks.ec2_fleet import Ec2GpuFleet

        return [Ec2GpuFleet]

    @classmethod
    def at(cls, placement: Placement | None = None) -> Ec2Backend:
        """Return the backend for the placement's fleet block (else the default one)."""
        return cls(placement.block if placement is not None else None)

    @classmethod
    def reaper(cls, block: str | None, namespace: str | None) -> Ec2Backend:
        return cls(block, field="--block")

    @classmethod
    def of(cls, cluster: Cluster) -> Ec2Backend:
        """Return the backend `cluster` was made with: its fleet block."""
        return cls(state_of(cluster, Ec2State).block)

    def __init__(self, block: str | None = None, field: str = "placement.block") -> None:
        self.block, self.field = block, field

    # -- settings ----------------------------------------------------------------------

    @functools.cached_property
    def settings(self) -> Fleet:
        """Return the fleet's settings: its Ec2GpuFleet block's (read once), else defaults."""
        return fleet_named(self.block, self.field)

    def fleet(self) -> Fleet:
        """Return the fleet's settings, checked for launching: InvalidSpec for a missing
        image, control prefix or an install step that cannot be trusted."""
        fleet = self.settings
        if self.block is None:
            raise InvalidSpec(
                "placement.block: launching on ec2 needs an Ec2GpuFleet block (its image_id"
                " and control_prefix); create one with blocks.Ec2GpuFleet(...).save(name) and"
                " name it here (gpuflow offers ranks without one)."
            )
        if not fleet.image_id:
            raise InvalidSpec(
                f"{fleet.field('image_id')}: no machine image is set; set it to an AMI with"
                " NVIDIA's driver and Python 3.11+ in the fleet's region."
            )
        from gpuflow.blocks.ec2_fleet import INSTALL_BY_NAME

        if fleet.install.strip() == INSTALL_BY_NAME:
            raise InvalidSpec(
                f"{fleet.field('install')}: it installs gpuflow by name from PyPI, where no"
                " such package is this gpuflow (whoever registered the name would run code on"
                " your instances); save the block again without install (the default installs"
                " the orchestrator's own wheel, checked by its hash) or give your own step."
            )
        control = fleet.control_prefix or ""
        if not control.startswith("s3://") or len(control) <= len("s3://"):
            raise InvalidSpec(
                f"{fleet.field('control_prefix')}: {control or 'nothing'} is not an s3:// prefix;"
                " set it to a bucket and prefix the instances can read and write."
            )
        return fleet

    def _clients(self, fleet: Fleet) -> tuple[Any, Any, Any]:
        return ec2_client(fleet), aws_client(fleet, "s3"), aws_client(fleet, "secretsmanager")

    def configure(self, spec: JobSpec, prices: PriceTable) -> tuple[JobSpec, PriceTable]:
        """Return the spec and prices as they are: this backend reads its block itself."""
        return spec, prices

    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        fleet = self.fleet()

        _, prices = resolve(spec)
        find_offers(spec, prices, fleet)  # region, product, budget, credentials: said here
        _, s3, _ = self._clients(fleet)
        bucket = fleet.control_prefix.removeprefix("s3://").split("/")[0]  # type: ignore[union-attr]
        try:
            s3.head_bucket(Bucket=bucket)
        except Exception as exc:
            raise aws_error(exc, fleet, f"reach the control bucket {bucket}") from None

    def offers(self, spec: JobSpec, prices: PriceTable) -> list[contract.Offer]:
        """Return the fleet's ranked offers (spot and on-demand, cheapest first, the order a
        launch tries them), each priced for every node. Whether a zone has the capacity is
        known only when a launch asks: every offer says it can start."""
        fleet, found = find_offers(spec, prices, self.settings)
        nodes = spec.resources.nodes
        return [
            contract.Offer(
                where=f"ec2/{fleet.name or 'default'} {o.instance_type} {o.market} in {o.zone}",
                gpu_product=o.product,
                hourly_usd=o.hourly_usd * nodes,
                can_start=True,
                why_not="capacity is known at launch",
                preemptible=o.market == "spot",
            )
            for o in found
        ]

    def describe(self, spec: JobSpec) -> list[dict[str, str]]:
        fleet = self.fleet()
        return [
            {
                "name": "instances",
                "level": "pass",
                "message": f"{spec.resources.nodes} instance(s) with {spec.resources.gpus} GPU(s)"
                f" in {fleet.region}, {placement_as(spec, Ec2Placement).market}; agents pull work from"
                f" {fleet.control_prefix}",
            }
        ]

    # -- provision -----------------------------------------------------------------------

    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        """Return the run's cluster of ready instances; a retry adopts them."""
        fleet = self.fleet()
        run_id = owner[RUN_LABEL]
        ec2, s3, secrets = self._clients(fleet)
        mailbox = Mailbox(s3, fleet.control_prefix or "", run_id)
        tags = {
            **owner,
            CONTROL_TAG: mailbox.url,
            ORPHAN_TAG: str(int(spec.limits.orphan_after)),
        }
        self._beat(mailbox, spec.limits.orphan_after)
        try:
            self._put_secret(secrets, run_id, tags, {})
            group = self._security_group(ec2, run_id, tags, spec.resources.nodes)
        except Exception as exc:
            raise aws_error(exc, fleet, "prepare the run's secret and security group") from None
        local_folder(run_id).joinpath("outputs").mkdir(parents=True, exist_ok=True)
        cluster = Cluster(
            backend=self.name,
            name=group_name(run_id),
            owner=dict(owner),
            hostname="",
            workspace=str(local_folder(run_id)),
            gpu_indices=list(range(spec.resources.gpus)),
            nodes=spec.resources.nodes,
            created_at=datetime.now(UTC),
            capabilities=self.capabilities,
            state=Ec2State(
                block=self.block,
                control=mailbox.url,
                security_group=group or None,
                job=spec.name,
                metrics=spec.metrics,
                ask=Ec2Ask.of(spec),
                tags=tags,
                image=spec.image,
            ).model_dump(mode="json"),
        )
        nodes, offer, adopted = self._nodes(cluster, fleet, ec2, mailbox)
        return self._with_nodes(cluster, nodes, offer).model_copy(update={"adopted": adopted})

    def _own_wheel(self, mailbox: Mailbox) -> tuple[str, str]:
        """Put this gpuflow's own wheel beside the run's mailbox (the instance installs it,
        never a package of that name from an index); return its URL and SHA-256."""
        name, data = own_wheel.build()
        mailbox.put(f"gpuflow/{name}", data)
        return f"{mailbox.url}gpuflow/{name}", own_wheel.sha256(data)

    def _with_nodes(self, cluster: Cluster, nodes: list[Ec2Node], offer: Offer | None) -> Cluster:
        state = state_of(cluster, Ec2State)
        state.instances = nodes
        if offer is not None:
            state.offer = offer
        known = state.offer
        addresses = [n.address for n in nodes]
        return cluster.model_copy(
            update={
                "hostname": addresses[0],
                "node_names": addresses,
                "rendezvous": f"{addresses[0]}:{run_port(cluster.owner[RUN_LABEL])}",
                "gpu_products": [known.product] * known.gpus if known else [],
                "cpus_per_node": known.vcpus if known else None,
                # the price of the offer launched (a spot instance at its spot price)
                "hourly_usd": known.hourly_usd * len(nodes) if known else None,
                "state": state.model_dump(mode="json"),
            }
        )

    def _nodes(
        self, cluster: Cluster, fleet: Fleet, ec2: Any, mailbox: Mailbox
    ) -> tuple[list[Ec2Node], Offer | None, bool]:
        """Return the run's live nodes (instance and address, node 0 first), the offer
        they were launched from (None when adopted) and whether they were adopted. Nodes
        lost or told of an interruption are terminated and replaced (all of them: a job
        is all or nothing)."""
        state = state_of(cluster, Ec2State)
        run_id = cluster.owner[RUN_LABEL]
        with _lock(run_id):
            live = launching.owned_instances(ec2, run_id, ["pending", "running"])
            noticed = {k.split("/", 1)[1] for k in mailbox.keys("notices/")}
            # lost once and replaced: a cluster record from before the replacement still
            # names them, and must not make every later unit replace its nodes again
            replaced = {k.split("/", 1)[1] for k in mailbox.keys("lost/")}
            known = state.instances
            vanished = {n.instance_id for n in known} - {i["InstanceId"] for i in live}
            lost = sorted((vanished | ({i["InstanceId"] for i in live} & noticed)) - replaced)
            if live and len(live) == cluster.nodes and not lost:
                return self._ready(fleet, mailbox, live), None, True
            for instance in lost:
                mailbox.put_json(f"lost/{instance}", {"at": datetime.now(UTC).isoformat()})
            if live:  # a partial set, or one that was warned: replace them all
                launching.remove(ec2, run_id, _say, group=None)
            losses = len(mailbox.keys("lost/"))
            if state.ask is None:
                raise ProvisionError(f"{cluster.name}: its record says not what to launch")
            ask = state.ask
            offers = self._offers(ask, losses)
            config = AgentConfig(
                run_id=run_id,
                control=fleet.control_prefix or "",
                region=fleet.region,
                endpoint_url=_endpoint(fleet),
                secret_id=secret_name(run_id),
                orphan_after_s=ask.limits.orphan_after,
                deadline_s=ask.limits.max_duration + ask.limits.stop_grace_s + 300,
                prefect_api_url=prefect_api_url(),
            )
            tags, group = state.tags, state.security_group
            try:
                made = launching.launch(
                    ec2,
                    offers,
                    ask.resources.nodes,
                    max(8, int(ask.resources.disk / 2**30)),
                    fleet.image_id or "",
                    user_data(fleet, config, self._own_wheel(mailbox)),
                    tags,
                    _say,
                    fleet.instance_profile,
                    [group] if group else None,
                )
            except CapacityError:
                raise
            except Exception as exc:
                raise aws_error(exc, fleet, "launch the run's instances") from None
            live = launching.owned_instances(ec2, run_id, ["pending", "running"])
            return self._ready(fleet, mailbox, live), made.offer, made.adopted

    def _offers(self, ask: Ec2Ask, losses: int) -> list[Offer]:
        """Return what to launch from (after `losses` spot interruptions, on-demand only
        where the placement says so)."""
        _, offers = find_offers(ask, prices_for(ask.placement), self.settings)
        market, after = ask.placement.market, ask.placement.on_demand_after
        if market == "spot-then-on-demand" and losses >= after:
            _say(
                f"{losses} spot interruption(s) so far (placement.on_demand_after"
                f" {after}): renting on-demand"
            )
            offers = [o for o in offers if o.market == "on-demand"]
        return offers

    def _ready(self, fleet: Fleet, mailbox: Mailbox, live: list[dict]) -> list[Ec2Node]:
        """Wait until every instance's agent said it is ready; return the nodes in launch
        order. ProvisionError when one is not ready within the fleet's boot timeout."""
        order = sorted(live, key=lambda i: (i.get("AmiLaunchIndex", 0), i["InstanceId"]))
        until = time.monotonic() + fleet.boot_timeout_s
        nodes: list[Ec2Node] = []
        for instance in order:
            iid = instance["InstanceId"]
            while True:
                ready = mailbox.get_json(f"nodes/{iid}/ready")
                if ready:
                    nodes.append(Ec2Node(instance_id=iid, address=ready["address"]))
                    break
                if time.monotonic() > until:
                    raise ProvisionError(
                        f"instance {iid} did not start gpuflow's agent within"
                        f" {fleet.boot_timeout_s:.0f} s ({fleet.field('boot_timeout_s')}); read"
                        " its console output (aws ec2 get-console-output) for the install step"
                    )
                time.sleep(0.5)
        return nodes

    # -- run -----------------------------------------------------------------------------

    def start(
        self,
        cluster: Cluster,
        unit: WorkUnit,
        env: Mapping[str, str],
        timeout_s: float,
        tail: LogTail,
    ) -> _Ec2Unit:
        """Hand `unit` to its node's instance through the mailbox. An interruption notice
        or a lost instance ends it as a preemption (exit 75)."""
        state = state_of(cluster, Ec2State)
        fleet = self.fleet()
        ec2, s3, secrets = self._clients(fleet)
        run_id = cluster.owner[RUN_LABEL]
        mailbox = Mailbox(s3, fleet.control_prefix or "", run_id)
        self._beat(mailbox, float(state.tags[ORPHAN_TAG]))  # as provision set it
        self._put_secret(secrets, run_id, state.tags, dict(env), self._login(state))
        nodes, _, _ = self._nodes(cluster, fleet, ec2, mailbox)
        instance = nodes[unit.node].instance_id
        name = f"{unit.name}-{uuid.uuid4().hex[:6]}"  # each try a unit of its own
        command = _moved(list(unit.command), cluster.hosts(), [n.address for n in nodes])
        command = [PYTHON if c == sys.executable else c for c in command]
        spec_unit = UnitSpec(
            name=name,
            command=command,
            env=unit.env,
            gpus=unit.gpus,
            node=unit.node,
            nodes=cluster.nodes,
            image=state.image.model_dump(mode="json") if state.image and unit.in_image else None,
            cluster=cluster.name,
            # the agent's own guard; this side stops first (after the grace, at most a stop's)
            timeout_s=timeout_s + (state.ask.limits if state.ask else Limits()).stop_grace_s + 60,
            metrics={
                "interval_s": state.metrics.interval_s,
                "pushgateway": state.metrics.pushgateway,
                "push_interval_s": state.metrics.push_interval_s,
                "job": state.job,
            },
        )
        mailbox.put(unit_key(instance, name, "unit.json"), spec_unit.model_dump_json())
        follower = _Follower(mailbox, instance, name, tail)
        return _Ec2Unit(ec2, run_id, instance, follower, Path(cluster.workspace))

    # -- teardown ------------------------------------------------------------------------

    def reap(self, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
        """Remove what runs that are over, or orphaned, left (instances, volumes, groups,
        secrets, mailboxes); with `dry_run`, say what would go and its hourly price."""
        return reaping.reap(self.settings, dry_run, say, runs)

    def stage(self, cluster: Cluster, path: Path, storage: S3Settings, staging: str | None) -> str:
        """Put `path` beside the run's mailbox, which its instances read (their role, or
        the fleet's credentials); it goes with the mailbox at teardown."""
        fleet = self.fleet()
        mailbox = Mailbox(
            aws_client(fleet, "s3"), fleet.control_prefix or "", cluster.owner[RUN_LABEL]
        )
        key = f"gpuflow/{path.name}"
        if not mailbox.keys(key):
            mailbox.put(key, path.read_bytes())
        return f"{mailbox.url}{key}"

    def teardown(self, cluster: Cluster) -> TeardownReport:
        return self.remove_run(cluster.owner[RUN_LABEL], cluster.name)

    @contextlib.contextmanager
    def outputs_here(self, cluster: Cluster) -> Iterator[Path]:
        """Bring every output file the run's agents put in its mailbox (each unit's, at its
        end, whether or not its gpuflow was there to read them) into the run's folder here
        and yield that folder; the mailbox goes with the run's teardown."""
        fleet = self.fleet()
        mailbox = Mailbox(
            aws_client(fleet, "s3"), fleet.control_prefix or "", cluster.owner[RUN_LABEL]
        )
        folder = Path(cluster.workspace) / "outputs"
        try:
            keys = mailbox.keys("nodes/")
        except Exception as exc:
            raise aws_error(exc, fleet, "read the run's mailbox") from None
        for key in keys:
            _, mark, relative = key.partition("/outputs/")
            if mark and relative:
                _write_output(mailbox, key, relative, folder)
        yield folder

    def remove_run(self, run_id: str, name: str | None = None) -> TeardownReport:
        """Remove everything the run made: instances, their volumes, the security group,
        the placement group, the secret and the mailbox; idempotent."""
        fleet = self.settings
        beat = _heartbeats.pop(run_id, None)
        if beat is not None:
            beat.stop()
        ec2 = ec2_client(fleet)
        try:
            gone = launching.remove(ec2, run_id, _say)
            removed = remove_leftovers(fleet, run_id)
        except Exception as exc:
            raise aws_error(exc, fleet, "remove the run's instances") from None
        shutil.rmtree(local_folder(run_id), ignore_errors=True)
        return TeardownReport(
            name=name or group_name(run_id),
            already_gone=not gone and not removed,
            killed_processes=len(gone),
            removed_workspace=True,
        )

    def list_owned(self, selector: Mapping[str, str]) -> list[Cluster]:
        """Return a cluster per run with live instances; asked for one run, that run's
        cluster even when only its secret, group or mailbox is left (teardown removes
        whatever there is)."""
        fleet = self.settings
        ec2 = ec2_client(fleet)
        filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in selector.items()]
        filters.append({"Name": "instance-state-name", "Values": launching.LIVE})
        runs: dict[str, list[dict]] = {}
        try:
            for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
                for reservation in page["Reservations"]:
                    for i in reservation["Instances"]:
                        tags = {t["Key"]: t["Value"] for t in i.get("Tags", [])}
                        runs.setdefault(tags.get(RUN_LABEL, ""), []).append(i | {"tags": tags})
        except Exception as exc:
            raise aws_error(exc, fleet, "list the run's instances") from None
        one = selector.get(RUN_LABEL)
        if one and one not in runs:
            runs[one] = [{"tags": {**selector}, "LaunchTime": datetime.now(UTC)}]
        return [
            Cluster(
                backend=self.name,
                name=group_name(run_id),
                owner={k: v for k, v in found[0]["tags"].items() if k.startswith("gpuflow.io/")},
                hostname=found[0].get("PrivateIpAddress", ""),
                workspace=str(local_folder(run_id)),
                nodes=len(found),
                created_at=found[0]["LaunchTime"],
                capabilities=self.capabilities,
                state=Ec2State(block=self.block).model_dump(mode="json"),
            )
            for run_id, found in runs.items()
            if run_id
        ]

    # -- helpers -------------------------------------------------------------------------

    def _beat(self, mailbox: Mailbox, orphan_after: float) -> None:
        run_id = mailbox.prefix.rstrip("/").rsplit("/", 1)[-1]
        with _guard:
            if run_id not in _heartbeats:
                _heartbeats[run_id] = Heartbeat(mailbox, max(1.0, min(30.0, orphan_after / 5)))

    def _login(self, state: Ec2State) -> dict[str, str] | None:
        """The registry login of the run's image (its credentials block), for the agents."""
        if state.image is None or state.image.credentials is None:
            return None
        username, password = imaging.credentials_of_image(state.image)
        return {"username": username or "", "password": password or ""}

    def _put_secret(
        self,
        secrets: Any,
        run_id: str,
        tags: Mapping[str, str],
        env: dict[str, str],
        login: dict[str, str] | None = None,
    ) -> None:
        """Keep the agent's Prefect token, the run's variables and its registry login in
        the run's secret (never in user-data or a unit's file)."""
        from prefect.settings import PREFECT_API_KEY

        given = {"prefect_api_key": PREFECT_API_KEY.value() or "", "env": env}
        value = json.dumps(given | ({"registry_login": login} if login else {}))
        try:
            secrets.put_secret_value(SecretId=secret_name(run_id), SecretString=value)
        except secrets.exceptions.ResourceNotFoundException:
            secrets.create_secret(
                Name=secret_name(run_id),
                SecretString=value,
                Description="gpuflow: the run's variables and its agents' Prefect API key",
                Tags=launching.tags_of(tags),
            )

    def _security_group(
        self, ec2: Any, run_id: str, tags: Mapping[str, str], nodes: int
    ) -> str | None:
        """Return the run's security group: no inbound rule from outside; the run's own
        nodes reach each other (rendezvous, NCCL). None where there is no default VPC."""
        vpcs = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
        if not vpcs:
            _say("no default VPC: the instances get the default security group")
            return None
        vpc = vpcs[0]["VpcId"]
        found = ec2.describe_security_groups(
            Filters=[
                {"Name": "group-name", "Values": [group_name(run_id)]},
                {"Name": "vpc-id", "Values": [vpc]},
            ]
        )["SecurityGroups"]
        if found:
            return found[0]["GroupId"]
        group = ec2.create_security_group(
            GroupName=group_name(run_id),
            Description="gpuflow run: no inbound from outside; the run's nodes reach each other",
            VpcId=vpc,
            TagSpecifications=[{"ResourceType": "security-group", "Tags": launching.tags_of(tags)}],
        )["GroupId"]
        if nodes > 1:
            ec2.authorize_security_group_ingress(
                GroupId=group,
                IpPermissions=[{"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group}]}],
            )
        return group


class _Ec2Unit:
    """A unit an agent runs on an instance, as follow_unit sees it through the mailbox:
    its result, stop requests, and the instance itself (checked every STATE_EVERY_S)."""

    every_s = 0.5

    def __init__(
        self, ec2: Any, run_id: str, instance: str, follower: _Follower, workspace: Path
    ) -> None:
        self.ec2, self.run_id, self.instance, self.follower = ec2, run_id, instance, follower
        self.mailbox, self.name, self.workspace = follower.mailbox, follower.unit, workspace
        self.state_at = time.monotonic()

    def finish(self, end: UnitEnd | None) -> UnitEnd | None:
        """Read the unit's last lines, its outputs and its samples from the mailbox."""
        if end is None:
            return None
        self.follower.read()
        self.follower.outputs(self.workspace / "outputs")
        data = self.mailbox.get(unit_key(self.instance, self.name, "samples.jsonl"))
        join_samples(self.workspace / SAMPLES, data or b"")
        return end

    def poll(self) -> UnitEnd | None:
        self.follower.read()
        result = self.mailbox.get_json(unit_key(self.instance, self.name, "result.json"))
        if result is not None:
            code = result.get("exit_code")
            if result.get("interrupted") and code != 0:
                code = PREEMPTED_EXIT_CODE
                self.follower.note(f"instance {self.instance} got a spot interruption notice")
            return UnitEnd(exit_code=code, signal=result.get("signal"))
        if time.monotonic() - self.state_at > STATE_EVERY_S:
            self.state_at = time.monotonic()
            live = {i["InstanceId"] for i in launching.owned_instances(self.ec2, self.run_id)}
            if self.instance not in live:
                self.follower.read()
                gone = self.mailbox.get_json(f"gone/{self.instance}")
                why = gone["why"] if gone else "terminated by EC2 (a spot interruption?)"
                self.follower.note(f"instance {self.instance} is gone: {why}")
                return UnitEnd(exit_code=PREEMPTED_EXIT_CODE)
        return None

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def stop(self, reason: StopReason, grace_s: float) -> None:
        self._ask(reason.value, grace_s)  # the agent stops it; its result says how it ended

    def interrupt(self, grace_s: float) -> None:
        with contextlib.suppress(Exception):
            self._ask("interrupted", grace_s)

    def unconfirmed(self) -> UnitEnd:
        self.follower.note(f"the agent on {self.instance} did not confirm the stop")
        return UnitEnd(signal=9)

    def _ask(self, why: str, grace_s: float) -> None:
        key = unit_key(self.instance, self.name, "stop")
        self.mailbox.put_json(key, {"why": why, "grace_s": grace_s})


class _Follower:
    """Reads a unit's log batches from the mailbox in order, once each."""

    def __init__(self, mailbox: Mailbox, instance: str, unit: str, tail: LogTail) -> None:
        self.mailbox, self.instance, self.unit, self.tail = mailbox, instance, unit, tail
        self.last = ""

    def read(self) -> None:
        under = unit_key(self.instance, self.unit, "log/")
        for key in self.mailbox.keys(under, after=self.last):
            for raw in (self.mailbox.get(key) or b"").decode(errors="replace").splitlines():
                self.tail(*json.loads(raw))
            self.last = key

    def note(self, line: str) -> None:
        self.tail.note(line)

    def outputs(self, folder: Path) -> None:
        under = unit_key(self.instance, self.unit, "outputs/")
        for key in self.mailbox.keys(under):
            _write_output(self.mailbox, key, key[len(under) :], folder)


def _write_output(mailbox: Mailbox, key: str, relative: str, folder: Path) -> None:
    """Write the output file at `key` of the mailbox as `relative` in `folder` (a name
    climbing out of the folder is not written)."""
    path = (folder / relative).resolve()
    if folder.resolve() not in path.parents:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(mailbox.get(key) or b"")


def _moved(command: list[str], old: list[str], new: list[str]) -> list[str]:
    """Return `command` with the cluster's first node addresses replaced by the current
    ones (instances launched again after an interruption have new addresses)."""
    mapping = {o: n for o, n in zip(old, new, strict=False) if o and o != n}
    if not mapping:
        return command
    moved = []
    for arg in command:
        host, sep, port = arg.partition(":")
        if host in mapping and (not sep or port.isdigit()):
            arg = mapping[host] + sep + port
        moved.append(arg)
    return moved


def _lock(run_id: str) -> threading.Lock:
    with _guard:
        return _locks.setdefault(run_id, threading.Lock())


def _endpoint(fleet: Fleet) -> str | None:
    if fleet.aws_credentials:
        return S3Settings.from_block(fleet.aws_credentials).endpoint_url
    return os.environ.get("AWS_ENDPOINT_URL")


_say = say_in_run


__all__ = ["Ec2Backend", "Heartbeat", "remove_leftovers", "user_data"]
