"""Kind `command`: any program, run once on the cluster's first node with every GPU it holds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from tasks.contract import Cluster, Needs, WorkUnit
from tasks.kinds.base import JobKind
from tasks.spec import JobSpec, SpecModel, split_argv


class CommandJob(SpecModel):
    """Run an arbitrary program in the workspace, like a container entrypoint."""

    kind: Literal["command"] = "command"
    command: list[str] = Field(description="Program and arguments, e.g. [python, train.py].")
    torch: bool = Field(False, description="Check torch's CUDA in preflight for this command.")

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

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        assert isinstance(spec.job, CommandJob)
        return [WorkUnit(name="main", command=list(spec.job.command))]
