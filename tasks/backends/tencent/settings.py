"""Where a job may rent on Tencent Cloud CVM: a CvmGpuFleet block's settings, its CAM
credentials, and the clients of CVM and of COS (its S3-compatible API) they make."""

from __future__ import annotations

import os
from typing import Any, ClassVar
from urllib.parse import urlsplit

from gpuflow.tasks.backends.instances.catalog import CloudSettings
from gpuflow.tasks.errors import InvalidSpec, Unreachable
from gpuflow.tasks.saved_blocks import load_block

TIMEOUT_S = 15
# what CVM answers when it will not take the credentials
REFUSED = (
    "AuthFailure",  # .SignatureFailure, .SecretIdNotFound, .SignatureExpire, .TokenFailure, ...
    "UnauthorizedOperation",
)
# GPU families by what CVM's catalog does not say: the GPU, and its memory (GiB)
FAMILY_GPUS: dict[str, tuple[str, int]] = {
    "GN7": ("T4", 16),
    "GN7vi": ("T4", 16),
    "GN8": ("P40", 24),
    "GN10X": ("V100", 32),
    "GN10Xp": ("V100", 32),
    "GT4": ("A100", 40),
    "PNV4": ("A10", 24),
    "HCCPNV4h": ("A100", 80),
}


class CvmFleet(CloudSettings):
    """A CvmGpuFleet block's settings (defaults without one)."""

    block_type: ClassVar[str] = "CvmGpuFleet"
    region: str = "ap-guangzhou"
    credentials: str | None = None
    cam_role: str | None = None
    vpc_id: str | None = None
    subnets: dict[str, str] = {}
    security_group: str | None = None
    endpoint: str | None = None
    cos_endpoint: str | None = None
    cos_region: str | None = None
    currency: str = "CNY"

    def field(self, setting: str) -> str:
        if self.name:
            return super().field(setting)
        return (
            f"{setting} (no CvmGpuFleet in placement.block: TENCENTCLOUD_* variables and defaults)"
        )

    def cos_url(self) -> str:
        return self.cos_endpoint or f"https://cos.{self.region}.myqcloud.com"

    def keys(self) -> tuple[str, str, str | None]:
        """The CAM SecretId and SecretKey (and token): the credentials block's, else the
        TENCENTCLOUD_* variables; InvalidSpec naming both when there are none."""
        if self.credentials:
            from gpuflow.blocks.tencent import TencentCredentials

            block = load_block(
                TencentCredentials,
                self.credentials,
                self.field("credentials"),
                otherwise="save a TencentCredentials block under that name",
            )
            token = block.token.get_secret_value() if block.token else None
            return block.secret_id, block.secret_key.get_secret_value(), token
        key = os.environ.get("TENCENTCLOUD_SECRET_ID")
        secret = os.environ.get("TENCENTCLOUD_SECRET_KEY")
        if not key or not secret:
            raise InvalidSpec(
                f"{self.field('credentials')}: no Tencent Cloud credentials; name a"
                " TencentCredentials block there or set TENCENTCLOUD_SECRET_ID and"
                " TENCENTCLOUD_SECRET_KEY."
            )
        return key, secret, os.environ.get("TENCENTCLOUD_SESSION_TOKEN") or None


def fleet_named(name: str | None, field: str = "placement.block") -> CvmFleet:
    """Return the CvmGpuFleet block `name`'s settings (defaults for None)."""
    if name is None:
        return CvmFleet(region=os.environ.get("TENCENTCLOUD_REGION") or "ap-guangzhou")
    from gpuflow.blocks.tencent import CvmGpuFleet

    block = load_block(CvmGpuFleet, name, field, otherwise=f"remove {field}")
    return CvmFleet(
        name=name,
        **block.model_dump(
            include={
                "region",
                "zones",
                "families",
                "credentials",
                "cam_role",
                "vpc_id",
                "subnets",
                "security_group",
                "image_id",
                "control_prefix",
                "endpoint",
                "cos_endpoint",
                "cos_region",
                "currency",
                "install",
                "boot_timeout_s",
            }
        ),
    )


def cvm_client(
    fleet: CvmFleet, keys: tuple[str, str, str | None] | None = None, endpoint: str | None = None
) -> Any:
    """A CVM client (Tencent's SDK) for the fleet's region with its keys (or `keys`)."""
    from tencentcloud.common import credential
    from tencentcloud.common.profile.client_profile import ClientProfile
    from tencentcloud.common.profile.http_profile import HttpProfile
    from tencentcloud.cvm.v20170312 import cvm_client as cvm

    key, secret, token = keys or fleet.keys()
    where = endpoint or fleet.endpoint or "cvm.tencentcloudapi.com"
    protocol, host = "https", where
    if "://" in where:
        parts = urlsplit(where)
        protocol, host = parts.scheme, parts.netloc
    profile = ClientProfile(
        httpProfile=HttpProfile(protocol=protocol, endpoint=host, reqTimeout=TIMEOUT_S)
    )
    return cvm.CvmClient(credential.Credential(key, secret, token), fleet.region, profile)


def cvm_error(exc: Exception, fleet: CvmFleet, doing: str) -> InvalidSpec | Unreachable:
    """What went wrong talking to CVM (or COS), as one sentence with its real cause."""
    from botocore.exceptions import BotoCoreError, ClientError
    from tencentcloud.common.exception.tencent_cloud_sdk_exception import (
        TencentCloudSDKException,
    )

    where = f"Tencent Cloud CVM in {fleet.region}"
    if isinstance(exc, InvalidSpec | Unreachable):
        return exc
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code, message = error.get("Code", "?"), error.get("Message", "")
        return InvalidSpec(
            f"COS at {fleet.cos_url()} said {code} ({message or 'no message'}) when asked to"
            f" {doing}; check {fleet.field('control_prefix')}, {fleet.field('cos_endpoint')} and"
            " the credentials' access to the bucket."
        )
    if isinstance(exc, BotoCoreError):
        return Unreachable(f"COS at {fleet.cos_url()} did not answer when asked to {doing}: {exc}.")
    if isinstance(exc, TencentCloudSDKException):
        code, message = str(exc.code or ""), str(exc.message or "")
        if code.startswith("ClientNetworkError") or code == "ClientError":
            return Unreachable(f"{where} did not answer when asked to {doing}: {message}.")
        if code.startswith(REFUSED):
            source = (
                f"the TencentCredentials block {fleet.credentials!r}"
                if fleet.credentials
                else "the TENCENTCLOUD_* variables"
            )
            return InvalidSpec(
                f"{where} refused the credentials from {source} ({code}: {message}); fix them"
                f" or grant the CAM user what it needs to {doing}."
            )
        return InvalidSpec(f"{where} said {code} ({message}) when asked to {doing}.")
    return InvalidSpec(f"{where} could not {doing}: {type(exc).__name__}: {exc}.")
