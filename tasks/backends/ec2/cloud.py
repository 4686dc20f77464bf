"""AWS as a provider of the instance backends: EC2 for instances, S3 for the mailbox,
Secrets Manager for the run's secret, a security group per run."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpuflow.tasks.backends.ec2 import launch as launching
from gpuflow.tasks.backends.ec2.catalog import (
    BACKEND,
    Fleet,
    aws_client,
    aws_error,
    ec2_client,
    find_offers,
    gpu_types,
)
from gpuflow.tasks.backends.instances.catalog import Offer
from gpuflow.tasks.backends.instances.cloud import FLEET_TAG, LIVE, Boot, Cloud, Launched, Machine
from gpuflow.tasks.backends.instances.placement import Ask
from gpuflow.tasks.contract import OWNER_LABEL, RUN_LABEL
from gpuflow.tasks.errors import InvalidSpec, Unreachable
from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.storage import S3Settings


def secret_name(run_id: str) -> str:
    return f"gpuflow/{run_id}"


def group_name(run_id: str) -> str:
    return f"gpuflow-{run_id}"


class AwsCloud(Cloud):
    backend = BACKEND
    label = "EC2"
    agent_module = "gpuflow.tasks.backends.ec2.agent"
    console_hint = "aws ec2 get-console-output"
    settings: Fleet

    def __init__(self, settings: Fleet) -> None:
        super().__init__(settings)

    @functools.cached_property
    def ec2(self) -> Any:
        return ec2_client(self.settings)

    @functools.cached_property
    def secrets(self) -> Any:
        return aws_client(self.settings, "secretsmanager")

    def storage(self) -> Any:
        return aws_client(self.settings, "s3")

    def error(self, exc: Exception, doing: str) -> InvalidSpec | Unreachable:
        return aws_error(exc, self.settings, doing)

    # -- what the cloud offers ---------------------------------------------------------

    def check_launch(self) -> None:
        fleet = self.settings
        if not fleet.image_id:
            raise InvalidSpec(
                f"{fleet.field('image_id')}: no machine image is set; set it to an AMI with"
                " NVIDIA's driver and Python 3.11+ in the fleet's region."
            )
        from gpuflow.blocks.ec2_fleet import INSTALL_BY_NAME

        if fleet.install.strip() == INSTALL_BY_NAME:
            raise InvalidSpec(
                f"{fleet.field('install')}: it installs gpuflow by name from PyPI, where no"
                " such package is this gpuflow (whoever registered the name would run code on"
                " your instances); save the block again without install (the default installs"
                " the orchestrator's own wheel, checked by its hash) or give your own step."
            )

    def find_offers(self, ask: Ask, prices: PriceTable) -> list[Offer]:
        return find_offers(ask, prices, self.settings)[1]

    # -- a run's instances -------------------------------------------------------------

    def machines(self, tags: Mapping[str, str], states: list[str] | None = None) -> list[Machine]:
        filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in tags.items()]
        filters.append({"Name": "instance-state-name", "Values": states or LIVE})
        found = []
        for page in self.ec2.get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page["Reservations"]:
                found += [_machine(i) for i in reservation["Instances"]]
        return found

    def launch(
        self, offers: list[Offer], nodes: int, boot: Boot, say: Callable[[str], None]
    ) -> Launched:
        return launching.launch(
            self.ec2,
            offers,
            nodes,
            boot.disk_gib,
            boot.image_id,
            boot.user_data,
            boot.tags,
            say,
            self.settings.instance_profile,
            [boot.network] if boot.network else None,
            subnet=boot.subnet,
            max_price=boot.spot_price_limit,
        )

    def remove(self, run_id: str, say: Callable[[str], None], wait_s: float = 300.0) -> list[str]:
        return launching.remove(self.ec2, run_id, say, wait_s)

    def terminate(self, ids: list[str]) -> None:
        if ids:
            self.ec2.terminate_instances(InstanceIds=ids)

    def network(self, run_id: str, tags: Mapping[str, str], nodes: int) -> str | None:
        """The run's security group: no inbound rule from outside; the run's own nodes
        reach each other (rendezvous, NCCL). None where there is no default VPC."""
        ec2 = self.ec2
        vpcs = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
        if not vpcs:
            return None
        vpc = vpcs[0]["VpcId"]
        found = ec2.describe_security_groups(
            Filters=[
                {"Name": "group-name", "Values": [group_name(run_id)]},
                {"Name": "vpc-id", "Values": [vpc]},
            ]
        )["SecurityGroups"]
        if found:
            return str(found[0]["GroupId"])
        group = ec2.create_security_group(
            GroupName=group_name(run_id),
            Description="gpuflow run: no inbound from outside; the run's nodes reach each other",
            VpcId=vpc,
            TagSpecifications=[{"ResourceType": "security-group", "Tags": launching.tags_of(tags)}],
        )["GroupId"]
        if nodes > 1:
            ec2.authorize_security_group_ingress(
                GroupId=group,
                IpPermissions=[{"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group}]}],
            )
        return str(group)

    def leftovers(self, run_id: str) -> list[str]:
        """Delete the run's volumes left available, its security groups and its secret."""
        ec2, secrets = self.ec2, self.secrets
        run_filter = [{"Name": f"tag:{RUN_LABEL}", "Values": [run_id]}]
        removed: list[str] = []
        for volume in ec2.describe_volumes(Filters=run_filter)["Volumes"]:
            if volume["State"] == "available":
                ec2.delete_volume(VolumeId=volume["VolumeId"])
                removed.append(volume["VolumeId"])
        for group in ec2.describe_security_groups(Filters=run_filter)["SecurityGroups"]:
            _retried(functools.partial(ec2.delete_security_group, GroupId=group["GroupId"]))
            removed.append(group["GroupId"])
        try:
            found = secrets.describe_secret(SecretId=secret_name(run_id))
        except secrets.exceptions.ResourceNotFoundException:
            found = None
        if found is not None:
            secrets.delete_secret(SecretId=secret_name(run_id), ForceDeleteWithoutRecovery=True)
            removed.append(found["Name"])
        return removed

    # -- storage and secrets -----------------------------------------------------------

    def secret_id(self, run_id: str) -> str:
        return secret_name(run_id)

    def put_secret(self, run_id: str, tags: Mapping[str, str], value: str) -> None:
        secrets = self.secrets
        try:
            secrets.put_secret_value(SecretId=secret_name(run_id), SecretString=value)
        except secrets.exceptions.ResourceNotFoundException:
            secrets.create_secret(
                Name=secret_name(run_id),
                SecretString=value,
                Description="gpuflow: the run's variables and its agents' Prefect API key",
                Tags=launching.tags_of(tags),
            )

    def agent_settings(self) -> dict[str, Any]:
        return {"region": self.settings.region, "endpoint_url": _endpoint(self.settings)}

    # -- an elastic fleet's instances ----------------------------------------------------

    def subnet_zone(self, subnet: str) -> str:
        return str(self.ec2.describe_subnets(SubnetIds=[subnet])["Subnets"][0]["AvailabilityZone"])

    def fleet_network(
        self, fleet: str, tags: Mapping[str, str], ssh_from: list[str], subnet: str | None
    ) -> str | None:
        """The fleet's security group in its subnet's VPC (else the default VPC): SSH from
        `ssh_from`, else the subnet (or VPC) only."""
        ec2, name = self.ec2, f"gpuflow-fleet-{fleet}"
        if subnet:
            found = ec2.describe_subnets(SubnetIds=[subnet])["Subnets"][0]
            vpc, cidr = found["VpcId"], found["CidrBlock"]
        else:
            vpcs = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
            if not vpcs:
                raise InvalidSpec(
                    f"fleet {fleet!r} ec2.subnet: the region has no default VPC; name a subnet."
                )
            vpc, cidr = vpcs[0]["VpcId"], vpcs[0]["CidrBlock"]
        made = self._fleet_group(name, vpc)
        if made is not None:
            return made
        try:
            group = ec2.create_security_group(
                GroupName=name,
                Description="gpuflow fleet: SSH from where gpuflow runs; the fleet's instances reach each other",
                VpcId=vpc,
                TagSpecifications=[
                    {"ResourceType": "security-group", "Tags": launching.tags_of(tags)}
                ],
            )["GroupId"]
        except Exception as exc:  # two runs growing the fleet at once: the other made it
            if "InvalidGroup.Duplicate" not in str(exc):
                raise
            made = self._fleet_group(name, vpc)
            if made is None:
                raise
            return made
        ranges = [{"CidrIp": c} for c in (ssh_from or [cidr])]
        ec2.authorize_security_group_ingress(
            GroupId=group,
            IpPermissions=[
                {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": ranges},
                {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group}]},
            ],
        )
        return str(group)

    def _fleet_group(self, name: str, vpc: str) -> str | None:
        groups = self.ec2.describe_security_groups(
            Filters=[
                {"Name": "group-name", "Values": [name]},
                {"Name": "vpc-id", "Values": [vpc]},
            ]
        )["SecurityGroups"]
        return str(groups[0]["GroupId"]) if groups else None

    def remove_fleet_network(self, fleet: str, say: Callable[[str], None]) -> None:
        groups = self.ec2.describe_security_groups(
            Filters=[{"Name": f"tag:{FLEET_TAG}", "Values": [fleet]}]
        )["SecurityGroups"]
        for group in groups:
            _retried(functools.partial(self.ec2.delete_security_group, GroupId=group["GroupId"]))
            say(f"deleted security group {group['GroupId']}")

    # -- reaping -----------------------------------------------------------------------

    def tagged(self) -> dict[str, dict[str, Any]]:
        runs = super().tagged()
        owned = [{"Name": f"tag:{OWNER_LABEL}", "Values": ["gpuflow"]}]
        for group in self.ec2.describe_security_groups(Filters=owned)["SecurityGroups"]:
            self.tagged_entry(runs, _tags(group))["others"].append(
                f"security group {group['GroupId']}"
            )
        for page in self.secrets.get_paginator("list_secrets").paginate():
            for secret in page["SecretList"]:
                tags = _tags(secret)
                if tags.get(OWNER_LABEL) == "gpuflow":
                    self.tagged_entry(runs, tags)["others"].append(f"secret {secret['Name']}")
        return runs

    @functools.cached_property
    def _types(self) -> dict[str, Any]:
        return {t.instance_type: t for t in gpu_types(self.ec2)}

    def hourly(self, machine: Machine) -> float | None:
        kind = self._types.get(machine.instance_type)
        return PriceTable().gpu_hourly(BACKEND, kind.product) * kind.gpus if kind else 0.0


def _retried(delete: Callable[[], Any], tries: int = 60) -> None:
    """Delete a security group, again while EC2 refuses because a terminating instance
    still uses it (DependencyViolation), for up to two minutes."""
    for attempt in range(tries):
        try:
            delete()
            return
        except Exception as exc:
            if "DependencyViolation" not in str(exc) or attempt == tries - 1:
                raise
            time.sleep(2)


def _machine(item: dict[str, Any]) -> Machine:
    return Machine(
        id=item["InstanceId"],
        state=item["State"]["Name"],
        instance_type=item.get("InstanceType", ""),
        zone=item.get("Placement", {}).get("AvailabilityZone", ""),
        market="spot" if item.get("InstanceLifecycle") == "spot" else "on-demand",
        address=item.get("PrivateIpAddress", ""),
        index=item.get("AmiLaunchIndex", 0),
        launched_at=item["LaunchTime"],
        tags=_tags(item),
    )


def _tags(item: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in item.get("Tags", [])}


def _endpoint(fleet: Fleet) -> str | None:
    if fleet.aws_credentials:
        return S3Settings.from_block(fleet.aws_credentials).endpoint_url
    return os.environ.get("AWS_ENDPOINT_URL")


__all__ = ["AwsCloud"]
