"""Kind `hpc`: an MPI program (or the built-in molecular dynamics) across ranks.

One launcher unit on the first node fetches the inputs, runs the build step and starts
mpirun over the cluster's hosts and slots; each rank writes a status file the launcher
reads to name the first rank that failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gpuflow.tasks.contract import Capabilities, Cluster, MpiLaunch, Needs, WorkUnit
from gpuflow.tasks.hpc.check import check_hpc, preflight_checks
from gpuflow.tasks.hpc.launch import hosts_for
from gpuflow.tasks.hpc.model import HpcJob
from gpuflow.tasks.hpc.mpi import hostfile
from gpuflow.tasks.hpc.report import summary
from gpuflow.tasks.hpc.result import MdResult
from gpuflow.tasks.kinds.base import JobKind, Report
from gpuflow.tasks.spec import JobSpec
from gpuflow.tasks.storage import local_paths, s3_settings


class HpcKind(JobKind[HpcJob]):
    name = "hpc"
    model = HpcJob
    result = MdResult
    flow = "gpuflow.flows.hpc:hpc"

    def uses_torch(self, spec: JobSpec) -> bool:
        return self.job_of(spec).torch

    def needs(self, spec: JobSpec) -> Needs:
        job = self.job_of(spec)
        inputs = {f"job.inputs[{i}]": url for i, url in enumerate(job.inputs)}
        if job.output:
            inputs["job.output"] = job.output
        # in an image, its mpirun is looked for there (on a host, check_hpc looks)
        programs = {"job.mpirun": job.mpirun} if spec.image is not None else {}
        return Needs(inputs=inputs, programs=programs, mpi_launcher=True, gpuflow=True)

    def extra(self, spec: JobSpec, where: Capabilities) -> str | None:
        job = self.job_of(spec)
        here = where.runs_here and spec.image is None  # else the node's or the image's
        return "hpc" if here and job.md is not None else None  # the MD workload

    def check(self, spec: JobSpec, where: Capabilities) -> None:
        check_hpc(spec, s3_settings(spec), on_host=where.runs_here and spec.image is None)

    def hosts(self, spec: JobSpec, cluster: Cluster) -> list[Any]:
        """Return the hosts mpirun spreads the ranks over: the job's, else every node."""

        return hosts_for(
            self.job_of(spec), cluster.gpus_per_node, cluster.hosts(), cluster.cpus_per_node
        )

    def preflight_rows(self, spec: JobSpec, cluster: Cluster) -> list[dict[str, str]]:

        return preflight_checks(spec, self.hosts(spec, cluster))

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:

        hosts = self.hosts(spec, cluster)
        command = [sys.executable, "-m", "gpuflow.tasks.hpc.launch", "--job-json"]
        command += [spec.job.model_dump_json()]
        command += ["--hosts-json", json.dumps([h.model_dump() for h in hosts])]
        job = self.job_of(spec)
        launcher = MpiLaunch(hostfile=hostfile(hosts))
        return [
            WorkUnit(
                name="launcher",
                command=command,
                launcher=launcher,
                reads=local_paths(*job.inputs),  # its storage here (an image has it mounted)
                writes=local_paths(job.output),
            )
        ]

    def report(self, spec: JobSpec, cluster: Cluster, artifacts: Path, title: str) -> Report:

        rows, lines = summary(Path(cluster.workspace), artifacts, title)
        return Report(rows=rows, lines=lines)

    def summary(self, job: dict[str, Any]) -> list[str]:
        done = self.figures(job)
        if not isinstance(done, MdResult):
            return []
        lines = [
            f"  md: {done.atoms} atoms x {done.steps} steps on {done.ranks} rank(s)"
            f" ({done.device}): {done.atom_steps_per_s:.4g} atom-steps/s,"
            f" {done.ns_per_day:.4g} ns/day (argon), energy drift"
            f" {done.energy_drift_per_atom:.2e} per atom"
        ]
        if done.gpu_vs_cpu_speedup is not None:
            lines.append(f"  GPU vs CPU: {done.gpu_vs_cpu_speedup:.1f}x on {done.gpu_name}")
        return lines
