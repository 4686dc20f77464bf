"""The reaper: what killed or finished gpuflow runs left, asked of each backend's own
reaper (tasks/backends/*/reap.py), plus what gpuflow itself leaves on this host.

Each backend tears down what runs that are over left; flow runs whose gpuflow died, still
Running in the API, are marked Crashed here; temporary Prefect servers whose gpuflow died
are stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from gpuflow.tasks.backends.registry import reaper
from gpuflow.tasks.host import (
    StateFileError,
    gpuflow_home,
    open_private,
    private_dir,
    read_private,
    read_state_json,
    write_atomic,
)
from gpuflow.tasks.pipeline import inflight
from gpuflow.tasks.pipeline.stages import keep_run_outputs, teardown_owned
from gpuflow.tasks.pipeline.usercode import archives
from gpuflow.tasks.platform import api as prefect_api
from gpuflow.tasks.platform.state import read_state
from gpuflow.tasks.ssh import sweep_keys
from gpuflow.tasks.workdir import PACKING

CRASHED_MESSAGE = "its gpuflow process was killed; `gpuflow reap` tore down what it left"
OUTAGE_MESSAGE = (
    "the Prefect API stopped answering during the run; gpuflow tore the run down and"
    " marked it Crashed once the API was back"
)
# Runs whose end the API never heard (it was away): marked Crashed once it answers again.
UNREPORTED_DAYS = 30


def unreported_dir() -> Path:
    return gpuflow_home() / "unreported"


def record_unreported(run_id: str, api_url: str, why: str) -> Path:
    """Remember a run whose end could not be told to the API at `api_url`."""
    path = unreported_dir() / f"{run_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    at = datetime.now(UTC).isoformat()
    write_atomic(path, json.dumps({"run_id": run_id, "api_url": api_url, "why": why, "at": at}))
    return path


def spill_logs(run_id: str, api_url: str, bodies: list[bytes]) -> Path:
    """Keep logs (LogCreate JSON, one per line) the API at `api_url` has not taken for
    run `run_id`, for `deliver_unreported`."""
    path = unreported_dir() / f"{run_id}.logs.jsonl"
    private_dir(path.parent)
    with open_private(path) as out:
        if out.tell() == 0:
            out.write(json.dumps({"api_url": api_url}).encode() + b"\n")
        out.write(b"".join(body + b"\n" for body in bodies))
    return path


def _deliver_logs(path: Path, urls: list[str], say: Callable[[str], None]) -> None:
    """Post the kept logs in `path` to the first API that answers, then remove the file."""

    from gpuflow.tasks.api_client import api_client

    try:
        header, *bodies = read_private(path, limit=1 << 30).encode().splitlines()
        recorded = json.loads(header)["api_url"]
    except (OSError, ValueError, KeyError, TypeError, StateFileError):
        path.unlink(missing_ok=True)
        return
    for url in dict.fromkeys([recorded, *urls]):
        if not url or prefect_api.health_error(url, timeout_s=3):
            continue
        try:
            with prefect_api.talking_to(url), api_client() as client:
                for start in range(0, len(bodies), 2000):
                    client.request(
                        "POST",
                        "/logs/",
                        content=b"[" + b",".join(bodies[start : start + 2000]) + b"]",
                        headers={"Content-Type": "application/json"},
                    ).raise_for_status()
        except Exception:  # not this API: try the next one
            continue
        run_id = path.name.removesuffix(".logs.jsonl")
        say(f"flow run {run_id}: {len(bodies)} log lines kept during an API outage delivered")
        path.unlink(missing_ok=True)
        return
    if time.time() - path.stat().st_mtime > UNREPORTED_DAYS * 86400:
        path.unlink(missing_ok=True)  # its API never came back


def deliver_unreported(say: Callable[[str], None], current_url: str | None = None) -> int:
    """Deliver the logs an API outage kept, and mark Crashed every remembered run whose API
    answers again: the one it was recorded in, else `current_url` (a new temporary API keeps
    its runs in the same database); return how many were marked. Quiet when there is nothing
    to do."""
    folder = unreported_dir()
    if not folder.is_dir():
        return 0
    urls = [current_url or "", os_api_url()]
    for path in sorted(folder.glob("*.logs.jsonl")):
        _deliver_logs(path, urls, say)
    marked = 0
    for path in sorted(folder.glob("*.json")):
        try:
            record = read_state_json(path)
        except StateFileError:
            record = None  # not a file gpuflow wrote: never read, never waited on
        if record is None or not isinstance(record.get("api_url"), str):
            path.unlink(missing_ok=True)
            continue
        for url in dict.fromkeys([record["api_url"], *urls]):
            if not url or prefect_api.health_error(url, timeout_s=3):
                continue
            try:
                crashed = _crash(record["run_id"], url, OUTAGE_MESSAGE)
            except Exception:  # not a run this API knows: try the next one
                continue
            if crashed:
                say(f"flow run {record['run_id']} marked Crashed: {record['why']}")
                marked += 1
            path.unlink(missing_ok=True)
            break
        else:
            if time.time() - path.stat().st_mtime > UNREPORTED_DAYS * 86400:
                path.unlink(missing_ok=True)  # its API never came back
    return marked


def keep_orphans(
    dry_run: bool, say: Callable[[str], None]
) -> tuple[list[tuple[str, str | None]], int]:
    """Find the runs whose gpuflow died at any stage (by their in-flight records, made
    before anything was packed or provisioned): keep what each job wrote (its outputs, a
    checkpoint) in the run's artifacts while its workspace still stands, remove what the
    dead process half-wrote (a folder being packed, its SSH key folder); return the runs
    to mark Crashed and how many files were removed."""
    crashed: list[tuple[str, str | None]] = []
    removed = 0
    for path, run in inflight.orphans():
        if dry_run:
            say(f"would keep what flow run {run.run_id} wrote in {run.artifacts} (its gpuflow,"
                f" pid {run.pid}, is gone)")  # fmt: skip
            continue
        removed += _keep_orphan(path, run, say)
        crashed.append((run.run_id, run.api_url))
    if not dry_run:
        for folder in sweep_keys():
            say(f"removed {folder} (the SSH key folder of a process that died)")
            removed += 1
    return crashed, removed


def _keep_orphan(path: Path, run: inflight.InFlight, say: Callable[[str], None]) -> int:
    """Keep what the orphaned `run`'s job wrote, remove its half-packed archive and its
    record; return how many files were removed."""
    started = time.monotonic()
    artifacts = Path(run.artifacts)
    for line in keep_run_outputs(run.placements, run.run_id, artifacts, run.secret_env):
        say(f"flow run {run.run_id}: {line} (in {time.monotonic() - started:.1f} s)")
    removed = 0
    for half in archives().glob(f"{PACKING}{run.pid}-*"):
        half.unlink(missing_ok=True)
        say(f"removed {half} (half-written by a process that died)")
        removed += 1
    path.unlink(missing_ok=True)
    return removed


def end_orphan(run_id: str, say: Callable[[str], None]) -> inflight.InFlight | None:
    """When the gpuflow that ran `run_id` on this machine is gone (its in-flight record
    says so), keep what its job wrote, tear down what it left and return its record: a
    cancel then ends the run at once instead of waiting on a process that cannot answer.
    None when no such record is here (the run is alive, or ran elsewhere)."""
    for path, run in inflight.orphans():
        if run.run_id != run_id:
            continue
        _keep_orphan(path, run, say)
        for where in run.placements:
            try:
                teardown_owned(where, run_id)
            except Exception as exc:  # its service is away: `gpuflow reap` tries again
                say(f"flow run {run_id}: not torn down on {where.backend}: {exc}")
        return run
    return None


def os_api_url() -> str:
    """Return the API this process would use: PREFECT_API_URL, else the local platform's."""
    state = read_state()
    return os.environ.get("PREFECT_API_URL") or (state or {}).get("api") or ""


class PrefectRuns:
    """How runs stand in the Prefect API each was recorded in (the reapers' RunStates)."""

    def state(self, run_id: str, api_url: str | None) -> str:
        return _run_states([run_id], api_url)[run_id]

    def states(self, runs: Sequence[tuple[str, str | None]]) -> dict[tuple[str, str | None], str]:
        by_api: dict[str | None, list[str]] = {}
        for run_id, url in dict.fromkeys(runs):
            by_api.setdefault(url, []).append(run_id)
        found: dict[tuple[str, str | None], str] = {}
        for url, run_ids in by_api.items():
            answers = _run_states(run_ids, url)
            found |= {(run_id, url): answers[run_id] for run_id in run_ids}
        return found


def reap(
    dry_run: bool,
    say: Callable[[str], None] = print,
    backend: str = "local",
    block: str | None = None,
    namespace: str | None = None,
) -> dict[str, Any]:
    """Remove what gpuflow runs left on `backend` once their flow run is over (finished,
    cancelled, crashed or unknown to the API it was recorded in) or their gpuflow, which
    ran on this host, is dead (its run is then marked Crashed); runs still going, and runs
    whose API does not answer, are left as they are. `block`: the SlurmCluster (its login
    node) or the Ec2GpuFleet asked; `namespace`: the Kubernetes namespace. On this host,
    also the temporary Prefect APIs killed gpuflows left. Return counts of what was (or,
    with `dry_run`, would be) done; EC2 adds what its instances cost an hour."""
    asked = reaper(backend, block, namespace)  # a wrong name or a missing --block: first
    orphans, half_written = keep_orphans(dry_run, say)  # before any backend tears down
    found = asked.reap(dry_run, say, PrefectRuns())
    found.crashed = list(dict.fromkeys([*orphans, *found.crashed]))
    done: dict[str, Any] = {"clusters": 0, "flow_runs_crashed": 0, "servers": 0, "files": 0}
    done |= {k: v if k.endswith("_usd") else int(v) for k, v in found.counts.items()}
    done["files"] += half_written
    servers = prefect_api.leftover_servers() if backend == "local" else []
    for record in servers:
        say(
            f"{'would stop' if dry_run else 'stopping'} the temporary Prefect API at"
            f" {record['api']} (pid {record['pid']}) that a killed gpuflow left"
        )
    if dry_run:
        done["servers"] = len(servers)
        return done
    done["flow_runs_crashed"] = _mark_crashed(found.crashed, say)
    done["flow_runs_crashed"] += deliver_unreported(lambda line: say(f"  {line}"))
    for record in servers:
        done["servers"] += prefect_api.stop_server(record)
    return done


def _run_states(run_ids: list[str], url: str | None, page: int = 200) -> dict[str, str]:
    """Return for each run "running", "away" (the API does not answer), "unknown" to the
    API, or its final state's name in lower case: one health check, one read per `page`."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from gpuflow.tasks.api_client import api_client

    if url and prefect_api.health_error(url, timeout_s=5):
        return dict.fromkeys(run_ids, "away")
    answers = dict.fromkeys(run_ids, "unknown")
    ids: dict[UUID, str] = {}
    for run_id in run_ids:
        with contextlib.suppress(ValueError):  # not a run id: unknown to every API
            ids[UUID(run_id)] = run_id
    wanted = list(ids)
    with (
        prefect_api.talking_to(url) if url else contextlib.nullcontext(),
        api_client() as client,
    ):
        for start in range(0, len(wanted), page):
            chunk = wanted[start : start + page]
            flow_runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=chunk)), limit=page
            )
            for flow_run in flow_runs:
                state = flow_run.state
                final = state is not None and state.is_final()
                answers[ids[flow_run.id]] = state.name.lower() if final else "running"
    return answers


def _mark_crashed(runs: list[tuple[str, str | None]], say: Callable[[str], None]) -> int:
    """Mark each flow run Crashed in the API it was recorded in, unless it already ended;
    an API that does not answer is named, and the run left as it is."""
    marked = 0
    here = os.environ.get("PREFECT_API_URL", "")
    started: list[Any] = []  # a temporary API chosen here: done with at the end
    for run_id, url in runs:
        if not url:
            continue
        problem = prefect_api.health_error(url, timeout_s=5)
        if problem and not here and prefect_api.loopback_temporary(url):
            with contextlib.suppress(Exception):  # none can start: the run is named below
                started.append(prefect_api.choose(lambda _: None))
                here = started[-1].url
        if problem and here and here != url:
            # a temporary API that died: the one this command uses keeps its runs in the
            # same database (the same PREFECT_HOME), and finds the run there
            with contextlib.suppress(Exception):
                if _crash(run_id, here):
                    say(f"  flow run {run_id} marked Crashed (through {here}: {url} is gone)")
                    marked += 1
                continue
        if problem:
            say(f"  flow run {run_id} not marked Crashed: the API at {url} is away ({problem})")
            continue
        if _crash(run_id, url):
            say(f"  flow run {run_id} marked Crashed")
            marked += 1
    for api in started:
        prefect_api.done_with(api)
    return marked


def _crash(run_id: str, url: str, message: str = CRASHED_MESSAGE) -> bool:
    from prefect.states import Crashed

    from gpuflow.tasks.api_client import api_client

    with prefect_api.talking_to(url), api_client() as client:
        state = client.read_flow_run(UUID(run_id)).state
        if state is not None and state.is_final():
            return False
        client.set_flow_run_state(UUID(run_id), Crashed(message=message), force=True)
        return True
