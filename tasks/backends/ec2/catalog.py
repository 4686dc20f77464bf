"""EC2's GPU instance types, where they are offered, what they cost, and which fit a job.

The types come from DescribeInstanceTypes (GPU product, count and memory, vCPUs, RAM), the
zones from DescribeInstanceTypeOfferings, spot prices from DescribeSpotPriceHistory;
on-demand and EBS prices from the run's price table; the offers are ranked as on every
cloud (gpuflow.tasks.backends.instances.catalog). Every failure is one sentence naming the
setting and the fix.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, ClassVar

from gpuflow.tasks.backends.ec2.placement import Ec2Ask
from gpuflow.tasks.backends.instances.catalog import (
    Catalog,
    CloudSettings,
    GpuType,
    Offer,
    key,
    rank,
)
from gpuflow.tasks.backends.instances.placement import Ask
from gpuflow.tasks.errors import InvalidSpec, Unreachable
from gpuflow.tasks.gpus import product_from_ec2
from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.saved_blocks import load_block
from gpuflow.tasks.spec import JobSpec
from gpuflow.tasks.storage import S3Settings, StorageError

BACKEND = "ec2"
REFUSED = {
    "AuthFailure",
    "UnrecognizedClientException",
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "UnauthorizedOperation",
    "AccessDenied",
    "ExpiredToken",
}


class Fleet(CloudSettings):
    """Where a job may rent: an Ec2GpuFleet block's settings (defaults without one)."""

    block_type: ClassVar[str] = "Ec2GpuFleet"
    region: str = "us-east-1"
    aws_credentials: str | None = None
    instance_profile: str | None = None

    @functools.cached_property
    def credentials(self) -> S3Settings | None:
        """Return the AwsCredentials block's settings, read once for this fleet; None:
        boto3's own chain. InvalidSpec for a block that does not exist."""
        if not self.aws_credentials:
            return None
        try:
            return S3Settings.from_block(self.aws_credentials)
        except StorageError as exc:
            raise InvalidSpec(
                str(exc).replace("storage.aws_credentials", self.field("aws_credentials"))
            ) from None

    def field(self, setting: str) -> str:
        if self.name:
            return super().field(setting)
        return f"{setting} (no Ec2GpuFleet in placement.block: AWS_* variables and defaults)"


def fleet_of(spec: JobSpec | Ask) -> Fleet:
    """Return the fleet settings `placement.block` names (an Ec2GpuFleet), else defaults
    with the region of AWS_DEFAULT_REGION / AWS_REGION."""
    return fleet_named(spec.placement.block)


def fleet_named(name: str | None, field: str = "placement.block") -> Fleet:
    """Return the Ec2GpuFleet block `name`'s settings (defaults for None)."""
    if name is None:
        region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
        return Fleet(region=region or "us-east-1")

    # blocks import prefect-aws and prefect-kubernetes (about 1 s): read one only when used
    from gpuflow.blocks.ec2_fleet import Ec2GpuFleet

    block = load_block(Ec2GpuFleet, name, field, otherwise=f"remove {field}")
    return Fleet(
        name=name,
        region=block.region,
        zones=list(block.zones),
        families=list(block.families),
        aws_credentials=block.aws_credentials,
        instance_profile=block.instance_profile,
        image_id=block.image_id,
        control_prefix=block.control_prefix,
        install=block.install,
        boot_timeout_s=block.boot_timeout_s,
    )


def aws_client(fleet: Fleet, service: str) -> Any:
    """Return a boto3 client of `service` for the fleet's region: the AwsCredentials
    block's keys and endpoint, else boto3's own chain (AWS_* variables incl.
    AWS_ENDPOINT_URL, profile, instance profile). InvalidSpec for a region AWS does not
    have, or a credentials block that does not exist."""
    import boto3

    session = boto3.session.Session()
    regions = {
        r
        for p in session.get_available_partitions()
        for r in session.get_available_regions("ec2", p)
    }
    if fleet.region not in regions:
        raise InvalidSpec(
            f"{fleet.field('region')}: {fleet.region!r} is not an AWS region; use one such as"
            " us-east-1, us-west-2 or eu-west-1."
        )
    params: dict[str, Any] = {"region_name": fleet.region}
    # Throttling (RequestLimitExceeded) and 5xx answers are retried with backoff and
    # jitter; RunInstances carries a ClientToken, so a retry never launches twice. The
    # block's own botocore config (aws_client_parameters.config) comes first.
    config: dict[str, Any] = {"retries": {"max_attempts": 8, "mode": "standard"}}
    settings = fleet.credentials
    if settings is not None:
        params |= settings.client_kwargs()
        config |= settings.client_config
    from botocore.config import Config

    try:
        params["config"] = Config(**config)
    except (TypeError, ValueError) as exc:
        raise InvalidSpec(
            f"the AwsCredentials block {fleet.aws_credentials!r}: aws_client_parameters.config"
            f" is not botocore's Config ({exc}); fix or remove it."
        ) from None
    return boto3.client(service, **params)


def ec2_client(fleet: Fleet) -> Any:
    """Return an EC2 client for the fleet (see aws_client)."""
    return aws_client(fleet, "ec2")


def aws_error(exc: Exception, fleet: Fleet, doing: str) -> InvalidSpec | Unreachable:
    """Return what went wrong talking to EC2 as one sentence with its real cause."""
    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    where = f"EC2 in {fleet.region}"
    if isinstance(exc, NoCredentialsError):
        return InvalidSpec(
            f"no AWS credentials to {doing}: name an AwsCredentials block in"
            f" {fleet.field('aws_credentials')} or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY."
        )
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code, message = error.get("Code", "?"), error.get("Message", "")
        if code in REFUSED:
            source = (
                f"the AwsCredentials block {fleet.aws_credentials!r}"
                if fleet.aws_credentials
                else "the AWS_* variables"
            )
            return InvalidSpec(
                f"{where} refused the credentials from {source} ({code}: {message}); fix them"
                f" or grant ec2:Describe* to {doing}."
            )
        return InvalidSpec(f"{where} said {code} ({message}) when asked to {doing}.")
    if isinstance(exc, EndpointConnectionError | ReadTimeoutError | ConnectTimeoutError):
        return Unreachable(f"{where} did not answer when asked to {doing}: {exc}.")
    return InvalidSpec(f"{where} could not {doing}: {type(exc).__name__}: {exc}.")


def gpu_types(ec2: Any, families: Iterable[str] = ()) -> list[GpuType]:
    """Return every instance type with whole GPUs (of `families`, when given)."""
    wanted = {f.lower() for f in families}
    found = []
    for page in ec2.get_paginator("describe_instance_types").paginate():
        for item in page["InstanceTypes"]:
            name = item["InstanceType"]
            gpus = (item.get("GpuInfo") or {}).get("Gpus") or []
            if not gpus or (wanted and name.split(".")[0].lower() not in wanted):
                continue
            gpu = gpus[0]
            count = sum(g.get("Count", 0) for g in gpus)
            if count < 1:  # fractional GPUs (g6f): not a GPU a job can hold
                continue
            memory = (gpu.get("MemoryInfo") or {}).get("SizeInMiB", 0)
            strategies = (item.get("PlacementGroupInfo") or {}).get("SupportedStrategies", [])
            found.append(
                GpuType(
                    instance_type=name,
                    product=product_from_ec2(
                        gpu["Name"], memory, gpu.get("Manufacturer", "NVIDIA")
                    ),
                    gpus=count,
                    gpu_memory_mib=memory,
                    vcpus=item["VCpuInfo"]["DefaultVCpus"],
                    memory_mib=item["MemoryInfo"]["SizeInMiB"],
                    placement_group="cluster" in strategies,
                )
            )
    return found


def zones_offering(ec2: Any, types: list[str]) -> dict[str, list[str]]:
    """Return instance type -> the zones of the region that offer it."""
    zones: dict[str, list[str]] = {}
    for start in range(0, len(types), 100):  # the filter takes at most 200 values
        pages = ec2.get_paginator("describe_instance_type_offerings").paginate(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": types[start : start + 100]}],
        )
        for page in pages:
            for offer in page["InstanceTypeOfferings"]:
                zones.setdefault(offer["InstanceType"], []).append(offer["Location"])
    return {t: sorted(z) for t, z in zones.items()}


def spot_prices(ec2: Any, types: list[str]) -> dict[str, float]:
    """Return "type zone" -> the latest Linux spot price; none where EC2 has none."""
    latest: dict[tuple[str, str], tuple[datetime, float]] = {}
    for start in range(0, len(types), 100):
        pages = ec2.get_paginator("describe_spot_price_history").paginate(
            InstanceTypes=types[start : start + 100],
            ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
            StartTime=datetime.now(UTC),
        )
        for page in pages:
            for item in page["SpotPriceHistory"]:
                where = (item["InstanceType"], item["AvailabilityZone"])
                stamp = item["Timestamp"]
                if where not in latest or stamp > latest[where][0]:
                    latest[where] = (stamp, float(item["SpotPrice"]))
    return {key(*where): price for where, (_, price) in latest.items()}


def find_offers(
    spec: JobSpec | Ask, prices: PriceTable, fleet: Fleet | None = None
) -> tuple[Fleet, list[Offer]]:
    """Return the fleet (`fleet`, else the one placement.block names) and the ranked
    offers for `spec` (a spec, or what a cluster keeps of it), read from EC2 (nothing
    launched)."""
    ask = spec if isinstance(spec, Ask) else Ec2Ask.of(spec, prices)
    fleet = fleet or fleet_of(ask)
    ec2 = ec2_client(fleet)
    try:
        types = gpu_types(ec2, fleet.families)
        names = [t.instance_type for t in types]
        zones = zones_offering(ec2, names) if names else {}
        spot = spot_prices(ec2, names) if names and ask.placement.market != "on-demand" else {}
    except Exception as exc:
        raise aws_error(exc, fleet, "list GPU instance types") from None
    if fleet.families and not types:
        raise InvalidSpec(
            f"{fleet.field('families')}: {', '.join(fleet.families)} hold no GPU instance type"
            f" in {fleet.region}; name GPU families such as g6, g5, p5."
        )
    catalog = Catalog(types=types, zones=zones, spot=spot)
    return fleet, rank(ask, catalog, prices, fleet, BACKEND, label="EC2")


__all__ = ["Fleet", "GpuType", "Offer", "aws_client", "aws_error", "ec2_client", "find_offers"]
