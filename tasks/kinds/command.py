"""Kind `command`: any program, run once on the cluster's first node with every GPU it
holds, or as copies: one on each node, or one on each GPU (a sweep, many one-GPU tasks in
one run and one allocation)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from gpuflow.tasks.contract import Capabilities, Cluster, Needs, WorkUnit
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.kinds.base import JobKind
from gpuflow.tasks.spec import JobSpec, SpecModel, split_argv


class CommandJob(SpecModel):
    """Run an arbitrary program in the workspace, like a container entrypoint."""

    kind: Literal["command"] = "command"
    command: list[str] = Field(description="Program and arguments, e.g. [python, train.py].")
    torch: bool = Field(False, description="Check torch's CUDA in preflight for this command.")
    copies: Literal["one", "per_node", "per_gpu"] = Field(
        "one",
        description="one: the command once, on the first node with every GPU; per_node: a"
        " copy on each node with its GPUs; per_gpu: a copy on each GPU of every node. Each"
        " copy reads its number in GPUFLOW_TASK_INDEX (0 to GPUFLOW_TASKS - 1); the job"
        " succeeds when every copy does.",
    )

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return split_argv(value)

    @field_validator("command")
    @classmethod
    def _not_empty(cls, value: list[str]) -> list[str]:
        if not value or not value[0].strip():
            raise ValueError("is empty; give the program to run, e.g. [python, train.py]")
        return value


class CommandKind(JobKind):
    name = "command"
    model = CommandJob

    def needs(self, spec: JobSpec) -> Needs:
        assert isinstance(spec.job, CommandJob)
        return Needs(programs={"job.command": spec.job.command[0]})

    def check(self, spec: JobSpec, where: Capabilities) -> None:
        assert isinstance(spec.job, CommandJob)
        if spec.job.copies == "per_gpu" and spec.resources.gpus == 0:
            raise InvalidSpec(
                "job.copies: per_gpu runs a copy on each GPU, but resources.gpus is 0; ask"
                " for GPUs (resources.gpus) or use copies: per_node."
            )

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        assert isinstance(spec.job, CommandJob)
        command = list(spec.job.command)
        if spec.job.copies == "one":
            return [WorkUnit(name="main", command=command)]
        # per_node: every GPU of its node (None); per_gpu: one each, or none on a cluster
        # without GPUs (resources.allow_cpu), where each node runs one copy
        slots: list[list[int] | None] = [None]
        if spec.job.copies == "per_gpu":
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
