"""MD throughput (atom-steps/s) on 1 and 2 MPI ranks at two system sizes, side by side.

Each run is the built-in workload under Debian's mpirun, as the hpc flow starts it
(`python -m mpi4py -m gpuflow.tasks.hpc.md_run`), timed by the kernel itself (the integration loop,
not start-up). Printed per size: 1 rank on every core, 1 rank on one core, 2 ranks on one
core each; the 2-rank/1-rank ratio, and parallel efficiency = rate(2 ranks) / (2 x rate(1
rank on one core)). On a GPU machine it also runs 1 rank on the GPU and prints the
GPU/CPU speedup of the same system.

    python bench/md_scaling.py [--sizes 4000,32000] [--steps 200,40] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(atoms: int, steps: int, ranks: int, threads: int, gpu: bool) -> dict:
    """Return the kernel's result.json for one run."""
    out = Path(tempfile.mkdtemp(prefix="md-scaling-"))
    settings = {"atoms": atoms, "steps": steps, "thermo_every": steps, "compare_cpu": gpu}
    settings["cpu_steps"] = max(5, steps // 4)
    env = dict(os.environ, GPUFLOW_OUTPUT_DIR=str(out), OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    argv = ["mpirun", "-np", str(ranks), "--bind-to", "none", "--map-by", "slot"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    argv += ["-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH", "-x", "GPUFLOW_OUTPUT_DIR"]
    argv += [sys.executable, "-m", "mpi4py", "-m", "gpuflow.tasks.hpc.md_run"]
    argv += ["--settings", json.dumps(settings)]
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    result = json.loads((out / "result.json").read_text())
    shutil.rmtree(out)
    return result


def median_rate(atoms: int, steps: int, ranks: int, threads: int, rounds: int) -> float:
    return statistics.median(
        run(atoms, steps, ranks, threads, False)["atom_steps_per_s"] for _ in range(rounds)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="4000,32000")
    parser.add_argument("--steps", default="200,40", help="steps per size")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    shutil.which("mpirun") or sys.exit("mpirun is not installed (apt-get install openmpi-bin)")
    sizes = [int(s) for s in args.sizes.split(",")]
    steps = [int(s) for s in args.steps.split(",")]
    cores = os.cpu_count() or 1
    print(f"{cores} CPU cores; median of {args.rounds} round(s); atom-steps/s")
    print(
        f"{'atoms':>7} {'steps':>6} {'1r x all':>10} {'1r x 1':>10} {'2r x 1':>10}"
        f" {'2r/1r-all':>10} {'efficiency':>10}"
    )
    for atoms, n in zip(sizes, steps, strict=True):
        whole = median_rate(atoms, n, 1, cores, args.rounds)
        single = median_rate(atoms, n, 1, 1, args.rounds)
        two = median_rate(atoms, n, 2, max(1, cores // 2), args.rounds)
        print(
            f"{atoms:>7} {n:>6} {whole:>10.4g} {single:>10.4g} {two:>10.4g}"
            f" {two / whole:>10.2f} {two / (2 * single):>10.2f}"
        )
    import torch

    if torch.cuda.is_available():
        for atoms, n in zip(sizes, steps, strict=True):
            result = run(atoms, n * 10, 1, cores, True)
            print(
                f"GPU {result['gpu_name']}: {atoms} atoms {result['atom_steps_per_s']:.4g}"
                f" atom-steps/s vs CPU {result['cpu_atom_steps_per_s']:.4g}:"
                f" speedup {result['gpu_vs_cpu_speedup']:.1f}x"
            )
    else:
        print("no GPU: the GPU/CPU speedup needs a CUDA device")


if __name__ == "__main__":
    main()
