"""gpuflow's runs as a person follows them from a terminal, on whichever API the command
uses: the recent ones (`listed`), one named by its job name, flow-run name, id or an id
prefix (`find`), its log as it grows (`log_lines`), and a cancel that lets the run's own
teardown run (`cancel`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from gpuflow.tasks.api_client import api_client
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.platform.users import owner_of, owner_tag

RECENT = 200  # the runs a name or prefix is looked for among, newest first


class RunRow(BaseModel):
    """One run as `gpuflow ls` shows it."""

    id: str
    job: str  # the spec's name; the flow run's name for runs without a spec
    flow_run: str
    state: str
    backend: str = ""
    host: str = ""  # where it ran, once collected (the metrics table says)
    gpus: int | None = None
    started: datetime | None = None
    duration_s: float | None = None
    cost_usd: float | None = None
    final: bool = False
    owner: str = ""  # the user who made it, on a shared platform ("": the platform's own)
    queued: int = 0  # its place in line for its team's GPU quota (0: not waiting)
    queue_reason: str = ""
    short: str = ""  # the shortest start of its id (8 or more) no other recent run shares


def _spec_of(run: Any) -> dict[str, Any]:
    spec = (run.parameters or {}).get("spec")
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            return {}
    return spec if isinstance(spec, dict) else {}


def _row(run: Any, collected: dict[str, Any] | None = None) -> RunRow:
    spec = _spec_of(run)
    placement = spec.get("placement") or {}
    if isinstance(placement, list):
        placement = placement[0] if placement else {}
    resources = spec.get("resources") or {}
    gpus = resources.get("gpus")
    state = run.state
    final = bool(state is not None and state.is_final())
    duration = None
    if run.start_time is not None:
        end = run.end_time if final and run.end_time else datetime.now(UTC)
        duration = max(0.0, (end - run.start_time).total_seconds())
    return RunRow(
        id=str(run.id),
        job=str(spec.get("name") or run.name),
        flow_run=run.name,
        state=state.name if state is not None else "Unknown",
        backend=str(placement.get("backend") or ("local" if spec else "")),
        gpus=gpus * int(resources.get("nodes") or 1) if isinstance(gpus, int) else None,
        started=run.start_time or run.expected_start_time,
        duration_s=duration,
        cost_usd=(collected or {}).get("cost_usd"),
        host=str((collected or {}).get("run.host") or ""),
        final=final,
        owner=owner_of(list(run.tags or [])) or "",
        **_queue(run, final),
    )


def _queue(run: Any, final: bool) -> dict[str, Any]:
    """Return a waiting run's place in line and why (its labels, tasks/platform/admission.py)."""
    labels = run.labels or {}
    place = labels.get("gpuflow.queue")
    if final or not isinstance(place, int) or place <= 0:
        return {}
    return {"queued": place, "queue_reason": str(labels.get("gpuflow.queue.reason") or "")}


def _recent(client: Any, limit: int, owner: str | None = None) -> list[Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    only = FlowRunFilter(tags=FlowRunFilterTags(all_=[owner_tag(owner)])) if owner else None
    return list(
        client.read_flow_runs(flow_run_filter=only, sort=FlowRunSort.START_TIME_DESC, limit=limit)
    )


def _collected(client: Any, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Return what each run's metrics table says of its cost (`cost_usd`, a number) and
    where it ran (`run.host`); runs without one: absent."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
    )

    if not run_ids:
        return {}
    found = client.read_artifacts(
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["gpuflow-metrics"])),
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(i) for i in run_ids])),
    )
    collected: dict[str, dict[str, Any]] = {}
    for artifact in found:
        rows = artifact.data if isinstance(artifact.data, list) else _json(artifact.data)
        said = collected.setdefault(str(artifact.flow_run_id), {})
        for row in rows or []:
            if not isinstance(row, dict):
                continue
            if row.get("metric") == "cost_usd":
                said.setdefault("cost_usd", float(row["value"]))
            elif row.get("metric") == "run.host":
                said.setdefault("run.host", str(row["value"]))
    return collected


def _json(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None


def listed(limit: int = 20, owner: str | None = None) -> list[RunRow]:
    """Return the newest `limit` runs (of user `owner` only, when given), newest first,
    with what each cost and where it ran where its metrics say."""
    with api_client() as client:
        recent = _recent(client, max(limit, RECENT))
        runs = _recent(client, limit, owner) if owner else recent[:limit]
        collected = _collected(client, [str(r.id) for r in runs])
    ids = [str(r.id) for r in recent]  # what `find` looks among: the shown start resolves
    return [
        _row(run, collected.get(str(run.id))).model_copy(
            update={"short": short_id(str(run.id), ids)}
        )
        for run in runs
    ]


def short_id(run_id: str, ids: list[str], least: int = 8) -> str:
    """Return the shortest start of `run_id` (at least `least` characters) that no other
    of `ids` begins with: runs made in the same minute share their first 8 (a UUIDv7
    begins with its time)."""
    others = [i for i in ids if i != run_id]
    for length in range(least, len(run_id) + 1):
        start = run_id[:length]
        if not start.endswith("-") and not any(i.startswith(start) for i in others):
            return start
    return run_id


def find(name: str) -> RunRow:
    """Return the run `name` names: its id, its flow run's name, its job's name (the
    newest run of that job), or the first characters of its id; InvalidSpec, one
    sentence, for none, or for a prefix that two runs' ids share."""
    with api_client() as client:
        try:
            exact = client.read_flow_run(UUID(name))
        except ValueError:
            exact = None  # not an id
        except Exception:
            exact = None
        if exact is not None:
            return _row(exact)
        runs = _recent(client, RECENT)
    by_run_name = [r for r in runs if r.name == name]
    if by_run_name:
        return _row(by_run_name[0])
    by_job = [r for r in runs if _spec_of(r).get("name") == name]
    if by_job:
        return _row(by_job[0])  # the newest run of that job
    lowered = name.lower()
    if lowered and all(c in "0123456789abcdef-" for c in lowered):
        prefixed = [r for r in runs if str(r.id).startswith(lowered)]
        if len(prefixed) > 1:
            shown = ", ".join(f"{str(r.id)[:12]} ({r.name})" for r in prefixed[:5])
            raise InvalidSpec(
                f"RUN: {name!r} begins the ids of {len(prefixed)} runs: {shown}; give more of"
                " the id (gpuflow ls shows them)."
            )
        if prefixed:
            return _row(prefixed[0])
    raise InvalidSpec(
        f"RUN: no run is named {name!r} among the {len(runs)} newest on this API (a job's"
        " name, a flow run's name, an id or the first characters of one); gpuflow ls lists"
        " them."
    )


def log_lines(
    run_id: str, follow: bool = False, poll_s: float = 1.0, stop: Callable[[], bool] | None = None
) -> Iterator[str]:
    """Yield the run's log lines in order; with `follow`, wait for new ones until the run
    is over (then the last ones: its lines reach the API in batches after its state, so
    they are read until the flow's own "Finished in state" line came, for at most
    LAST_LINES_S) or `stop()` says so."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    seen: set[str] = set()
    offset = 0
    ended_at: float | None = None
    finished = False
    while True:
        with api_client() as client:
            run = client.read_flow_run(UUID(run_id))
            over = run.state is None or run.state.is_final()
            while True:
                page = client.read_logs(
                    log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)])),
                    sort=LogSort.TIMESTAMP_ASC,
                    limit=200,
                    offset=offset,
                )
                for log in page:
                    if str(log.id) in seen:
                        continue
                    seen.add(str(log.id))
                    finished |= log.task_run_id is None and log.message.startswith(FINISHED)
                    yield _line(log)
                offset += len(page)
                if len(page) < 200:
                    break
        if not follow or (stop is not None and stop()):
            return
        if over:
            ended_at = ended_at or time.monotonic()
            if finished or run.state is None or time.monotonic() - ended_at > LAST_LINES_S:
                return
        time.sleep(poll_s)


FINISHED = "Finished in state"  # the flow engine's last line of a run
LAST_LINES_S = 10.0  # how long a run that is over is read for its last lines


def _line(log: Any) -> str:
    when = log.timestamp.astimezone().strftime("%H:%M:%S")
    level = "" if log.level <= 20 else f"{_LEVELS.get(log.level, log.level)} "
    return f"{when} {level}{log.message}"


_LEVELS = {30: "WARNING", 40: "ERROR", 50: "CRITICAL"}


def cancel(run: RunRow, wait_s: float = 120.0, poll_s: float = 0.5) -> str:
    """Ask the API to cancel `run` (as the UI's Cancel does: the run stops its job, and
    its teardown runs) and wait up to `wait_s` for it to end; return how it ended, in a
    sentence. InvalidSpec for a run that is already over."""
    from prefect.states import Cancelling

    if run.final:
        raise InvalidSpec(
            f"RUN: {run.job} ({run.flow_run}, {run.id[:8]}) is already {run.state.lower()};"
            " there is nothing to cancel."
        )
    from gpuflow.tasks.platform.reap import end_orphan

    said: list[str] = []
    if (orphan := end_orphan(run.id, said.append)) is not None:  # its gpuflow is gone
        from prefect.states import Cancelled

        with api_client() as client:
            message = f"cancelled after its gpuflow (pid {orphan.pid}) had died"
            client.set_flow_run_state(UUID(run.id), Cancelled(message=message), force=True)
        kept = "".join(f"; {line}" for line in said)
        return (
            f"{run.job} ({run.flow_run}, {run.id[:8]}) is cancelled: its gpuflow (pid"
            f" {orphan.pid}) had died, so what it left was torn down here{kept}."
        )
    with api_client() as client:
        client.set_flow_run_state(UUID(run.id), Cancelling(), force=True)
        until = time.monotonic() + wait_s
        while time.monotonic() < until:
            state = client.read_flow_run(UUID(run.id)).state
            if state is not None and state.is_final():
                return (
                    f"{run.job} ({run.flow_run}, {run.id[:8]}) is {state.name.lower()}:"
                    " its job was stopped and torn down."
                )
            time.sleep(poll_s)
    return (
        f"{run.job} ({run.flow_run}, {run.id[:8]}) was asked to cancel, but has not ended within"
        f" {wait_s:.0f} s: the process that runs it may be gone; `gpuflow reap` removes"
        " what a dead run left."
    )
