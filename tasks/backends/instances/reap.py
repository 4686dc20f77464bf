"""What an instance run leaves besides its instances (its network, secret and mailbox),
and the reaper that removes what runs that are over, or orphaned, left: on every cloud,
through its provider."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from gpuflow.tasks.backends.instances.cloud import Cloud
from gpuflow.tasks.backends.instances.mailbox import HEARTBEAT, Mailbox
from gpuflow.tasks.contract import ReapReport, RunStates

CONTROL_TAG = "gpuflow.io/control"  # the run's mailbox, for a reaper
ORPHAN_TAG = "gpuflow.io/orphan-after"


def remove_leftovers(cloud: Cloud, run_id: str, control: str | None = None) -> list[str]:
    """Delete what the run left besides its instances (after they are terminated): the
    provider's (volumes, network, secret), then its mailbox (`control`: its URL, from the
    run's tags; else under the settings' control prefix); return what went."""
    removed = cloud.leftovers(run_id)
    url = control.rstrip("/").rpartition("/")[0] if control else cloud.settings.control_prefix
    if url and Mailbox(cloud.storage(), url, run_id).delete_all():
        removed.append(control or f"{url.rstrip('/')}/{run_id}/")
    return removed


def reap(cloud: Cloud, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
    """Remove what gpuflow's runs left on the cloud: instances, volumes, networks, secrets
    and mailboxes tagged with a run whose flow run is finished, cancelled, crashed or
    unknown to the API, or still Running but orphaned (its gpuflow stopped writing the
    heartbeat more than limits.orphan_after ago; such a run is marked Crashed). Runs still
    going are left alone. With `dry_run`, say what would go and what it costs an hour
    (on-demand prices: what is saved at most)."""
    done = ReapReport(counts={"instances": 0, "runs": 0, "hourly_usd": 0.0, "leftovers": 0})
    try:
        found = cloud.tagged()
    except Exception as exc:
        raise cloud.error(exc, "list gpuflow's instances") from None
    for run_id, run in sorted(found.items()):
        state = runs.state(run_id, None) if run_id else "unknown"
        if state == "away":
            say(f"run {run_id}: left as it is; the Prefect API that records it is away")
            continue
        if state == "running":
            why = _orphaned(cloud, run["tags"])
            if why is None:
                continue
            state = f"running, but {why}"
            if not dry_run:
                done.crashed.append((run_id, prefect_api_url()))
        instances = run["instances"]
        try:
            prices = [cloud.hourly(m) for m in instances]
        except Exception as exc:
            raise cloud.error(exc, "price gpuflow's instances") from None
        hourly = sum(p for p in prices if p is not None)
        if instances:
            ids = ", ".join(m.id for m in instances)
            cost = f"${hourly:.2f}/h"
            if None in prices:
                cost = (
                    f"{cost} and {prices.count(None)} instance(s) unpriced here: no USD rate"
                    f" for {cloud.currency} (GPUFLOW_USD_PER_{cloud.currency}) or a type no"
                    " longer listed"
                )
            say(
                f"{'would terminate' if dry_run else 'terminating'} {len(instances)} instance(s)"
                f" of run {run_id or '(untagged)'} ({ids}; its flow run is {state}; {cost})"
            )
        else:
            say(
                f"{'would remove' if dry_run else 'removing'} what run {run_id} left"
                f" ({', '.join(run['others'])}; its flow run is {state})"
            )
        if not dry_run:
            try:
                if run_id:
                    cloud.remove(run_id, say)
                    remove_leftovers(cloud, run_id, run["tags"].get(CONTROL_TAG))
                else:
                    cloud.terminate([m.id for m in instances])
            except Exception as exc:
                raise cloud.error(exc, f"remove what run {run_id} left") from None
        done.counts["instances"] += len(instances)
        done.counts["runs"] += 1
        done.counts["hourly_usd"] += hourly
        done.counts["leftovers"] += len(run["others"])
    return done


def _orphaned(cloud: Cloud, tags: dict[str, Any]) -> str | None:
    """Return why a run that the API says is running is orphaned (its heartbeat stopped
    more than its orphan_after ago, or is gone), None when its gpuflow is alive or the
    run has no mailbox to tell."""
    control = tags.get(CONTROL_TAG)
    if not control:
        return None
    after = float(tags.get(ORPHAN_TAG, "900"))
    url, _, run_id = control.rstrip("/").rpartition("/")
    mailbox = Mailbox(cloud.storage(), url, run_id)
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
