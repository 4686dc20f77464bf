"""RunMetrics: what a run used, from its samples. Pure."""

from __future__ import annotations

import itertools
from statistics import fmean
from typing import Any

from pydantic import BaseModel

from gpuflow.tasks.metrics.cost import Cost

IDLE_PCT = 5.0  # a GPU under this utilisation (in %) is idle, unless limits.idle_gpu says


class RunMetrics(BaseModel):
    samples: int
    duration_s: float
    gpu_count: int
    gpu_seen: bool
    note: str = ""
    gpu_util_mean: float | None = None
    gpu_util_max: float | None = None
    gpu_memory_peak_mib: float | None = None
    gpu_power_mean_w: float | None = None
    energy_j: float | None = None
    gpu_hours: float = 0.0
    gpu_hours_idle: float = 0.0  # the share of gpu_hours its GPUs sat under IDLE_PCT
    host_cpu_mean: float | None = None
    host_memory_peak_bytes: int | None = None
    cost_usd: float = 0.0
    cost_hourly_usd: float = 0.0
    cost_breakdown: dict[str, float] = {}
    # a run placed on a list of candidates: GPU-hours and cost on each candidate it used
    by_placement: list[dict[str, Any]] = []
    job: dict[str, Any] = {}
    image: str | None = None  # the image the run's units ran, name@digest (image:)
    # the job's own figures (metrics.from_log): the newest value of each, and how many rows
    from_log: dict[str, float] = {}
    from_log_rows: int = 0


def _energy_j(samples: list[dict[str, Any]]) -> float | None:
    """Energy from the driver's counter where present, else power integrated over time."""
    by_gpu: dict[int, list[tuple[float, dict[str, Any]]]] = {}
    for sample in samples:
        for gpu in sample["gpus"]:
            by_gpu.setdefault(gpu["gpu"], []).append((sample["t"], gpu))
    if not by_gpu:
        return None
    total = 0.0
    for readings in by_gpu.values():
        counters = [g.get("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION") for _, g in readings]
        first, last = counters[0], counters[-1]
        if len(readings) > 1 and None not in counters and first is not None and last is not None:
            total += (last - first) / 1000.0
            continue
        for (t0, g0), (t1, _) in itertools.pairwise(readings):
            total += g0.get("DCGM_FI_DEV_POWER_USAGE", 0.0) * (t1 - t0)
    return total


def summarise(
    samples: list[dict[str, Any]],
    duration_s: float,
    gpu_count: int,
    cost: Cost,
    gpu_note: str = "",
    idle_pct: float = IDLE_PCT,
    held_s: float | None = None,
) -> RunMetrics:
    """Return the run's summary: utilisation, memory, energy, GPU-hours (the GPUs held for
    `held_s`, else for the whole duration) and cost."""
    gpus = [g for s in samples for g in s["gpus"]]
    utils = [g["DCGM_FI_DEV_GPU_UTIL"] for g in gpus if "DCGM_FI_DEV_GPU_UTIL" in g]
    mems = [g["DCGM_FI_DEV_FB_USED"] for g in gpus if "DCGM_FI_DEV_FB_USED" in g]
    powers = [g["DCGM_FI_DEV_POWER_USAGE"] for g in gpus if "DCGM_FI_DEV_POWER_USAGE" in g]
    cpus = [s["host"]["cpu_percent"] for s in samples]
    host_mem = [s["host"]["memory_used_bytes"] for s in samples]
    seen = bool(gpus)
    gpu_hours = gpu_count * (duration_s if held_s is None else held_s) / 3600.0
    idle_share = sum(u < idle_pct for u in utils) / len(utils) if utils else 0.0
    note = gpu_note or ("" if seen else "no GPU was seen: host CPU and memory only")
    return RunMetrics(
        samples=len(samples),
        duration_s=duration_s,
        gpu_count=gpu_count,
        gpu_seen=seen,
        note=note,
        gpu_util_mean=fmean(utils) if utils else None,
        gpu_util_max=max(utils) if utils else None,
        gpu_memory_peak_mib=max(mems) if mems else None,
        gpu_power_mean_w=fmean(powers) if powers else None,
        energy_j=_energy_j(samples),
        gpu_hours=gpu_hours,
        gpu_hours_idle=gpu_hours * idle_share,
        host_cpu_mean=fmean(cpus) if cpus else None,
        host_memory_peak_bytes=max(host_mem) if host_mem else None,
        cost_usd=cost.usd,
        cost_hourly_usd=cost.hourly_usd,
        cost_breakdown=cost.breakdown,
    )
