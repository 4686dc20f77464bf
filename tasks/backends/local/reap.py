"""The local backend's reaper: clusters on this host whose gpuflow process died, found
from the backend's records on disk, and state it was half-way through writing."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuflow.tasks.backends.local import cgroups
from gpuflow.tasks.contract import OWNER_LABEL, RUN_LABEL, ReapReport
from gpuflow.tasks.host import alive

if TYPE_CHECKING:
    from gpuflow.tasks.backends.local.backend import LocalBackend


def reap(backend: LocalBackend, dry_run: bool, say: Callable[[str], None]) -> ReapReport:
    """Tear down clusters whose gpuflow process died; return the count and their runs (to
    be marked Crashed). Without `dry_run`, also remove half-written state files and empty
    cgroups."""
    done = ReapReport(counts={"clusters": 0, "files": 0})
    for cluster in backend.list_owned({OWNER_LABEL: "gpuflow"}):
        owner = backend.record_of(cluster)
        if owner.orchestrator_pid and alive(owner.orchestrator_pid, owner.orchestrator_started):
            continue  # its run is still going
        say(f"{'would reap' if dry_run else 'reaping'} {cluster.name} ({cluster.workspace})")
        done.counts["clusters"] += 1
        if not dry_run:
            report = backend.teardown(cluster)
            say(f"  {report.model_dump_json()}")
        done.crashed.append((cluster.owner[RUN_LABEL], owner.api_url))
    if dry_run:
        return done
    swept = backend.sweep_partial_writes()
    for path in swept:
        say(f"removed {path} (half-written by a process that died)")
    done.counts["files"] = len(swept)
    for path in cgroups.sweep_empty():
        say(f"removed the empty cgroup {path}")
    return done
