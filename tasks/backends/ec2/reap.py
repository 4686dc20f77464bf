"""What an EC2 run leaves besides its instances (volumes, security groups, its secret,
its mailbox) and the reaper that removes what runs that are over, or orphaned, left."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from gpuflow.tasks.backends.ec2.catalog import (
    BACKEND,
    Fleet,
    aws_client,
    aws_error,
    ec2_client,
    gpu_types,
)
from gpuflow.tasks.backends.ec2.launch import LIVE, remove
from gpuflow.tasks.backends.ec2.mailbox import HEARTBEAT, Mailbox
from gpuflow.tasks.contract import OWNER_LABEL, RUN_LABEL, ReapReport, RunStates
from gpuflow.tasks.metrics.cost import PriceTable

CONTROL_TAG = "gpuflow.io/control"  # the run's mailbox, for a reaper
ORPHAN_TAG = "gpuflow.io/orphan-after"


def secret_name(run_id: str) -> str:
    return f"gpuflow/{run_id}"


def remove_leftovers(fleet: Fleet, run_id: str) -> list[str]:
    """Delete the run's volumes left available, its security groups, its secret and its
    mailbox (after its instances are terminated); return what went."""
    ec2 = ec2_client(fleet)
    secrets = aws_client(fleet, "secretsmanager")
    run_filter = [{"Name": f"tag:{RUN_LABEL}", "Values": [run_id]}]
    removed: list[str] = []
    for volume in ec2.describe_volumes(Filters=run_filter)["Volumes"]:
        if volume["State"] == "available":
            ec2.delete_volume(VolumeId=volume["VolumeId"])
            removed.append(volume["VolumeId"])
    control = None
    for group in ec2.describe_security_groups(Filters=run_filter)["SecurityGroups"]:
        tags = {t["Key"]: t["Value"] for t in group.get("Tags", [])}
        control = control or tags.get(CONTROL_TAG)
        for attempt in range(30):  # EC2 refuses while a terminating instance still uses it
            try:
                ec2.delete_security_group(GroupId=group["GroupId"])
                removed.append(group["GroupId"])
                break
            except Exception as exc:
                if "DependencyViolation" not in str(exc) or attempt == 29:
                    raise
                time.sleep(2)
    try:
        found = secrets.describe_secret(SecretId=secret_name(run_id))
    except secrets.exceptions.ResourceNotFoundException:
        found = None
    if found is not None:
        tags = {t["Key"]: t["Value"] for t in found.get("Tags", [])}
        control = control or tags.get(CONTROL_TAG)
        secrets.delete_secret(SecretId=secret_name(run_id), ForceDeleteWithoutRecovery=True)
        removed.append(found["Name"])
    if control:
        url, _, _ = control.rstrip("/").rpartition("/")
        if Mailbox(aws_client(fleet, "s3"), url, run_id).delete_all():
            removed.append(control)
    return removed


def reap(fleet: Fleet, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
    """Remove what gpuflow's EC2 runs left: instances, volumes, security groups, secrets
    and mailboxes tagged with a run whose flow run is finished, cancelled, crashed or
    unknown to the API, or still Running but orphaned (its gpuflow stopped writing the
    heartbeat more than limits.orphan_after ago; such a run is marked Crashed). Runs still
    going are left alone. With `dry_run`, say what would go and what it costs an hour
    (on-demand prices from the price table: what is saved at most)."""
    ec2 = ec2_client(fleet)
    done = ReapReport(counts={"instances": 0, "runs": 0, "hourly_usd": 0.0, "leftovers": 0})
    try:
        found = _ec2_runs(fleet, ec2)
        kinds = {i["InstanceType"] for run in found.values() for i in run["instances"]}
        types = {t.instance_type: t for t in gpu_types(ec2)} if kinds else {}
    except Exception as exc:
        raise aws_error(exc, fleet, "list gpuflow's instances") from None
    prices = PriceTable()
    for run_id, run in sorted(found.items()):
        state = runs.state(run_id, None) if run_id else "unknown"
        if state == "away":
            say(f"run {run_id}: left as it is; the Prefect API that records it is away")
            continue
        if state == "running":
            why = _orphaned(fleet, run["tags"])
            if why is None:
                continue
            state = f"running, but {why}"
            if not dry_run:
                done.crashed.append((run_id, prefect_api_url()))
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
        done.counts["instances"] += len(instances)
        done.counts["runs"] += 1
        done.counts["hourly_usd"] += hourly
        done.counts["leftovers"] += len(run["others"])
    return done


def _ec2_runs(fleet: Any, ec2: Any) -> dict[str, dict[str, Any]]:
    """Return run id -> its live instances, the names of its other resources (security
    groups, secrets) and the tags they carry, for everything tagged as gpuflow's."""
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


def prefect_api_url() -> str | None:
    """Return the Prefect API this process records runs in, if one is set."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None
