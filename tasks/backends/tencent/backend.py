"""The Tencent Cloud backend: the instance backend (gpuflow.tasks.backends.instances.backend)
on CVM, whose provider is tasks/backends/tencent/cloud.py."""

from __future__ import annotations

from typing import ClassVar, Literal

from gpuflow.tasks.backends.instances.backend import InstanceBackend
from gpuflow.tasks.backends.instances.catalog import CloudSettings
from gpuflow.tasks.backends.instances.cloud import Cloud
from gpuflow.tasks.backends.instances.placement import InstancePlacement
from gpuflow.tasks.backends.tencent.cloud import TencentCloud
from gpuflow.tasks.backends.tencent.settings import CvmFleet, fleet_named
from gpuflow.tasks.spec import Placement


class TencentPlacement(InstancePlacement):
    """placement: on Tencent Cloud CVM: the market (spot is SPOTPAID)."""

    backend: Literal["tencent"] = "tencent"


class TencentBackend(InstanceBackend):
    name = "tencent"
    placement_model: ClassVar[type[Placement]] = TencentPlacement
    extra: ClassVar[str | None] = "tencent"

    @classmethod
    def block_types(cls) -> list[type]:
        from gpuflow.blocks.tencent import CvmGpuFleet, TencentCredentials

        return [TencentCredentials, CvmGpuFleet]

    def settings_named(self, block: str | None, field: str) -> CvmFleet:
        return fleet_named(block, field)

    def cloud_of(self, settings: CloudSettings) -> Cloud:
        assert isinstance(settings, CvmFleet)
        return TencentCloud(settings)
