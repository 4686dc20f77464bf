"""The built-in MD workload as an MPI program: every rank holds all positions, computes the
forces of its share of the cells, and one allreduce per step sums them (replicated data).
Rank 0 writes thermo.csv and result.json to the outputs folder.

Run it as `python -m mpi4py -m gpuflow.tasks.hpc.md_run --settings JSON` so that an exception on
one rank aborts them all instead of leaving the others waiting in the allreduce.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpuflow.tasks.hpc import md
from gpuflow.tasks.hpc.box import box_for, ns_per_day
from gpuflow.tasks.hpc.result import MdResult

DEFAULTS: dict[str, Any] = {
    "atoms": 4000,
    "density": 0.8442,
    "temperature": 0.72,
    "cutoff": 2.5,
    "skin": 0.3,
    "dt": 0.005,
    "steps": 1000,
    "thermo_every": 50,
    "seed": 1,
    "dtype": "float64",
    "compare_cpu": True,
    "cpu_steps": 100,
}

Reduce = Callable[[torch.Tensor], torch.Tensor]


def simulate(
    settings: dict[str, Any],
    device: torch.device,
    rank: int = 0,
    ranks: int = 1,
    reduce: Reduce | None = None,
    steps: int | None = None,
    on_thermo: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Return thermo rows, timings and counts for one run. With several ranks, each computes
    the forces of its share of cells and `reduce` (an allreduce) sums forces, energy and
    virial; positions stay identical on every rank, so every rank decides the same rebuilds."""
    s = {**DEFAULTS, **settings}
    steps = s["steps"] if steps is None else steps
    dtype = getattr(torch, s["dtype"])
    box = box_for(s["atoms"], s["density"], s["cutoff"], s["skin"])
    x = md.lattice(box, dtype).to(device)
    v = md.velocities(box.atoms, s["temperature"], s["seed"], dtype).to(device)
    dt, n = s["dt"], box.atoms

    def forces(x: torch.Tensor, pairs: tuple[torch.Tensor, torch.Tensor]):
        f, pe, vir = md.pair_forces(x, box, *pairs)
        if reduce is None:
            return f, pe, vir
        packed = reduce(torch.cat([f.reshape(-1), pe.reshape(1), vir.reshape(1)]))
        return packed[:-2].reshape(n, 3), packed[-2], packed[-1]

    def thermo(step: int, pe: torch.Tensor, vir: torch.Tensor) -> dict[str, float]:
        ke = md.kinetic_energy(v)
        temp = 2 * ke / (3 * n - 3)
        row = {
            "step": step,
            "time": step * dt,
            "temperature": temp,
            "potential_per_atom": float(pe) / n,
            "kinetic_per_atom": ke / n,
            "total_per_atom": (float(pe) + ke) / n,
            "pressure": (n * temp + float(vir) / 3) / box.volume,
        }
        if on_thermo:
            on_thermo(row)
        return row

    pairs = md.neighbour_pairs(x, box, rank, ranks)
    anchor = x.clone()
    f, pe, vir = forces(x, pairs)
    rows = [thermo(0, pe, vir)]
    rebuilds = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        v += 0.5 * dt * f
        x += dt * v
        moved = ((x - anchor) ** 2).sum(dim=1).max()
        if float(moved) > (box.skin / 2) ** 2:
            pairs = md.neighbour_pairs(x, box, rank, ranks)
            anchor = x.clone()
            rebuilds += 1
        f, pe, vir = forces(x, pairs)
        v += 0.5 * dt * f
        if step % s["thermo_every"] == 0 or step == steps:
            rows.append(thermo(step, pe, vir))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    energies = [r["total_per_atom"] for r in rows]
    return {
        "atoms": n,
        "steps": steps,
        "ranks": ranks,
        "device": str(device),
        "box_length": box.length,
        "seconds": seconds,
        "atom_steps_per_s": n * steps / seconds,
        "ns_per_day": ns_per_day(steps, dt, seconds),
        "neighbour_rebuilds": rebuilds,
        "energy_drift_per_atom": energies[-1] - energies[0],
        "max_energy_deviation_per_atom": max(abs(e - energies[0]) for e in energies),
        "thermo": rows,
    }


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", 0)  # the rank's CUDA_VISIBLE_DEVICES holds its own GPU(s)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--settings", default="{}", help="JSON of the md settings")
    args = parser.parse_args(argv)
    settings = {**DEFAULTS, **json.loads(args.settings)}
    comm = _comm()
    rank, ranks = (comm.Get_rank(), comm.Get_size()) if comm else (0, 1)
    reduce = _allreduce(comm) if comm and ranks > 1 else None
    device = _device(int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
    out = Path(os.environ.get("GPUFLOW_OUTPUT_DIR", "outputs"))

    def progress(row: dict[str, float]) -> None:
        if rank == 0:
            print(
                f"step {row['step']:>7}  T {row['temperature']:.4f}  E/N {row['total_per_atom']:.6f}"
                f"  P {row['pressure']:.4f}",
                flush=True,
            )

    if rank == 0:
        print(f"md: {settings['atoms']} atoms, {ranks} rank(s), {device}", flush=True)
    result = simulate(settings, device, rank, ranks, reduce, on_thermo=progress)
    if device.type == "cuda" and settings["compare_cpu"]:
        cpu = simulate(settings, torch.device("cpu"), rank, ranks, reduce, settings["cpu_steps"])
        result["cpu_atom_steps_per_s"] = cpu["atom_steps_per_s"]
        result["gpu_vs_cpu_speedup"] = result["atom_steps_per_s"] / cpu["atom_steps_per_s"]
        result["gpu_name"] = torch.cuda.get_device_name(device)
    if rank == 0:
        _write(out, result)
        print(
            f"md: {result['atom_steps_per_s']:.4g} atom-steps/s, {result['ns_per_day']:.4g} ns/day"
            f" (argon), energy drift {result['energy_drift_per_atom']:.3g} per atom",
            flush=True,
        )
        if "gpu_vs_cpu_speedup" in result:
            print(f"md: GPU vs CPU speedup {result['gpu_vs_cpu_speedup']:.1f}x", flush=True)
    return 0


def _write(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = result.pop("thermo")
    header = list(rows[0])
    lines = [",".join(header)] + [",".join(f"{r[k]:.15g}" for k in header) for r in rows]
    (out / "thermo.csv").write_text("\n".join(lines) + "\n")
    (out / "result.json").write_text(
        MdResult(**result).model_dump_json(indent=2, exclude_none=True)
    )


def _comm() -> Any:
    """Return MPI's world communicator when started by mpirun, else None (a plain run)."""
    if not any(k.startswith(("OMPI_COMM_WORLD", "PMI_RANK", "PMIX_RANK")) for k in os.environ):
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _allreduce(comm: Any) -> Reduce:
    from mpi4py import MPI

    def reduce(t: torch.Tensor) -> torch.Tensor:
        buf = t.detach().to("cpu").contiguous().numpy()
        comm.Allreduce(MPI.IN_PLACE, buf)
        return torch.from_numpy(buf).to(t.device)

    return reduce


if __name__ == "__main__":
    sys.exit(main())
