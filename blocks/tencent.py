"""TencentCredentials and CvmGpuFleet: where and what gpuflow may rent on Tencent Cloud CVM
(`placement.backend: tencent`), and whose CAM key pays for it."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

# The orchestrator's own build of gpuflow: user-data sets GPUFLOW_WHEEL_GET (a presigned
# URL of the wheel beside the run's mailbox in COS, good for that object and the boot
# only), GPUFLOW_WHEEL_SHA256 and GPUFLOW_WHEEL; the instance fetches it, checks its hash
# and installs it with the tencent extra.
INSTALL_FROM_COS = (
    'curl -fsS -o "$GPUFLOW_WHEEL" "$GPUFLOW_WHEEL_GET"'
    ' && echo "$GPUFLOW_WHEEL_SHA256  $GPUFLOW_WHEEL" | sha256sum --check --quiet'
    " && python3 -m venv /opt/gpuflow"
    ' && /opt/gpuflow/bin/pip install --quiet "$GPUFLOW_WHEEL[tencent]"'
    " && GPUFLOW_PYTHON=/opt/gpuflow/bin/python"
)


class TencentCredentials(Block):
    """A CAM SecretId and SecretKey (and a token, for temporary credentials).

    Examples:
        ```python
        from gpuflow.blocks import TencentCredentials
        TencentCredentials(secret_id="AKID...", secret_key="...").save("tencent")
        ```
    """

    _block_type_name = "gpuflow Tencent Cloud Credentials"
    _block_type_slug = "gpuflow-tencent-credentials"
    _description = "A CAM SecretId and SecretKey for gpuflow's Tencent Cloud backend."

    secret_id: str = Field(..., title="SecretId")
    secret_key: SecretStr = Field(..., title="SecretKey")
    token: SecretStr | None = Field(
        None, title="Token", description="For temporary (STS) credentials only."
    )


class CvmGpuFleet(Block):
    """The region, zones, subnets and GPU families a job may rent on Tencent Cloud CVM.

    Examples:
        T4s in Guangzhou:
        ```python
        from gpuflow.blocks import CvmGpuFleet
        CvmGpuFleet(region="ap-guangzhou", families=["GN7"], vpc_id="vpc-...",
                    subnets={"ap-guangzhou-3": "subnet-..."}, security_group="sg-...",
                    credentials="tencent", cam_role="gpuflow-agent", image_id="img-...",
                    control_prefix="s3://my-bucket-1250000000/gpuflow").save("cvm")
        ```
        then `placement: {backend: tencent, block: cvm}`.
    """

    _block_type_name = "gpuflow CVM GPU Fleet"
    _block_type_slug = "gpuflow-cvm-gpu-fleet"
    _description = "Region, zones, subnets, GPU families and credentials for Tencent Cloud CVM."

    region: str = Field("ap-guangzhou", title="Region", description="e.g. ap-guangzhou.")
    zones: list[str] = Field(
        default_factory=list,
        title="Zones",
        description="Zones to launch in; empty: every zone that has a subnet below.",
    )
    families: list[str] = Field(
        default_factory=list,
        title="Instance families",
        description="Families allowed (e.g. GN7, GN10Xp, GT4); empty: every GPU family.",
    )
    credentials: str | None = Field(
        None,
        title="TencentCredentials block",
        description="Name of a TencentCredentials block; empty: TENCENTCLOUD_SECRET_ID and"
        " TENCENTCLOUD_SECRET_KEY.",
    )
    cam_role: str | None = Field(
        None,
        title="Instance CAM role",
        description="The CAM role the instances get: their agent reads and writes the control"
        " prefix in COS and terminates its own instance with it (no key on the instance).",
    )
    vpc_id: str | None = Field(None, title="VPC")
    subnets: dict[str, str] = Field(
        default_factory=dict, title="Subnets", description="Zone -> the subnet instances join."
    )
    security_group: str | None = Field(
        None,
        title="Security group",
        description="The security group the instances join: no inbound rule from outside,"
        " the group's own instances reach each other.",
    )
    image_id: str | None = Field(
        None, title="Image", description="NVIDIA's driver and Python 3.11+."
    )
    control_prefix: str | None = Field(
        None,
        title="Control prefix",
        description="s3:// prefix in COS (its S3-compatible API) where gpuflow and the agents"
        " exchange work, log lines, results and heartbeats; needed to launch.",
    )
    endpoint: str | None = Field(
        None,
        title="CVM endpoint",
        description="CVM's API endpoint; empty: cvm.tencentcloudapi.com.",
    )
    cos_endpoint: str | None = Field(
        None,
        title="COS endpoint",
        description="COS's S3-compatible endpoint; empty: https://cos.<region>.myqcloud.com.",
    )
    cos_region: str | None = Field(
        None,
        title="COS signing region",
        description="The region COS's S3-compatible API signs requests for; empty: the fleet's.",
    )
    currency: str = Field(
        "CNY",
        title="Currency",
        description="The currency CVM's prices are in for this account: CNY on the China"
        " site, USD on the international one.",
    )
    install: str = Field(INSTALL_FROM_COS, title="Install step")
    boot_timeout_s: float = Field(900.0, gt=0, title="Boot timeout")
