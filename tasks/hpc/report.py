"""What an HPC run shows: per-rank outcomes, and for the MD workload its energies over time
and its speed."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from gpuflow.tasks.hpc.result import MdResult
from gpuflow.tasks.metrics.plot import figure
from gpuflow.tasks.outputs import read_result


def read_thermo(path: Path) -> list[dict[str, float]]:
    if not path.is_file():
        return []
    with path.open() as handle:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def energy_png(rows: list[dict[str, float]], path: Path, title: str) -> Path | None:
    """Draw total, potential and kinetic energy per atom, and temperature, against reduced
    time; None for fewer than 2 rows."""
    if len(rows) < 2:
        return None
    t = [r["time"] for r in rows]
    fig = figure(8, 6)
    energy_ax, total_ax = fig.subplots(2, 1, sharex=True)
    for key, label in (("potential_per_atom", "potential"), ("kinetic_per_atom", "kinetic")):
        energy_ax.plot(t, [r[key] for r in rows], label=label)
    energy_ax.set_ylabel("energy per atom (epsilon)")
    energy_ax.legend()
    energy_ax.set_title(title)
    total_ax.plot(t, [r["total_per_atom"] - rows[0]["total_per_atom"] for r in rows])
    total_ax.set_ylabel("total energy drift per atom")
    total_ax.set_xlabel("time (tau)")
    fig.tight_layout()
    fig.savefig(path)
    return path


def rank_table(workspace: Path) -> list[dict[str, Any]]:
    """Return one row per rank that reported: rank, host, exit code, signal."""
    rows = []
    for path in (workspace / "ranks").glob("rank-*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        rows.append({k: record.get(k) for k in ("rank", "host", "exit_code", "signal")})
    return sorted(rows, key=lambda r: r["rank"])


def summary(workspace: Path, out_dir: Path, title: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Return table rows and markdown lines for a finished (or failed) HPC run."""
    outputs = workspace / "outputs"
    ranks = rank_table(workspace)
    result = read_result(outputs / "result.json", MdResult)
    rows = [{"metric": "hpc.ranks_reported", "value": len(ranks)}]
    failed = [r for r in ranks if r["exit_code"] not in (0, None) or r["signal"]]
    rows.append({"metric": "hpc.ranks_failed", "value": len(failed)})
    lines = []
    if ranks:
        hosts = sorted({r["host"] for r in ranks})
        lines.append(f"- {len(ranks)} rank(s) on {', '.join(hosts)}; {len(failed)} failed")
    if result is not None:
        lines.append(
            f"- **{result.atom_steps_per_s:.4g} atom-steps/s**, {result.ns_per_day:.4g}"
            f" ns/day (argon), {result.atoms} atoms x {result.steps} steps on"
            f" {result.ranks} rank(s) ({result.device})"
        )
        lines.append(
            f"- total-energy drift {result.energy_drift_per_atom:.2e} per atom (largest"
            f" deviation {result.max_energy_deviation_per_atom:.2e})"
        )
        if result.gpu_vs_cpu_speedup is not None:
            lines.append(f"- GPU vs CPU: **{result.gpu_vs_cpu_speedup:.1f}x** on {result.gpu_name}")
    png = energy_png(read_thermo(outputs / "thermo.csv"), out_dir / "energy.png", title)
    if png:
        lines.append(f"- energies over time: `{png}`")
    return rows, lines
