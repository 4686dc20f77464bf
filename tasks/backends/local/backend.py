"""The local backend: GPUs, a workspace and child processes on this host (the embedded default).

State lives on disk under $GPUFLOW_HOME/local so that teardown and the reaper work
from any process: clusters/<name>.json describes each cluster (and the job's
process group once it runs), gpus/<index>.json claims a device.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar, Literal

import psutil
from pydantic import BaseModel, Field

from gpuflow.tasks import nvml
from gpuflow.tasks.backends import imaging
from gpuflow.tasks.backends.base import LogTail, ProcessGroupUnit, UnitBackend, exit_end
from gpuflow.tasks.backends.local import cgroups, gpu_slots
from gpuflow.tasks.backends.local import reap as reaping
from gpuflow.tasks.contract import (
    RUN_LABEL,
    Capabilities,
    Cluster,
    Needs,
    Offer,
    ReapReport,
    RunStates,
    StopReason,
    TeardownReport,
    UnitEnd,
    WorkUnit,
    state_of,
    unit_env,
)
from gpuflow.tasks.errors import CapacityError, InvalidSpec, ProvisionError
from gpuflow.tasks.host import (
    OutputPump,
    StateFileError,
    alive,
    gpuflow_home,
    job_environ,
    make_dirs,
    private_dir,
    read_state_json,
    resolve_program,
    secure_home,
    start_time,
    state_records,
    stop_group,
    sweep_partial_writes,
    write_atomic,
)
from gpuflow.tasks.metrics.cost import PriceTable, hourly_rate
from gpuflow.tasks.saved_blocks import load_block
from gpuflow.tasks.spec import Folder, JobSpec, Placement, placement_as
from gpuflow.tasks.storage import S3Settings
from gpuflow.tasks.units import format_bytes

# Chunks of a render run side by side on one cluster: their records must not race.
_RECORD_LOCK = threading.Lock()


def workspace_root(spec: JobSpec) -> Path:
    """Return where this spec's workspaces go."""
    root = placement_as(spec, LocalPlacement).workspace_root
    return Path(root).expanduser().absolute() if root else gpuflow_home() / "workspaces"


class LocalState(BaseModel):
    """What the local backend keeps on its cluster record."""

    # resources.memory holds the job to that much, where a memory cgroup can be made
    memory_bytes: int | None = None
    image: imaging.HostImage | None = None  # the units run in it (the spec's image:)
    shm_bytes: int | None = None  # resources.shm: a container's /dev/shm (1 GiB unless said)


def job_tmp(workspace: str) -> Path:
    """Return the job's TMPDIR: a short folder of its own under /tmp (programs put Unix
    sockets there, whose paths may not pass 107 bytes: a workspace's path can be longer),
    named after its workspace, made 0700 at provision and removed by teardown."""
    digest = hashlib.sha256(workspace.encode()).hexdigest()[:16]
    return Path("/tmp") / f"gpuflow-job-{digest}"


class LocalRecord(BaseModel):
    """The local backend's record of one cluster on disk (clusters/<name>.json): what
    teardown and the reaper need, from any process."""

    cluster: Cluster
    orchestrator_pid: int | None = None  # the gpuflow process that runs it ...
    orchestrator_started: float | None = None  # ... and its create time
    api_url: str | None = None  # the Prefect API its run is in
    complete: bool = False  # provision finished: a retry adopts it as it is
    jobs: dict[str, float] = {}  # a running job's process group -> its create time
    cgroups: list[str] | None = None  # where its jobs are tracked; None: not made yet
    memory_cgroup: str | None = None  # the cgroup holding them to resources.memory
    memory_limited: bool = False  # the memory cgroup was asked for (None: none here)


class LocalPlacement(Placement):
    """placement: for this machine: where workspaces go, and whether the Prefect
    concurrency limit `gpu` must exist."""

    backend: Literal["local"] = "local"
    workspace_root: Folder | None = Field(None, description="Folder for job workspaces.")
    strict_gpu_limit: bool = Field(
        False, description="Fail when the Prefect concurrency limit `gpu` does not exist."
    )

    def reads_api(self) -> bool:
        return super().reads_api() or self.strict_gpu_limit


class LocalBackend(UnitBackend):
    """This host: GPUs by CUDA_VISIBLE_DEVICES, a workspace folder, process groups."""

    name = "local"
    # the job runs here: preflight inspects this machine's GPUs and disk
    capabilities = Capabilities(runs_here=True, runs_images=True, where="this machine")
    placement_model: ClassVar[type[Placement]] = LocalPlacement

    @classmethod
    def block_types(cls) -> list[type]:
        from gpuflow.blocks.local_host import LocalGpuHost

        return [LocalGpuHost]

    @classmethod
    def at(cls, placement: Placement | None = None) -> LocalBackend:
        """Return the backend for this host (the placement's settings are in the spec)."""
        return cls()

    @classmethod
    def of(cls, cluster: Cluster) -> LocalBackend:
        """Return this machine's backend: a cluster's record says where it is."""
        return cls()

    def __init__(self, home: Path | None = None, slots: bool = True) -> None:
        self.home = (home or gpuflow_home()) / "local"
        # the Prefect limit `gpu` counts this machine's GPUs for its platform; a fleet host's
        # GPUs are counted by their claims alone (its orchestrators may use other platforms)
        self.slots = slots

    # -- state on disk -------------------------------------------------------
    def _record_path(self, name: str) -> Path:
        return self.home / "clusters" / f"{name}.json"

    def _read_record(self, name: str) -> LocalRecord | None:
        found = read_state_json(self._record_path(name))
        if found is None:
            return None
        try:
            return LocalRecord.model_validate(found)
        except ValueError:  # not a record of this shape: as good as half-written
            return None

    def _recorded(self, name: str) -> bool:
        """Return True when cluster `name` has a record here (what another run planted
        where its record would be is no record)."""
        try:
            return self._read_record(name) is not None
        except StateFileError:
            return False

    def _write_record(self, record: LocalRecord) -> None:
        text = record.model_dump_json(exclude={"cluster": {"adopted"}})
        write_atomic(self._record_path(record.cluster.name), text)

    def record_of(self, cluster: Cluster) -> LocalRecord:
        """Return what is recorded of `cluster` (a bare record when nothing is)."""
        return self._read_record(cluster.name) or LocalRecord(cluster=cluster)

    def sweep_partial_writes(self) -> list[str]:
        """Remove state files half-written by a process that died mid-write; return them."""
        return [
            str(path)
            for folder in (self.home / "clusters", self.home / "gpus")
            for path in sweep_partial_writes(folder)
        ]

    # -- verbs ---------------------------------------------------------------
    def configure(self, spec: JobSpec, prices: PriceTable) -> tuple[JobSpec, PriceTable]:
        """Return the spec with its LocalGpuHost block's settings (placement.block; values
        written in the spec win) and the prices with the host's; InvalidSpec for no such
        block."""
        name = spec.placement.block
        if name is None:
            return spec, prices
        # blocks import prefect-aws and prefect-kubernetes (about 1 s): read one only when used
        from gpuflow.blocks.local_host import LocalGpuHost

        host = load_block(LocalGpuHost, name, "placement.block", otherwise="remove placement.block")
        placement = spec.placement.model_copy(
            update={
                "workspace_root": placement_as(spec, LocalPlacement).workspace_root
                or host.workspace_root,
                "strict_gpu_limit": placement_as(spec, LocalPlacement).strict_gpu_limit
                or host.strict_gpu_limit,
            }
        )
        prices = prices.with_gpu_rate(self.name, host.gpu_hourly_usd, host.cpu_core_hourly_usd)
        return spec.model_copy(update={"placement": placement}), prices

    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        """Raise InvalidSpec if this host cannot run `spec`; makes nothing but a probe file."""
        if spec.resources.nodes > 1:
            raise InvalidSpec(
                f"resources.nodes: the local backend is this one machine, not"
                f" {spec.resources.nodes}; set resources.nodes: 1 or placement.backend: kubernetes."
            )
        root = workspace_root(spec)
        if not placement_as(spec, LocalPlacement).workspace_root:
            try:  # a GPUFLOW_HOME of another user's is refused before a byte goes in
                secure_home()
            except StateFileError as exc:
                raise InvalidSpec(str(exc)) from None
        probe = root / f".gpuflow-probe-{os.getpid()}"
        try:
            make_dirs(root)
            probe.write_bytes(b"ok")
        except OSError as exc:
            field = (
                "placement.workspace_root"
                if placement_as(spec, LocalPlacement).workspace_root
                else "GPUFLOW_HOME (where workspaces go when placement.workspace_root is not set)"
            )
            raise InvalidSpec(
                f"{field}: cannot write to {root} ({exc.strerror});"
                " choose a writable folder or fix its permissions."
            ) from None
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
        free = shutil.disk_usage(root).free
        if free < spec.resources.disk:
            raise InvalidSpec(
                f"placement.workspace_root: {root} has {format_bytes(free)} free but resources.disk"
                f" asks for {format_bytes(spec.resources.disk)}; free space, lower resources.disk"
                " or choose another workspace_root."
            )
        wanted = spec.resources.gpus
        if wanted and not spec.resources.allow_cpu:
            status = nvml.query()
            matching = [g for g in status.gpus if spec.resources.gpu_product in (None, g.product)]
            if len(matching) < wanted:
                seen = status.reason or f"{len(matching)} matching GPU(s)"
                raise InvalidSpec(
                    f"resources.gpus: this host cannot give {wanted} GPU(s)"
                    f"{' of ' + spec.resources.gpu_product if spec.resources.gpu_product else ''}"
                    f" ({seen}); lower resources.gpus, set resources.allow_cpu: true, or run on"
                    " a GPU host."
                )
        if (
            wanted
            and placement_as(spec, LocalPlacement).strict_gpu_limit
            and not gpu_slots.limit_exists()
        ):
            raise InvalidSpec(
                "placement.strict_gpu_limit: the Prefect concurrency limit 'gpu' does not exist;"
                " create it with `prefect gcl create gpu --limit N` or set strict_gpu_limit: false."
            )

    def stage(self, cluster: Cluster, path: Path, storage: S3Settings, staging: str | None) -> str:
        """As every backend stages; for units in an image, a link to the archive in the
        workspace they see (this machine's other folders are not mounted in)."""
        where = super().stage(cluster, path, storage, staging)
        if staging or state_of(cluster, LocalState).image is None:
            return where
        inside = Path(cluster.workspace) / f".gpuflow-{path.name}"
        if not inside.is_file():
            try:
                os.link(path, inside)
            except OSError:  # another file system
                shutil.copyfile(path, inside)
        return str(inside)

    def job_argv(self, cluster: Cluster) -> Callable[[list[str]], list[str]]:
        """In a container of the run's image with the cluster's GPUs, where it has one."""
        image = state_of(cluster, LocalState).image
        if image is None:
            return list
        return lambda argv: imaging.probe_argv(image, cluster, argv)

    def pin_image(self, spec: JobSpec, needs: Needs, say: Callable[[str], None]) -> JobSpec:
        """Pull the spec's image with this host's engine and pin it (tasks/containers.py)."""
        return spec if spec.image is None else imaging.pin(spec, needs, say)

    def offers(self, spec: JobSpec, prices: PriceTable) -> list[Offer]:
        """Return this host's offer: its GPUs of the product that no other gpuflow run has
        claimed now, at the host's price (free unless a LocalGpuHost gives one)."""
        wanted, product = spec.resources.gpus, spec.resources.gpu_product
        gpus = [g for g in nvml.query().gpus if product in (None, g.product)] if wanted else []
        free = [g for g in gpus if not self._claimed(g.index)]
        given = product or (free[0].product if free else gpus[0].product if gpus else None)
        cpu_only = wanted and not gpus and spec.resources.allow_cpu
        can_start = len(free) >= wanted or bool(cpu_only)
        why = "" if can_start else f"{len(free)} of its {len(gpus)} GPU(s) are free now"
        if cpu_only:
            why = "no GPU here: the job runs on the CPU (resources.allow_cpu)"
        hourly = hourly_rate(
            prices,
            self.name,
            [given or ""] * (0 if cpu_only else wanted),
            spec.resources.cpu or 1.0,
            spec.resources.disk,
        )
        return [
            Offer(
                where=f"this machine ({socket.gethostname()})",
                gpu_product=given,
                gpus_free=len(free),
                hourly_usd=hourly,
                can_start=can_start,
                why_not=why,
            )
        ]

    def _claimed(self, index: int) -> bool:
        """Return True when another live gpuflow cluster holds GPU `index` of this host."""
        owner = _claim_owner(self.home / "gpus" / f"{index}.json")
        return owner is not None and self._recorded(owner)

    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        """Reserve GPUs and make the workspace. Retried with the same owner, it adopts what
        an earlier try made (workspace, GPU claims, lease) instead of making twins.
        Raises CapacityError when the GPUs or `gpu` slots are busy."""
        name = f"gpuflow-{owner[RUN_LABEL]}"
        self.sweep_partial_writes()
        record = self._read_record(name)
        if record is not None:
            cluster = record.cluster.model_copy(update={"adopted": True})
            if record.complete and Path(cluster.workspace).is_dir():
                return cluster
        else:
            cluster = Cluster(
                backend=self.name,
                name=name,
                owner=dict(owner),
                hostname=socket.gethostname(),
                node_names=["localhost"],
                cpus_per_node=os.cpu_count() or 1,
                workspace=str(workspace_root(spec) / name),
                created_at=datetime.now(UTC),
                # resources.memory holds the job to that much, where a memory cgroup can be made
                capabilities=self.capabilities,
                state=LocalState(
                    memory_bytes=spec.resources.memory,
                    image=imaging.plan(spec),
                    shm_bytes=spec.resources.shm,
                ).model_dump(),
            )
        # Record first: whatever happens next, teardown and the reaper can find it.
        self._save(cluster, complete=False)
        workspace = Path(cluster.workspace)
        try:
            make_dirs(workspace)  # this user's alone under GPUFLOW_HOME
            (workspace / "outputs").mkdir(exist_ok=True)
            private_dir(job_tmp(cluster.workspace))  # refused if another user's
        except OSError as exc:
            raise ProvisionError(
                f"could not create the workspace {workspace}: {exc.strerror}"
            ) from None
        indices, products = self._claim_within(spec, name)
        cluster = cluster.model_copy(update={"gpu_indices": indices, "gpu_products": products})
        self._save(cluster, complete=False)
        if indices and cluster.gpu_lease_id is None and self.slots:
            lease = gpu_slots.acquire(
                len(indices),
                spec.placement.gpu_wait,
                placement_as(spec, LocalPlacement).strict_gpu_limit,
                owner.get(RUN_LABEL),
            )
            cluster = cluster.model_copy(update={"gpu_lease_id": lease})
        self._save(cluster, complete=True)
        return cluster

    def _save(self, cluster: Cluster, complete: bool) -> None:
        self._write_record(
            LocalRecord(
                cluster=cluster,
                orchestrator_pid=os.getpid(),
                orchestrator_started=psutil.Process().create_time(),
                api_url=os.environ.get("PREFECT_API_URL"),
                complete=complete,
            )
        )

    def _claim_within(self, spec: JobSpec, name: str) -> tuple[list[int], list[str]]:
        """Claim the job's GPUs, waiting up to placement.gpu_wait for other runs to free
        them (a sweep of one-GPU jobs on a few GPUs: each starts when one is free)."""
        deadline = time.monotonic() + spec.placement.gpu_wait
        while True:
            try:
                return self._claim_gpus(spec, name)
            except CapacityError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                time.sleep(min(0.5, left))

    def _claim_gpus(self, spec: JobSpec, name: str) -> tuple[list[int], list[str]]:
        wanted = spec.resources.gpus
        if not wanted:
            return [], []
        gpus = [g for g in nvml.query().gpus if spec.resources.gpu_product in (None, g.product)]
        if not gpus and spec.resources.allow_cpu:
            return [], []
        claims = self.home / "gpus"
        make_dirs(claims)
        taken: list[tuple[int, str]] = []
        for gpu in gpus:
            if len(taken) == wanted:
                break
            path = claims / f"{gpu.index}.json"
            self._drop_stale_claim(path)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if _claim_owner(path) == name:  # claimed by an earlier try of this run
                    taken.append((gpu.index, gpu.product))
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump({"cluster": name, "pid": os.getpid()}, handle)
            taken.append((gpu.index, gpu.product))
        if len(taken) < wanted:
            for index, _ in taken:
                (claims / f"{index}.json").unlink(missing_ok=True)
            raise CapacityError(
                f"only {len(taken)} of the {wanted} GPU(s) asked for are free on this host;"
                " other gpuflow runs hold the rest"
            )
        return [i for i, _ in taken], [p for _, p in taken]

    def _drop_stale_claim(self, path: Path) -> None:
        try:
            claim = read_state_json(path)
        except StateFileError:  # planted in gpuflow's own folder: no claim of a run
            with contextlib.suppress(OSError):
                path.unlink()
            return
        if claim is None:
            return
        if not self._recorded(str(claim.get("cluster", ""))):
            path.unlink(missing_ok=True)

    def start(
        self,
        cluster: Cluster,
        unit: WorkUnit,
        env: Mapping[str, str],
        timeout_s: float,
        tail: LogTail,
    ) -> LocalUnit:
        """Start the unit's command in its own process group and cgroup(s), pinned to the
        unit's GPUs (in a container of the run's image, where it has one); InvalidSpec for
        a program that is not there."""
        gpus = cluster.gpu_indices if unit.gpus is None else unit.gpus
        state = state_of(cluster, LocalState)
        if state.image is not None and unit.in_image:
            tmp = str(job_tmp(cluster.workspace))
            place = imaging.UnitPlace(cluster.workspace, tmp, unit.node, cluster.nodes)
            proc, name = imaging.start(
                state.image,
                cluster.name,
                place,
                unit.name,
                unit.command,
                {**env, **unit.env},
                gpus,
                state.memory_bytes,
                unit.reads,
                unit.writes,
                state.shm_bytes,
            )
            self._note_job(cluster, proc.pid, psutil.Process(proc.pid).create_time())
            pump = OutputPump({"stdout": proc.stdout, "stderr": proc.stderr}, tail).start()
            return ContainerUnit(proc, self, cluster, pump, tail, (None, 0), state.image, name)
        command = unit.command
        program = resolve_program(command[0], env.get("PATH"))
        if program is None:
            raise InvalidSpec(
                f"job.command: {command[0]!r} was not found; install it or give its full path."
            )
        child_env = {
            **job_environ(),
            # the job's temporary files go with its workspace (a spec's env may say otherwise)
            "TMPDIR": str(job_tmp(cluster.workspace)),
            **env,
            **unit.env,
            **unit_env(unit.node, cluster.nodes, cluster.workspace, gpus),
        }
        tracked, memory = self._cgroups(cluster)
        groups = [g for g in dict.fromkeys([*tracked, memory]) if g]
        oom_before = cgroups.memory_events(memory).get("oom_kill", 0)
        proc = subprocess.Popen(
            [program, *command[1:]],
            cwd=cluster.workspace,
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            # In its cgroup(s) before exec: nothing it starts can leave them.
            preexec_fn=(lambda: _join_all(groups)) if groups else None,
        )
        self._note_job(cluster, proc.pid, psutil.Process(proc.pid).create_time())
        pump = OutputPump({"stdout": proc.stdout, "stderr": proc.stderr}, tail).start()
        return LocalUnit(proc, self, cluster, pump, tail, (memory, oom_before))

    def _cgroups(self, cluster: Cluster) -> tuple[list[str], str | None]:
        """Return the cgroups the cluster's jobs are tracked in and, when resources.memory
        asked for a limit, the cgroup holding them to that (made on first use and
        recorded); none where this machine allows none."""
        # Named after this state folder too: two GPUFLOW_HOMEs on one machine may use the
        # same flow-run id (tests do), and must not share a cgroup.
        name = f"{cluster.name}-{hashlib.sha256(str(self.home).encode()).hexdigest()[:8]}"
        limit = state_of(cluster, LocalState).memory_bytes

        def gone(paths: list[str]) -> bool:  # swept while empty
            return any(not Path(path).is_dir() for path in paths)

        with _RECORD_LOCK:
            record = self.record_of(cluster)
            if record.cgroups is None or gone(record.cgroups):
                record.cgroups = [str(path) for path in cgroups.create(name)]
                self._write_record(record)
            v2 = next((path for path in record.cgroups if cgroups.is_v2(path)), None)
            memory = record.memory_cgroup
            if limit and (not record.memory_limited or gone([memory] if memory else [])):
                record.memory_cgroup = cgroups.limit_memory(name, v2, int(limit))
                record.memory_limited = True
                self._write_record(record)
            return record.cgroups, record.memory_cgroup

    def _note_job(self, cluster: Cluster, pgid: int, started: float | None) -> None:
        """Record a running job's process group (started is its create time), or forget it
        (started None). Several jobs may run on one cluster at once (render chunks)."""
        with _RECORD_LOCK:
            record = self._read_record(cluster.name)
            if record is None:
                if started is None:
                    return
                record = LocalRecord(cluster=cluster)
            if started is None:
                record.jobs.pop(str(pgid), None)
            else:
                record.jobs[str(pgid)] = started
            self._write_record(record)

    def teardown(self, cluster: Cluster) -> TeardownReport:
        """Kill the job's process group, release GPUs and slots, remove the workspace.
        Idempotent: a cluster that is already gone gives a report with already_gone."""
        record = self._read_record(cluster.name)
        report = TeardownReport(name=cluster.name, already_gone=record is None)
        if record is not None:
            cluster = record.cluster
            image = state_of(cluster, LocalState).image
            report.killed_processes += imaging.remove_all(image, cluster.name)
            for pgid, started in record.jobs.items():
                if alive(int(pgid), started):
                    report.killed_processes += stop_group(int(pgid), started)
            tracked = record.cgroups or []
            memory = record.memory_cgroup
            groups = [g for g in dict.fromkeys([*tracked, memory]) if g]
            if groups:  # one stop over every hierarchy: leaving one of them is not enough
                report.killed_processes += cgroups.stop(groups, grace_s=5.0)
            if tracked:
                report.process_tracking = "cgroup"
                report.escapes = cgroups.ESCAPE
                report.killed_processes += _stop_strays(cluster.workspace)
            else:
                report.process_tracking = "process groups, environment, working directory"
                report.escapes = (
                    "no cgroup could be made here: a process the job starts in a session of"
                    " its own, with a clean environment and outside the workspace, is not found"
                )
                since = cluster.created_at.timestamp()
                report.killed_processes += _stop_strays(cluster.workspace, cwd_since=since)
        claims = self.home / "gpus"
        for index in cluster.gpu_indices:
            path = claims / f"{index}.json"
            if _claim_owner(path) == cluster.name:
                path.unlink(missing_ok=True)
                report.released_gpus.append(index)
        if cluster.gpu_lease_id:
            report.released_lease = gpu_slots.release(cluster.gpu_lease_id)
        workspace = Path(cluster.workspace)
        if workspace.exists():
            shutil.rmtree(workspace, ignore_errors=True)
            report.removed_workspace = not workspace.exists()
        scratch = job_tmp(cluster.workspace)
        with contextlib.suppress(OSError):
            if (
                scratch.lstat().st_uid == os.geteuid()
                and scratch.is_dir()
                and not scratch.is_symlink()
            ):
                shutil.rmtree(scratch, ignore_errors=True)
        self._record_path(cluster.name).unlink(missing_ok=True)
        return report

    def reap(self, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
        """Tear down clusters whose gpuflow process died (their runs are to be marked
        Crashed) and remove what dead processes half-wrote; with `dry_run`, only say which."""
        return reaping.reap(self, dry_run, say)

    def list_owned(self, selector: Mapping[str, str]) -> list[Cluster]:
        """Return clusters recorded on this host whose owner labels include `selector`."""
        found = []
        for _, data in state_records(self.home / "clusters"):
            try:
                cluster = LocalRecord.model_validate(data).cluster
            except ValueError:  # not a record of this shape: as good as half-written
                continue
            if all(cluster.owner.get(k) == v for k, v in selector.items()):
                found.append(cluster)
        return found


class LocalUnit(ProcessGroupUnit):
    """A unit started here: its process group, its output pump and its memory cgroup."""

    def __init__(
        self,
        proc: subprocess.Popen,
        backend: LocalBackend,
        cluster: Cluster,
        pump: OutputPump,
        tail: LogTail,
        memory: tuple[str | None, int],
    ) -> None:
        super().__init__(proc)
        self.backend, self.cluster, self.pump, self.tail, self.memory = (
            backend,
            cluster,
            pump,
            tail,
            memory,
        )

    def finish(self, end: UnitEnd | None) -> UnitEnd | None:
        """Forget the process group, read every line the job wrote (a process that left
        the job's group and keeps its pipes open is not waited on: teardown stops it), and
        count the out-of-memory kills of its cgroup."""
        if end is None:
            return None
        self.backend._note_job(self.cluster, self.proc.pid, None)
        if held := self.pump.finish():
            self.tail.on_line(  # the run's log only: the job's last lines stay its own
                "stderr",
                f"a process the job started and left running holds its {' and '.join(held)}"
                " open; it was not waited on, and teardown stops it",
            )
        memory, oom_before = self.memory
        if memory:
            oom_kills = cgroups.memory_events(memory).get("oom_kill", 0) - oom_before
            end = end.model_copy(update={"memory_events": {"oom_kill": oom_kills}})
        return end


class ContainerUnit(LocalUnit):
    """A unit in a container of the run's image: stopped through its engine (the engine's
    own process passes no signal on once it is killed, and the container outlives it)."""

    def __init__(
        self,
        proc: subprocess.Popen,
        backend: LocalBackend,
        cluster: Cluster,
        pump: OutputPump,
        tail: LogTail,
        memory: tuple[str | None, int],
        image: imaging.HostImage,
        container: str,
    ) -> None:
        super().__init__(proc, backend, cluster, pump, tail, memory)
        self.image, self.container = image, container

    def stop(self, reason: StopReason, grace_s: float) -> UnitEnd:
        imaging.stop(self.proc, self.image, self.container, grace_s)
        return exit_end(self.proc.wait())

    def interrupt(self, grace_s: float) -> None:
        imaging.stop(self.proc, self.image, self.container, grace_s)


def _stop_strays(workspace: str, grace_s: float = 5.0, cwd_since: float | None = None) -> int:
    """Stop processes of this job that left its process groups (MPI ranks each get a group
    of their own; daemons call setsid): those whose environment names its workspace and,
    with `cwd_since` (where no cgroup holds the job, which may clear its environment),
    those started since then whose working directory is in it. A shell someone opened in
    the workspace before the job started is spared."""
    strays = []
    root = Path(workspace)
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid == os.getpid():
                continue
            if proc.environ().get("GPUFLOW_WORKSPACE") == workspace or (
                cwd_since is not None
                and start_time(proc) >= cwd_since
                and Path(proc.cwd().removesuffix(" (deleted)")).is_relative_to(root)
            ):
                strays.append(proc)
    for proc in strays:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(strays, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return len(strays)


def _claim_owner(path: Path) -> str | None:
    try:
        claim = read_state_json(path)
    except StateFileError:  # not a claim gpuflow wrote: nobody's
        return None
    owner = None if claim is None else claim.get("cluster")
    return owner if isinstance(owner, str) else None


def _join_all(groups: list[str]) -> None:
    """Move this process into each of `groups` (a unit's, before it execs)."""
    for group in groups:
        cgroups.join(group)
