"""A unit of a Slurm run as follow_unit sees it (a job step, srun inside the run allocation, stopped with its grace, requeues and preemptions told apart) and the sampler step that samples each node GPUs."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

from gpuflow.tasks.backends.base import join_samples, stop_process
from gpuflow.tasks.backends.slurm.commands import LocalClient
from gpuflow.tasks.backends.slurm.model import ACTIVE, BUSY, REQUEUED, SlurmState, gres
from gpuflow.tasks.backends.slurm.queue import (
    hostnames,
    job_row,
    job_shown,
    shared,
)
from gpuflow.tasks.contract import (
    Cluster,
    MpiLaunch,
    StopReason,
    UnitEnd,
)
from gpuflow.tasks.errors import (
    PREEMPTED_EXIT_CODE,
    CapacityError,
    ProvisionError,
)
from gpuflow.tasks.host import STOP_GRACE_S, OutputPump
from gpuflow.tasks.metrics.sampler import NODE_SAMPLES, SAMPLES

# squeue's states of a job that still holds (or waits for) its allocation


# how long a job that is COMPLETING after its step ended is watched for its requeue
REQUEUE_SEEN_S = 120.0


# how often a running step's job is asked whether Slurm took it back (requeued)
ORPHAN_CHECK_S = 2.0


# how often a unit's node samples its GPUs
SAMPLE_INTERVAL_S = 1.0


def step_srun(state: SlurmState, step: str, node: str, workspace: str) -> list[str]:
    """Return the srun that starts a step named `step` of the run's job on one node,
    beside its other steps (--overlap), in the run's workspace."""
    return [
        "srun",
        f"--jobid={state.job_id}",
        f"--job-name={step}",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        f"--chdir={workspace}",
    ]


class NodeSampler:
    """The GPUs a run holds on one node, sampled on that node: a step beside its units'
    steps, with the run's GPUs of the node (--overlap), running `python -m
    gpuflow.tasks.metrics.sampler` into the shared workspace. The units on a node share one
    (`join`, `leave`): the last to leave stops it and its samples join the run's."""

    _lock = threading.Lock()
    _live: ClassVar[dict[tuple[str, str], NodeSampler]] = {}  # (job id, node) -> its sampler

    @classmethod
    def join(cls, cli: LocalClient, cluster: Cluster, state: SlurmState, node: str) -> NodeSampler:
        """Return the sampler of the run's job on `node`, started by its first unit."""
        with cls._lock:
            sampler = cls._live.get((state.job_id, node))
            if sampler is None:
                sampler = cls._live[state.job_id, node] = cls(cli, cluster, state, node)
            sampler.users += 1
            return sampler

    def leave(self) -> None:
        """Say a unit on the node ended; the last one stops the sampler (finish)."""
        with self._lock:
            self.users -= 1
            if self.users:
                return
            del self._live[self.key]
        self.finish()

    def __init__(self, cli: LocalClient, cluster: Cluster, state: SlurmState, node: str) -> None:
        self.key, self.users = (state.job_id, node), 0
        self.workspace = Path(cluster.workspace)
        step = f"{cluster.name}.sampler.{node}.{uuid.uuid4().hex[:8]}"
        self.path = self.workspace / NODE_SAMPLES.replace("*", step)
        argv = [
            *step_srun(state, step, node, cluster.workspace),
            f"--gres={gres(cluster.gpus_per_node, state.gres_type)}",
            # the GPUs Slurm gave the step on this node (indices differ from node to node)
            *(
                "sh",
                "-c",
                'exec "$@" --gpus "${SLURM_STEP_GPUS:-$CUDA_VISIBLE_DEVICES}"',
                "sh",
            ),
            sys.executable,
            "-m",
            "gpuflow.tasks.metrics.sampler",
            "--out",
            str(self.path),
            "--interval",
            str(SAMPLE_INTERVAL_S),
            "--host",
            node,
        ]
        proc = cli.start(argv, {})
        pump = OutputPump({"stdout": proc.stdout, "stderr": proc.stderr}, _quiet).start()
        self.step = SlurmStep(cli, proc, state.job_id, step, pump)

    def finish(self) -> None:
        """Stop the sampler (its last sample closes the energy window) and add its samples
        to the run's."""
        self.step.interrupt(STOP_GRACE_S)
        stop_process(self.step.proc)  # its step never showed in squeue: end its srun
        self.step.finish(None)
        join_samples(self.workspace / SAMPLES, self.path)


def _quiet(stream: str, text: str) -> None:
    """A sampler's own lines are not the job's."""


class SlurmStep:
    """A unit that is a job step, as follow_unit sees it: srun on this machine follows it,
    its output pump reads srun's pipes, and the node's sampler runs while it does."""

    every_s = 0.1

    def __init__(
        self,
        cli: LocalClient,
        proc: subprocess.Popen,
        job_id: str,
        name: str,
        pump: OutputPump,
        sampler: NodeSampler | None = None,
    ) -> None:
        self.cli, self.proc, self.job_id, self.name = cli, proc, job_id, name
        self.pump, self.sampler = pump, sampler
        self._looked = time.monotonic()  # when the job's state was last asked while srun ran

    def finish(self, end: UnitEnd | None) -> UnitEnd | None:
        """Read srun's last lines; the last unit on its node stops the node's sampler."""
        self.pump.finish()
        if self.sampler is not None:
            self.sampler.leave()
        return end

    def poll(self) -> UnitEnd | None:
        code = self.proc.poll()
        if code is None:
            return self._orphaned()
        if why := requeued_why(self.cli, self.job_id):
            # preempted or its node lost: Slurm requeued the run's job, as a preemption.
            # Asked whatever srun's code: srun that loses its step's node ("Node failure")
            # exits 0 without the unit's code, even though the unit was stopped.
            return UnitEnd(exit_code=PREEMPTED_EXIT_CODE, tail=[why])
        return srun_end(code)

    def _orphaned(self) -> UnitEnd | None:
        """Return a preemption when Slurm took the run's job back (requeued: its node lost)
        while srun still runs: an srun whose node went away and came back at once may
        follow a step that is no more. Asked every ORPHAN_CHECK_S; None otherwise."""
        now = time.monotonic()
        if now - self._looked < ORPHAN_CHECK_S:
            return None
        self._looked = now
        row = job_row(self.cli, self.job_id)
        if row is None or row["state"] not in REQUEUED:
            return None
        stop_process(self.proc)
        why = f"the Slurm job {self.job_id} was requeued (a node lost) while its step ran"
        return UnitEnd(exit_code=PREEMPTED_EXIT_CODE, tail=[why])

    def wait(self, seconds: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=seconds)

    def _step_id(self) -> str | None:
        for _ in range(50):  # srun names its step once slurmctld made it
            steps = shared(self.cli, ["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"])
            for line in steps.stdout.splitlines():
                step, _, name = line.partition(" ")
                if name.strip() == self.name:
                    return step
            if self.proc.poll() is not None:
                return None
            time.sleep(0.1)
        return None

    def stop(self, reason: StopReason, grace_s: float) -> UnitEnd | None:
        step = self._step_id()
        if step is None:
            return self.poll()
        self.cli.run(["scancel", "--signal=TERM", step], check=False)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return srun_end(self.proc.wait(timeout=grace_s))
        self.cli.run(["scancel", step], check=False)
        return None

    def interrupt(self, grace_s: float) -> None:
        step = self._step_id()
        if step is not None:
            self.cli.run(["scancel", "--signal=TERM", step], check=False)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
                return
            self.cli.run(["scancel", step], check=False)

    def unconfirmed(self) -> UnitEnd:
        return UnitEnd(signal=9)


def share_of(cluster: Cluster, gpus: list[int]) -> list[str]:
    """Return the words that give a unit its own GPUs of the node's, as positions among the
    job's GPUs there (`gpus` are first-node indices; other nodes may hold other indices):
    CUDA_VISIBLE_DEVICES is cut down to those positions before the unit starts."""
    positions = ",".join(
        str(cluster.gpu_indices.index(g)) for g in gpus if g in cluster.gpu_indices
    )
    pick = (
        'i=0; mine=; for d in $(echo "$CUDA_VISIBLE_DEVICES" | tr , " "); do'
        f' case ,{positions}, in *,$i,*) mine="$mine${{mine:+,}}$d";; esac; i=$((i+1));'
        ' done; CUDA_VISIBLE_DEVICES=$mine exec "$@"'
    )
    return ["sh", "-c", pick, "sh"]


def mpi_launch(
    cli: LocalClient, launch: MpiLaunch, cluster: Cluster, state: SlurmState
) -> list[str]:
    """Return the words that start an MPI launcher unit's mpirun in the job, not in its own
    step: Open MPI inside a Slurm step starts its daemons with srun, which reads the
    allocation from the step's variables (one node, one task). This sets them to the hosts
    and slots of the unit's hostfile, makes that srun share the job's resources with the
    launcher (--overlap) and gives it each node's GPUs as gres."""
    hosts = [name for name, _ in launch.hosts()]
    slots = [str(ranks) for _, ranks in launch.hosts()]
    nodes = cli.run(["scontrol", "show", "hostlist", ",".join(hosts)]).strip()
    count = cluster.gpus_per_node
    step_only = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES",
                 "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE")  # fmt: skip
    return [
        "env",
        *(f"--unset={name}" for name in step_only),
        f"SLURM_JOB_NODELIST={nodes}",
        f"SLURM_NODELIST={nodes}",
        f"SLURM_NNODES={len(hosts)}",
        f"SLURM_JOB_NUM_NODES={len(hosts)}",
        f"SLURM_TASKS_PER_NODE={','.join(slots)}",
        "SLURM_OVERLAP=1",
        f"OMPI_MCA_plm_slurm_args=--gres={gres(count, state.gres_type) if count else 'none'}",
    ]


def requeued_why(cli: LocalClient, job_id: str) -> str | None:
    """Return why the run's job was taken back (preempted, its node lost) when Slurm
    requeued it; None while it still runs as it did."""
    # A job being requeued passes through COMPLETING until its steps are gone: on a busy
    # node that lasts KillWait and more, so it is waited out (a run's job is COMPLETING only
    # when the whole job ends, never when one of its steps does), up to REQUEUE_SEEN_S.
    until = time.monotonic() + REQUEUE_SEEN_S
    while True:
        row = job_row(cli, job_id)
        if row is None:
            return None
        if row["state"] in REQUEUED or (row["state"] == "RUNNING" and preempting(cli, job_id)):
            return f"the Slurm job {job_id} was preempted or lost a node, and is requeued"
        if row["state"] != "COMPLETING" or time.monotonic() > until:
            return None
        time.sleep(0.1)


def preempting(cli: LocalClient, job_id: str) -> bool:
    """Return True while Slurm preempts the job (its grace time before the requeue)."""
    return bool(re.search(r"\bPreemptTime=(?!None)", job_shown(cli, job_id)))


def live_row(cli: LocalClient, job_id: str, ended: str) -> dict[str, Any]:
    """Return squeue's row of the run's job while it holds (or waits for) its allocation;
    ProvisionError saying it `ended` once it no longer does."""
    row = job_row(cli, job_id)
    if row is None or row["state"] not in ACTIVE:
        state = row["state"] if row else "gone from squeue"
        raise ProvisionError(f"the Slurm job {job_id} holding this run's nodes {ended} ({state})")
    return row


def running_again(cli: LocalClient, job_id: str, deadline: float) -> list[str]:
    """Return the run's nodes once its job runs: a job Slurm requeued (preempted, a node
    lost) starts again when Slurm says (after its requeue delay, BeginTime, so that the job
    that took the GPUs starts first) and is waited for until `deadline` (time.monotonic()).
    ProvisionError when it cannot run any more."""
    while True:
        row = live_row(cli, job_id, "has ended; a retry provisions again")
        if row["state"] == "RUNNING" and not preempting(cli, job_id):
            return hostnames(cli, row["nodes"])
        if row["state"] == "PENDING" and row["reason"] not in BUSY:
            raise ProvisionError(
                f"the Slurm job {job_id} holding this run's nodes waits with reason"
                f" {row['reason']} and cannot run"
            )
        if time.monotonic() > deadline:
            raise CapacityError(
                f"the Slurm job {job_id} holding this run's nodes was requeued and has not"
                f" run again (squeue says {row['reason']})"
            )
        time.sleep(0.5)


def srun_end(code: int) -> UnitEnd:
    """Return how a step ended from srun's exit code (128 + n: killed by signal n)."""
    if code > 128:
        return UnitEnd(signal=code - 128)
    return UnitEnd(exit_code=code) if code >= 0 else UnitEnd(signal=-code)


def gpu_indices_of(cli: LocalClient, job_id: str) -> list[int]:
    """Return the GPU indices the job holds on its first node (`scontrol show job -d`)."""
    detail = cli.run(["scontrol", "show", "job", "-d", job_id])
    for line in detail.splitlines():
        if "GRES=" in line and "(IDX:" in line:
            spans = line.split("(IDX:", 1)[1].split(")", 1)[0]
            indices: list[int] = []
            for span in spans.split(","):
                low, _, high = span.partition("-")
                indices += range(int(low), int(high or low) + 1)
            return indices
    return []
