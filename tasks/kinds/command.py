"""Kind `command`: any program, run once on the cluster's first node with every GPU it
holds, or as copies: one on each node, or one on each GPU (a sweep, many one-GPU tasks in
one run and one allocation); or, with `launcher: torchrun`, one torchrun on each node,
meeting at the first node (nnodes from resources.nodes, a rank per GPU of a node)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from gpuflow.tasks.contract import (
    RENDEZVOUS_PORT,
    Capabilities,
    Cluster,
    Needs,
    WorkUnit,
)
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.host import resolve_program
from gpuflow.tasks.kinds.base import JobKind
from gpuflow.tasks.kinds.code import check_code
from gpuflow.tasks.spec import CodeJob, JobSpec, command_line

if TYPE_CHECKING:  # what the validators make of it
    Command = list[str]
else:
    Command = command_line("[python, train.py]")


class CommandJob(CodeJob):
    """Run an arbitrary program in the workspace, like a container entrypoint."""

    kind: Literal["command"] = "command"
    command: Command = Field(description="Program and arguments, e.g. [python, train.py].")
    torch: bool = Field(
        False,
        description="Check torch and its CUDA in preflight for this command, as the Python"
        " it starts imports them.",
    )
    python: str | None = Field(
        None,
        description="The Python a command that starts with python (python3, python3.11)"
        " runs: omitted, the first on the job's PATH where it runs; gpuflow: the Python"
        " gpuflow runs from (its packages); or the absolute path of an interpreter.",
    )
    copies: Literal["one", "per_node", "per_gpu"] = Field(
        "one",
        description="one: the command once, on the first node with every GPU; per_node: a"
        " copy on each node with its GPUs; per_gpu: a copy on each GPU of every node. Each"
        " copy reads its number in GPUFLOW_TASK_INDEX (0 to GPUFLOW_TASKS - 1); the job"
        " succeeds when every copy does.",
    )

    launcher: Literal["torchrun"] | None = Field(
        None,
        description="torchrun: one torchrun on each node (nnodes: resources.nodes; a rank"
        " per GPU of a node, or one with gloo where there is none), meeting at the first"
        " node. RANK, LOCAL_RANK, WORLD_SIZE reach the script as torchrun sets them.",
    )

    ranks_per_node: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="launcher: torchrun: ranks on each node (default: its GPUs, or 1).",
    )

    @model_validator(mode="after")
    def _python(self) -> CommandJob:
        if self.python is not None and self.python != "gpuflow" and not self.python.startswith("/"):
            raise ValueError(
                f"job.python: {self.python!r} is neither gpuflow nor an absolute path; give"
                " gpuflow (the Python gpuflow runs from) or the full path of an interpreter"
            )
        if self.python is not None and not is_python(self.command[0]):
            raise ValueError(
                f"job.python: names the Python of a command that starts with python, and this"
                f" one starts with {self.command[0]!r}; remove job.python or start the command"
                " with python"
            )
        return self

    def argv(self) -> list[str]:
        """Return the command as it runs: its leading python replaced by job.python's."""
        if self.python is None:
            return list(self.command)
        python = sys.executable if self.python == "gpuflow" else self.python
        return [python, *self.command[1:]]

    @model_validator(mode="after")
    def _one_launch(self) -> CommandJob:
        if self.launcher == "torchrun" and self.copies != "one":
            raise ValueError(
                f"job.launcher: torchrun starts the ranks itself, one torchrun per node, so"
                f" job.copies must be one, not {self.copies}; remove copies or the launcher"
            )
        if self.ranks_per_node is not None and self.launcher is None:
            raise ValueError(
                "job.ranks_per_node: sets torchrun's ranks on each node; add launcher: torchrun"
                " or remove it"
            )
        return self


PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?")


def is_python(program: str) -> bool:
    """Return True when `program` (a name or a path) is a Python interpreter by its name."""
    return PYTHON_NAME.fullmatch(Path(program).name) is not None


class CommandKind(JobKind[CommandJob]):
    name = "command"
    model = CommandJob

    def interpreter(self, spec: JobSpec) -> str | None:
        job = self.job_of(spec)
        program = job.argv()[0]
        if not is_python(program):
            return None
        if spec.image is not None:
            return program  # looked up in the image, where the job runs
        return resolve_program(program, spec.env.get("PATH", os.environ.get("PATH")))

    def preflight_rows(self, spec: JobSpec, cluster: Cluster) -> list[dict[str, str]]:
        python = self.interpreter(spec) if cluster.capabilities.runs_here else None
        if python is None:
            return []
        if spec.image is not None:
            shown = f"{python} of the image {spec.image.pinned}"
        else:
            real = os.path.realpath(python)
            shown = python if real == python else f"{python} (-> {real})"
        return [{"name": "python", "level": "pass", "message": f"the job runs {shown}."}]

    def uses_torch(self, spec: JobSpec) -> bool:
        return self.job_of(spec).torch

    def needs(self, spec: JobSpec) -> Needs:
        job = self.job_of(spec)
        program = job.argv()[0]
        relative = "/" in program and not program.startswith("/")  # ./run.sh: check() sees it
        torchrun = job.launcher == "torchrun"  # gpuflow's launcher starts the ranks
        if relative or (job.workdir and (Path(job.workdir) / program).is_file()):
            return Needs(gpuflow=torchrun)  # a file of the working folder, not on PATH
        return Needs(programs={"job.command": program}, gpuflow=torchrun)

    def check(self, spec: JobSpec, where: Capabilities) -> None:
        job = self.job_of(spec)
        if job.copies == "per_gpu" and spec.resources.gpus == 0:
            raise InvalidSpec(
                "job.copies: per_gpu runs a copy on each GPU, but resources.gpus is 0; ask"
                " for GPUs (resources.gpus) or use copies: per_node."
            )
        copies = {"GPUFLOW_TASK_INDEX", "GPUFLOW_TASKS"} if job.copies != "one" else set()
        check_code(spec, job, job.command, copies, where)

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        job = self.job_of(spec)
        command = job.argv()
        if job.launcher == "torchrun":
            return torchrun_units(command, cluster, job.ranks_per_node)
        if job.copies == "one":
            return [WorkUnit(name="main", command=command)]
        # per_node: every GPU of its node (None); per_gpu: one each, or none on a cluster
        # without GPUs (resources.allow_cpu), where each node runs one copy
        slots: list[list[int] | None] = [None]
        if job.copies == "per_gpu":
            slots = [[gpu] for gpu in cluster.gpu_indices] or [[]]
        places = [(node, gpus) for node in range(cluster.nodes) for gpus in slots]
        return [
            WorkUnit(
                name=f"task-{index}",
                command=command,
                env={"GPUFLOW_TASK_INDEX": str(index), "GPUFLOW_TASKS": str(len(places))},
                node=node,
                gpus=gpus,
            )
            for index, (node, gpus) in enumerate(places)
        ]


def torchrun_units(command: list[str], cluster: Cluster, ranks: int | None) -> list[WorkUnit]:
    """Return one torchrun per node (gpuflow.tasks.torchrun): `ranks` per node, else a
    rank per GPU of the node (one where there is none), nodes meeting at the first node's
    address (the cluster's rendezvous port where it names one); on one node torchrun is
    standalone and picks a free port itself."""
    per_node = ranks or cluster.gpus_per_node or 1
    launch = [sys.executable, "-m", "gpuflow.tasks.torchrun", f"--nproc-per-node={per_node}"]
    if cluster.nodes == 1:
        return [WorkUnit(name="main", command=[*launch, "--standalone", "--", *command])]
    host, _, port = (cluster.rendezvous or "").rpartition(":")
    return [
        WorkUnit(
            name=f"node-{node}",
            command=[
                *launch,
                f"--nnodes={cluster.nodes}",
                f"--node-rank={node}",
                f"--master-addr={host or cluster.addresses()[0]}",
                f"--master-port={port or RENDEZVOUS_PORT}",
                "--",
                *command,
            ],
            node=node,
            world_size=cluster.nodes * per_node,
        )
        for node in range(cluster.nodes)
    ]
