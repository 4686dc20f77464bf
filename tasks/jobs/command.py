"""Kind `command`: any program, run once on the cluster's first node with every GPU it holds."""

from __future__ import annotations

from tasks.compute.base import Cluster, WorkUnit
from tasks.jobs.base import JobKind
from tasks.spec import CommandJob, JobSpec


class CommandKind(JobKind):
    name = "command"
    model = CommandJob

    def programs(self, spec: JobSpec) -> dict[str, str]:
        assert isinstance(spec.job, CommandJob)
        return {"job.command": spec.job.command[0]}

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        assert isinstance(spec.job, CommandJob)
        return [WorkUnit(name="main", command=list(spec.job.command))]
