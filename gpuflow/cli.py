"""The `gpuflow` command: the parser, with its commands grouped the way they are used.

Each group's commands live in a module of gpuflow.commands; this module only puts the
parser together, lists the groups in --help, and runs the chosen command interruptibly.
Exit codes: 0 the job completed; 1 the job (or its preflight) failed; 2 invalid input.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

from gpuflow import session
from gpuflow.commands import (
    datasets,
    fleet,
    follow,
    hpc,
    maintenance,
    offers,
    platform,
    render,
    run,
    secret,
    service,
)
from gpuflow.commands.common import EXIT_CODES, EXIT_FAILED, EXIT_INVALID, EXIT_OK

# (title, the modules whose commands it lists, in this order)
GROUPS: list[tuple[str, list[Any]]] = [
    ("run work", [run, render, hpc, datasets, offers]),
    ("fleets and services", [fleet, service]),
    ("follow runs", [follow]),
    ("platform and deployments", [platform, secret]),
    ("maintenance", [maintenance]),
]

__all__ = ["EXIT_FAILED", "EXIT_INVALID", "EXIT_OK", "build_parser", "command", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Return the parser: every command, and a --help that lists them by group."""
    parser = argparse.ArgumentParser(
        prog="gpuflow",
        description="Run GPU work as a Prefect pipeline: provision, preflight, run, collect, teardown.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="one of the commands below"
    )
    parser.set_defaults(on_signal=None)  # what a signal's sentence says the stop did
    groups = [(title, [e for m in modules for e in m.add(commands)]) for title, modules in GROUPS]
    width = max(len(name) for _, listed in groups for name, _ in listed)
    listing = []
    for title, listed in groups:
        listing += [f"{title}:", *(f"  {name:<{width}}  {text}" for name, text in listed), ""]
    parser.epilog = "\n".join([*listing, EXIT_CODES, "`gpuflow COMMAND --help` says more."])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    session.outlive_the_terminal()
    return session.interruptible(lambda: args.handler(args), args.on_signal)


def command() -> int:
    """Return main()'s exit code to a process that is about to end (the console script,
    `python -m gpuflow`): the objects made so far are frozen, so that Python's last
    garbage collection as it stops skips them (with Prefect loaded, that collection alone
    took half a second of every command). atexit handlers still run, and logs and events
    are sent before main() returns."""
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(command())
