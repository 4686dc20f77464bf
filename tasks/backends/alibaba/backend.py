"""The Alibaba Cloud backend: the instance backend (gpuflow.tasks.backends.instances.backend)
on ECS, whose provider is tasks/backends/alibaba/cloud.py."""

from __future__ import annotations

from typing import ClassVar, Literal

from gpuflow.tasks.backends.alibaba.cloud import AlibabaCloud
from gpuflow.tasks.backends.alibaba.settings import EcsFleet, fleet_named
from gpuflow.tasks.backends.instances.backend import InstanceBackend
from gpuflow.tasks.backends.instances.catalog import CloudSettings
from gpuflow.tasks.backends.instances.cloud import Cloud
from gpuflow.tasks.backends.instances.placement import InstancePlacement
from gpuflow.tasks.spec import Placement


class AlibabaPlacement(InstancePlacement):
    """placement: on Alibaba Cloud ECS: the market (preemptible instances are its spot)."""

    backend: Literal["alibaba"] = "alibaba"


class AlibabaBackend(InstanceBackend):
    name = "alibaba"
    placement_model: ClassVar[type[Placement]] = AlibabaPlacement
    extra: ClassVar[str | None] = "alibaba"

    @classmethod
    def block_types(cls) -> list[type]:
        from gpuflow.blocks.alibaba import AlibabaCredentials, EcsGpuFleet

        return [AlibabaCredentials, EcsGpuFleet]

    def settings_named(self, block: str | None, field: str) -> EcsFleet:
        return fleet_named(block, field)

    def cloud_of(self, settings: CloudSettings) -> Cloud:
        assert isinstance(settings, EcsFleet)
        return AlibabaCloud(settings)
