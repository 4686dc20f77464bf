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

from tasks.compute.base import Cluster, WorkUnit
from tasks.jobs.base import JobKind, Report
from tasks.spec import HpcJob, JobSpec
from tasks.storage import s3_settings


class HpcKind(JobKind):
    name = "hpc"
    model = HpcJob
    flow = "flows.hpc:hpc"

    def check(self, spec: JobSpec) -> None:
        from tasks.hpc.check import check_hpc

        check_hpc(spec, s3_settings(spec))

    def hosts(self, spec: JobSpec, cluster: Cluster) -> list[Any]:
        """Return the hosts mpirun spreads the ranks over: the job's, else every node."""
        from tasks.hpc.launch import hosts_for

        assert isinstance(spec.job, HpcJob)
        return hosts_for(spec.job, cluster.gpus_per_node, cluster.hosts(), cluster.cpus_per_node)

    def preflight_rows(self, spec: JobSpec, cluster: Cluster) -> list[dict[str, str]]:
        from tasks.hpc.check import preflight_checks

        return preflight_checks(spec, self.hosts(spec, cluster))

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        from tasks.hpc.mpi import hostfile

        hosts = self.hosts(spec, cluster)
        command = [sys.executable, "-m", "tasks.hpc.launch", "--job-json"]
        command += [spec.job.model_dump_json()]
        command += ["--hosts-json", json.dumps([h.model_dump() for h in hosts])]
        return [
            WorkUnit(
                name="launcher", command=command, judge="rank_status", hostfile=hostfile(hosts)
            )
        ]

    def report(self, spec: JobSpec, cluster: Cluster, artifacts: Path, title: str) -> Report:
        from tasks.hpc.report import summary

        rows, lines = summary(Path(cluster.workspace), artifacts, title)
        return Report(rows=rows, lines=lines)

    def summary(self, job: dict[str, Any]) -> list[str]:
        if "atom_steps_per_s" not in job:
            return []
        lines = [
            f"  md: {job['atoms']} atoms x {job['steps']} steps on {job['ranks']} rank(s)"
            f" ({job['device']}): {job['atom_steps_per_s']:.4g} atom-steps/s,"
            f" {job['ns_per_day']:.4g} ns/day (argon), energy drift"
            f" {job['energy_drift_per_atom']:.2e} per atom"
        ]
        if "gpu_vs_cpu_speedup" in job:
            lines.append(f"  GPU vs CPU: {job['gpu_vs_cpu_speedup']:.1f}x on {job['gpu_name']}")
        return lines
