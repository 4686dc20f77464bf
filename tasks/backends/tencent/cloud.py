"""Tencent Cloud CVM as a provider of the instance backends, through Tencent's Python SDK
(tencentcloud-sdk-python-cvm): its GPU types, what each zone sells and at what price by the
hour (DescribeZoneInstanceConfigInfos: pay-as-you-go and spot in one answer), spot
instances (`SPOTPAID`, one-time, under placement.spot_price_limit when given), and COS's
S3-compatible API for the mailbox.

CVM's catalog names a type's GPU count but not its GPU: the family says it (GN7: T4,
GN10Xp: V100, GT4: A100, PNV4: A10, ...: settings.FAMILY_GPUS); a family gpuflow does not
know is offered as `<family>-GPU`. The run's secret is an object of its mailbox
(instances.cloud.SecretInMailbox), as on Alibaba Cloud. The instances join the block's security
group (CVM's security groups are the VPC API's: one per run is not made here).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from gpuflow.tasks.backends.instances.catalog import Catalog, GpuType, Offer, key, nearest, rank
from gpuflow.tasks.backends.instances.cloud import (
    LIVE,
    Boot,
    Cloud,
    Launched,
    Machine,
    NextOffer,
    RoleMetadata,
    SecretInMailbox,
    failover,
)
from gpuflow.tasks.backends.instances.mailbox import s3_compatible
from gpuflow.tasks.backends.instances.placement import Ask
from gpuflow.tasks.backends.tencent import metadata
from gpuflow.tasks.backends.tencent.settings import FAMILY_GPUS, CvmFleet, cvm_client, cvm_error
from gpuflow.tasks.contract import RUN_LABEL
from gpuflow.tasks.errors import InvalidSpec, Unreachable
from gpuflow.tasks.gpus import product_from_ec2
from gpuflow.tasks.metrics.cost import PriceTable

BACKEND = "tencent"
FORBID_OVERWRITE = "x-cos-forbid-overwrite"  # COS's own conditional write
STATES = {
    "PENDING": "pending",
    "STARTING": "pending",
    "RUNNING": "running",
    "REBOOTING": "running",
    "STOPPING": "stopping",
    "STOPPED": "stopped",
    "SHUTDOWN": "stopped",
    "TERMINATING": "shutting-down",
    "LAUNCH_FAILED": "terminated",
}
# refusals after which another offer may still launch: no stock of the type in the zone
NEXT_OFFER = ("ResourceInsufficient.SpecifiedInstanceType", "ResourceInsufficient.Zone",
              "ResourcesSoldOut")  # fmt: skip
QUOTA = ("LimitExceeded", "ResourceInsufficient.AccountQuota")


class TencentCloud(SecretInMailbox, Cloud):
    backend = BACKEND
    label = "CVM"
    agent_module = "gpuflow.tasks.backends.tencent.agent"
    console_hint = "the CVM console's VNC login, or the instance's /var/log/cloud-init-output.log"
    settings: CvmFleet

    def __init__(self, settings: CvmFleet) -> None:
        super().__init__(settings)
        self.currency = settings.currency

    @functools.cached_property
    def cvm(self) -> Any:
        return cvm_client(self.settings)

    @functools.cached_property
    def cvm_anywhere(self) -> Any:
        """A client that names no region: for DescribeRegions, which answers anywhere."""
        return cvm_client(self.settings.model_copy(update={"region": ""}))

    def _call(self, action: str, **params: Any) -> Any:
        """Call `action` with the SDK's request model read from `params`; its response."""
        from tencentcloud.cvm.v20170312 import models

        request = getattr(models, f"{action}Request")()
        request.from_json_string(json.dumps(params))
        client = self.cvm_anywhere if action == "DescribeRegions" else self.cvm
        return getattr(client, action)(request)

    def storage(self) -> Any:
        fleet = self.settings
        return s3_compatible(
            fleet.cos_url(), fleet.cos_region or fleet.region, fleet.keys(), FORBID_OVERWRITE
        )

    def error(self, exc: Exception, doing: str) -> InvalidSpec | Unreachable:
        return cvm_error(exc, self.settings, doing)

    # -- what the cloud offers ---------------------------------------------------------

    def check_launch(self) -> None:
        fleet = self.settings
        self.check_image()
        if not fleet.vpc_id or not fleet.subnets or not fleet.security_group:
            raise InvalidSpec(
                f"{fleet.field('subnets')}: instances join a subnet of a VPC and a security"
                " group; set vpc_id, subnets (zone -> subnet id) and security_group in the block."
            )
        if not fleet.cam_role:
            raise InvalidSpec(
                f"{fleet.field('cam_role')}: the instances' agent reads and writes the control"
                " prefix and terminates its own instance with the instance's CAM role; set it"
                " to a role that may."
            )

    def _region(self) -> list[str]:
        """The region's zones; InvalidSpec (with the nearest names) for a region CVM does
        not have."""
        regions = [r.Region for r in self._call("DescribeRegions").RegionSet or []]
        if self.settings.region not in regions:
            raise InvalidSpec(
                f"{self.settings.field('region')}: {self.settings.region!r} is not a Tencent"
                f" Cloud region; use one such as {nearest(self.settings.region, regions)}."
            )
        return [z.Zone for z in self._call("DescribeZones").ZoneSet or []]

    def find_offers(self, ask: Ask, prices: PriceTable) -> list[Offer]:
        try:
            zones = self._region()
            self.check_zones(
                zones, {"subnets": list(self.settings.subnets), "zones": self.settings.zones}
            )
            types, where, on_demand = self._catalog("POSTPAID_BY_HOUR")
            spot: dict[str, float] = {}
            if ask.placement.market != "on-demand":
                _, spot_where, spot = self._catalog("SPOTPAID")
                if ask.placement.market == "spot":
                    where = spot_where
        except InvalidSpec:
            raise
        except Exception as exc:
            raise self.error(exc, "list GPU instance types") from None
        catalog = Catalog(types=types, zones=where, spot=spot, on_demand=on_demand)
        return rank(ask, catalog, prices, self.settings, BACKEND, self.currency, label=self.label)

    def _catalog(self, charge: str) -> tuple[list[GpuType], dict[str, list[str]], dict[str, float]]:
        """The GPU types of the fleet's families on sale with `charge`, the zones selling
        each (with a subnet), and "type zone" -> its price of an hour."""
        fleet = self.settings
        filters = [{"Name": "instance-charge-type", "Values": [charge]}]
        if fleet.families:
            filters.append({"Name": "instance-family", "Values": list(fleet.families)})
        answer = self._call("DescribeZoneInstanceConfigInfos", Filters=filters)
        types: dict[str, GpuType] = {}
        zones: dict[str, list[str]] = {}
        price: dict[str, float] = {}
        families: set[str] = set()
        for item in answer.InstanceTypeQuotaSet or []:
            families.add(item.InstanceFamily)
            count = float(item.GpuCount or 0)
            if count < 1 or count != int(count):  # none, or a slice of one (vGPU)
                continue
            gpu, memory_gib = FAMILY_GPUS.get(
                item.InstanceFamily, (f"{item.InstanceFamily}-GPU", 0)
            )
            types[item.InstanceType] = GpuType(
                instance_type=item.InstanceType,
                product=product_from_ec2(gpu, memory_gib * 1024),
                gpus=int(count),
                gpu_memory_mib=memory_gib * 1024,
                vcpus=int(item.Cpu or 0),
                memory_mib=int(item.Memory or 0) * 1024,
            )
            if item.Status != "SELL" or (fleet.subnets and item.Zone not in fleet.subnets):
                continue
            zones.setdefault(item.InstanceType, []).append(item.Zone)
            unit = item.Price.UnitPriceDiscount if item.Price else None
            if unit is not None:
                price[key(item.InstanceType, item.Zone)] = float(unit)
        stray = [f for f in fleet.families if f not in families]
        if stray:
            raise InvalidSpec(
                f"{fleet.field('families')}: {', '.join(stray)} is not an instance family CVM"
                f" sells in {fleet.region}; GPU families gpuflow knows: {', '.join(FAMILY_GPUS)}."
            )
        if fleet.families and not types:
            raise InvalidSpec(
                f"{fleet.field('families')}: {', '.join(fleet.families)} has no GPU instance"
                f" type in {fleet.region}; GPU families there are such as {', '.join(FAMILY_GPUS)}."
            )
        return list(types.values()), {t: sorted(z) for t, z in zones.items()}, price

    # -- a run's instances -------------------------------------------------------------

    def machines(self, tags: Mapping[str, str], states: list[str] | None = None) -> list[Machine]:
        wanted = set(states or LIVE)
        filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in tags.items()]
        found: list[Machine] = []
        offset = 0
        while True:
            answer = self._call("DescribeInstances", Filters=filters, Offset=offset, Limit=100)
            items = answer.InstanceSet or []
            for item in items:
                machine = _machine(item)
                if machine.state in wanted:
                    found.append(machine)
            offset += len(items)
            if not items or offset >= (answer.TotalCount or 0):
                return sorted(found, key=lambda m: (m.index, m.id))

    def launch(
        self, offers: list[Offer], nodes: int, boot: Boot, say: Callable[[str], None]
    ) -> Launched:
        run_id = boot.tags[RUN_LABEL]
        if found := self.adopted(run_id):
            return found
        fleet = self.settings

        def try_offer(offer: Offer) -> list[str]:
            token = hashlib.sha256(
                f"{run_id}:{offer.instance_type}:{offer.zone}:{offer.market}".encode()
            ).hexdigest()[:64]
            params: dict[str, Any] = {
                "InstanceChargeType": "SPOTPAID" if offer.market == "spot" else "POSTPAID_BY_HOUR",
                "Placement": {"Zone": offer.zone},
                "InstanceType": offer.instance_type,
                "ImageId": boot.image_id,
                "SystemDisk": {"DiskType": "CLOUD_PREMIUM", "DiskSize": max(50, boot.disk_gib)},
                "VirtualPrivateCloud": {
                    "VpcId": fleet.vpc_id,
                    "SubnetId": fleet.subnets[offer.zone],
                },
                "InternetAccessible": {"PublicIpAssigned": False, "InternetMaxBandwidthOut": 0},
                "InstanceCount": nodes,
                "InstanceName": f"gpuflow-{run_id}"[:100] + "-{R:1}",  # -1, -2: the nodes' order
                "SecurityGroupIds": [fleet.security_group],
                "ClientToken": token,
                "TagSpecification": [
                    {
                        "ResourceType": "instance",
                        "Tags": [{"Key": k, "Value": v} for k, v in sorted(boot.tags.items())],
                    }
                ],
                "UserData": base64.b64encode(boot.user_data.encode()).decode(),
                "CamRoleName": fleet.cam_role,
                "DisableApiTermination": False,
            }
            if offer.market == "spot":
                spot: dict[str, Any] = {"SpotInstanceType": "one-time"}
                if boot.spot_price_limit is not None:
                    spot["MaxPrice"] = f"{boot.spot_price_limit:.4f}"
                params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
            try:
                answer = self._call("RunInstances", **params)
            except Exception as exc:
                code = str(getattr(exc, "code", "") or "")
                message = str(getattr(exc, "message", "") or "")
                if code.startswith(NEXT_OFFER):
                    raise NextOffer(code, message) from None
                if code.startswith(QUOTA):
                    raise InvalidSpec(
                        f"Tencent Cloud CVM in {fleet.region} said {code} ({message}) when"
                        f" asked for {nodes} x {offer.instance_type}: no quota left in the"
                        " region; raise it in the console or ask for fewer GPUs."
                    ) from None
                raise
            return list(answer.InstanceIdSet or [])

        offer, ids = failover(offers, nodes, try_offer, say)
        return Launched(instance_ids=ids, offer=offer)

    def terminate(self, ids: list[str]) -> None:
        for start in range(0, len(ids), 100):
            self._call("TerminateInstances", InstanceIds=ids[start : start + 100])

    def network(self, run_id: str, tags: Mapping[str, str], nodes: int) -> str | None:
        return self.settings.security_group

    def leftovers(self, run_id: str) -> list[str]:
        return []  # the security group is the block's; the secret goes with the mailbox

    def hourly(self, machine: Machine) -> float | None:
        """The type's pay-as-you-go price in its zone (DescribeZoneInstanceConfigInfos), in
        USD."""
        _types, _zones, prices = self._catalog("POSTPAID_BY_HOUR")
        return self.in_usd(prices.get(key(machine.instance_type, machine.zone)), self.currency)

    def fleet_network(
        self, fleet: str, tags: Mapping[str, str], ssh_from: list[str], subnet: str | None
    ) -> str | None:
        """The block's security group: it must let SSH in from where gpuflow runs."""
        return self.settings.security_group

    def role_metadata(self) -> RoleMetadata:
        return RoleMetadata(
            endpoint=metadata.ENDPOINT,
            variable="GPUFLOW_CVM_METADATA_ENDPOINT",
            credentials_path=f"/latest/meta-data/cam/security-credentials/{self.settings.cam_role}",
            fields=("TmpSecretId", "TmpSecretKey", "Token"),
            forbid_overwrite=FORBID_OVERWRITE,
        )

    # -- storage and secrets -----------------------------------------------------------

    def agent_settings(self) -> dict[str, Any]:
        fleet = self.settings
        return {
            "region": fleet.region,
            "endpoint_url": fleet.cos_url(),
            "cloud": {
                "cvm_endpoint": fleet.endpoint or "",
                "cam_role": fleet.cam_role or "",
                "storage_region": fleet.cos_region or fleet.region,
            },
        }


def _machine(item: Any) -> Machine:
    tags = {t.Key: t.Value for t in item.Tags or []}
    name = item.InstanceName or ""
    suffix = name.rsplit("-", 1)[-1]
    try:
        launched = datetime.strptime(item.CreatedTime or "", "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=UTC
        )
    except ValueError:
        launched = datetime.now(UTC)
    return Machine(
        id=item.InstanceId,
        state=STATES.get(item.InstanceState or "", (item.InstanceState or "").lower()),
        instance_type=item.InstanceType or "",
        zone=item.Placement.Zone if item.Placement else "",
        market="spot" if item.InstanceChargeType == "SPOTPAID" else "on-demand",
        address=(item.PrivateIpAddresses or [""])[0],
        index=int(suffix) - 1 if suffix.isdigit() else 0,
        launched_at=launched,
        tags=tags,
    )
