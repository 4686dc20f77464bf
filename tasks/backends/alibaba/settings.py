"""Where a job may rent on Alibaba Cloud ECS: an EcsGpuFleet block's settings, its RAM
credentials, and the clients of ECS and of OSS (its S3-compatible API) they make."""

from __future__ import annotations

import os
from typing import Any, ClassVar
from urllib.parse import urlsplit

from gpuflow.tasks.backends.instances.catalog import CloudSettings
from gpuflow.tasks.backends.instances.mailbox import s3_compatible
from gpuflow.tasks.errors import InvalidSpec, Unreachable
from gpuflow.tasks.saved_blocks import load_block

TIMEOUT_MS = 15_000
# what ECS answers when it will not take the credentials
REFUSED = {
    "InvalidAccessKeyId.NotFound",
    "InvalidAccessKeyId.Inactive",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "IncompleteSignature",
    "InvalidSecurityToken.Expired",
    "InvalidSecurityToken.Malformed",
    "Forbidden.RAM",
    "Forbidden",
    "NoPermission",
}


class EcsFleet(CloudSettings):
    """An EcsGpuFleet block's settings (defaults without one)."""

    block_type: ClassVar[str] = "EcsGpuFleet"
    region: str = "cn-hangzhou"
    credentials: str | None = None
    ram_role: str | None = None
    vpc_id: str | None = None
    vswitches: dict[str, str] = {}
    endpoint: str | None = None
    oss_endpoint: str | None = None
    oss_region: str | None = None

    def field(self, setting: str) -> str:
        if self.name:
            return super().field(setting)
        return (
            f"{setting} (no EcsGpuFleet in placement.block: ALIBABA_CLOUD_* variables and defaults)"
        )

    def ecs_endpoint(self) -> tuple[str, str]:
        """ECS's host (and port) and protocol."""
        return _host_and_protocol(self.endpoint or f"ecs.{self.region}.aliyuncs.com")

    def oss_url(self) -> str:
        return self.oss_endpoint or f"https://oss-{self.region}.aliyuncs.com"

    def keys(self) -> tuple[str, str, str | None]:
        """The RAM AccessKey pair (and STS token): the credentials block's, else the
        ALIBABA_CLOUD_* variables; InvalidSpec naming both when there are none."""
        if self.credentials:
            from gpuflow.blocks.alibaba import AlibabaCredentials

            block = load_block(
                AlibabaCredentials,
                self.credentials,
                self.field("credentials"),
                otherwise="save an AlibabaCredentials block under that name",
            )
            token = block.security_token.get_secret_value() if block.security_token else None
            return block.access_key_id, block.access_key_secret.get_secret_value(), token
        key = os.environ.get("ALIBABA_CLOUD_ACCESS_KEY_ID")
        secret = os.environ.get("ALIBABA_CLOUD_ACCESS_KEY_SECRET")
        if not key or not secret:
            raise InvalidSpec(
                f"{self.field('credentials')}: no Alibaba Cloud credentials; name an"
                " AlibabaCredentials block there or set ALIBABA_CLOUD_ACCESS_KEY_ID and"
                " ALIBABA_CLOUD_ACCESS_KEY_SECRET."
            )
        return key, secret, os.environ.get("ALIBABA_CLOUD_SECURITY_TOKEN") or None


def fleet_named(name: str | None, field: str = "placement.block") -> EcsFleet:
    """Return the EcsGpuFleet block `name`'s settings (defaults for None)."""
    if name is None:
        return EcsFleet(region=os.environ.get("ALIBABA_CLOUD_REGION_ID") or "cn-hangzhou")
    from gpuflow.blocks.alibaba import EcsGpuFleet

    block = load_block(EcsGpuFleet, name, field, otherwise=f"remove {field}")
    return EcsFleet(
        name=name,
        region=block.region,
        zones=list(block.zones),
        families=list(block.families),
        credentials=block.credentials,
        ram_role=block.ram_role,
        vpc_id=block.vpc_id,
        vswitches=dict(block.vswitches),
        image_id=block.image_id,
        control_prefix=block.control_prefix,
        endpoint=block.endpoint,
        oss_endpoint=block.oss_endpoint,
        oss_region=block.oss_region,
        install=block.install,
        boot_timeout_s=block.boot_timeout_s,
    )


def ecs_client(
    fleet: EcsFleet, keys: tuple[str, str, str | None] | None = None, endpoint: str | None = None
) -> Any:
    """An ECS client (Alibaba's SDK) for the fleet's region with its keys (or `keys`)."""
    from alibabacloud_ecs20140526.client import Client
    from alibabacloud_tea_openapi import models as open_api

    key, secret, token = keys or fleet.keys()
    host, protocol = _host_and_protocol(endpoint) if endpoint else fleet.ecs_endpoint()
    return Client(
        open_api.Config(
            access_key_id=key,
            access_key_secret=secret,
            security_token=token,
            region_id=fleet.region,
            endpoint=host,
            protocol=protocol,
            connect_timeout=TIMEOUT_MS,
            read_timeout=TIMEOUT_MS,
        )
    )


FORBID_OVERWRITE = "x-oss-forbid-overwrite"  # OSS's own conditional write


def oss_client(url: str, region: str, keys: tuple[str, str, str | None]) -> Any:
    """A boto3 client of OSS's S3-compatible API at `url`."""
    return s3_compatible(url, region, keys, FORBID_OVERWRITE)


def ecs_error(exc: Exception, fleet: EcsFleet, doing: str) -> InvalidSpec | Unreachable:
    """What went wrong talking to ECS, as one sentence with its real cause."""
    from botocore.exceptions import BotoCoreError, ClientError
    from darabonba.exceptions import UnretryableException

    where = f"Alibaba Cloud ECS in {fleet.region}"
    if isinstance(exc, InvalidSpec | Unreachable):
        return exc
    if isinstance(exc, ClientError):  # OSS, through its S3-compatible API
        error = exc.response.get("Error", {})
        code, message = error.get("Code", "?"), error.get("Message", "")
        return InvalidSpec(
            f"OSS at {fleet.oss_url()} said {code} ({message or 'no message'}) when asked to"
            f" {doing}; check {fleet.field('control_prefix')}, {fleet.field('oss_endpoint')} and"
            " the credentials' access to the bucket."
        )
    if isinstance(exc, BotoCoreError):
        return Unreachable(f"OSS at {fleet.oss_url()} did not answer when asked to {doing}: {exc}.")
    code = getattr(exc, "code", None)
    if code:
        data = getattr(exc, "data", None) or {}
        message = data.get("Message") if isinstance(data, dict) else None
        message = message or str(getattr(exc, "message", "") or "")
        if code in REFUSED:
            source = (
                f"the AlibabaCredentials block {fleet.credentials!r}"
                if fleet.credentials
                else "the ALIBABA_CLOUD_* variables"
            )
            return InvalidSpec(
                f"{where} refused the credentials from {source} ({code}: {message}); fix them"
                f" or grant the RAM user what it needs to {doing}."
            )
        return InvalidSpec(f"{where} said {code} ({message}) when asked to {doing}.")
    if isinstance(exc, UnretryableException | OSError):
        cause = getattr(exc, "message", None) or str(exc)
        return Unreachable(f"{where} did not answer when asked to {doing}: {cause}.")
    return InvalidSpec(f"{where} could not {doing}: {type(exc).__name__}: {exc}.")


def _host_and_protocol(endpoint: str) -> tuple[str, str]:
    if "://" in endpoint:
        parts = urlsplit(endpoint)
        return parts.netloc, parts.scheme
    return endpoint, "https"
