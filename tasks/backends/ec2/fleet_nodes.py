"""The EC2 side of an elastic fleet (GpuFleet.ec2): instances launched for the fleet, kept
across runs, reached over SSH like any host of the fleet.

An instance's user-data only lets the fleet's key in (a public key) and publishes the
instance's own SSH host key to the fleet's records in S3 (a URL that can write that one
object, once, until the boot timeout): gpuflow then checks the host key like any other
host's. gpuflow itself is pushed over SSH, as on every fleet host. Instances carry the
tags `gpuflow.io/owner: gpuflow-fleet` and `gpuflow.io/fleet: <name>` (never a run's, so
the EC2 backend's reaper leaves them to the fleet's scaler). Their security group lets SSH
in from `ssh_from` (else the subnet) and the fleet's instances reach each other.
"""

from __future__ import annotations

import functools
import json
import shlex
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from gpuflow.tasks.backends.ec2 import launch as launching
from gpuflow.tasks.backends.ec2.catalog import (
    Fleet,
    Offer,
    aws_client,
    aws_error,
    ec2_client,
    find_offers,
    fleet_named,
)
from gpuflow.tasks.backends.ec2.placement import Ec2Ask, Ec2Placement
from gpuflow.tasks.backends.elastic import Instance, Want
from gpuflow.tasks.backends.instances.mailbox import Mailbox
from gpuflow.tasks.contract import OWNER_LABEL, RUN_LABEL
from gpuflow.tasks.errors import CapacityError, InvalidSpec
from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.spec import Limits, Resources

# Run on the instance by its user-data: put standard input at s3://BUCKET/KEY, if nothing
# is there yet, with the instance's own credentials.
_PUBLISH = (
    "import sys, boto3; boto3.client('s3').put_object(Bucket=%r, Key=%r,"
    " Body=sys.stdin.read().strip(), IfNoneMatch='*')"
)
FLEET_TAG = "gpuflow.io/fleet"
OFFERS_FOR_S = 300.0
_OFFERS: dict[tuple, tuple[float, list[Offer]]] = {}
_OFFERS_LOCK = threading.Lock()
FLEET_OWNER = "gpuflow-fleet"
SLOT_TAG = "gpuflow.io/fleet-slot"


def _aws(doing: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Turn an AWS failure of the decorated method into one sentence: what it was doing
    (`doing`, with {name}: the fleet's), where, and why."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def said(self: Ec2FleetNodes, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except (InvalidSpec, CapacityError):
                raise
            except Exception as exc:
                raise aws_error(exc, self.settings, doing.format(name=self.name)) from None

        return said

    return wrap


class Ec2FleetNodes:
    """An elastic fleet's instances on EC2, and its records under the control prefix."""

    def __init__(self, section: Any, name: str, public_key: str) -> None:
        self.section, self.name, self.public_key = section, name, public_key
        self.settings: Fleet = fleet_named(section.block, f"fleet {name!r} ec2.block")
        if not self.settings.control_prefix:
            raise InvalidSpec(
                f"{self.settings.field('control_prefix')}: an elastic fleet keeps its records"
                " there; set it to an s3:// prefix."
            )
        if not self.settings.image_id:
            raise InvalidSpec(
                f"{self.settings.field('image_id')}: no machine image is set; set it to an"
                " AMI with NVIDIA's driver, sshd and Python 3.11+."
            )
        self.records = Mailbox(
            aws_client(self.settings, "s3"), self.settings.control_prefix, f"fleets/{name}"
        )

    @functools.cached_property
    def ec2(self) -> Any:
        return ec2_client(self.settings)

    # -- what a new instance is ----------------------------------------------------------

    @functools.cached_property
    def offers(self) -> list[Offer]:
        """Return the offers for the fleet's instance types, in the order they are tried:
        the types as listed, the market's order within each (asked of EC2 once every
        OFFERS_FOR_S per process: every stage of a run reads them)."""
        key = (
            self.section.block,
            tuple(self.section.instance_types),
            self.section.market,
            self.section.subnet,
        )
        with _OFFERS_LOCK:
            cached = _OFFERS.get(key)
        if cached is not None and time.monotonic() - cached[0] < OFFERS_FOR_S:
            return cached[1]
        found = self._offers()
        with _OFFERS_LOCK:
            _OFFERS[key] = (time.monotonic(), found)
        return found

    def _offers(self) -> list[Offer]:
        ask = Ec2Ask(
            resources=Resources(gpus=1),
            placement=Ec2Placement(block=self.section.block, market=self.section.market),
            limits=Limits(),
        )
        _, found = find_offers(ask, PriceTable(), self.settings)
        zone = self._subnet_zone()
        ordered = []
        for wanted in self.section.instance_types:
            ordered += [
                o for o in found if o.instance_type == wanted and (zone is None or o.zone == zone)
            ]
        if not ordered:
            raise InvalidSpec(
                f"fleet {self.name!r} ec2.instance_types: none of {', '.join(self.section.instance_types)}"
                f" is offered{f' in {zone}' if zone else ''} with GPUs in {self.settings.region};"
                " name GPU instance types that are (gpuflow offers lists them)."
            )
        return ordered

    def _subnet_zone(self) -> str | None:
        if not self.section.subnet:
            return None
        try:
            subnets = self.ec2.describe_subnets(SubnetIds=[self.section.subnet])["Subnets"]
        except Exception as exc:
            raise aws_error(exc, self.settings, f"find subnet {self.section.subnet}") from None
        return subnets[0]["AvailabilityZone"]

    def boot_timeout_s(self) -> float:
        return self.settings.boot_timeout_s

    def instance_gpus(self) -> tuple[int, str, float]:
        first = self.offers[0]
        return first.gpus, first.product, first.hourly_usd

    # -- instances -----------------------------------------------------------------------

    def instances(self) -> list[Instance]:
        filters = [
            {"Name": f"tag:{FLEET_TAG}", "Values": [self.name]},
            {"Name": f"tag:{OWNER_LABEL}", "Values": [FLEET_OWNER]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ]
        try:
            found = []
            for page in self.ec2.get_paginator("describe_instances").paginate(Filters=filters):
                for reservation in page["Reservations"]:
                    found += reservation["Instances"]
        except Exception as exc:
            raise aws_error(exc, self.settings, f"list fleet {self.name!r}'s instances") from None
        offers = {(o.instance_type, o.market): o for o in self.offers}
        keys = self.host_keys()
        out = []
        for item in found:
            tags = {t["Key"]: t["Value"] for t in item.get("Tags", [])}
            market = "spot" if item.get("InstanceLifecycle") == "spot" else "on-demand"
            offer = offers.get((item["InstanceType"], market))
            address = item.get("PrivateIpAddress", "")
            key = keys.get(item["InstanceId"])
            out.append(
                Instance(
                    id=item["InstanceId"],
                    slot=int(tags[SLOT_TAG]) if tags.get(SLOT_TAG, "").isdigit() else None,
                    address=address,
                    instance_type=item["InstanceType"],
                    gpus=offer.gpus if offer else 0,
                    product=offer.product if offer else "",
                    market=market,
                    state=item["State"]["Name"],
                    launched_at=item["LaunchTime"],
                    known_hosts=f"{address} {key}" if key and address else None,
                    hourly_usd=offer.hourly_usd if offer else 0.0,
                )
            )
        return sorted(out, key=lambda i: (i.slot if i.slot is not None else 1000, i.id))

    def launch(self, slot: int, say: Callable[[str], None]) -> Instance:
        """Launch the instance of `slot` from the first offer with capacity."""
        owner = {
            OWNER_LABEL: FLEET_OWNER,
            FLEET_TAG: self.name,
            SLOT_TAG: str(slot),
            RUN_LABEL: f"fleet-{self.name}-{slot}-{uuid.uuid4().hex[:8]}",
        }
        try:
            group = self._security_group()
            launched = launching.launch(
                self.ec2,
                self.offers,
                1,
                64,
                self.settings.image_id or "",
                self.user_data(slot),
                owner,
                say,
                instance_profile=self.settings.instance_profile,
                security_groups=[group],
                subnet=self.section.subnet,
            )
        except (CapacityError, InvalidSpec):
            raise
        except Exception as exc:
            raise aws_error(
                exc, self.settings, f"launch an instance for fleet {self.name!r}"
            ) from None
        offer = launched.offer or self.offers[0]
        return Instance(
            id=launched.instance_ids[0],
            slot=slot,
            instance_type=offer.instance_type,
            gpus=offer.gpus,
            product=offer.product,
            market=offer.market,
            state="pending",
            launched_at=datetime.now(UTC),
            hourly_usd=offer.hourly_usd,
        )

    def end(self, instance_ids: list[str], say: Callable[[str], None]) -> None:
        if not instance_ids:
            return
        try:
            self.ec2.terminate_instances(InstanceIds=instance_ids)
        except Exception as exc:
            raise aws_error(exc, self.settings, f"end fleet {self.name!r}'s instances") from None
        say(f"ended {', '.join(instance_ids)}")

    def user_data(self, slot: int) -> str:
        """Return an instance's boot script: the fleet's public key let in for the SSH user,
        and the instance's host key published to the fleet's records with the instance's
        own profile (Python's boto3 on the image; written only if none is there). Nothing
        secret in it."""
        records = self.records
        endpoint = self.settings.credentials.endpoint_url if self.settings.credentials else None
        publish = _PUBLISH % (records.bucket, records.prefix + f"hosts/slot-{slot}.pub")
        return "\n".join(
            [
                "#!/bin/bash",
                f"# gpuflow: an instance of fleet {self.name} (slot {slot}); gpuflow reaches it"
                " over SSH",
                "set -euo pipefail",
                f"export AWS_DEFAULT_REGION={shlex.quote(self.settings.region)}",
                *([f"export AWS_ENDPOINT_URL={shlex.quote(endpoint)}"] if endpoint else []),
                f"user={shlex.quote(self.section.user)}",
                'home=$(getent passwd "$user" | cut -d: -f6 || true)',
                "# where sshd reads them (an image that keeps them elsewhere sets these)",
                "keys=${AUTHORIZED_KEYS:-$home/.ssh/authorized_keys}",
                "host_key=${SSH_HOST_KEY:-/etc/ssh/ssh_host_ed25519_key.pub}",
                'mkdir -p "$(dirname "$keys")" && chmod 700 "$(dirname "$keys")"',
                f'echo {shlex.quote(self.public_key)} >> "$keys"',
                'chmod 600 "$keys"',
                '[ -z "$home" ] || chown -R "$user" "$(dirname "$keys")" 2>/dev/null || true',
                'for try in $(seq 60); do [ -s "$host_key" ] && break; sleep 1; done',
                "# the host key, for gpuflow to check (the instance's profile may write it)",
                f'cut -d" " -f1-2 "$host_key" | python3 -c {shlex.quote(publish)}',
                "",
            ]
        )

    @_aws("read fleet {name!r}'s host keys")
    def host_keys(self) -> dict[str, str]:
        """Return instance id -> the host key it published (under its slot)."""
        keys: dict[str, str] = {}
        for slot, record in self.slots().items():
            data = self.records.get(f"hosts/slot-{slot}.pub") if record.get("instance") else None
            if data:
                keys[record["instance"]] = data.decode().strip()
        return keys

    # -- the fleet's records ---------------------------------------------------------------

    @_aws("read fleet {name!r}'s slots")
    def slots(self) -> dict[int, dict[str, Any]]:
        found = {}
        for key in self.records.keys("slots/"):
            record = self.records.get_json(key)
            if record is not None:
                found[int(key.rsplit("/", 1)[1])] = record
        return found

    @_aws("take a slot of fleet {name!r}")
    def take_slot(self, slot: int, record: dict[str, Any]) -> bool:
        if not self.records.put_new(f"slots/{slot}", json.dumps(record)):
            return False
        self.records.delete(f"hosts/slot-{slot}.pub")  # a reclaimed instance's, if any
        return True

    @_aws("write a slot of fleet {name!r}")
    def set_slot(self, slot: int, record: dict[str, Any]) -> None:
        self.records.put_json(f"slots/{slot}", record)

    @_aws("free a slot of fleet {name!r}")
    def free_slot(self, slot: int) -> None:
        self.records.delete(f"hosts/slot-{slot}.pub")
        self.records.delete(f"slots/{slot}")

    @_aws("read the runs waiting on fleet {name!r}")
    def wants(self) -> list[Want]:
        found = []
        for key in self.records.keys("wants/"):
            record = self.records.get_json(key)
            if record is not None:
                found.append(Want.model_validate(record))
        return found

    @_aws("record a run waiting on fleet {name!r}")
    def want(self, want: Want) -> None:
        self.records.put(f"wants/{want.run}", want.model_dump_json())

    @_aws("forget a run waiting on fleet {name!r}")
    def unwant(self, run: str) -> None:
        self.records.delete(f"wants/{run}")

    @_aws("record an ended instance of fleet {name!r}")
    def ended(self, instance_id: str, record: dict[str, Any]) -> None:
        self.records.put_json(f"ended/{instance_id}", record)

    @_aws("read fleet {name!r}'s ledger")
    def ledger(self) -> list[dict[str, Any]]:
        return [r for k in self.records.keys("ended/") if (r := self.records.get_json(k))]

    # -- the fleet's security group ------------------------------------------------------

    def _security_group(self) -> str:
        name = f"gpuflow-fleet-{self.name}"
        if self.section.subnet:
            subnet = self.ec2.describe_subnets(SubnetIds=[self.section.subnet])["Subnets"][0]
            vpc, cidr = subnet["VpcId"], subnet["CidrBlock"]
        else:
            vpcs = self.ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])
            if not vpcs["Vpcs"]:
                raise InvalidSpec(
                    f"fleet {self.name!r} ec2.subnet: the region has no default VPC; name a subnet."
                )
            vpc, cidr = vpcs["Vpcs"][0]["VpcId"], vpcs["Vpcs"][0]["CidrBlock"]
        found = self.ec2.describe_security_groups(
            Filters=[
                {"Name": "group-name", "Values": [name]},
                {"Name": "vpc-id", "Values": [vpc]},
            ]
        )["SecurityGroups"]
        if found:
            return found[0]["GroupId"]
        tags = {OWNER_LABEL: FLEET_OWNER, FLEET_TAG: self.name}
        group = self.ec2.create_security_group(
            GroupName=name,
            Description="gpuflow fleet: SSH from where gpuflow runs; the fleet's instances reach each other",
            VpcId=vpc,
            TagSpecifications=[{"ResourceType": "security-group", "Tags": launching.tags_of(tags)}],
        )["GroupId"]
        ranges = [{"CidrIp": c} for c in (self.section.ssh_from or [cidr])]
        self.ec2.authorize_security_group_ingress(
            GroupId=group,
            IpPermissions=[
                {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": ranges},
                {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group}]},
            ],
        )
        return group

    def remove_all(self, say: Callable[[str], None]) -> None:
        """Delete the fleet's security group (once its instances are gone) and its records."""
        from botocore.exceptions import ClientError

        groups = self.ec2.describe_security_groups(
            Filters=[{"Name": f"tag:{FLEET_TAG}", "Values": [self.name]}]
        )["SecurityGroups"]
        for group in groups:
            until = time.monotonic() + 120
            while True:
                try:
                    self.ec2.delete_security_group(GroupId=group["GroupId"])
                    say(f"deleted security group {group['GroupId']}")
                    break
                except ClientError as exc:
                    if "DependencyViolation" not in str(exc) or time.monotonic() > until:
                        raise aws_error(
                            exc, self.settings, "delete the fleet's security group"
                        ) from None
                    time.sleep(2)
        self.records.delete_all()
