"""Launching a run's EC2 instances, and removing them: the EC2 side of provision and
teardown, by owner tags.

`launch` first looks for the run's instances by its tags (a retried provision adopts them:
EC2's ClientToken is a second guard, not the first), then tries the ranked offers in
order: InsufficientInstanceCapacity, a spot price over the cap and spot limits move on to
the next offer, each step said. Every instance requires IMDSv2, has no key pair or public
SSH (its agent pulls its work), an encrypted gp3 root volume sized from resources.disk,
terminates when it shuts itself down, and carries the owner tags (so do its volumes and
the placement group of a multi-node run). `remove` terminates the run's instances and
deletes its placement group, then describes them to confirm.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpuflow.tasks.backends.instances.catalog import Offer
from gpuflow.tasks.backends.instances.cloud import LIVE, Launched, NextOffer, failover
from gpuflow.tasks.contract import RUN_LABEL
from gpuflow.tasks.errors import CapacityError

# Errors after which another offer (type, zone or market) may still launch.
NEXT_OFFER = {
    "InsufficientInstanceCapacity",
    "InstanceLimitExceeded",
    "SpotMaxPriceTooLow",
    "MaxSpotInstanceCountExceeded",
    "Unsupported",
    "InsufficientCapacity",
}


def tags_of(owner: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"Key": k, "Value": v} for k, v in sorted(owner.items())]


def owned_instances(ec2: Any, run_id: str, states: list[str] | None = None) -> list[dict]:
    """Return the run's instances (by its tag) in `states` (default: not terminated)."""
    filters = [
        {"Name": f"tag:{RUN_LABEL}", "Values": [run_id]},
        {"Name": "instance-state-name", "Values": states or LIVE},
    ]
    found = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for reservation in page["Reservations"]:
            found += reservation["Instances"]
    return found


def launch(
    ec2: Any,
    offers: list[Offer],
    nodes: int,
    disk_gib: int,
    image_id: str,
    user_data: str,
    owner: Mapping[str, str],
    say: Callable[[str], None],
    instance_profile: str | None = None,
    security_groups: list[str] | None = None,
    subnet: str | None = None,
    max_price: float | None = None,
) -> Launched:
    """Return the run's `nodes` instances: adopted when they exist, else launched from the
    first offer that has capacity. CapacityError (retryable) when none has."""
    from botocore.exceptions import ClientError

    run_id = owner[RUN_LABEL]
    existing = owned_instances(ec2, run_id)
    if existing:
        return Launched(instance_ids=[i["InstanceId"] for i in existing], adopted=True)
    group = None
    if nodes > 1:  # nodes close together; a network nicety, not worth failing a run for
        try:
            group = _placement_group(ec2, run_id, owner)
        except Exception as exc:
            why = (str(exc).splitlines() or [""])[0][:160]
            say(f"no cluster placement group ({type(exc).__name__}: {why}); launching without")

    def try_offer(offer: Offer) -> list[str]:
        request = _request(offer, nodes, disk_gib, image_id, user_data, owner, group, max_price)
        if instance_profile:
            request["IamInstanceProfile"] = {"Name": instance_profile}
        if security_groups:
            request["SecurityGroupIds"] = security_groups
        if subnet:
            request["SubnetId"] = subnet
        try:
            made = ec2.run_instances(**request)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            if error.get("Code", "") not in NEXT_OFFER:
                raise
            raise NextOffer(error.get("Code", ""), error.get("Message", "")) from None
        return [i["InstanceId"] for i in made["Instances"]]

    try:
        offer, ids = failover(offers, nodes, try_offer, say)
    except CapacityError:
        if group:
            remove(ec2, run_id, say, group=group)  # only the group: nothing was launched
        raise
    return Launched(instance_ids=ids, offer=offer, placement_group=group)


def _request(
    offer: Offer,
    nodes: int,
    disk_gib: int,
    image_id: str,
    user_data: str,
    owner: Mapping[str, str],
    group: str | None,
    max_price: float | None = None,
) -> dict[str, Any]:
    tags = tags_of(owner)
    token = hashlib.sha256(
        f"{owner[RUN_LABEL]}:{offer.instance_type}:{offer.zone}:{offer.market}".encode()
    ).hexdigest()[:64]
    placement: dict[str, Any] = {"AvailabilityZone": offer.zone}
    if group:
        placement["GroupName"] = group
    request: dict[str, Any] = {
        "ImageId": image_id,
        "InstanceType": offer.instance_type,
        "MinCount": nodes,
        "MaxCount": nodes,
        "ClientToken": token,
        "Placement": placement,
        "UserData": user_data,
        "InstanceInitiatedShutdownBehavior": "terminate",
        "MetadataOptions": {
            "HttpTokens": "required",
            "HttpEndpoint": "enabled",
            "HttpPutResponseHopLimit": 2,
            "InstanceMetadataTags": "disabled",
        },
        "BlockDeviceMappings": [
            {
                "DeviceName": "/dev/sda1",
                "Ebs": {
                    "VolumeSize": max(8, disk_gib),
                    "VolumeType": "gp3",
                    "Encrypted": True,
                    "DeleteOnTermination": True,
                },
            }
        ],
        "TagSpecifications": [
            {"ResourceType": "instance", "Tags": tags},
            {"ResourceType": "volume", "Tags": tags},
        ],
    }
    if offer.market == "spot":
        request["InstanceMarketOptions"] = {
            "MarketType": "spot",
            "SpotOptions": {
                "SpotInstanceType": "one-time",
                "InstanceInterruptionBehavior": "terminate",
            },
        }
        if max_price is not None:  # placement.spot_price_limit; else up to on-demand
            request["InstanceMarketOptions"]["SpotOptions"]["MaxPrice"] = f"{max_price:.4f}"
    return request


def group_name(run_id: str) -> str:
    return f"gpuflow-{run_id}"[:255]


def _placement_group(ec2: Any, run_id: str, owner: Mapping[str, str]) -> str:
    from botocore.exceptions import ClientError

    name = group_name(run_id)
    try:
        ec2.create_placement_group(
            GroupName=name,
            Strategy="cluster",
            TagSpecifications=[{"ResourceType": "placement-group", "Tags": tags_of(owner)}],
        )
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "InvalidPlacementGroup.Duplicate":
            raise
    return name


def _delete_group(ec2: Any, name: str) -> None:
    from botocore.exceptions import ClientError

    try:
        ec2.delete_placement_group(GroupName=name)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "InvalidPlacementGroup.Unknown":
            raise


def remove(
    ec2: Any,
    run_id: str,
    say: Callable[[str], None] = print,
    wait_s: float = 300.0,
    group: str | None = None,
) -> list[str]:
    """Terminate the run's instances and delete its placement group; return the instance
    ids terminated, once EC2 describes every one as terminated (or `wait_s` passed). A
    placement group that cannot be deleted (it costs nothing) is said, not raised."""
    found = owned_instances(ec2, run_id)
    ids = [i["InstanceId"] for i in found]
    groups = {i.get("Placement", {}).get("GroupName") for i in found} | {group}
    if ids:
        ec2.terminate_instances(InstanceIds=ids)
    until = time.monotonic() + wait_s
    while ids and owned_instances(ec2, run_id, [*LIVE, "shutting-down"]):
        if time.monotonic() > until:
            break
        time.sleep(1.0)
    for name in sorted(g for g in groups if g):
        try:
            _delete_group(ec2, name)  # gone already: no error
        except Exception as exc:
            say(f"placement group {name} was left ({type(exc).__name__}: {exc})")
    return ids
