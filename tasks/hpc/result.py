"""The figures the MD program writes to outputs/result.json: it writes them through this
model and the hpc kind reads them through it."""

from __future__ import annotations

from pydantic import BaseModel


class MdResult(BaseModel):
    """A molecular-dynamics run's figures (the GPU-vs-CPU ones when it compared them)."""

    atoms: int
    steps: int
    ranks: int
    device: str
    box_length: float
    seconds: float
    atom_steps_per_s: float
    ns_per_day: float
    neighbour_rebuilds: int
    energy_drift_per_atom: float
    max_energy_deviation_per_atom: float
    cpu_atom_steps_per_s: float | None = None
    gpu_vs_cpu_speedup: float | None = None
    gpu_name: str | None = None
