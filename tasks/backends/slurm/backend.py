"""The Slurm backend: a run's nodes and GPUs are one Slurm allocation, its units are job
steps in it. Slurm is the scheduler: gpuflow asks it, never schedules beside it.

- provision: `sbatch` of a job that holds the allocation (nodes, gres, time) and does
  nothing else; the run's owner labels, its API and its orchestrator (host, pid) go in the
  job's comment, so squeue is the record and nothing is kept on this machine. A retry
  finds the job by its comment and adopts it.
- run: one `srun --jobid` step per unit on its node, with the unit's GPUs as gres (Slurm
  hands the step its CUDA_VISIBLE_DEVICES); its lines come back through srun. A stop is
  SIGTERM to the step (`scancel --signal=TERM`), its grace, then the step is cancelled.
- teardown: `scancel` of the job, confirmed with squeue; the workspace goes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import psutil

from gpuflow.tasks.backends import imaging
from gpuflow.tasks.backends.base import LogTail, UnitBackend
from gpuflow.tasks.backends.slurm import oci
from gpuflow.tasks.backends.slurm.commands import HERE, LocalClient, LoginNode, said
from gpuflow.tasks.backends.slurm.fit import (
    IDLE_FORMAT,
    SINFO_FORMAT,
    Request,
    accounting,
    idle_gpus,
    parse_sinfo,
    pending_reason,
    qos_refusal,
    refusal,
    room_now,
)
from gpuflow.tasks.backends.slurm.model import (
    ACTIVE,
    BUSY,
    SCHEDULER_CYCLES_S,
    SlurmPlacement,
    SlurmState,
    gres,
    gres_type,
    minutes,
    workspace_root,
)
from gpuflow.tasks.backends.slurm.queue import (
    FIELDS,
    hostnames,
    job_row,
    parse,
)
from gpuflow.tasks.backends.slurm.steps import (
    NodeSampler,
    SlurmStep,
    gpu_indices_of,
    live_row,
    mpi_launch,
    running_again,
    share_of,
    step_srun,
)
from gpuflow.tasks.contract import (
    OWNER_LABEL,
    RUN_LABEL,
    Capabilities,
    Cluster,
    Needs,
    Offer,
    ReapReport,
    RunStates,
    TeardownReport,
    WorkUnit,
    state_of,
    unit_env,
)
from gpuflow.tasks.errors import (
    CapacityError,
    InvalidSpec,
    ProvisionError,
)
from gpuflow.tasks.host import OutputPump, alive, start_time
from gpuflow.tasks.metrics.cost import PriceTable, hourly_rate
from gpuflow.tasks.runscope import recall, remember
from gpuflow.tasks.saved_blocks import load_block
from gpuflow.tasks.spec import JobSpec, Placement, placement_as
from gpuflow.tasks.storage import S3Settings

if TYPE_CHECKING:
    from gpuflow.blocks.slurm_cluster import SlurmCluster

# squeue's states of a job that still holds (or waits for) its allocation


# squeue's states of a job that still holds (or waits for) its allocation


class SlurmBackend(UnitBackend):
    name = "slurm"
    capabilities = Capabilities(
        where="the Slurm cluster's nodes",
        local_files=False,  # the nodes see the cluster's shared filesystem, not this machine's
        samples_nodes=True,  # a step beside a run's units on each node samples its GPUs
        node_samples_in_workspace=True,  # ... into the shared workspace, as it samples
        runs_images=True,  # its steps run in the run's image through Slurm's OCI support
    )
    placement_model: ClassVar[type[Placement]] = SlurmPlacement

    def pin_image(self, spec: JobSpec, needs: Needs, say: Callable[[str], None]) -> JobSpec:
        """The image's digest from its registry, asked from here; the bundle is made of it."""
        if spec.image is None:
            return spec
        remember(("runs-gpuflow", spec.image.ref), needs.gpuflow)  # provision asks
        return imaging.pin_by_registry(spec, say)

    def __init__(self, block: str | None = None) -> None:
        self.block = block  # the SlurmCluster block of the runs it serves (None: the client here)

    @classmethod
    def block_types(cls) -> list[type]:
        from gpuflow.blocks.slurm_cluster import SlurmCluster

        return [SlurmCluster]

    @classmethod
    def at(cls, placement: Placement | None = None) -> SlurmBackend:
        return cls(placement.block if placement else None)

    @classmethod
    def of(cls, cluster: Cluster) -> SlurmBackend:
        """Return the backend `cluster` was made with: its SlurmCluster block."""
        return cls(state_of(cluster, SlurmState).block)

    @functools.cached_property
    def settings(self) -> SlurmCluster | None:
        """Return the SlurmCluster block (read once), None without one."""
        if self.block is None:
            return None
        from gpuflow.blocks.slurm_cluster import SlurmCluster

        return load_block(
            SlurmCluster,
            self.block,
            "placement.block",
            otherwise="remove placement.block",
        )

    @functools.cached_property
    def cli(self) -> LocalClient:
        """Return how commands reach the cluster: its login node over SSH when the block
        names one, else the Slurm client here."""
        return _reach(self.settings)

    def _types(self) -> Mapping[str, str] | None:
        return self.settings.gres_types if self.settings is not None else None

    def configure(self, spec: JobSpec, prices: PriceTable) -> tuple[JobSpec, PriceTable]:
        """Return the spec with its SlurmCluster block's partition and workspace root
        (values written in the spec win) and the prices with the cluster's; InvalidSpec
        for no such block."""
        cluster = self.settings
        if cluster is None:
            return spec, prices
        placement = spec.placement.model_copy(
            update={
                "partition": placement_as(spec, SlurmPlacement).partition or cluster.partition,
                "workspace_root": placement_as(spec, SlurmPlacement).workspace_root
                or cluster.workspace_root,
            }
        )
        prices = prices.with_gpu_rate(self.name, cluster.gpu_hourly_usd)
        return spec.model_copy(update={"placement": placement}), prices

    def offers(self, spec: JobSpec, prices: PriceTable) -> list[Offer]:
        """Return the partition's offer: GPUs of the gres type idle now on up nodes, whether
        `resources.nodes` nodes have the job's GPUs free, and the jobs pending there ahead of
        it (sinfo, squeue), at the cluster's price. A cluster that does not answer is an
        offer that cannot start."""
        res, request = spec.resources, self._request(spec)
        hourly = hourly_rate(
            prices,
            self.name,
            [res.gpu_product or ""] * res.gpus * res.nodes,
            res.cpu or 1.0,
            res.disk,
        )
        cli = self.cli
        try:
            table = parse_sinfo(_sinfo(cli))
            name = request.partition or next((r.partition for r in table if r.default), "")
            idle = cli.run(["sinfo", "-h", "-N", "-p", name, "-O", IDLE_FORMAT])
            queued = cli.run(["squeue", "-h", "-p", name, "-t", "PENDING", "-o", "%i"])
        except (InvalidSpec, ProvisionError) as exc:
            where = f"slurm/{self.block or 'this cluster'}"
            return [Offer(where=where, hourly_usd=hourly, can_start=False, why_not=str(exc))]
        free, fitting = room_now(idle, res.gpus, request.gres_type)
        ahead = len(queued.split())
        what = gres(res.gpus, request.gres_type)
        why = ""
        if fitting < res.nodes:
            why = f"{fitting} node(s) have {what} idle now, the job needs {res.nodes}"
        elif ahead:
            why = f"{ahead} job(s) pending in {name} ahead of it"
        return [
            Offer(
                where=f"slurm/{self.block or 'this cluster'} (partition {name})",
                gpu_product=res.gpu_product or request.gres_type,
                gpus_free=free,
                hourly_usd=hourly,
                can_start=not why,
                why_not=why,
                queue_ahead=ahead,
            )
        ]

    def describe(self, spec: JobSpec) -> list[dict[str, str]]:
        """Return preflight rows for `spec`: how gpuflow reaches the cluster, the partition's
        nodes and GPUs idle now, and whether the job fits it (nothing is submitted)."""
        cli = self.cli
        cli.check()
        rows = [{"name": "cluster", "level": "pass", "message": cli.describe()}]
        res = spec.resources
        request = self._request(spec)
        table = parse_sinfo(_sinfo(cli))
        name = placement_as(spec, SlurmPlacement).partition or next(
            (r.partition for r in table if r.default), ""
        )
        nodes = sorted({r.node for r in table if r.partition == name})
        if nodes:
            idle = idle_gpus(cli.run(["sinfo", "-h", "-N", "-p", name, "-O", IDLE_FORMAT]))
            free = ", ".join(f"gpu:{k or 'any'} {n}" for k, n in sorted(idle.items())) or "none"
            rows.append(
                {
                    "name": "partition",
                    "level": "pass",
                    "message": f"{name}: {len(nodes)} node(s) ({', '.join(nodes)});"
                    f" GPUs idle now: {free}",
                }
            )
        problem = refusal(request, table)
        wanted = f"{res.nodes} node(s) x {gres(res.gpus, request.gres_type)}"
        rows.append(
            {
                "name": "fit",
                "level": "fail" if problem else "pass",
                "message": problem or f"the job fits: {wanted}, --time {request.minutes} min",
            }
        )
        return rows

    def _sbatch_args(self, spec: JobSpec, name: str, comment: str, workspace: Path) -> list[str]:
        res = spec.resources
        hold_s = spec.limits.max_duration + spec.limits.stop_grace_s + 60
        argv = [
            f"--job-name={name}",
            f"--comment={comment}",
            f"--nodes={res.nodes}",
            f"--time={self._hold_minutes(spec)}",
            f"--chdir={workspace}",
            "--output=/dev/null",
            "--requeue",
        ]
        if res.gpus:
            argv.append(f"--gres={gres(res.gpus, gres_type(res.gpu_product, self._types()))}")
        if placement_as(spec, SlurmPlacement).partition:
            argv.append(f"--partition={placement_as(spec, SlurmPlacement).partition}")
        cluster = self.settings
        if cluster is not None:
            argv += [f"--account={cluster.account}"] if cluster.account else []
            argv += [f"--qos={cluster.qos}"] if cluster.qos else []
            argv += cluster.sbatch_options
        return [*argv, "--wrap", f"exec sleep {int(hold_s)}"]

    def _request(self, spec: JobSpec) -> Request:
        """Return the allocation `spec` asks for, as the fit check reads it."""
        res = spec.resources
        return Request(
            partition=placement_as(spec, SlurmPlacement).partition,
            nodes=res.nodes,
            gpus=res.gpus,
            gres_type=gres_type(res.gpu_product, self._types()),
            minutes=self._hold_minutes(spec),
        )

    def _hold_minutes(self, spec: JobSpec) -> int:
        return minutes(spec.limits.max_duration + spec.limits.stop_grace_s + 60)

    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        """Raise InvalidSpec when this machine has no Slurm client or the cluster would
        refuse the allocation (`sbatch --test-only`: partition, gres, nodes, time); submits
        nothing."""
        cli = self.cli
        cli.check()
        if cli.remote and not placement_as(spec, SlurmPlacement).workspace_root:
            raise InvalidSpec(
                "placement.workspace_root: a cluster reached over SSH needs a folder on its"
                " shared filesystem for the runs' workspaces; set it in the spec or the"
                " SlurmCluster block."
            )
        root = workspace_root(placement_as(spec, SlurmPlacement).workspace_root)
        try:
            cli.make_dir(str(root))
        except (OSError, ProvisionError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise InvalidSpec(
                f"placement.workspace_root: cannot make {root} ({why}); give a folder"
                " on the cluster's shared filesystem that gpuflow can write."
            ) from None
        if spec.image is not None:
            oci.check(cli)
        res = spec.resources
        request = self._request(spec)
        problem = refusal(request, parse_sinfo(_sinfo(cli)))
        if problem:
            raise InvalidSpec(problem)
        cluster = self.settings
        if cluster is not None and cluster.qos and (problem := _qos_problem(cli, cluster.qos)):
            raise InvalidSpec(problem)
        argv = self._sbatch_args(spec, "gpuflow-check", "{}", root)
        done = cli.answer(["sbatch", "--test-only", *argv])
        if done.returncode != 0:
            raise InvalidSpec(
                f"resources: the Slurm cluster refuses {res.nodes} node(s) with"
                f" {gres(res.gpus, gres_type(res.gpu_product, self._types()))} each for"
                f" limits.max_duration: {said(done.stderr)}; ask for what its partitions have"
                " (`sinfo -o '%P %D %G %l'`)."
            )

    # -- the allocation ------------------------------------------------------------------

    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        """Submit the run's allocation and wait until it runs; a retry adopts the job its
        owner labels name. CapacityError when it still waits for busy GPUs after
        placement.gpu_wait (the job is cancelled); ProvisionError when Slurm can never run
        it (the reason in Slurm's words)."""
        run_id = owner[RUN_LABEL]
        found = self.list_owned({RUN_LABEL: run_id})
        kind = gres_type(spec.resources.gpu_product, self._types())
        root = workspace_root(placement_as(spec, SlurmPlacement).workspace_root)
        bundle = library = None
        if spec.image is not None:  # before the allocation: an image that cannot be had
            bundle = oci.bundle(self.cli, spec.image, str(root), imaging.credentials_of(spec))
            if recall(("runs-gpuflow", spec.image.ref)) is not False:  # its steps run gpuflow's
                library = oci.library(self.cli, bundle, str(root), spec.job.kind)
        if found:
            job = state_of(found[0], SlurmState).job_id
            cluster = found[0].model_copy(
                update={
                    "nodes": spec.resources.nodes,
                    "state": SlurmState(
                        job_id=job,
                        gres_type=kind,
                        block=spec.placement.block,
                        bundle=bundle,
                        library=library,
                    ).model_dump(),
                }
            )
            return self._running(cluster, spec).model_copy(update={"adopted": True})
        name = f"gpuflow-{run_id}"
        workspace = root / name
        cli = self.cli
        cli.make_dir(str(workspace / "outputs"))  # the job contract: $GPUFLOW_OUTPUT_DIR is there
        me = psutil.Process()
        comment = json.dumps(
            {
                **owner,
                "workspace": str(workspace),
                "api": _api_url(),
                "host": socket.gethostname(),
                "pid": me.pid,
                "started": start_time(me),
            },
            separators=(",", ":"),
        )
        job_id = cli.run(
            ["sbatch", "--parsable", *self._sbatch_args(spec, name, comment, workspace)]
        )
        job_id = job_id.strip().split(";")[0]
        cluster = Cluster(
            backend=self.name,
            name=name,
            owner=dict(owner),
            hostname="",
            workspace=str(workspace),
            nodes=spec.resources.nodes,
            capabilities=self.capabilities,
            state=SlurmState(
                job_id=job_id,
                gres_type=kind,
                block=spec.placement.block,
                bundle=bundle,
                library=library,
            ).model_dump(),
            created_at=datetime.now(UTC),
        )
        return self._running(cluster, spec)

    def _running(self, cluster: Cluster, spec: JobSpec) -> Cluster:
        """Return `cluster` once its job runs, with its nodes and GPU indices."""
        job, cli = state_of(cluster, SlurmState).job_id, self.cli
        waited_from = time.monotonic()
        while True:
            row = live_row(cli, job, "ended before it ran")
            if row["state"] == "RUNNING":
                break
            reason = row["reason"]
            if reason not in BUSY:
                cli.run(["scancel", job], check=False)
                partition = placement_as(spec, SlurmPlacement).partition or "(the default)"
                said = pending_reason(reason, self._request(spec), partition)
                raise ProvisionError(f"Slurm cannot start this job: {said}; the job was cancelled")
            waited = time.monotonic() - waited_from
            if reason == "None" and waited < SCHEDULER_CYCLES_S:
                # the scheduler has not looked at the job yet (a job just submitted, GPUs
                # a job just ended still being released): no wait for GPUs has begun
                time.sleep(0.2)
                continue
            if waited > spec.placement.gpu_wait:
                # Busy GPUs past gpu_wait: capacity. GPUs idle enough for the job: the
                # scheduler has not reached it yet (many jobs at once), which its next
                # cycles do; waited for up to SCHEDULER_CYCLES_S more.
                idle, room = self._room(spec)
                needed = max(1, spec.resources.gpus) * spec.resources.nodes
                late = waited > spec.placement.gpu_wait + SCHEDULER_CYCLES_S
                if idle < needed or late:
                    cli.run(["scancel", job], check=False)
                    why = (
                        f"Slurm has not started it within {SCHEDULER_CYCLES_S:.0f} s though"
                        if idle >= needed
                        else "the Slurm cluster has no room for this job now:"
                    )
                    raise CapacityError(
                        f"{why} {room} (squeue says {reason}); placement.gpu_wait"
                        f" ({spec.placement.gpu_wait:.0f} s) has passed; the job was cancelled"
                    )
                time.sleep(1.0)
                continue
            time.sleep(0.2)
        hosts = hostnames(cli, row["nodes"])
        indices = gpu_indices_of(cli, job)
        # training meets on the first node, at its address, on a port of this job's own
        # (several jobs may share a node)
        addresses = [_node_address(cli, host) for host in hosts]
        rendezvous = f"{addresses[0]}:{20000 + int(job.split('_')[0]) % 20000}"
        return cluster.model_copy(
            update={
                "hostname": hosts[0],
                "node_names": hosts,
                "node_addresses": addresses,
                "gpu_indices": indices,
                # what the run is priced by: the product asked for (a gres type is no product)
                "gpu_products": [spec.resources.gpu_product or "any"] * len(indices),
                "rendezvous": rendezvous,
            }
        )

    def _room(self, spec: JobSpec) -> tuple[int, str]:
        """Return the GPUs of the job's type idle now in its partition, and what the job
        waits for and what the partition has, in words."""
        res = spec.resources
        kind = gres_type(res.gpu_product, self._types())
        wanted = f"{res.nodes} node(s) x {gres(res.gpus, kind)}"
        cli = self.cli
        table = parse_sinfo(cli.run(["sinfo", "-h", "-N", "-o", SINFO_FORMAT], check=False))
        name = placement_as(spec, SlurmPlacement).partition or next(
            (r.partition for r in table if r.default), ""
        )
        listed = cli.run(["sinfo", "-h", "-N", "-p", name, "-O", IDLE_FORMAT], check=False)
        idle = idle_gpus(listed).get(kind or "", 0) if kind else sum(idle_gpus(listed).values())
        each = f"gpu:{kind}" if kind else "GPUs"
        return (
            idle,
            f"it waits for {wanted}; partition {name} has {idle} {each} idle now",
        )

    # -- units -----------------------------------------------------------------------------

    def start(
        self,
        cluster: Cluster,
        unit: WorkUnit,
        env: Mapping[str, str],
        timeout_s: float,
        tail: LogTail,
    ) -> SlurmStep:
        """Run the unit as a step of the run's job on its node, with its GPUs as gres; its
        variables reach the step through srun's environment (never its command line)."""
        state, cli = state_of(cluster, SlurmState), self.cli
        bundle = state.bundle if unit.in_image else None  # gpuflow's own program: the node's
        hosts = running_again(cli, state.job_id, time.monotonic() + timeout_s)
        step = f"{cluster.name}.{unit.name}.{uuid.uuid4().hex[:8]}"
        # A unit with GPUs of its own (a render chunk, a copy per GPU) gets the node's
        # GPUs of the job and keeps its share: steps that --overlap share their gres, so
        # Slurm would hand each one-GPU step the node's first GPU.
        count = cluster.gpus_per_node if unit.gpus is None or unit.gpus else 0
        argv = [
            *step_srun(state, step, hosts[unit.node], cluster.workspace),
            "--kill-on-bad-exit=1",
            f"--gres={gres(count, state.gres_type)}" if count else "--gres=none",
            *(mpi_launch(cli, unit.launcher, cluster, state) if unit.launcher else []),
            *(share_of(cluster, unit.gpus) if unit.gpus else []),
            *([f"--container={bundle}"] if bundle else []),
            *(oci.in_bundle(cli, unit.command, cluster.workspace) if bundle else unit.command),
        ]
        # in the image, the step's GPUs are the container's only ones: 0..n-1 (Slurm's
        # CUDA_VISIBLE_DEVICES does not reach a container's environment)
        inside = list(range(len(unit.gpus) if unit.gpus else count)) if bundle else None
        child_env = {
            **env,
            **unit.env,
            **unit_env(unit.node, cluster.nodes, cluster.workspace, inside or None),
        }
        if bundle and state.library and imaging.runs_gpuflow(unit.command):
            path = [state.library, child_env.get("PYTHONPATH")]  # gpuflow's own code first
            child_env["PYTHONPATH"] = ":".join(filter(None, path))
        proc = cli.start(argv, child_env)
        pump = OutputPump({"stdout": proc.stdout, "stderr": proc.stderr}, tail).start()
        sampler = None
        if count and not cli.remote:  # the samples are read from the shared workspace
            sampler = NodeSampler.join(cli, cluster, state, hosts[unit.node])
        return SlurmStep(cli, proc, state.job_id, step, pump, sampler)

    # -- teardown and reaping ------------------------------------------------------------------

    def stage(self, cluster: Cluster, path: Path, storage: S3Settings, staging: str | None) -> str:
        """Put `path` in the run's workspace on the cluster's shared file system (over the
        login node where there is one), where every node of the job reads it; removed with
        the workspace at teardown."""
        target = f"{cluster.workspace}/.{path.name}"
        self.cli.put_file(path, target)
        return target

    def teardown(self, cluster: Cluster) -> TeardownReport:
        """Cancel the run's job (its steps with it), wait until squeue no longer holds it,
        remove the workspace. Never raises on "already gone"."""
        job, cli = state_of(cluster, SlurmState).job_id, self.cli
        row = job_row(cli, job)
        gone = row is None or row["state"] not in ACTIVE
        if not gone:
            cli.run(["scancel", job], check=False)
            deadline = time.monotonic() + 60
            while (row := job_row(cli, job)) and row["state"] in ACTIVE:
                if time.monotonic() > deadline:
                    raise ProvisionError(
                        f"the Slurm job {job} was cancelled but is still {row['state']}"
                    )
                time.sleep(0.2)
        removed = bool(cluster.workspace) and cli.remove_dir(cluster.workspace)
        return TeardownReport(name=cluster.name, already_gone=gone, removed_workspace=removed)

    def _owned_jobs(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """Yield each active job gpuflow submitted (squeue's row) with its owner labels."""
        for row in parse(self.cli.run(["squeue", "-h", "-a", "-o", FIELDS])):
            if row["comment"].get(OWNER_LABEL) == "gpuflow" and row["state"] in ACTIVE:
                yield row, row["comment"]

    def list_owned(self, selector: Mapping[str, str]) -> list[Cluster]:
        """Return the runs' allocations squeue holds whose owner labels include `selector`."""
        found = []
        for row, labels in self._owned_jobs():
            if any(labels.get(k) != v for k, v in selector.items()):
                continue
            owner = {k: str(v) for k, v in labels.items() if k.startswith("gpuflow.io/")}
            found.append(
                Cluster(
                    backend=self.name,
                    name=f"gpuflow-{owner.get(RUN_LABEL, row['id'])}",
                    owner=owner,
                    hostname="",
                    workspace=str(labels.get("workspace", "")),
                    capabilities=self.capabilities,
                    state=SlurmState(job_id=row["id"], block=self.block).model_dump(),
                    created_at=_submitted(row["submitted"]),
                )
            )
        return found

    def reap(self, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
        """Cancel the jobs of runs that are over (final or unknown to their API), or whose
        gpuflow ran on this host and died (their run is marked Crashed); runs whose API is
        away are left as they are."""
        report = ReapReport(counts={"clusters": 0})
        self.cli.check()  # a client, a login node that lets gpuflow in: else one sentence
        for row, labels in self._owned_jobs():
            run_id, api = str(labels.get(RUN_LABEL, "")), labels.get("api")
            standing = runs.state(run_id, api)
            why = None
            if standing == "running":
                if labels.get("host") == socket.gethostname() and not alive(
                    int(labels.get("pid", 0)), labels.get("started")
                ):
                    why = "its gpuflow is dead"
                    report.crashed.append((run_id, api))
            elif standing != "away":
                why = f"its flow run is {standing}"
            if why is None:
                continue
            verb = "would cancel" if dry_run else "cancelled"
            say(f"  Slurm job {row['id']} of run {run_id}: {why}; {verb}")
            report.counts["clusters"] += 1
            if dry_run:
                continue
            cluster = Cluster(
                backend=self.name,
                name=f"gpuflow-{run_id}",
                owner={},
                hostname="",
                workspace=str(labels.get("workspace", "")),
                state=SlurmState(job_id=row["id"], block=self.block).model_dump(),
                created_at=datetime.now(UTC),
            )
            self.teardown(cluster)
        return report


def _qos_problem(cli: LocalClient, qos: str) -> str | None:
    """Return why the cluster cannot give a job `qos` (qos_refusal), None when it can."""
    plugin = accounting(cli.run(["scontrol", "show", "config"]))
    known = None
    if not plugin.endswith("/none"):
        listed = cli.answer(["sacctmgr", "-n", "-P", "show", "qos", "format=name"])
        known = listed.stdout.split() if listed.returncode == 0 else None
    return qos_refusal(qos, plugin, known)


def _sinfo(cli: LocalClient) -> str:
    """Return sinfo's rows of every node (SINFO_FORMAT); InvalidSpec when the Slurm client
    here has no cluster to ask (no slurm.conf, no configless DNS record)."""
    try:
        return cli.run(["sinfo", "-h", "-N", "-o", SINFO_FORMAT])
    except ProvisionError as exc:
        if "configuration source" not in str(exc):
            raise
        raise InvalidSpec(
            "placement.backend: slurm: the Slurm client here knows no cluster (no slurm.conf,"
            " no SLURM_CONF); set SLURM_CONF to the cluster's slurm.conf, or run gpuflow on its"
            " login node."
        ) from None


_LOGIN_NODES_LOCK = threading.Lock()


_LOGIN_NODES: dict[
    tuple, LoginNode
] = {}  # one per login node and key: its SSH connection serves every run


def _reach(cluster: Any) -> LocalClient:
    """Return how commands reach the cluster a SlurmCluster block describes: its login node
    over SSH (the key read from the Secret block it names), else the Slurm client here."""
    if cluster is None or not cluster.login_host:
        return HERE
    key = None
    if cluster.ssh_key:
        from prefect.blocks.system import Secret

        create = f"the login node's private key: Secret(value=...).save({cluster.ssh_key!r})"
        key = load_block(Secret, cluster.ssh_key, "ssh_key", create=create).get()
    settings = (cluster.login_host, cluster.login_user, cluster.login_port, key)
    with _LOGIN_NODES_LOCK:
        found = _LOGIN_NODES.get((*settings, cluster.known_hosts, cluster.ssh_key))
        if found is None:
            found = LoginNode(*settings, known_hosts=cluster.known_hosts, key_name=cluster.ssh_key)
            _LOGIN_NODES[(*settings, cluster.known_hosts, cluster.ssh_key)] = found
    return found


def _node_address(cli: LocalClient, node: str) -> str:
    """Return the address the node's slurmd has (NodeAddr), which other nodes reach."""
    shown = cli.run(["scontrol", "show", "node", node])
    found = re.search(r"\bNodeAddr=(\S+)", shown)
    return found.group(1) if found else node


def _submitted(text: str) -> datetime:
    with contextlib.suppress(ValueError):
        return datetime.fromisoformat(text).replace(tzinfo=UTC)
    return datetime.now(UTC)


def _api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None
