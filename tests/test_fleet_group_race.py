"""Two runs growing one EC2 fleet at once both find no security group and both make it:
the second's CreateSecurityGroup answers InvalidGroup.Duplicate (moto, as EC2 does), and it
takes the group the first made instead of failing its run."""

from __future__ import annotations

import boto3
from moto import mock_aws

from gpuflow.tasks.backends.ec2.cloud import AwsCloud


def test_the_second_run_to_make_a_fleets_group_takes_the_first_ones():
    with mock_aws():
        ec2 = boto3.client("ec2", region_name="us-east-1")
        other = boto3.client("ec2", region_name="us-east-1")
        vpc = ec2.describe_vpcs()["Vpcs"][0]["VpcId"]
        made: list[str] = []

        def first_run_wins(**_: object) -> None:  # the other run, between look and make
            if not made:
                group = other.create_security_group(
                    GroupName="gpuflow-fleet-lab", Description="x", VpcId=vpc
                )
                made.append(group["GroupId"])

        ec2.meta.events.register("before-call.ec2.CreateSecurityGroup", first_run_wins)
        cloud = AwsCloud.__new__(AwsCloud)
        cloud.__dict__["ec2"] = ec2  # the client its settings would make
        got = cloud.fleet_network("lab", {"gpuflow.fleet": "lab"}, [], None)
        assert made and got == made[0]
        groups = ec2.describe_security_groups(
            Filters=[{"Name": "group-name", "Values": ["gpuflow-fleet-lab"]}]
        )["SecurityGroups"]
        assert [g["GroupId"] for g in groups] == made
