"""The EC2 backend: the instance backend (gpuflow.tasks.backends.instances.backend) on AWS,
whose provider is tasks/backends/ec2/cloud.py: EC2's catalog and launches (IMDSv2, an
encrypted gp3 root, no key pair, terminate on shutdown), S3 for the mailbox, Secrets
Manager for the run's secret, a security group per run."""

from __future__ import annotations

from typing import ClassVar

from gpuflow.tasks.backends.ec2.catalog import Fleet, fleet_named
from gpuflow.tasks.backends.ec2.cloud import AwsCloud
from gpuflow.tasks.backends.ec2.placement import Ec2Ask, Ec2Placement
from gpuflow.tasks.backends.instances.backend import (
    Heartbeat,
    InstanceBackend,
    InstanceState,
    user_data,
)
from gpuflow.tasks.backends.instances.catalog import CloudSettings
from gpuflow.tasks.backends.instances.cloud import Cloud
from gpuflow.tasks.backends.instances.placement import Ask
from gpuflow.tasks.metrics.cost import ListPrices
from gpuflow.tasks.spec import Placement


class Ec2Backend(InstanceBackend):
    name = "ec2"
    placement_model: ClassVar[type[Placement]] = Ec2Placement
    ask_model: ClassVar[type[Ask]] = Ec2Ask
    extra: ClassVar[str | None] = "aws"
    # on-demand list prices per GPU (an instance's price divided by its GPUs)
    list_prices = ListPrices(
        gpu_hourly_usd={
            "Tesla-T4": 0.526,
            "NVIDIA-A10G": 1.006,
            "NVIDIA-L4": 0.805,
            "NVIDIA-L40S": 1.861,
            "Tesla-V100-SXM2-16GB": 3.06,
            "NVIDIA-A100-SXM4-40GB": 4.096,
            "NVIDIA-A100-SXM4-80GB": 5.121,
            "NVIDIA-H100-80GB-HBM3": 12.29,
            "NVIDIA-H200": 13.86,
        },
        cpu_core_hourly_usd=0.048,
        disk_gb_month_usd=0.08,
    )

    @classmethod
    def block_types(cls) -> list[type]:
        from gpuflow.blocks.ec2_fleet import Ec2GpuFleet

        return [Ec2GpuFleet]

    def settings_named(self, block: str | None, field: str) -> Fleet:
        return fleet_named(block, field)

    def cloud_of(self, settings: CloudSettings) -> Cloud:
        assert isinstance(settings, Fleet)
        return AwsCloud(settings)


__all__ = ["Ec2Backend", "Ec2Placement", "Heartbeat", "InstanceState", "user_data"]
