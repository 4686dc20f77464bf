"""Following runs from a terminal: `ls` (the recent runs), `logs RUN [--follow]` and
`cancel RUN`, on whichever API the command uses (the platform, PREFECT_API_URL or the
kept temporary API). RUN is a job's name, a flow run's name, an id or its first
characters."""

from __future__ import annotations

import sys
from typing import Any

from gpuflow.commands.common import EXIT_FAILED, EXIT_OK, invalid, number


def add(commands: Any) -> list[tuple[str, str]]:
    ls = commands.add_parser("ls", description="List the recent runs, newest first.")
    ls.add_argument("-n", "--limit", type=number(1, 200), default=20, help="how many (20)")
    ls.add_argument("--owner", help="only the runs this user of a shared platform made")
    ls.set_defaults(handler=lambda args: _with_api(lambda: list_runs(args.limit, args.owner)))
    logs = commands.add_parser("logs", description="Print a run's log.")
    logs.add_argument("run", help="job name, flow run name, id, or the first characters of one")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="keep printing until the run is over"
    )
    logs.set_defaults(
        handler=lambda args: _with_api(lambda: print_logs(args.run, args.follow)),
        on_signal="only this command stopped; the run goes on (`gpuflow cancel RUN` stops it).",
    )
    cancel = commands.add_parser(
        "cancel", description="Cancel a run: its job is stopped and torn down, as from the UI."
    )
    cancel.add_argument("run", help="job name, flow run name, id, or the first characters of one")
    cancel.set_defaults(handler=lambda args: _with_api(lambda: cancel_run(args.run)))
    return [
        ("ls", "list the recent runs: job, state, backend, GPUs, duration, cost"),
        ("logs", "print a run's log (--follow: until it is over)"),
        ("cancel", "cancel a run; its teardown runs"),
    ]


def _with_api(body: Any) -> int:
    from gpuflow import session

    return session.with_api(lambda api: body())


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def list_runs(limit: int, owner: str | None = None) -> int:
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.platform.runs import listed
    from gpuflow.tasks.platform.users import check_name

    try:
        rows = listed(limit, check_name(owner) if owner else None)
    except InvalidSpec as exc:
        return invalid(exc)
    if not rows:
        print(f"no runs of {owner} on this API" if owner else "no runs on this API yet")
        return EXIT_OK
    shared = any(row.owner for row in rows)  # a platform with users: who made each
    table = [("RUN", "JOB", "STATE", *(("OWNER",) if shared else ()), "BACKEND", "HOST")]
    table[0] += ("GPUS", "DURATION", "COST", "FLOW RUN")
    for row in rows:
        table.append(
            (
                row.short or row.id[:8],
                row.job,
                f"Queued ({row.queued})" if row.queued else row.state,
                *((row.owner or "-",) if shared else ()),
                row.backend or "-",
                row.host or "-",
                "-" if row.gpus is None else str(row.gpus),
                _duration(row.duration_s),
                "-" if row.cost_usd is None else f"${row.cost_usd:.4f}",
                row.flow_run,
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for line in table:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        )
    for row in sorted((r for r in rows if r.queued), key=lambda r: r.queued):
        print(f"queued {row.queued}: {row.short or row.id[:8]} {row.queue_reason}")
    return EXIT_OK


def print_logs(name: str, follow: bool) -> int:
    from gpuflow.tasks.platform.runs import find, log_lines

    run = find(name)
    for line in log_lines(run.id, follow=follow):
        print(line, flush=follow)
    if follow:
        print(f"[gpuflow] {run.job} ({run.flow_run}) is over", file=sys.stderr)
    return EXIT_OK


def cancel_run(name: str) -> int:
    from gpuflow.tasks.platform.runs import cancel, find

    run = find(name)
    if not run.final:
        print(f"[gpuflow] cancelling {run.job} ({run.flow_run}, {run.id[:8]})", file=sys.stderr)
    said = cancel(run)
    print(said)
    return EXIT_FAILED if "has not ended" in said else EXIT_OK
