"""Ec2GpuFleet: where and what gpuflow may rent on AWS EC2 (`placement.backend: ec2`)."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field

# The orchestrator's own build of gpuflow, never a package of that name from an index:
# user-data sets GPUFLOW_WHEEL_URL (s3://, beside the run's mailbox), GPUFLOW_WHEEL_SHA256
# and GPUFLOW_WHEEL (where to put it).
INSTALL_OWN_WHEEL = (
    'aws s3 cp --only-show-errors "$GPUFLOW_WHEEL_URL" "$GPUFLOW_WHEEL"'
    ' && echo "$GPUFLOW_WHEEL_SHA256  $GPUFLOW_WHEEL" | sha256sum --check --quiet'
    ' && python3 -m venv /opt/gpuflow && /opt/gpuflow/bin/pip install --quiet "$GPUFLOW_WHEEL"'
    " && GPUFLOW_PYTHON=/opt/gpuflow/bin/python"
)
# what earlier versions saved as the default: gpuflow by name from PyPI
INSTALL_BY_NAME = (
    "python3 -m venv /opt/gpuflow && /opt/gpuflow/bin/pip install --quiet gpuflow"
    " && GPUFLOW_PYTHON=/opt/gpuflow/bin/python"
)


class Ec2GpuFleet(Block):
    """The region, zones and instance families a job may use, and whose credentials.

    Examples:
        Rent L4s and A10Gs in two zones of us-east-1:
        ```python
        from gpuflow.blocks import Ec2GpuFleet
        Ec2GpuFleet(region="us-east-1", zones=["us-east-1a", "us-east-1b"],
                    families=["g6", "g5"], aws_credentials="aws").save("gpus")
        ```
        then `placement: {backend: ec2, block: gpus}` in a job spec; `gpuflow offers JOB.yaml`
        ranks what it would rent.
    """

    _block_type_name = "gpuflow EC2 GPU Fleet"
    _block_type_slug = "gpuflow-ec2-gpu-fleet"
    _description = "Region, zones, instance families and credentials for gpuflow's EC2 backend."

    region: str = Field("us-east-1", title="Region", description="e.g. us-east-1.")
    zones: list[str] = Field(
        default_factory=list,
        title="Availability zones",
        description="Zones to launch in (e.g. us-east-1a); empty: every zone of the region.",
    )
    families: list[str] = Field(
        default_factory=list,
        title="Instance families",
        description="Families allowed (e.g. g6, g5, p5); empty: every GPU family.",
    )
    aws_credentials: str | None = Field(
        None,
        title="AwsCredentials block",
        description="Name of a prefect-aws AwsCredentials block; empty: the AWS_* variables"
        " (or the instance profile where the flow runs).",
    )
    instance_profile: str | None = Field(
        None, title="Instance profile", description="IAM instance profile the instances get."
    )
    image_id: str | None = Field(
        None,
        title="Machine image",
        description="AMI the instances boot (one with NVIDIA's driver and Python 3.11+, e.g. an"
        " AWS Deep Learning AMI); needed to launch, not to rank offers.",
    )
    control_prefix: str | None = Field(
        None,
        title="Control prefix",
        description="s3:// prefix where gpuflow and its instances' agents exchange work, log"
        " lines, results and heartbeats; needed to launch.",
    )
    install: str = Field(
        INSTALL_OWN_WHEEL,
        title="Install step",
        description="The user-data's shell step that installs gpuflow on the instance and sets"
        " GPUFLOW_PYTHON to the interpreter that runs its agent. The default fetches the"
        " orchestrator's own wheel ($GPUFLOW_WHEEL_URL, beside the run's mailbox) with the"
        " AWS CLI and the instance's profile, checks it against $GPUFLOW_WHEEL_SHA256 and"
        " installs it in a venv (its dependencies from PyPI).",
    )
    boot_timeout_s: float = Field(
        900.0,
        gt=0,
        title="Boot timeout",
        description="Seconds from launch until every instance's agent must have said it is ready.",
    )
