"""Sampling while a job runs: GPU and host metrics into the run's workspace (or read as
the nodes write them there), pushed live to a Pushgateway when one is set, watched for
idle GPUs when limits.idle_gpu asks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpuflow.tasks.contract import Cluster
from gpuflow.tasks.metrics.idle import IdleWatch
from gpuflow.tasks.metrics.prometheus import LivePush
from gpuflow.tasks.metrics.sampler import NODE_SAMPLES, SAMPLES, Sampler, SampleTail
from gpuflow.tasks.spec import JobSpec


@contextlib.contextmanager
def sampling(
    spec: JobSpec, cluster: Cluster, flow_run_id: str, warn: Callable[..., None]
) -> Iterator[IdleWatch | None]:
    """Sample GPU/host metrics into the workspace (and push them live when a Pushgateway
    is configured) while the body runs; yield the idle watch when limits.idle_gpu is set."""
    idle = spec.limits.idle_gpu
    nodes_write_here = cluster.capabilities.node_samples_in_workspace and (
        Path(cluster.workspace).is_dir()  # the cluster's shared filesystem, seen from here
    )
    if cluster.capabilities.samples_nodes and not nodes_write_here:
        if idle is not None:
            warn(
                "limits.idle_gpu is not enforced on %s: its nodes sample themselves and"
                " this machine does not see their samples as they come",
                cluster.backend,
            )
        yield None
        return
    consumers: list[Callable[[dict[str, Any]], None]] = []
    if spec.metrics.pushgateway:
        consumers.append(
            LivePush(
                spec.metrics.pushgateway, flow_run_id, spec.name, spec.metrics.push_interval_s, warn
            )
        )
    watch = IdleWatch(idle, flow_run_id, spec.name, warn) if idle is not None else None
    if watch is not None:
        consumers.append(watch)

    def on_sample(sample: dict[str, Any]) -> None:
        for consume in consumers:
            consume(sample)

    if nodes_write_here:  # the nodes' samplers write into the workspace: read them there
        tail = SampleTail(Path(cluster.workspace), NODE_SAMPLES, on_sample, spec.metrics.interval_s)
        with tail, watch if watch is not None else contextlib.nullcontext():
            yield watch
        return
    samples = Path(cluster.workspace) / SAMPLES
    sampler = Sampler(samples, cluster.gpu_indices, spec.metrics.interval_s, on_sample=on_sample)
    try:
        with sampler, watch if watch is not None else contextlib.nullcontext():
            yield watch
    finally:
        if sampler.write_error:
            warn(
                "%d metric sample(s) were lost: %s; the metrics cover only the rest",
                sampler.lost,
                sampler.write_error,
            )
