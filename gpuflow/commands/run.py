"""`gpuflow run JOB.yaml` and `gpuflow demo`: a job spec through its kind's flow."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gpuflow.commands.hpc import hpc_demo
from gpuflow.commands.jobs import run_job
from gpuflow.commands.render import render_demo

SMOKE_JOB = Path(__file__).resolve().parent.parent / "smoke.yaml"


def add(commands: Any) -> list[tuple[str, str]]:
    run = commands.add_parser("run", description="Run JOB.yaml through the pipeline.")
    run.add_argument("job", help="path of a job spec (YAML or JSON)")
    run.set_defaults(handler=lambda args: run_job(args.job))
    demo = commands.add_parser("demo", description="Run a demo job on this machine.")
    demo.add_argument(
        "which",
        nargs="?",
        choices=["matmul", "render", "hpc"],
        default="matmul",
        help="matmul: the GPU smoke job (TFLOP/s); render: a small Blender animation;"
        " hpc: molecular dynamics on two MPI ranks",
    )
    demo.set_defaults(handler=_demo)
    return [
        ("run", "run JOB.yaml through the pipeline"),
        ("demo", "run a demo job on this machine"),
    ]


def _demo(args: argparse.Namespace) -> int:
    if args.which == "render":
        return render_demo()
    if args.which == "hpc":
        return hpc_demo()
    return run_job(str(SMOKE_JOB))
