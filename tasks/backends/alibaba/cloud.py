"""Alibaba Cloud ECS as a provider of the instance backends, through Alibaba's Python SDK
(alibabacloud-ecs20140526): its GPU types, stock by zone and prices (in the currency ECS
gives: CNY on the China site), pay-as-you-go and preemptible instances (SpotAsPriceGo, or
SpotWithPriceLimit under placement.spot_price_limit), a security group per run, and OSS's
S3-compatible API for the mailbox.

Why OSS's S3-compatible API and not its own SDK: the mailbox, the agent and the reaper are
one code path on every cloud (boto3, which gpuflow has for S3 already); OSS takes S3's
signature V4 and its requests gpuflow makes (put, get, list, delete, conditional writes).
The run's secret (the agents' Prefect token, the run's variables, a registry login) is an
object of the run's mailbox written with server-side encryption, which only the run's RAM
role and gpuflow read; it goes with the mailbox at teardown.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import inspect
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from gpuflow.tasks.backends.alibaba import metadata
from gpuflow.tasks.backends.alibaba.settings import (
    FORBID_OVERWRITE,
    EcsFleet,
    ecs_client,
    ecs_error,
    oss_client,
)
from gpuflow.tasks.backends.instances.catalog import Catalog, GpuType, Offer, key, nearest, rank
from gpuflow.tasks.backends.instances.cloud import (
    FLEET_TAG,
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
from gpuflow.tasks.backends.instances.placement import Ask
from gpuflow.tasks.contract import OWNER_LABEL, RUN_LABEL
from gpuflow.tasks.errors import CapacityError, InvalidSpec, Unreachable
from gpuflow.tasks.gpus import canonical_product, product_named
from gpuflow.tasks.metrics.cost import PriceTable

BACKEND = "alibaba"
PRIVATE = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]
# ECS's words for an instance's state, in the words gpuflow keeps (EC2's)
STATES = {
    "Pending": "pending",
    "Starting": "pending",
    "Running": "running",
    "Stopping": "stopping",
    "Stopped": "stopped",
}
# refusals after which another offer (type, zone or market) may still launch
NEXT_OFFER = {
    "OperationDenied.NoStock",
    "Zone.NotOnSale",
    "InvalidInstanceType.ZoneNotSupported",
    "InvalidResourceType.NotSupported",
    "InvalidSpotPriceLimit.LowerThanPublicPrice",
    "OperationDenied.SpotPriceLimitTooLow",
    "InvalidInstanceType.NotSupported",
}
# refusals that hold for every offer of the region: said as the API said them
QUOTA = ("QuotaExceed", "OperationDenied.QuotaExceed", "InvalidAccountStatus")


class AlibabaCloud(SecretInMailbox, Cloud):
    backend = BACKEND
    label = "ECS"
    # what DescribePrice answers in (an international account's USD is said per price)
    currency = "CNY"
    agent_module = "gpuflow.tasks.backends.alibaba.agent"
    console_hint = "the ECS console's instance screenshot, or GetInstanceConsoleOutput"
    settings: EcsFleet

    def __init__(self, settings: EcsFleet) -> None:
        super().__init__(settings)

    @functools.cached_property
    def ecs(self) -> Any:
        return ecs_client(self.settings)

    def _call(self, action: str, **params: Any) -> Any:
        """Call `action` with the SDK's request model built from `params`; its body."""
        from alibabacloud_ecs20140526 import models
        from darabonba.runtime import RuntimeOptions

        model = getattr(models, f"{action}Request")
        if "region_id" in inspect.signature(model.__init__).parameters:
            params["region_id"] = self.settings.region
        request = model(**params)
        method = getattr(self.ecs, f"{_snake(action)}_with_options")
        return method(request, RuntimeOptions(autoretry=False)).body

    def storage(self) -> Any:
        fleet = self.settings
        return oss_client(fleet.oss_url(), fleet.oss_region or fleet.region, fleet.keys())

    def error(self, exc: Exception, doing: str) -> InvalidSpec | Unreachable:
        return ecs_error(exc, self.settings, doing)

    # -- what the cloud offers ---------------------------------------------------------

    def check_launch(self) -> None:
        fleet = self.settings
        self.check_image()
        if not fleet.vpc_id or not fleet.vswitches:
            raise InvalidSpec(
                f"{fleet.field('vswitches')}: instances attach to a vSwitch of a VPC; set"
                " vpc_id and vswitches (zone -> vSwitch id) in the block."
            )
        if not fleet.ram_role:
            raise InvalidSpec(
                f"{fleet.field('ram_role')}: the instances' agent reads and writes the control"
                " prefix and deletes its own instance with the instance's RAM role; set it to"
                " a role that may."
            )

    def _region(self) -> None:
        """InvalidSpec (with the nearest names) for a region ECS does not have."""
        regions = [r.region_id for r in self._call("DescribeRegions").regions.region or []]
        if self.settings.region not in regions:
            raise InvalidSpec(
                f"{self.settings.field('region')}: {self.settings.region!r} is not an"
                f" Alibaba Cloud region; use one such as {nearest(self.settings.region, regions)}."
            )

    def find_offers(self, ask: Ask, prices: PriceTable) -> list[Offer]:
        try:
            self._region()
            types = self._gpu_types()
            wanted = self._wanted(ask, types)
            zones, region_zones = self._zones(
                [t.instance_type for t in wanted], ask.placement.market
            )
            on_demand, currency = self._prices(wanted, zones)
            spot = {}
            if ask.placement.market != "on-demand":
                spot = self._spot_prices(wanted, zones)
        except InvalidSpec:
            raise
        except Exception as exc:
            raise self.error(exc, "list GPU instance types") from None
        fleet = self.settings
        self._check_zones(region_zones)
        catalog = Catalog(types=types, zones=zones, spot=spot, on_demand=on_demand)
        return rank(ask, catalog, prices, fleet, BACKEND, currency, label=self.label)

    def _gpu_types(self) -> list[GpuType]:
        """Every instance type with whole GPUs of the fleet's families (every family when
        none is named); InvalidSpec naming the GPU families there for a family with none."""
        found: dict[str, list[GpuType]] = {}
        token = None
        while True:
            body = self._call("DescribeInstanceTypes", max_results=100, next_token=token)
            for item in body.instance_types.instance_type or []:
                gpus = int(item.gpuamount or 0)
                spec = (item.gpuspec or "").strip()
                if gpus < 1 or not spec or "/" in spec:  # none, or a slice of one (vGPU)
                    continue
                memory_gib = float(item.gpumemory_size or 0)
                found.setdefault((item.instance_type_family or "").lower(), []).append(
                    GpuType(
                        instance_type=item.instance_type_id,
                        product=product_named(spec, int(memory_gib * 1024)),
                        gpus=gpus,
                        gpu_memory_mib=int(memory_gib * 1024),
                        vcpus=int(item.cpu_core_count or 0),
                        memory_mib=int(float(item.memory_size or 0) * 1024),
                    )
                )
            token = body.next_token
            if not token:
                break
        fleet = self.settings
        wanted = [f.lower() for f in fleet.families] or list(found)
        stray = [f for f in wanted if f not in found]
        if stray:
            raise InvalidSpec(
                f"{fleet.field('families')}: {', '.join(stray)} has no GPU instance type in"
                f" {fleet.region}; GPU families there: {nearest(stray[0], sorted(found))}."
            )
        return [t for family in wanted for t in found[family]]

    def _wanted(self, ask: Ask, types: list[GpuType]) -> list[GpuType]:
        """The types worth pricing for `ask` (each price is a call)."""
        res = ask.resources
        product = canonical_product(res.gpu_product) if res.gpu_product else None
        fits = [
            t
            for t in types
            if (product is None or t.product == product)
            and t.gpus >= res.gpus
            and (res.memory is None or t.memory_mib * 2**20 >= res.memory)
            and (res.cpu is None or t.vcpus >= res.cpu)
        ]
        return fits

    def _zones(self, types: list[str], market: str) -> tuple[dict[str, list[str]], list[str]]:
        """Instance type -> the zones of the region with stock of it (and a vSwitch); and
        every zone of the region."""
        strategy = "NoSpot" if market == "on-demand" else "SpotAsPriceGo"
        body = self._call(
            "DescribeAvailableResource",
            destination_resource="InstanceType",
            instance_charge_type="PostPaid",
            spot_strategy=strategy,
        )
        wanted, zones = set(types), dict[str, list[str]]()
        switched = set(self.settings.vswitches)
        every = [zone.zone_id for zone in body.available_zones.available_zone or []]
        for zone in body.available_zones.available_zone or []:
            if switched and zone.zone_id not in switched:
                continue
            for resource in zone.available_resources.available_resource or []:
                for item in resource.supported_resources.supported_resource or []:
                    stocked = item.status_category in ("WithStock", "ClosedWithStock")
                    if item.value in wanted and stocked:
                        zones.setdefault(item.value, []).append(zone.zone_id)
        return {t: sorted(z) for t, z in zones.items()}, every

    def _prices(
        self, types: list[GpuType], zones: dict[str, list[str]]
    ) -> tuple[dict[str, float], str]:
        """ "type zone" -> the pay-as-you-go price of an hour (instance and system disk),
        and the currency ECS prices in."""
        prices: dict[str, float] = {}
        currency = "CNY"
        for kind in types:
            for zone in zones.get(kind.instance_type, []):
                body = self._call(
                    "DescribePrice",
                    resource_type="instance",
                    instance_type=kind.instance_type,
                    zone_id=zone,
                    price_unit="Hour",
                    period=1,
                )
                price = body.price_info.price
                prices[key(kind.instance_type, zone)] = float(price.trade_price)
                currency = price.currency or currency
        return prices, currency

    def _spot_prices(self, types: list[GpuType], zones: dict[str, list[str]]) -> dict[str, float]:
        """ "type zone" -> the latest preemptible price of an hour."""
        latest: dict[str, tuple[str, float]] = {}
        for kind in types:
            for zone in zones.get(kind.instance_type, []):
                body = self._call(
                    "DescribeSpotPriceHistory",
                    instance_type=kind.instance_type,
                    zone_id=zone,
                    network_type="vpc",
                    ostype="linux",
                )
                for item in body.spot_prices.spot_price_type or []:
                    where = key(item.instance_type, item.zone_id)
                    if where not in latest or item.timestamp > latest[where][0]:
                        latest[where] = (item.timestamp, float(item.spot_price))
        return {where: price for where, (_, price) in latest.items()}

    def _check_zones(self, known: list[str]) -> None:
        """InvalidSpec for a zone the block names that the region does not have (with the
        nearest names), or one it would launch in without a vSwitch."""
        fleet = self.settings
        self.check_zones(known, {"vswitches": list(fleet.vswitches), "zones": fleet.zones})
        unswitched = [z for z in fleet.zones if z not in fleet.vswitches]
        if unswitched and fleet.vswitches:
            raise InvalidSpec(
                f"{fleet.field('zones')}: {', '.join(unswitched)} has no vSwitch in"
                f" {fleet.field('vswitches')} (zones that do: {', '.join(sorted(fleet.vswitches))});"
                " add one or remove the zone."
            )

    # -- a run's instances -------------------------------------------------------------

    def machines(self, tags: Mapping[str, str], states: list[str] | None = None) -> list[Machine]:
        from alibabacloud_ecs20140526 import models

        wanted = set(states or LIVE)
        found: list[Machine] = []
        token = None
        tag = [models.DescribeInstancesRequestTag(key=k, value=v) for k, v in tags.items()]
        while True:
            body = self._call("DescribeInstances", tag=tag, max_results=100, next_token=token)
            for item in body.instances.instance or []:
                machine = _machine(item)
                if machine.state in wanted:
                    found.append(machine)
            token = body.next_token
            if not token:
                return sorted(found, key=lambda m: (m.index, m.id))

    def launch(
        self, offers: list[Offer], nodes: int, boot: Boot, say: Callable[[str], None]
    ) -> Launched:
        from alibabacloud_ecs20140526 import models

        run_id = boot.tags[RUN_LABEL]
        if found := self.adopted(run_id):
            return found
        fleet, limit = self.settings, boot.spot_price_limit

        def try_offer(offer: Offer) -> list[str]:
            token = hashlib.sha256(
                f"{run_id}:{offer.instance_type}:{offer.zone}:{offer.market}".encode()
            ).hexdigest()[:64]
            spot: dict[str, Any] = {"spot_strategy": "NoSpot"}
            if offer.market == "spot":
                spot = {"spot_strategy": "SpotAsPriceGo", "spot_interruption_behavior": "Terminate"}
                if limit is not None:
                    spot |= {"spot_strategy": "SpotWithPriceLimit", "spot_price_limit": limit}
            try:
                body = self._call(
                    "RunInstances",
                    zone_id=offer.zone,
                    instance_type=offer.instance_type,
                    image_id=boot.image_id,
                    amount=nodes,
                    min_amount=nodes,
                    instance_charge_type="PostPaid",
                    instance_name=f"gpuflow-{run_id}"[:120] + "-",
                    unique_suffix=True,  # gpuflow-<run>-001, -002: the nodes' order
                    user_data=base64.b64encode(boot.user_data.encode()).decode(),
                    v_switch_id=fleet.vswitches[offer.zone],
                    security_group_id=boot.network,
                    ram_role_name=fleet.ram_role,
                    internet_max_bandwidth_out=0,
                    http_tokens="required",
                    client_token=token,
                    system_disk=models.RunInstancesRequestSystemDisk(
                        category="cloud_essd", size=str(max(20, boot.disk_gib))
                    ),
                    tag=[
                        models.RunInstancesRequestTag(key=k, value=v)
                        for k, v in sorted(boot.tags.items())
                    ],
                    **spot,
                )
            except Exception as exc:
                code = str(getattr(exc, "code", "") or "")
                if code in NEXT_OFFER:
                    raise NextOffer(code, _message(exc)) from None
                if code.startswith(QUOTA):
                    raise InvalidSpec(
                        f"Alibaba Cloud ECS in {fleet.region} said {code} ({_message(exc)})"
                        f" when asked for {nodes} x {offer.instance_type}: no quota left in the"
                        " region; raise it in the Quota Center or ask for fewer GPUs."
                    ) from None
                raise
            return list(body.instance_id_sets.instance_id_set or [])

        try:
            offer, ids = failover(offers, nodes, try_offer, say)
        except CapacityError:
            raise
        return Launched(instance_ids=ids, offer=offer)

    def terminate(self, ids: list[str]) -> None:
        if ids:
            self._call("DeleteInstances", instance_id=ids, force=True)

    def network(self, run_id: str, tags: Mapping[str, str], nodes: int) -> str | None:
        """The run's security group in the fleet's VPC: no inbound rule from outside; the
        run's own nodes reach each other."""
        return self._group(f"gpuflow-{run_id}", tags, [], nodes > 1, "the run's nodes")

    def fleet_network(
        self, fleet: str, tags: Mapping[str, str], ssh_from: list[str], subnet: str | None
    ) -> str | None:
        """The elastic fleet's security group: SSH from `ssh_from` (else from private
        addresses only: its instances have none public), its instances reach each other."""
        return self._group(
            f"gpuflow-fleet-{fleet}", tags, ssh_from or PRIVATE, True, "the fleet's instances"
        )

    def _group(
        self, name: str, tags: Mapping[str, str], ssh_from: list[str], within: bool, who: str
    ) -> str:
        from alibabacloud_ecs20140526 import models

        found = self._call(
            "DescribeSecurityGroups", vpc_id=self.settings.vpc_id, security_group_name=name
        ).security_groups.security_group
        if found:
            return str(found[0].security_group_id)
        inbound = "SSH from where gpuflow runs" if ssh_from else "no inbound from outside"
        group = self._call(
            "CreateSecurityGroup",
            vpc_id=self.settings.vpc_id,
            security_group_name=name,
            description=f"gpuflow: {inbound}; {who} reach each other",
            tag=[
                models.CreateSecurityGroupRequestTag(key=k, value=v)
                for k, v in sorted(tags.items())
            ],
        ).security_group_id
        for cidr in ssh_from:
            self._call(
                "AuthorizeSecurityGroup",
                security_group_id=group,
                ip_protocol="TCP",
                port_range="22/22",
                source_cidr_ip=cidr,
            )
        if within:
            self._call(
                "AuthorizeSecurityGroup",
                security_group_id=group,
                ip_protocol="ALL",
                port_range="-1/-1",
                source_group_id=group,
            )
        return str(group)

    def remove_fleet_network(self, fleet: str, say: Callable[[str], None]) -> None:
        for group in self._delete_groups(FLEET_TAG, fleet):
            say(f"deleted security group {group}")

    def role_metadata(self) -> RoleMetadata:
        return RoleMetadata(
            endpoint=metadata.ENDPOINT,
            variable="GPUFLOW_ECS_METADATA_ENDPOINT",
            credentials_path=f"/latest/meta-data/ram/security-credentials/{self.settings.ram_role}",
            fields=("AccessKeyId", "AccessKeySecret", "SecurityToken"),
            token_path="/latest/api/token",
            token_ttl_header="X-aliyun-ecs-metadata-token-ttl-seconds",
            token_header="X-aliyun-ecs-metadata-token",
            forbid_overwrite=FORBID_OVERWRITE,
        )

    def leftovers(self, run_id: str) -> list[str]:
        return self._delete_groups(RUN_LABEL, run_id)

    def _delete_groups(self, tag_key: str, value: str) -> list[str]:
        """Delete the security groups tagged `tag_key: value`, again while ECS refuses
        because a deleted instance still holds one (for up to a minute); return them."""
        from alibabacloud_ecs20140526 import models

        removed: list[str] = []
        tag = [models.DescribeSecurityGroupsRequestTag(key=tag_key, value=value)]
        groups = self._call("DescribeSecurityGroups", tag=tag).security_groups.security_group
        for group in groups or []:
            for attempt in range(30):
                try:
                    self._call("DeleteSecurityGroup", security_group_id=group.security_group_id)
                    removed.append(group.security_group_id)
                    break
                except Exception as exc:
                    if "Dependency" not in str(getattr(exc, "code", "")) or attempt == 29:
                        raise
                    time.sleep(2)
        return removed

    # -- storage and secrets -----------------------------------------------------------

    def agent_settings(self) -> dict[str, Any]:
        fleet = self.settings
        inside = fleet.oss_endpoint or f"https://oss-{fleet.region}-internal.aliyuncs.com"
        host, protocol = fleet.ecs_endpoint()
        return {
            "region": fleet.region,
            "endpoint_url": inside,
            "cloud": {
                "ecs_endpoint": f"{protocol}://{host}",
                "ram_role": fleet.ram_role or "",
                "storage_region": fleet.oss_region or fleet.region,
            },
        }

    # -- reaping -----------------------------------------------------------------------

    def hourly(self, machine: Machine) -> float | None:
        """The type's pay-as-you-go price in its zone (DescribePrice), in USD."""
        kind = next(
            (t for t in self._gpu_types() if t.instance_type == machine.instance_type), None
        )
        if kind is None or not machine.zone:
            return None
        prices, currency = self._prices([kind], {kind.instance_type: [machine.zone]})
        return self.in_usd(prices.get(key(kind.instance_type, machine.zone)), currency)

    def tagged(self) -> dict[str, dict[str, Any]]:
        from alibabacloud_ecs20140526 import models

        runs = super().tagged()
        tag = [models.DescribeSecurityGroupsRequestTag(key=OWNER_LABEL, value="gpuflow")]
        groups = self._call("DescribeSecurityGroups", tag=tag).security_groups.security_group
        for group in groups or []:
            tags = {t.tag_key: t.tag_value for t in (group.tags.tag if group.tags else []) or []}
            self.tagged_entry(runs, tags)["others"].append(
                f"security group {group.security_group_id}"
            )
        return runs


def _machine(item: Any) -> Machine:
    tags = {t.tag_key: t.tag_value for t in (item.tags.tag if item.tags else []) or []}
    addresses: list[str] = []
    if item.vpc_attributes and item.vpc_attributes.private_ip_address:
        addresses = item.vpc_attributes.private_ip_address.ip_address or []
    created = item.creation_time or ""
    try:
        launched = datetime.strptime(created, "%Y-%m-%dT%H:%MZ").replace(tzinfo=UTC)
    except ValueError:
        launched = datetime.now(UTC)
    return Machine(
        id=item.instance_id,
        state=STATES.get(item.status or "", (item.status or "").lower()),
        instance_type=item.instance_type or "",
        zone=item.zone_id or "",
        market="on-demand" if item.spot_strategy in (None, "", "NoSpot") else "spot",
        address=addresses[0] if addresses else "",
        index=int(item.instance_name.rsplit("-", 1)[-1]) if _numbered(item.instance_name) else 0,
        launched_at=launched,
        tags=tags,
    )


def _numbered(name: str | None) -> bool:
    return bool(name) and str(name).rsplit("-", 1)[-1].isdigit()


def _message(exc: Exception) -> str:
    data = getattr(exc, "data", None) or {}
    return str(data.get("Message") if isinstance(data, dict) else "") or str(exc)


def _snake(action: str) -> str:
    out = ""
    for i, ch in enumerate(action):
        if ch.isupper() and i:
            out += "_"
        out += ch.lower()
    return out
