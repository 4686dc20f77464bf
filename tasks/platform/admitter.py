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

from gpuflow.tasks.platform.admission import PARKED, Ledger, entries_of, read_quotas
from gpuflow.tasks.platform.quotas import decide
from gpuflow.tasks.platform.users import UserBook

EVERY_S = 1.0
WAITING = ("SCHEDULED", "PENDING", "RUNNING", "PAUSED")


def once(folder: Path, client: Any) -> list[str]:
    """One round: return the runs scheduled again."""
    ledger = Ledger(folder)
    if not (folder / "quotas.json").is_file() or not ledger.path.is_file():
        return []
    quotas = read_quotas(folder, UserBook(folder / "users.json"))
    with ledger.changing() as rows:
        parked = [row for row in rows if row.get("pid") is None]
        if not parked:
            return []
        started: list[str] = []
        gone = {row["run"] for row in parked if not _waiting(client, row["run"])}
        rows[:] = [row for row in rows if row["run"] not in gone]
        extra = {row["run"]: {"pid": row["pid"], "started": row["started"]} for row in rows}
        decided = decide(entries_of(rows), quotas)
        rows[:] = [{**asdict(e), **extra[e.run]} for e in decided]
        started = [
            e.run
            for e in decided
            if extra[e.run]["pid"] is None
            and e.state in ("admitted", "borrowed")
            and _parked(client, e.run)
        ]
    for run in started:
        _schedule_now(client, run)
    return started


def _waiting(client: Any, run: str) -> bool:
    """Return True while flow run `run` may still start (not ended, not deleted)."""
    try:
        state = client.read_flow_run(UUID(run)).state
    except Exception as exc:  # deleted: gone; the API away: keep it for the next round
        return "404" not in str(exc) and "not found" not in str(exc).lower()
    return state is not None and state.type.value in WAITING


def _parked(client: Any, run: str) -> bool:
    with contextlib.suppress(Exception):
        state = client.read_flow_run(UUID(run)).state
        return state is not None and state.name == PARKED
    return False


def _schedule_now(client: Any, run: str) -> None:
    from prefect.states import Scheduled

    with contextlib.suppress(Exception):  # the next round tries again
        client.set_flow_run_state(
            UUID(run), Scheduled(message="admitted by its GPU quota"), force=True
        )


def main(argv: list[str]) -> int:
    from gpuflow.tasks.api_client import api_client

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
