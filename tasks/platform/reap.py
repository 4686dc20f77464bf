"""The reaper: what a killed gpuflow left on this host, found from its records on disk.

Clusters whose orchestrator is gone are torn down; their flow runs, still Running in the
API, are marked Crashed; temporary Prefect servers whose gpuflow died are stopped; state
files half-written by a dead process are removed.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any
from uuid import UUID

from tasks.compute import cgroups
from tasks.compute.base import OWNER_LABEL, RUN_LABEL
from tasks.compute.local import LocalBackend, alive
from tasks.platform import api as prefect_api

CRASHED_MESSAGE = "its gpuflow process was killed; `gpuflow reap` tore down what it left"


def reap(dry_run: bool, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Reap what dead gpuflow processes left; return counts of what was (or would be) done."""
    backend = LocalBackend()
    done: dict[str, Any] = {"clusters": 0, "flow_runs_crashed": 0, "servers": 0, "files": 0}
    runs: list[tuple[str, str | None]] = []  # (flow run id, the API it was recorded in)
    for cluster in backend.list_owned({OWNER_LABEL: "gpuflow"}):
        owner = backend.orchestrator(cluster)
        if owner["orchestrator_pid"] and alive(
            owner["orchestrator_pid"], owner["orchestrator_started"]
        ):
            continue  # its run is still going
        say(f"{'would reap' if dry_run else 'reaping'} {cluster.name} ({cluster.workspace})")
        done["clusters"] += 1
        if not dry_run:
            report = backend.teardown(cluster)
            say(f"  {report.model_dump_json()}")
        runs.append((cluster.owner[RUN_LABEL], owner["api_url"]))
    servers = prefect_api.leftover_servers()
    for record in servers:
        say(
            f"{'would stop' if dry_run else 'stopping'} the temporary Prefect API at"
            f" {record['api']} (pid {record['pid']}) that a killed gpuflow left"
        )
    if dry_run:
        done["servers"] = len(servers)
        return done
    done["flow_runs_crashed"] = _mark_crashed(runs, say)
    for record in servers:
        done["servers"] += prefect_api.stop_server(record)
    swept = backend.sweep_partial_writes()
    for path in swept:
        say(f"removed {path} (half-written by a process that died)")
    done["files"] = len(swept)
    for path in cgroups.sweep_empty():
        say(f"removed the empty cgroup {path}")
    return done


def reap_kubernetes(
    dry_run: bool, namespace: str | None = None, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Delete the objects of runs that are over: their flow run is finished, cancelled,
    crashed or unknown to the API it was recorded in, or their gpuflow ran on this host
    and is dead (its run is then marked Crashed). Runs still going are left alone; an API
    that does not answer is named and its runs are left as they are."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from tasks.compute.kubernetes import KubernetesBackend

    backend = KubernetesBackend(namespace=namespace)
    done: dict[str, Any] = {"clusters": 0, "flow_runs_crashed": 0, "servers": 0, "files": 0}
    crashed: list[tuple[str, str | None]] = []
    lock = threading.Lock()

    def one(cluster: Any) -> None:
        run_id, url = cluster.owner.get(RUN_LABEL, ""), cluster.backend_config.get("api_url")
        owner = json.loads(cluster.backend_config.get("orchestrator") or "{}")
        dead_here = owner.get("host") == socket.gethostname() and not alive(
            owner.get("pid", 0), owner.get("started")
        )
        state = _run_state(run_id, url)
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
            done["clusters"] += 1
            if state == "running" and not dry_run:
                crashed.append((run_id, url))

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="reap") as pool:
        list(pool.map(one, backend.list_owned({OWNER_LABEL: "gpuflow"})))
    if not dry_run:
        done["flow_runs_crashed"] = _mark_crashed(crashed, say)
    return done


def reap_ec2(
    dry_run: bool, block: str | None = None, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Remove what gpuflow's EC2 runs left: instances, volumes, security groups, secrets
    and mailboxes tagged with a run whose flow run is finished, cancelled, crashed or
    unknown to the API, or still Running but orphaned (its gpuflow stopped writing the
    heartbeat more than limits.orphan_after ago; such a run is marked Crashed). Runs still
    going are left alone. With `dry_run`, say what would go and what it costs an hour
    (on-demand prices from the price table: what is saved at most)."""
    from tasks.compute.ec2 import remove_leftovers
    from tasks.compute.ec2_catalog import BACKEND, aws_error, ec2_client, fleet_named, gpu_types
    from tasks.compute.ec2_launch import remove
    from tasks.metrics.cost import PriceTable

    fleet = fleet_named(block, "--block")
    ec2 = ec2_client(fleet)
    done: dict[str, Any] = {"instances": 0, "runs": 0, "hourly_usd": 0.0, "leftovers": 0}
    try:
        runs = _ec2_runs(fleet, ec2)
        kinds = {i["InstanceType"] for run in runs.values() for i in run["instances"]}
        types = {t.instance_type: t for t in gpu_types(ec2)} if kinds else {}
    except Exception as exc:
        raise aws_error(exc, fleet, "list gpuflow's instances") from None
    prices = PriceTable()
    orphans: list[tuple[str, str | None]] = []
    for run_id, run in sorted(runs.items()):
        state = _run_state(run_id, None) if run_id else "unknown"
        if state == "away":
            say(f"run {run_id}: left as it is; the Prefect API that records it is away")
            continue
        if state == "running":
            why = _orphaned(fleet, run["tags"])
            if why is None:
                continue
            state = f"running, but {why}"
            orphans.append((run_id, _api_url()))
        instances = run["instances"]
        hourly = 0.0
        for instance in instances:
            kind = types.get(instance["InstanceType"])
            if kind is not None:
                hourly += prices.gpu_hourly(BACKEND, kind.product) * kind.gpus
        if instances:
            ids = ", ".join(i["InstanceId"] for i in instances)
            say(
                f"{'would terminate' if dry_run else 'terminating'} {len(instances)} instance(s)"
                f" of run {run_id or '(untagged)'} ({ids}; its flow run is {state};"
                f" ${hourly:.2f}/h)"
            )
        else:
            say(
                f"{'would remove' if dry_run else 'removing'} what run {run_id} left"
                f" ({', '.join(run['others'])}; its flow run is {state})"
            )
        if not dry_run:
            try:
                if run_id:
                    remove(ec2, run_id, say)
                    remove_leftovers(fleet, run_id)
                else:
                    ec2.terminate_instances(InstanceIds=[i["InstanceId"] for i in instances])
            except Exception as exc:
                raise aws_error(exc, fleet, f"remove what run {run_id} left") from None
        done["instances"] += len(instances)
        done["runs"] += 1
        done["hourly_usd"] += hourly
        done["leftovers"] += len(run["others"])
    if not dry_run:
        _mark_crashed(orphans, say)
    return done


def _ec2_runs(fleet: Any, ec2: Any) -> dict[str, dict[str, Any]]:
    """Return run id -> its live instances, the names of its other resources (security
    groups, secrets) and the tags they carry, for everything tagged as gpuflow's."""
    from tasks.compute.ec2_catalog import aws_client
    from tasks.compute.ec2_launch import LIVE

    runs: dict[str, dict[str, Any]] = {}

    def entry(tags: dict[str, str]) -> dict[str, Any]:
        run = runs.setdefault(tags.get(RUN_LABEL, ""), {"instances": [], "others": [], "tags": {}})
        run["tags"] |= tags
        return run

    owned = [{"Name": f"tag:{OWNER_LABEL}", "Values": ["gpuflow"]}]
    live = [*owned, {"Name": "instance-state-name", "Values": LIVE}]
    for page in ec2.get_paginator("describe_instances").paginate(Filters=live):
        for reservation in page["Reservations"]:
            for instance in reservation["Instances"]:
                entry(_tags(instance))["instances"].append(instance)
    for group in ec2.describe_security_groups(Filters=owned)["SecurityGroups"]:
        entry(_tags(group))["others"].append(f"security group {group['GroupId']}")
    secrets = aws_client(fleet, "secretsmanager")
    for page in secrets.get_paginator("list_secrets").paginate():
        for secret in page["SecretList"]:
            tags = _tags(secret)
            if tags.get(OWNER_LABEL) == "gpuflow":
                entry(tags)["others"].append(f"secret {secret['Name']}")
    return runs


def _tags(item: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in item.get("Tags", [])}


def _orphaned(fleet: Any, tags: dict[str, str]) -> str | None:
    """Return why a run that the API says is running is orphaned (its heartbeat stopped
    more than its orphan_after ago, or is gone), None when its gpuflow is alive or the
    run has no mailbox to tell."""
    from datetime import UTC, datetime

    from tasks.compute.ec2 import CONTROL_TAG, ORPHAN_TAG
    from tasks.compute.ec2_catalog import aws_client
    from tasks.compute.ec2_mailbox import HEARTBEAT, Mailbox

    control = tags.get(CONTROL_TAG)
    if not control:
        return None
    after = float(tags.get(ORPHAN_TAG, "900"))
    url, _, run_id = control.rstrip("/").rpartition("/")
    mailbox = Mailbox(aws_client(fleet, "s3"), url, run_id)
    try:
        head = mailbox.s3.head_object(Bucket=mailbox.bucket, Key=mailbox.prefix + HEARTBEAT)
    except Exception:
        return "its gpuflow left no heartbeat"
    silent = (datetime.now(UTC) - head["LastModified"]).total_seconds()
    if silent <= after:
        return None
    return f"its gpuflow has been silent for {silent:.0f} s (limits.orphan_after {after:.0f} s)"


def _api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def _run_state(run_id: str, url: str | None) -> str:
    """Return "running", "away" (the API does not answer), "unknown" to the API, or the
    final state's name in lower case."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if url and prefect_api.health_error(url, timeout_s=5):
        return "away"
    try:
        with (
            temporary_settings({PREFECT_API_URL: url} if url else {}),
            get_client(sync_client=True) as client,
        ):
            state = client.read_flow_run(UUID(run_id)).state
    except (ObjectNotFound, ValueError):
        return "unknown"
    if state is None or not state.is_final():
        return "running"
    return state.name.lower()


def _mark_crashed(runs: list[tuple[str, str | None]], say: Callable[[str], None]) -> int:
    """Mark each flow run Crashed in the API it was recorded in, unless it already ended;
    an API that does not answer is named, and the run left as it is."""
    marked = 0
    for run_id, url in runs:
        if not url:
            continue
        problem = prefect_api.health_error(url, timeout_s=5)
        if problem:
            say(f"  flow run {run_id} not marked Crashed: the API at {url} is away ({problem})")
            continue
        if _crash(run_id, url):
            say(f"  flow run {run_id} marked Crashed")
            marked += 1
    return marked


def _crash(run_id: str, url: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Crashed

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        state = client.read_flow_run(UUID(run_id)).state
        if state is not None and state.is_final():
            return False
        client.set_flow_run_state(UUID(run_id), Crashed(message=CRASHED_MESSAGE), force=True)
        return True
