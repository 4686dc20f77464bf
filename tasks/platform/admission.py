"""Admission on the platform's host: every run of a user with a team waits for its GPU
quota's turn before it takes GPUs, and gives borrowed GPUs back when asked.

The platform's quotas are `$GPUFLOW_HOME/platform/quotas.json` (`gpuflow platform quota`);
who holds or waits for GPUs is the ledger `$GPUFLOW_HOME/platform/admission.json`, changed
under a lock by the flow-run processes themselves: each waiting run, every half second,
drops entries whose process is gone, lets `quotas.decide` place every entry and writes the
result. A run learns its own state from it: admitted or borrowing (it goes on), queued
(its position and reason go to its log, its flow run's labels `gpuflow.queue` and
`gpuflow.queue.reason`, and an event), or asked to yield (its stop check stops the job
with its grace; the pipeline gives the GPUs back and the run waits again).

Each decision about a run is a Prefect event `gpuflow.admission.<state>` about the run
(`gpuflow.run.<id>`), with the reason, team, scope and GPUs in its payload.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil

from gpuflow.tasks.api_client import api_client, emit_run_event
from gpuflow.tasks.errors import InvalidSpec, JobCancelled
from gpuflow.tasks.host import alive, make_dirs, read_state_json, write_atomic
from gpuflow.tasks.pipeline.stopping import cancel_requested
from gpuflow.tasks.platform.quotas import ANYWHERE, Entry, Quotas, decide
from gpuflow.tasks.platform.users import UserBook, check_name, owner_of
from gpuflow.tasks.spec import JobSpec

PRIORITY_TAG = "priority:"  # a run's tag priority:N (-100..100), its place in its team's queue
POLL_S = 0.5


def read_quotas(folder: Path, book: UserBook) -> Quotas:
    """Return the platform's quotas (none when it has none) with each user's team."""
    found = read_state_json(folder / "quotas.json") or {}
    teams = {
        str(team): {str(scope): int(n) for scope, n in (quota or {}).items()}
        for team, quota in (found.get("teams") or {}).items()
    }
    caps = {str(user): int(n) for user, n in (found.get("caps") or {}).items()}
    team_of = {u.name: u.team for u in book.users().values() if u.team}
    return Quotas(teams=teams, caps=caps, team_of=team_of)


def set_quota(folder: Path, team: str, gpus: int, scope: str = ANYWHERE) -> None:
    """Set `team`'s nominal quota in `scope` (0 removes it)."""
    check_name(team, "team")
    if gpus < 0:
        raise InvalidSpec(f"--gpus {gpus}: a quota is 0 or more GPUs; 0 removes it.")
    if scope != ANYWHERE and not scope.startswith(("gpu:", "backend:")):
        raise InvalidSpec(
            f"--scope {scope!r}: write * (anywhere), backend:NAME (local, slurm, fleet, ...)"
            " or gpu:PRODUCT (H100, L4, ...)."
        )
    with _changing(folder / "quotas.json") as found:
        teams = found.setdefault("teams", {})
        quota = teams.setdefault(team, {})
        if gpus:
            quota[scope] = gpus
        else:
            quota.pop(scope, None)
        if not quota:
            teams.pop(team)


def set_cap(folder: Path, user: str, gpus: int | None) -> None:
    """Set (or with None remove) `user`'s own GPU cap within its team."""
    check_name(user)
    if gpus is not None and gpus < 0:
        raise InvalidSpec(f"--gpus {gpus}: a cap is 0 or more GPUs; `--none` removes it.")
    with _changing(folder / "quotas.json") as found:
        caps = found.setdefault("caps", {})
        if gpus is None:
            caps.pop(user, None)
        else:
            caps[user] = gpus


@contextlib.contextmanager
def _changing(path: Path) -> Iterator[dict[str, Any]]:
    """Read `path`'s JSON object under its lock, let the caller change it, write it whole."""
    make_dirs(path.parent, private=True)
    descriptor = os.open(
        path.with_name(path.name + ".lock"), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600
    )
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        found = read_state_json(path) or {}
        yield found
        write_atomic(path, json.dumps(found, indent=1, sort_keys=True) + "\n")
    finally:
        os.close(descriptor)


def priority_of(tags: list[str]) -> int:
    for tag in tags:
        if tag.startswith(PRIORITY_TAG):
            with contextlib.suppress(ValueError):
                return max(-100, min(100, int(tag[len(PRIORITY_TAG) :])))
    return 0


class Ledger:
    """Who holds or waits for GPUs, each entry with the process that waits for it."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "admission.json"

    @contextlib.contextmanager
    def changing(self) -> Iterator[list[dict[str, Any]]]:
        """The entries (dicts: an Entry's fields, pid, started), changed in place under
        the lock; entries whose process is gone are dropped first (a parked run's has no
        process: the admitter keeps it while its flow run waits)."""
        with _changing(self.path) as found:
            entries = [
                e
                for e in found.get("entries") or []
                if e.get("pid") is None or alive(e["pid"], e["started"])
            ]
            yield entries
            found["entries"] = entries

    def read(self) -> list[dict[str, Any]]:
        return list((read_state_json(self.path) or {}).get("entries") or [])


def entries_of(rows: list[dict[str, Any]]) -> list[Entry]:
    fields = set(Entry.__dataclass_fields__)
    return [Entry(**{k: v for k, v in row.items() if k in fields}) for row in rows]


class PlatformGate:
    """The pipeline's gate (tasks/pipeline/gate.py) for one run on this platform."""

    def __init__(self, folder: Path, entry: Entry, say: Callable[[str], None]) -> None:
        self.folder, self.entry, self.say = folder, entry, say
        self.ledger = Ledger(folder)
        self.book = UserBook(folder / "users.json")
        self.me = {"pid": os.getpid(), "started": psutil.Process().create_time()}
        self._said: tuple[str, int, str] | None = None
        self._checked = (0.0, False)

    def _decide(self, park: bool = False) -> Entry:
        """Place every entry (this run's added, or claimed by this process, first);
        return this run's. With `park`, a run left waiting is parked: no process of its
        own holds it (the admitter starts it again once admitted)."""
        quotas = read_quotas(self.folder, self.book)
        with self.ledger.changing() as rows:
            found = [row for row in rows if row["run"] == self.entry.run]
            if found:
                found[0].update(self.me)
            else:
                rows.append({**asdict(self.entry), **self.me})
            extra = {row["run"]: {"pid": row["pid"], "started": row["started"]} for row in rows}
            decided = decide(entries_of(rows), quotas)
            mine = next(e for e in decided if e.run == self.entry.run)
            if park and mine.state == "queued" and not mine.reclaiming:
                extra[mine.run] = {"pid": None, "started": None}
            rows[:] = [{**asdict(e), **extra[e.run]} for e in decided]
        return mine

    def admit_or_park(self, can_park: bool) -> None:
        """Return once the run is admitted; a run that must wait and can be started again
        by its worker is parked instead: its flow run goes back to Scheduled
        (AwaitingQuota) and this process ends (prefect's Abort), holding no worker slot
        while it waits. Without `can_park` it waits here."""
        mine = self._decide(park=can_park)
        self._tell(mine)
        if mine.state in ("admitted", "borrowed"):
            return
        if not can_park or mine.reclaiming:  # GPUs on their way back: seconds, not a queue
            self.wait(cancel_requested(self.entry.run))
            return
        park(self.entry.run, mine)

    def wait(self, stop: Callable[[], bool]) -> None:
        """Return once admitted, deciding every half second (the run's process waits:
        a run given back its GPUs, or one its worker cannot start again)."""
        while True:
            mine = self._decide()
            self._tell(mine)
            if mine.state in ("admitted", "borrowed", "yield"):
                return
            if stop():
                self.release()
                raise JobCancelled("cancelled while it waited for GPU quota")
            time.sleep(POLL_S)

    def must_yield(self) -> bool:
        at, said = self._checked
        if time.monotonic() - at < POLL_S:
            return said
        with contextlib.suppress(OSError, ValueError, TypeError):
            mine = [e for e in entries_of(self.ledger.read()) if e.run == self.entry.run]
            said = bool(mine) and mine[0].state == "yield"
            if said:
                self._tell(mine[0])  # once: the event and the log line of the request
        self._checked = (time.monotonic(), said)
        return said

    def requeue(self) -> None:
        with self.ledger.changing() as rows:
            for row in rows:
                if row["run"] == self.entry.run:
                    row["state"] = "queued"
        self._checked = (0.0, False)

    def release(self) -> None:
        with self.ledger.changing() as rows:
            rows[:] = [row for row in rows if row["run"] != self.entry.run]

    def _tell(self, mine: Entry) -> None:
        said = (mine.state, mine.position, mine.reason)
        if said == self._said:
            return
        self._said = said
        e = mine
        where = "anywhere" if e.scope == ANYWHERE else e.scope
        if e.state == "queued":
            self.say(f"queued ({e.position} in line) for {e.gpus} GPUs {where}: {e.reason}")
        else:
            self.say(f"{e.state} for {e.gpus} GPUs {where}: {e.reason}")
        payload = {"reason": e.reason, "team": e.team, "scope": e.scope, "gpus": e.gpus}
        payload |= {"position": e.position, "user": e.user}
        emit_run_event(
            f"gpuflow.admission.{e.state}", f"gpuflow.run.{e.run}", e.run, e.run, payload
        )
        _label(e)


PARKED = "AwaitingQuota"


def park(run_id: str, mine: Entry) -> None:
    """Put the run back to Scheduled (AwaitingQuota, far ahead) and end this process
    quietly: the admitter schedules it again when the queue admits it."""
    from prefect.exceptions import Abort
    from prefect.states import Scheduled

    later = datetime.now(UTC) + timedelta(days=365)
    state: Any = Scheduled(scheduled_time=later, name=PARKED, message=mine.reason)
    with api_client() as client:
        client.set_flow_run_state(UUID(run_id), state, force=True)
    raise Abort(f"parked until its GPU quota admits it ({mine.position} in line)")


def _label(entry: Entry) -> None:
    """Put the run's place in line on its flow run's labels (what `gpuflow ls` and the UI
    show); a label that cannot be written is no reason to stop."""
    labels: dict[str, Any] = {
        "gpuflow.queue": entry.position if entry.state == "queued" else 0,
        "gpuflow.queue.reason": entry.reason if entry.state == "queued" else entry.state,
    }
    with contextlib.suppress(Exception), api_client() as client:
        client.update_flow_run_labels(UUID(entry.run), labels)


def gate_for(
    spec: JobSpec, run_id: str, tags: list[str], folder: Path, say: Callable[[str], None]
) -> PlatformGate | None:
    """Return the gate of a run on this platform whose owner belongs to a team, when the
    platform has quotas and the run asks for GPUs; None otherwise (it is not gated)."""
    owner = owner_of(tags)
    gpus = spec.resources.gpus * spec.resources.nodes
    if owner is None or gpus == 0 or not (folder / "quotas.json").is_file():
        return None
    book = UserBook(folder / "users.json")
    quotas = read_quotas(folder, book)
    team = quotas.team_of.get(owner)
    if team is None or not quotas.teams:
        return None
    places = list(spec.candidates) or [spec.placement]
    backend = places[0].backend if len({p.backend for p in places}) == 1 else None
    scope = quotas.scope_for(team, spec.resources.gpu_product, backend)
    entry = Entry(run_id, owner, team, gpus, scope, time.time(), priority_of(tags))
    return PlatformGate(folder, entry, say)
