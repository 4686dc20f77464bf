"""`gpuflow hpc [-- PROGRAM]` and `gpuflow demo hpc`: MPI ranks, or the Kubeflow MPIJob."""

from __future__ import annotations

import argparse
from typing import Any

from gpuflow.commands.common import (
    EXIT_OK,
    add_job_options,
    invalid,
    load_job_spec,
    spec_from,
)
from gpuflow.commands.jobs import run_job

HELP = "run an MPI program across ranks (default: the built-in molecular dynamics)"


def add(commands: Any) -> list[tuple[str, str]]:
    # The job's ranges (ranks, MD density, temperature...) are checked by the spec, whose
    # sentences say what the physics or the host allows; here only the types.
    hpc = commands.add_parser(
        "hpc",
        description=HELP[0].upper() + HELP[1:] + ".",
        epilog="Give your program after --, e.g. gpuflow hpc --ranks 4 --build make -- ./sim",
    )
    hpc.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS (default: MD)")
    hpc.add_argument("--ranks", type=int, default=1, help="MPI processes (mpirun -np)")
    hpc.add_argument("--gpus-per-rank", type=int, default=0)
    hpc.add_argument("--slots", type=int, help="ranks this host takes (default: its cores)")
    hpc.add_argument("--oversubscribe", action="store_true", help="allow more ranks than slots")
    hpc.add_argument("--build", help="build step run in the workspace first, e.g. 'make -j4'")
    hpc.add_argument("--input", dest="inputs", action="append", help="file:/// or s3:// URL")
    hpc.add_argument("--out", dest="output", help="prefix the outputs folder is uploaded to")
    hpc.add_argument("--mpirun", help="the mpirun program (default: mpirun on PATH)")
    hpc.add_argument("--atoms", type=int, default=4000, help="MD: atoms")
    hpc.add_argument("--steps", type=int, default=1000, help="MD: time steps")
    hpc.add_argument("--density", type=float, help="MD: reduced density (default 0.8442)")
    hpc.add_argument("--temperature", type=float, help="MD: reduced temperature (default 0.72)")
    hpc.add_argument(
        "--mpijob",
        metavar="IMAGE",
        help="print the Kubeflow MPIJob (v2beta1) for this job, run by IMAGE, instead of running",
    )
    add_job_options(hpc, "hpc", gpus=0)
    hpc.set_defaults(handler=_hpc)
    return [("hpc", HELP)]


def _hpc(args: argparse.Namespace) -> int:
    spec = hpc_spec(args)
    if args.mpijob is None:
        return run_job(spec)
    from gpuflow.tasks.images import image_problem

    if (why := image_problem(args.mpijob)) is not None:
        return invalid(ValueError(f"--mpijob: {why}."))
    return mpijob(spec, args.mpijob)


def hpc_spec(args: argparse.Namespace) -> dict:
    """Return the job spec the `hpc` options describe: the program after --, else MD."""
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    job: dict = {"kind": "hpc", "ranks": args.ranks, "gpus_per_rank": args.gpus_per_rank}
    if program:
        job["program"] = program
    else:
        md = {"atoms": args.atoms, "steps": args.steps}
        md |= {
            k: getattr(args, k) for k in ("density", "temperature") if getattr(args, k) is not None
        }
        job["md"] = md
    if args.oversubscribe:
        job["oversubscribe"] = True
    return spec_from(args, job, ("build", "output", "slots", "mpirun", "inputs"))


def mpijob(spec: dict, image: str) -> int:
    """Print the MPIJob manifest for `spec` as YAML; exit 2 when it has no MPIJob shape."""
    import uuid

    import yaml

    from gpuflow.commands.mpijob import MpiJobError, build
    from gpuflow.tasks.errors import InvalidSpec

    try:
        manifest = build(load_job_spec(spec), image, str(uuid.uuid4()))
    except (InvalidSpec, MpiJobError) as exc:
        return invalid(exc)
    print(yaml.safe_dump(manifest, sort_keys=False), end="")
    return EXIT_OK


def hpc_demo() -> int:
    """Run the MD workload on up to two ranks of this machine through the hpc flow."""
    import os

    from gpuflow.tasks import nvml

    gpus = len(nvml.query().gpus)
    ranks = min(2, gpus) if gpus else min(2, os.cpu_count() or 1)
    where = f"{ranks} GPU(s)" if gpus else "the CPU (no GPU seen)"
    print(
        f"molecular dynamics: 2048 Lennard-Jones atoms, 500 steps, {ranks} MPI rank(s) on {where}"
    )
    job = {"kind": "hpc", "ranks": ranks, "md": {"atoms": 2048, "steps": 500}}
    if gpus:
        job["gpus_per_rank"] = 1
    return run_job({"name": "hpc-demo", "job": job, "resources": {"gpus": ranks if gpus else 0}})
