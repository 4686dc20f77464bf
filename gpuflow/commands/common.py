"""What every command shares: exit codes, the one-sentence error, the run's UI link, and
the job spec the job-making commands (render, hpc) build from their options."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
EXIT_CODES = "Exit codes: 0 completed; 1 the job or its preflight failed; 2 invalid input."


def load_job_spec(source: Any) -> Any:
    """Return the JobSpec at `source` (a path or a dict), with every job kind registered;
    InvalidSpec for a bad one."""
    from gpuflow.tasks.pipeline import plugins  # noqa: F401 - the job and placement models
    from gpuflow.tasks.spec import load_spec

    return load_spec(source)


def invalid(exc: Exception | str) -> int:
    """Say why the input is invalid, in one sentence; return the exit code for it."""
    print(f"gpuflow: invalid input: {exc}", file=sys.stderr)
    return EXIT_INVALID


def print_link(api: Any, state: Any, failed: bool = False) -> None:
    """Print the flow run's page in the UI, when the API has one."""
    link = api.run_link(str(state.state_details.flow_run_id))
    if link:
        print(
            f"{'gpuflow: ' if failed else '  '}flow run: {link}",
            file=sys.stderr if failed else sys.stdout,
        )


def number(low: float, high: float = math.inf, kind: type = int) -> Any:
    """Return an argparse type: a finite `kind` from `low` to `high`, else one sentence."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {_a(kind)}") from None
        if not (math.isfinite(value) and low <= value <= high):
            bound = f"at least {low}" if high == math.inf else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"{text} is out of range; give {bound}")
        return value

    return parse


def _a(kind: type) -> str:
    return "a whole number" if kind is int else "a number"


def add_job_options(parser: argparse.ArgumentParser, name: str, gpus: int) -> None:
    """Add the options every job-making command takes: name, GPUs, S3 credentials."""
    parser.add_argument(
        "--gpus", type=number(0, 4096), default=gpus, help="GPUs to use when there are any"
    )
    parser.add_argument("--name", default=name)
    parser.add_argument("--aws-credentials", help="name of a prefect-aws AwsCredentials block")


def spec_from(args: argparse.Namespace, job: dict, options: tuple[str, ...]) -> dict:
    """Return a job spec: `job` plus the `options` given on the command line, with the
    name, GPUs (CPU allowed) and S3 credentials block every job command takes."""
    job = job | {o: getattr(args, o) for o in options if getattr(args, o) is not None}
    spec: dict = {
        "name": args.name,
        "job": job,
        "resources": {"gpus": args.gpus, "allow_cpu": True},
    }
    if args.aws_credentials:
        spec["storage"] = {"aws_credentials": args.aws_credentials}
    return spec
