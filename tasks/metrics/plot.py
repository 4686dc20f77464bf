"""Utilisation over time as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def figure(width: float, height: float) -> Any:
    """Return a new matplotlib Figure (100 dpi), saved with Agg. Not through pyplot: pyplot
    keeps its figures in one process-wide list, which runs in threads of one process (a
    sweep, many runs at once) would share without a lock; and it loads a GUI backend's
    machinery. matplotlib is imported on first use."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


def utilisation_png(samples: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Draw GPU (or, with no GPU, host CPU) utilisation over time; None for < 2 samples."""
    if len(samples) < 2:
        return None
    t0 = samples[0]["t"]
    fig = figure(8, 3.5)
    ax = fig.subplots()
    gpu_ids = sorted({g["gpu"] for s in samples for g in s["gpus"]})
    for gpu in gpu_ids:
        points = [
            (s["t"] - t0, g["DCGM_FI_DEV_GPU_UTIL"])
            for s in samples
            for g in s["gpus"]
            if g["gpu"] == gpu and "DCGM_FI_DEV_GPU_UTIL" in g
        ]
        if points:
            ax.plot(*zip(*points, strict=True), label=f"GPU {gpu} util %")
    ax.plot(
        [s["t"] - t0 for s in samples],
        [s["host"]["cpu_percent"] for s in samples],
        label="host CPU %",
        linestyle="--" if gpu_ids else "-",
    )
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    ax.set_title(title if gpu_ids else f"{title} (no GPU seen)")
    ax.legend(loc="lower right")
    # fixed margins: tight_layout measured every tick label's text again, a third of the
    # plot's cost, which each of many runs at once in one process paid
    fig.subplots_adjust(left=0.075, right=0.98, top=0.91, bottom=0.14)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
