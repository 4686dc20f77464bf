"""The instance backends: a run rents GPU instances from a cloud, whose agents pull its
units from a mailbox in the cloud's object storage. The same on every cloud; what is a
cloud's own is its provider (gpuflow.tasks.backends.instances.cloud.Cloud: AWS in
tasks/backends/ec2, Alibaba Cloud in tasks/backends/alibaba, ...).

- `provision` ranks the offers (gpuflow.tasks.backends.instances.catalog), keeps the run's
  variables and the agent's Prefect token in the run's secret (never in user-data), makes
  a network with no inbound rule from outside (nodes of one run reach each other),
  launches with user-data that installs gpuflow and starts its agent (capacity failover
  across the offers), and waits until every agent says it is ready. From then until
  teardown this process rewrites the run's heartbeat; agents that stop seeing it
  terminate their instances.
- `run` writes the unit into the node's mailbox and follows its log lines, its end and its
  instance. A spot interruption (the agent saw the notice, or the instance is gone) is a
  preemption (exit 75): the run stage retries, and the retry finds the instances lost,
  launches new ones (on-demand after `placement.on_demand_after` interruptions when the
  market allows) and resumes the job from its checkpoint.
- `teardown` terminates the instances and removes what the run made (its network, its
  secret, its mailbox), and confirms by describing them.
"""

from __future__ import annotations

import abc
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
from typing import ClassVar, Self

from pydantic import BaseModel

from gpuflow.tasks import contract, own_wheel
from gpuflow.tasks.backends import imaging
from gpuflow.tasks.backends.base import LogTail, UnitBackend, join_samples, say_in_run
from gpuflow.tasks.backends.instances import reap as reaping
from gpuflow.tasks.backends.instances.agent import PYTHON, AgentConfig, UnitSpec
from gpuflow.tasks.backends.instances.catalog import CloudSettings, Offer, money
from gpuflow.tasks.backends.instances.cloud import Boot, Cloud, Machine
from gpuflow.tasks.backends.instances.mailbox import HEARTBEAT, Mailbox, unit_key
from gpuflow.tasks.backends.instances.placement import Ask, InstancePlacement
from gpuflow.tasks.backends.instances.reap import CONTROL_TAG, ORPHAN_TAG, prefect_api_url
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
from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.metrics.sampler import SAMPLES
from gpuflow.tasks.placement import prices_for, resolve
from gpuflow.tasks.runscope import once
from gpuflow.tasks.spec import Image, JobSpec, Limits, MetricsSettings, Placement, placement_as
from gpuflow.tasks.storage import S3Settings

STATE_EVERY_S = 5.0
_heartbeats: dict[str, Heartbeat] = {}
_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()


def group_name(run_id: str) -> str:
    return f"gpuflow-{run_id}"


def article(word: str) -> str:
    return "an" if word[:1].upper() in "AEIOU" else "a"


def local_folder(run_id: str, backend: str = "ec2") -> Path:
    """Return this host's folder for the run: outputs its units send back, samples."""
    return gpuflow_home() / backend / run_id


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


def user_data(
    fleet: CloudSettings, config: AgentConfig, wheel: tuple[str, str, str], cloud: Cloud
) -> str:
    """Return the instance's boot script: where this gpuflow's own wheel is (`wheel`: its
    s3:// URL beside the run's mailbox, its SHA-256 and a presigned URL that GETs it), the
    block's install step, then the
    cloud's agent. Its settings are base64 JSON with nothing secret in them."""
    url, digest, get = wheel
    return "\n".join(
        [
            "#!/bin/bash",
            f"# gpuflow: the agent of run {config.run_id}; it pulls the run's work from"
            f" {config.control}",
            "set -euo pipefail",
            "GPUFLOW_PYTHON=python3",
            "# the orchestrator's own build of gpuflow, to be checked by its SHA-256 (the"
            " URL to GET it serves that object only, until the boot times out)",
            f"export GPUFLOW_WHEEL_URL={shlex.quote(url)}",
            f"export GPUFLOW_WHEEL_GET={shlex.quote(get)}",
            f"export GPUFLOW_WHEEL_SHA256={digest}",
            f"export GPUFLOW_WHEEL=/var/tmp/{shlex.quote(url.rsplit('/', 1)[1])}",
            "# install gpuflow (sets GPUFLOW_PYTHON); a step that fails ends the boot here",
            "{",
            fleet.install or ":",
            "} || { echo 'gpuflow: the install step failed; the agent is not started' >&2; exit 1; }",
            f'exec "$GPUFLOW_PYTHON" -m {cloud.agent_module} --config ' + config.encode(),
            "",
        ]
    )


class Node(BaseModel):
    """One node of a run: the instance and the address its agent said it has."""

    instance_id: str
    address: str


class InstanceState(BaseModel):
    """What an instance backend keeps on its cluster record."""

    block: str | None = None
    control: str = ""  # the run's mailbox
    security_group: str | None = None
    # what each unit's start reads (typed, never the spec re-read)
    job: str = ""  # the job's name, in its metrics
    metrics: MetricsSettings = MetricsSettings()
    # what the cloud is asked for: read to launch the instances again after a loss
    ask: Ask | None = None
    tags: dict[str, str] = {}  # put on everything the run makes
    instances: list[Node] = []  # node 0 first
    offer: Offer | None = None  # what the instances were launched from
    # the run's image, pinned (image:): each agent's engine pulls it, its units run in it
    image: Image | None = None


class InstanceBackend(UnitBackend):
    """A backend that rents instances from one provider's cloud (`cloud_class`)."""

    # each agent samples its instance; the run stage samples nothing here
    capabilities = Capabilities(
        runs_here=False,
        where="rented instances",
        local_files=False,
        samples_nodes=True,
        runs_images=True,  # each agent's engine pulls the run's pinned image (image:)
    )
    placement_model: ClassVar[type[Placement]] = InstancePlacement
    ask_model: ClassVar[type[Ask]] = Ask

    def pin_image(self, spec: JobSpec, needs: Needs, say: Callable[[str], None]) -> JobSpec:
        """The image's digest from its registry, asked from here; each instance pulls it."""
        return spec if spec.image is None else imaging.pin_by_registry(spec, say)

    @classmethod
    def at(cls, placement: Placement | None = None) -> Self:
        """Return the backend for the placement's block (else the default one)."""
        return cls(placement.block if placement is not None else None)

    @classmethod
    def reaper(cls, block: str | None, namespace: str | None) -> Self:
        return cls(block, field="--block")

    @classmethod
    def of(cls, cluster: Cluster) -> Self:
        """Return the backend `cluster` was made with: its block."""
        return cls(state_of(cluster, InstanceState).block)

    def __init__(self, block: str | None = None, field: str = "placement.block") -> None:
        self.block, self.field = block, field

    # -- what a provider gives -----------------------------------------------------------

    @abc.abstractmethod
    def settings_named(self, block: str | None, field: str) -> CloudSettings:
        """The provider block `block`'s settings (defaults for None), read once."""

    @abc.abstractmethod
    def cloud_of(self, settings: CloudSettings) -> Cloud:
        """The provider's cloud for these settings."""

    # -- settings ----------------------------------------------------------------------

    @functools.cached_property
    def settings(self) -> CloudSettings:
        """Return the block's settings (read once), else defaults."""
        return self.settings_named(self.block, self.field)

    @functools.cached_property
    def cloud(self) -> Cloud:
        return self.cloud_of(self.settings)

    def fleet(self) -> CloudSettings:
        """Return the settings, checked for launching: InvalidSpec for a missing block,
        image, control prefix or an install step that cannot be trusted."""
        settings, cloud = self.settings, self.cloud
        if self.block is None:
            kind = settings.block_type
            raise InvalidSpec(
                f"placement.block: launching on {self.name} needs {article(kind)} {kind} block (its"
                f" image_id and control_prefix); create one with blocks.{kind}(...).save(name)"
                " and name it here (gpuflow offers ranks without one)."
            )
        cloud.check_launch()
        control = settings.control_prefix or ""
        if not control.startswith("s3://") or len(control) <= len("s3://"):
            raise InvalidSpec(
                f"{settings.field('control_prefix')}: {control or 'nothing'} is not an s3://"
                " prefix; set it to a bucket and prefix the instances can read and write."
            )
        return settings

    def configure(self, spec: JobSpec, prices: PriceTable) -> tuple[JobSpec, PriceTable]:
        """Return the spec and prices as they are: this backend reads its block itself."""
        return spec, prices

    def ranked(self, spec: JobSpec | Ask, prices: PriceTable, fresh: bool = False) -> list[Offer]:
        """The cloud's offers for `spec` (a spec, or what a cluster keeps of it), in the
        order a launch tries them, priced in its currency and in USD (nothing launched):
        asked once per run scope (a check, then a pool's offers), or anew when `fresh`
        (launching again after a loss: prices and stock have moved)."""
        ask = spec if isinstance(spec, Ask) else self.ask_model.of(spec, prices)
        if fresh:
            return self.cloud.find_offers(ask, prices)
        key = ("ranked", self.name, self.block, ask.model_dump_json(), prices.model_dump_json())
        return once(key, lambda: self.cloud.find_offers(ask, prices))

    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        settings = self.fleet()
        _, prices = resolve(spec)
        self.ranked(spec, prices)  # region, product, budget, credentials: said here
        bucket = (settings.control_prefix or "").removeprefix("s3://").split("/")[0]
        try:
            self.cloud.storage().head_bucket(Bucket=bucket)
        except Exception as exc:
            raise self.cloud.error(exc, f"reach the control bucket {bucket}") from None

    def offers(self, spec: JobSpec, prices: PriceTable) -> list[contract.Offer]:
        """Return the ranked offers (spot and on-demand, cheapest first, the order a launch
        tries them), each priced for every node. Whether a zone has the capacity is known
        only when a launch asks: every offer says it can start."""
        found = self.ranked(spec, prices)
        nodes = spec.resources.nodes
        where = f"{self.name}/{self.settings.name or 'default'}"
        return [
            contract.Offer(
                where=f"{where} {o.instance_type} {o.market} in {o.zone}"
                + (
                    f" ({money(o.hourly_price * nodes, o.currency)}/h)"
                    if o.hourly_price and o.currency != "USD"
                    else ""
                ),
                gpu_product=o.product,
                hourly_usd=o.hourly_usd * nodes,
                can_start=True,
                why_not="capacity is known at launch",
                preemptible=o.market == "spot",
            )
            for o in found
        ]

    def describe(self, spec: JobSpec) -> list[dict[str, str]]:
        settings = self.fleet()
        market = placement_as(spec, InstancePlacement).market
        return [
            {
                "name": "instances",
                "level": "pass",
                "message": f"{spec.resources.nodes} instance(s) with {spec.resources.gpus} GPU(s)"
                f" in {settings.region}, {market}; agents pull work from"
                f" {settings.control_prefix}",
            }
        ]

    def _mailbox(self, run_id: str) -> Mailbox:
        return Mailbox(self.cloud.storage(), self.settings.control_prefix or "", run_id)

    # -- provision -----------------------------------------------------------------------

    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        """Return the run's cluster of ready instances; a retry adopts them."""
        self.fleet()
        cloud = self.cloud
        run_id = owner[RUN_LABEL]
        mailbox = self._mailbox(run_id)
        tags = {
            **owner,
            CONTROL_TAG: mailbox.url,
            ORPHAN_TAG: str(int(spec.limits.orphan_after)),
        }
        self._beat(mailbox, spec.limits.orphan_after)
        try:
            self._put_secret(run_id, tags, {})
            group = cloud.network(run_id, tags, spec.resources.nodes)
        except InvalidSpec:
            raise
        except Exception as exc:
            raise cloud.error(exc, "prepare the run's secret and security group") from None
        if group is None:
            _say("no default network: the instances get the default security group")
        local_folder(run_id, self.name).joinpath("outputs").mkdir(parents=True, exist_ok=True)
        cluster = Cluster(
            backend=self.name,
            name=group_name(run_id),
            owner=dict(owner),
            hostname="",
            workspace=str(local_folder(run_id, self.name)),
            gpu_indices=list(range(spec.resources.gpus)),
            nodes=spec.resources.nodes,
            created_at=datetime.now(UTC),
            capabilities=self.capabilities,
            state=InstanceState(
                block=self.block,
                control=mailbox.url,
                security_group=group or None,
                job=spec.name,
                metrics=spec.metrics,
                ask=self.ask_model.of(spec),
                tags=tags,
                image=spec.image,
            ).model_dump(mode="json"),
        )
        nodes, offer, adopted = self._nodes(cluster, mailbox)
        return self._with_nodes(cluster, nodes, offer).model_copy(update={"adopted": adopted})

    def _own_wheel(self, mailbox: Mailbox) -> tuple[str, str, str]:
        """Put this gpuflow's own wheel beside the run's mailbox (the instance installs it,
        never a package of that name from an index); return its URL, SHA-256 and a URL
        that GETs that object only, until the boot times out."""
        name, data = own_wheel.build()
        mailbox.put(f"gpuflow/{name}", data)
        get = mailbox.s3.generate_presigned_url(
            "get_object",
            Params={"Bucket": mailbox.bucket, "Key": f"{mailbox.prefix}gpuflow/{name}"},
            ExpiresIn=int(self.settings.boot_timeout_s) + 600,
        )
        return f"{mailbox.url}gpuflow/{name}", own_wheel.sha256(data), str(get)

    def _with_nodes(self, cluster: Cluster, nodes: list[Node], offer: Offer | None) -> Cluster:
        state = state_of(cluster, InstanceState)
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

    def _nodes(self, cluster: Cluster, mailbox: Mailbox) -> tuple[list[Node], Offer | None, bool]:
        """Return the run's live nodes (instance and address, node 0 first), the offer
        they were launched from (None when adopted) and whether they were adopted. Nodes
        lost or told of an interruption are terminated and replaced (all of them: a job
        is all or nothing)."""
        state = state_of(cluster, InstanceState)
        run_id = cluster.owner[RUN_LABEL]
        cloud, settings = self.cloud, self.settings
        with _lock(run_id):
            live = cloud.run_machines(run_id, ["pending", "running"])
            noticed = {k.split("/", 1)[1] for k in mailbox.keys("notices/")}
            # lost once and replaced: a cluster record from before the replacement still
            # names them, and must not make every later unit replace its nodes again
            replaced = {k.split("/", 1)[1] for k in mailbox.keys("lost/")}
            known = state.instances
            vanished = {n.instance_id for n in known} - {m.id for m in live}
            lost = sorted((vanished | ({m.id for m in live} & noticed)) - replaced)
            if live and len(live) == cluster.nodes and not lost:
                return self._ready(mailbox, live), None, True
            for instance in lost:
                mailbox.put_json(f"lost/{instance}", {"at": datetime.now(UTC).isoformat()})
            if live:  # a partial set, or one that was warned: replace them all
                cloud.remove(run_id, _say)
            losses = len(mailbox.keys("lost/"))
            if state.ask is None:
                raise ProvisionError(f"{cluster.name}: its record says not what to launch")
            ask = state.ask
            offers = self._offers(ask, losses)
            config = AgentConfig(
                run_id=run_id,
                control=settings.control_prefix or "",
                secret_id=cloud.secret_id(run_id),
                orphan_after_s=ask.limits.orphan_after,
                deadline_s=ask.limits.max_duration + ask.limits.stop_grace_s + 300,
                prefect_api_url=prefect_api_url(),
                **cloud.agent_settings(),
            )
            boot = Boot(
                image_id=settings.image_id or "",
                user_data=user_data(settings, config, self._own_wheel(mailbox), cloud),
                disk_gib=max(8, int(ask.resources.disk / 2**30)),
                tags=state.tags,
                network=state.security_group,
                spot_price_limit=ask.placement.spot_price_limit,
            )
            try:
                made = cloud.launch(offers, ask.resources.nodes, boot, _say)
            except (CapacityError, InvalidSpec):
                raise
            except Exception as exc:
                raise cloud.error(exc, "launch the run's instances") from None
            live = cloud.run_machines(run_id, ["pending", "running"])
            return self._ready(mailbox, live), made.offer, made.adopted

    def _offers(self, ask: Ask, losses: int) -> list[Offer]:
        """Return what to launch from (after `losses` spot interruptions, on-demand only
        where the placement says so)."""
        offers = self.ranked(ask, prices_for(ask.placement), fresh=True)
        market, after = ask.placement.market, ask.placement.on_demand_after
        if market == "spot-then-on-demand" and losses >= after:
            _say(
                f"{losses} spot interruption(s) so far (placement.on_demand_after"
                f" {after}): renting on-demand"
            )
            offers = [o for o in offers if o.market == "on-demand"]
        return offers

    def _ready(self, mailbox: Mailbox, live: list[Machine]) -> list[Node]:
        """Wait until every instance's agent said it is ready; return the nodes in launch
        order. ProvisionError when one is not ready within the boot timeout."""
        settings = self.settings
        order = sorted(live, key=lambda m: (m.index, m.id))
        until = time.monotonic() + settings.boot_timeout_s
        nodes: list[Node] = []
        for instance in order:
            while True:
                ready = mailbox.get_json(f"nodes/{instance.id}/ready")
                if ready:
                    nodes.append(Node(instance_id=instance.id, address=ready["address"]))
                    break
                if time.monotonic() > until:
                    raise ProvisionError(
                        f"instance {instance.id} did not start gpuflow's agent within"
                        f" {settings.boot_timeout_s:.0f} s ({settings.field('boot_timeout_s')});"
                        f" read its console output ({self.cloud.console_hint}) for the install"
                        " step"
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
    ) -> _InstanceUnit:
        """Hand `unit` to its node's instance through the mailbox. An interruption notice
        or a lost instance ends it as a preemption (exit 75)."""
        state = state_of(cluster, InstanceState)
        self.fleet()
        run_id = cluster.owner[RUN_LABEL]
        mailbox = self._mailbox(run_id)
        self._beat(mailbox, float(state.tags[ORPHAN_TAG]))  # as provision set it
        self._put_secret(run_id, state.tags, dict(env), self._login(state))
        nodes, _, _ = self._nodes(cluster, mailbox)
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
        return _InstanceUnit(self.cloud, run_id, instance, follower, Path(cluster.workspace))

    # -- teardown ------------------------------------------------------------------------

    def reap(self, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
        """Remove what runs that are over, or orphaned, left (instances, volumes, groups,
        secrets, mailboxes); with `dry_run`, say what would go and its hourly price."""
        return reaping.reap(self.cloud, dry_run, say, runs)

    def stage(self, cluster: Cluster, path: Path, storage: S3Settings, staging: str | None) -> str:
        """Put `path` beside the run's mailbox, which its instances read (their role, or
        the block's credentials); it goes with the mailbox at teardown."""
        mailbox = self._mailbox(cluster.owner[RUN_LABEL])
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
        mailbox = self._mailbox(cluster.owner[RUN_LABEL])
        folder = Path(cluster.workspace) / "outputs"
        try:
            keys = mailbox.keys("nodes/")
        except Exception as exc:
            raise self.cloud.error(exc, "read the run's mailbox") from None
        for key in keys:
            _, mark, relative = key.partition("/outputs/")
            if mark and relative:
                _write_output(mailbox, key, relative, folder)
        yield folder

    def remove_run(self, run_id: str, name: str | None = None) -> TeardownReport:
        """Remove everything the run made: instances, their volumes, its network, its
        secret and its mailbox; idempotent."""
        beat = _heartbeats.pop(run_id, None)
        if beat is not None:
            beat.stop()
        try:
            gone = self.cloud.remove(run_id, _say)
            removed = reaping.remove_leftovers(self.cloud, run_id)
        except Exception as exc:
            raise self.cloud.error(exc, "remove the run's instances") from None
        shutil.rmtree(local_folder(run_id, self.name), ignore_errors=True)
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
        try:
            found = self.cloud.machines(selector)
        except Exception as exc:
            raise self.cloud.error(exc, "list the run's instances") from None
        runs: dict[str, list[Machine]] = {}
        for machine in found:
            runs.setdefault(machine.tags.get(RUN_LABEL, ""), []).append(machine)
        one = selector.get(RUN_LABEL)
        if one and one not in runs:
            runs[one] = [Machine(id="", state="", tags={**selector}, launched_at=datetime.now(UTC))]
        return [
            Cluster(
                backend=self.name,
                name=group_name(run_id),
                owner={k: v for k, v in machines[0].tags.items() if k.startswith("gpuflow.io/")},
                hostname=machines[0].address,
                workspace=str(local_folder(run_id, self.name)),
                nodes=len(machines),
                created_at=machines[0].launched_at,
                capabilities=self.capabilities,
                state=InstanceState(block=self.block).model_dump(mode="json"),
            )
            for run_id, machines in runs.items()
            if run_id
        ]

    # -- helpers -------------------------------------------------------------------------

    def _beat(self, mailbox: Mailbox, orphan_after: float) -> None:
        run_id = mailbox.prefix.rstrip("/").rsplit("/", 1)[-1]
        with _guard:
            if run_id not in _heartbeats:
                _heartbeats[run_id] = Heartbeat(mailbox, max(1.0, min(30.0, orphan_after / 5)))

    def _login(self, state: InstanceState) -> dict[str, str] | None:
        """The registry login of the run's image (its credentials block), for the agents."""
        if state.image is None or state.image.credentials is None:
            return None
        username, password = imaging.credentials_of_image(state.image)
        return {"username": username or "", "password": password or ""}

    def _put_secret(
        self,
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
        self.cloud.put_secret(run_id, tags, value)


class _InstanceUnit:
    """A unit an agent runs on an instance, as follow_unit sees it through the mailbox:
    its result, stop requests, and the instance itself (checked every STATE_EVERY_S)."""

    every_s = 0.5

    def __init__(
        self, cloud: Cloud, run_id: str, instance: str, follower: _Follower, workspace: Path
    ) -> None:
        self.cloud, self.run_id, self.instance, self.follower = cloud, run_id, instance, follower
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
            live = {m.id for m in self.cloud.run_machines(self.run_id)}
            if self.instance not in live:
                self.follower.read()
                gone = self.mailbox.get_json(f"gone/{self.instance}")
                why = (
                    gone["why"]
                    if gone
                    else f"terminated by {self.cloud.label} (a spot interruption?)"
                )
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


_say = say_in_run
