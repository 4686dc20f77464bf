"""The failure sentence of a job's end: what stopped it, what the diagnosis table knows
of its last lines, else its code and last lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuflow.tasks.contract import Cluster, JobResult
from gpuflow.tasks.diagnose import diagnose
from gpuflow.tasks.kinds.registry import kind_of
from gpuflow.tasks.metrics.sampler import SAMPLES, read_samples
from gpuflow.tasks.spec import JobSpec


def failure_context(spec: JobSpec, cluster: Cluster) -> dict[str, Any]:
    """Return what makes a diagnosis precise: the GPU memory peak the samples saw and the
    job's batch size."""
    peaks = [
        gpu.get("DCGM_FI_DEV_FB_USED") or 0.0
        for sample in read_samples(Path(cluster.workspace) / SAMPLES)
        for gpu in sample.get("gpus", [])
    ]
    return {
        "peak_gpu_memory_mib": max(peaks, default=0.0),
        "batch_size": kind_of(spec).batch_size(spec),
    }


def failure_sentence(
    result: JobResult,
    timeout: float,
    stopped_by: str,
    reason: str | None,
    context: dict[str, Any] | None = None,
) -> str | None:
    if result.timed_out:
        return (
            f"the job ran past limits.{stopped_by} ({timeout:.0f} s) and was stopped;"
            f" raise limits.{stopped_by} or make the job shorter."
        )
    lines = [*result.log_tail, reason] if reason else result.log_tail
    known = diagnose(result.exit_code, result.signal, lines, context)
    if known is not None:
        code = (
            f"signal {result.signal}" if result.signal is not None else f"exit {result.exit_code}"
        )
        return f"the job failed ({code}): {known.message}"
    if result.signal is not None:
        hint = " (SIGKILL often means the out-of-memory killer)" if result.signal == 9 else ""
        return f"the job was killed by signal {result.signal}{hint}; see the last lines of its log."
    if result.exit_code and reason:
        return f"the job failed (exit {result.exit_code}): {reason}"
    if result.exit_code:
        last = " | ".join(result.log_tail[-3:])
        return f"the job exited with code {result.exit_code}; last lines: {last}"
    return None
