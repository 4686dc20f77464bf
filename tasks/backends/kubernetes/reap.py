"""The Kubernetes backend's reaper: the objects of runs that are over, or whose gpuflow
died on this host, found by their owner labels."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tasks.backends.kubernetes.state import KubeState
from tasks.contract import OWNER_LABEL, RUN_LABEL, ReapReport, RunStates, state_of

if TYPE_CHECKING:
    from tasks.backends.kubernetes.backend import KubernetesBackend


def reap(
    backend: KubernetesBackend, dry_run: bool, say: Callable[[str], None], runs: RunStates
) -> ReapReport:
    """Delete the objects of runs that are over: their flow run is finished, cancelled,
    crashed or unknown to the API it was recorded in, or their gpuflow ran on this host
    and is dead (its run is then marked Crashed). Runs still going are left alone; an API
    that does not answer is named and its runs are left as they are."""
    done = ReapReport(counts={"clusters": 0})
    lock = threading.Lock()

    def one(cluster: Any) -> None:
        kube = state_of(cluster, KubeState)
        run_id, url = cluster.owner.get(RUN_LABEL, ""), kube.api_url
        dead_here = kube.orchestrator.dead_here()
        state = runs.state(run_id, url)
        if state == "away" and not dead_here:
            say(f"{cluster.name}: left as it is; the API at {url} that records its run is away")
            return
        if state == "running" and not dead_here:
            return  # its run is still going
        why = f"its flow run is {state}"
        if state in ("running", "away"):
            why = "its gpuflow died" + (f"; the API at {url} is away" if state == "away" else "")
        say(f"{'would delete' if dry_run else 'deleting'} {cluster.name} ({why})")
        if not dry_run:
            backend.teardown(cluster)
        with lock:
            done.counts["clusters"] += 1
            if state == "running" and not dry_run:
                done.crashed.append((run_id, url))

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="reap") as pool:
        list(pool.map(one, backend.list_owned({OWNER_LABEL: "gpuflow"})))
    return done
