"""The Kubernetes backend's reaper: the objects of runs that are over, or whose gpuflow
died on this host, found by their owner labels."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from gpuflow.tasks.backends.kubernetes import serving
from gpuflow.tasks.backends.kubernetes.state import KubeState
from gpuflow.tasks.contract import OWNER_LABEL, RUN_LABEL, Cluster, ReapReport, RunStates, state_of

if TYPE_CHECKING:
    from gpuflow.tasks.backends.kubernetes.backend import KubernetesBackend

CHUNK = 100  # clusters a request to delete (a label selector of about 5 KB)


def reap(
    backend: KubernetesBackend, dry_run: bool, say: Callable[[str], None], runs: RunStates
) -> ReapReport:
    """Delete the objects of runs that are over: their flow run is finished, cancelled,
    crashed or unknown to the API it was recorded in, their gpuflow ran on this host and
    is dead, or their service (a Deployment and its HPA, which scale without gpuflow)
    is past the run's deadline (the run is then marked Crashed). Runs still going are
    left alone; an API that does not answer is named and its runs are left as they are."""
    done = ReapReport(counts={"clusters": 0})
    clusters = backend.list_owned({OWNER_LABEL: "gpuflow"})
    asked = {c.name: (c.owner.get(RUN_LABEL, ""), state_of(c, KubeState).api_url) for c in clusters}
    states = runs.states(list(asked.values()))  # one read per API, not one per run
    over: list[Cluster] = []
    late = {
        name
        for name, deadline in serving.deadlines(backend.api()).items()
        if deadline < datetime.now(UTC)
    }
    for cluster in clusters:
        run_id, url = asked[cluster.name]
        dead_here = state_of(cluster, KubeState).orchestrator.dead_here() or cluster.name in late
        state = states[run_id, url]
        if state == "away" and not dead_here:
            say(f"{cluster.name}: left as it is; the API at {url} that records its run is away")
            continue
        if state == "running" and not dead_here:
            continue  # its run is still going
        why = f"its flow run is {state}"
        if state in ("running", "away"):
            why = "its gpuflow died" + (f"; the API at {url} is away" if state == "away" else "")
            if cluster.name in late:
                why = "its service is past the run's deadline (limits.max_duration)"
        say(f"{'would delete' if dry_run else 'deleting'} {cluster.name} ({why})")
        done.counts["clusters"] += 1
        over.append(cluster)
        if state == "running" and not dry_run:
            done.crashed.append((run_id, url))
    if not dry_run and over:
        chunks = [over[start : start + CHUNK] for start in range(0, len(over), CHUNK)]
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="reap") as pool:
            list(pool.map(backend.teardown_all, chunks))  # a collection at a time
    return done
