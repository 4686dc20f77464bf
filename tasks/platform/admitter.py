"""The platform's admitter: starts parked runs again once their GPU quota admits them.

A run that has to wait for its team's quota parks (tasks/platform/admission.py): its flow
run goes back to Scheduled (AwaitingQuota) and its process ends, so a queue of hundreds of
runs holds none of the worker's slots. Every second this process, started by `platform up`
beside the worker, drops parked entries whose flow run ended or is gone (cancelled while
it waited), lets the queue decide, and schedules every parked run now admitted for now:
the worker starts it, and its gate finds it admitted.

Run as `python -m gpuflow.tasks.platform.admitter FOLDER` (the platform's folder).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any
from uuid import UUID

from gpuflow.tasks.api_client import api_client
from gpuflow.tasks.platform.admission import PARKED, Ledger, entries_of, read_quotas
from gpuflow.tasks.platform.quotas import decide
from gpuflow.tasks.platform.users import UserBook

EVERY_S = 1.0
PAGE = 200
WAITING = ("SCHEDULED", "PENDING", "RUNNING", "PAUSED")


def once(folder: Path, client: Any) -> list[str]:
    """One round: return the runs scheduled again. The parked runs' states are read in one
    call before the ledger is locked (none is asked for while others wait on the lock)."""
    ledger = Ledger(folder)
    if not (folder / "quotas.json").is_file() or not ledger.path.is_file():
        return []
    parked = [row["run"] for row in ledger.read() if row.get("pid") is None]
    if not parked:
        return []
    states = _states(client, parked)  # run -> its state's name and type; absent: deleted
    quotas = read_quotas(folder, UserBook(folder / "users.json"))
    with ledger.changing() as rows:
        gone = {run for run in parked if run not in states or states[run][1] not in WAITING}
        rows[:] = [row for row in rows if row["run"] not in gone]
        extra = {row["run"]: {"pid": row["pid"], "started": row["started"]} for row in rows}
        decided = decide(entries_of(rows), quotas)
        rows[:] = [{**asdict(e), **extra[e.run]} for e in decided]
        started = [
            e.run
            for e in decided
            if extra[e.run]["pid"] is None
            and e.state in ("admitted", "borrowed")
            and states.get(e.run, ("", ""))[0] == PARKED
        ]
    for run in started:
        _schedule_now(client, run)
    return started


def _states(client: Any, runs: list[str]) -> dict[str, tuple[str, str]]:
    """Return each of `runs` that exists with its state's name and type (one API call
    per 200 runs)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    states: dict[str, tuple[str, str]] = {}
    for first in range(0, len(runs), PAGE):  # the API gives at most 200 runs an answer
        ids = [UUID(r) for r in runs[first : first + PAGE]]
        only = FlowRunFilter(id=FlowRunFilterId(any_=ids))
        for run in client.read_flow_runs(flow_run_filter=only, limit=PAGE):
            state = run.state
            states[str(run.id)] = (state.name, state.type.value) if state else ("", "")
    return states


def _schedule_now(client: Any, run: str) -> None:
    from prefect.states import Scheduled

    with contextlib.suppress(Exception):  # the next round tries again
        client.set_flow_run_state(
            UUID(run), Scheduled(message="admitted by its GPU quota"), force=True
        )


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    while True:
        with contextlib.suppress(Exception), api_client() as client:
            while True:
                for run in once(folder, client):
                    print(f"admitted {run}: scheduled again", flush=True)
                time.sleep(EVERY_S)
        time.sleep(EVERY_S)  # the API away: try again


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
