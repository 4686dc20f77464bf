"""AlibabaCredentials and EcsGpuFleet: where and what gpuflow may rent on Alibaba Cloud ECS
(`placement.backend: alibaba`), and whose RAM AccessKey pays for it."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

# The orchestrator's own build of gpuflow: user-data sets GPUFLOW_WHEEL_GET (a presigned
# URL of the wheel beside the run's mailbox in OSS, good for that object and the boot
# only), GPUFLOW_WHEEL_SHA256 and GPUFLOW_WHEEL; the instance fetches it, checks its hash
# and installs it with the alibaba extra.
INSTALL_FROM_OSS = (
    'curl -fsS -o "$GPUFLOW_WHEEL" "$GPUFLOW_WHEEL_GET"'
    ' && echo "$GPUFLOW_WHEEL_SHA256  $GPUFLOW_WHEEL" | sha256sum --check --quiet'
    " && python3 -m venv /opt/gpuflow"
    ' && /opt/gpuflow/bin/pip install --quiet "$GPUFLOW_WHEEL[alibaba]"'
    " && GPUFLOW_PYTHON=/opt/gpuflow/bin/python"
)


class AlibabaCredentials(Block):
    """A RAM user's AccessKey pair (and an STS token, for temporary credentials).

    Examples:
        ```python
        from gpuflow.blocks import AlibabaCredentials
        AlibabaCredentials(access_key_id="LTAI...", access_key_secret="...").save("aliyun")
        ```
    """

    _block_type_name = "gpuflow Alibaba Cloud Credentials"
    _block_type_slug = "gpuflow-alibaba-credentials"
    _description = "A RAM AccessKey pair for gpuflow's Alibaba Cloud backend."

    access_key_id: str = Field(..., title="AccessKey ID")
    access_key_secret: SecretStr = Field(..., title="AccessKey secret")
    security_token: SecretStr | None = Field(
        None, title="STS token", description="For temporary (STS) credentials only."
    )


class EcsGpuFleet(Block):
    """The region, zones, vSwitches and GPU families a job may rent on Alibaba Cloud ECS.

    Examples:
        T4s and A10s in two zones of Hangzhou:
        ```python
        from gpuflow.blocks import EcsGpuFleet
        EcsGpuFleet(region="cn-hangzhou", families=["ecs.gn6i", "ecs.gn7i"],
                    vswitches={"cn-hangzhou-h": "vsw-...", "cn-hangzhou-i": "vsw-..."},
                    vpc_id="vpc-...", credentials="aliyun", ram_role="gpuflow-agent",
                    image_id="ubuntu_22_04_x64_20G_alibase_...",
                    control_prefix="s3://my-bucket/gpuflow").save("ecs")
        ```
        then `placement: {backend: alibaba, block: ecs}`; `gpuflow offers JOB.yaml` ranks
        what it would rent.
    """

    _block_type_name = "gpuflow ECS GPU Fleet"
    _block_type_slug = "gpuflow-ecs-gpu-fleet"
    _description = "Region, zones, vSwitches, GPU families and credentials for Alibaba Cloud ECS."

    region: str = Field("cn-hangzhou", title="Region", description="e.g. cn-hangzhou.")
    zones: list[str] = Field(
        default_factory=list,
        title="Zones",
        description="Zones to launch in; empty: every zone that has a vSwitch below.",
    )
    families: list[str] = Field(
        default_factory=list,
        title="Instance families",
        description="Families allowed (e.g. ecs.gn6i, ecs.gn7i, ecs.gn7); empty: every GPU family.",
    )
    credentials: str | None = Field(
        None,
        title="AlibabaCredentials block",
        description="Name of an AlibabaCredentials block; empty: ALIBABA_CLOUD_ACCESS_KEY_ID and"
        " ALIBABA_CLOUD_ACCESS_KEY_SECRET.",
    )
    ram_role: str | None = Field(
        None,
        title="Instance RAM role",
        description="The RAM role the instances get: their agent reads and writes the control"
        " prefix in OSS and deletes its own instance with it (no key on the instance).",
    )
    vpc_id: str | None = Field(None, title="VPC", description="The VPC of the vSwitches.")
    vswitches: dict[str, str] = Field(
        default_factory=dict,
        title="vSwitches",
        description="Zone -> the vSwitch instances in that zone attach to (no public address).",
    )
    image_id: str | None = Field(
        None,
        title="Image",
        description="The image the instances boot (NVIDIA's driver and Python 3.11+); needed"
        " to launch, not to rank offers.",
    )
    control_prefix: str | None = Field(
        None,
        title="Control prefix",
        description="s3:// prefix in OSS (its S3-compatible API) where gpuflow and the agents"
        " exchange work, log lines, results and heartbeats; needed to launch.",
    )
    endpoint: str | None = Field(
        None,
        title="ECS endpoint",
        description="ECS's API endpoint; empty: ecs.<region>.aliyuncs.com (https).",
    )
    oss_endpoint: str | None = Field(
        None,
        title="OSS endpoint",
        description="OSS's S3-compatible endpoint; empty: https://oss-<region>.aliyuncs.com"
        " (the instances use the -internal one).",
    )
    oss_region: str | None = Field(
        None,
        title="OSS signing region",
        description="The region OSS's S3-compatible API signs requests for (the bucket's);"
        " empty: the fleet's region.",
    )
    install: str = Field(
        INSTALL_FROM_OSS,
        title="Install step",
        description="The user-data's shell step that installs gpuflow and sets GPUFLOW_PYTHON.",
    )
    boot_timeout_s: float = Field(900.0, gt=0, title="Boot timeout")


__all__ = ["INSTALL_FROM_OSS", "AlibabaCredentials", "EcsGpuFleet"]
