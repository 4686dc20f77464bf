"""Kind `train`: PyTorch training on webdataset shards, one torchrun per node.

Each node runs gpuflow.tasks.training.launch, which starts one rank per GPU it sees (or
`cpu_processes` CPU ranks). On one node torchrun is standalone; on N nodes every node's
torchrun meets at the cluster's one rendezvous address, so N nodes x G GPUs is one job.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gpuflow.tasks.contract import Capabilities, Cluster, Needs, WorkUnit
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.kinds.base import JobKind, Report
from gpuflow.tasks.spec import JobSpec
from gpuflow.tasks.storage import StorageError, local_paths, s3_settings
from gpuflow.tasks.training.model import TrainJob
from gpuflow.tasks.training.profile import read
from gpuflow.tasks.training.report import summary
from gpuflow.tasks.training.result import TrainResult
from gpuflow.tasks.training.validate import check_train

RENDEZVOUS_PORT = 29400


class TrainKind(JobKind[TrainJob]):
    name = "train"
    model = TrainJob
    result = TrainResult
    flow = None  # `gpuflow run` trains inside gpu_pipeline; deployments use gpuflow.flows.train

    def uses_torch(self, spec: JobSpec) -> bool:
        return self.job_of(spec).torch

    def batch_size(self, spec: JobSpec) -> int | None:
        return self.job_of(spec).batch_size

    def needs(self, spec: JobSpec) -> Needs:
        job = self.job_of(spec)
        inputs = {"job.dataset": job.dataset, "job.output": job.output}
        if job.eval_dataset:
            inputs["job.eval_dataset"] = job.eval_dataset
        return Needs(inputs=inputs, gpuflow=True)

    def extra(self, spec: JobSpec, where: Capabilities) -> str | None:
        here = where.runs_here and spec.image is None
        return "train" if here else None  # elsewhere: the nodes' own torch, or the image's

    def check(self, spec: JobSpec, where: Capabilities) -> None:

        try:
            settings = s3_settings(spec)
        except StorageError as exc:
            raise InvalidSpec(str(exc)) from None
        check_train(spec, settings, where.runs_here)

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        job = self.job_of(spec)
        per_node = cluster.gpus_per_node or job.cpu_processes
        command = [sys.executable, "-m", "gpuflow.tasks.training.launch", "--job-json"]
        command += [job.model_dump_json(), "--run-name", spec.name]
        command += ["--stop-grace-s", f"{spec.limits.stop_grace_s:g}"]
        # its storage on this machine (an image has them mounted)
        files = {
            "reads": local_paths(job.dataset, job.eval_dataset),
            "writes": local_paths(job.output),
        }
        if cluster.nodes == 1:
            return [WorkUnit(name="main", command=command, world_size=per_node, **files)]
        rendezvous = cluster.rendezvous or f"{cluster.hosts()[0]}:{RENDEZVOUS_PORT}"
        return [
            WorkUnit(
                name=f"node-{node}",
                command=[
                    *command,
                    "--nnodes",
                    str(cluster.nodes),
                    "--node-rank",
                    str(node),
                    "--rendezvous",
                    rendezvous,
                    "--rendezvous-id",
                    cluster.name,
                ],
                node=node,
                world_size=cluster.nodes * per_node,
                **files,
            )
            for node in range(cluster.nodes)
        ]

    def report(self, spec: JobSpec, cluster: Cluster, artifacts: Path, title: str) -> Report:

        outputs = Path(cluster.workspace) / "outputs"
        rows, lines = summary(outputs, artifacts, title)
        _profile_artifacts(outputs, title)
        return Report(rows=rows, lines=lines)

    def summary(self, job: dict[str, Any]) -> list[str]:
        done = self.figures(job)
        if not isinstance(done, TrainResult):
            return []
        speed, unit = done.speed()
        lines = [
            f"  trained {done.steps} steps on {done.world_size} rank(s) ({done.device}):"
            f" {done.samples_per_s} samples/s, {speed} {unit}"
        ]
        if done.eval_loss is not None:
            accuracy = done.eval_accuracy
            top1 = f", top-1 accuracy {100 * accuracy:.1f}%" if accuracy is not None else ""
            lines.append(f"  eval at step {done.eval_step}: loss {done.eval_loss:.4f}{top1}")
        lines.append(f"  weights: {done.weights}")
        return lines


def _profile_artifacts(outputs: Path, title: str) -> None:
    """Publish a profiled run's top operators and per-step split as table artifacts."""
    from prefect.artifacts import create_table_artifact

    from gpuflow.tasks.api_client import publish

    profiled = read(outputs)
    if profiled is None:
        return
    ops, steps = profiled
    publish(
        create_table_artifact,
        key="gpuflow-profile-operators",
        table=ops,
        description=f"{title}: operators by self time over the profiled steps",
    )
    publish(
        create_table_artifact,
        key="gpuflow-profile-steps",
        table=steps,
        description=f"{title}: each profiled step, waiting for data vs computing (ms)",
    )
