"""Alibaba Cloud ECS on loopback: the API calls gpuflow makes, checked as ECS checks them,
and the instance metadata service of the instances it "runs".

No offline emulator of ECS exists; this one is written at the wire, with Alibaba's own SDK
(alibabacloud-ecs20140526 and alibabacloud-tea-openapi) on the server side:

- every request's ACS3-HMAC-SHA256 signature is computed again with the SDK's own signing
  code (`Utils.get_authorization`) over the headers the request says it signed, and
  compared; an unknown AccessKey is `InvalidAccessKeyId.NotFound` (HTTP 404), a wrong
  secret `SignatureDoesNotMatch` (400), a date more than 15 minutes off
  `InvalidTimeStamp.Expired`, a nonce used twice `SignatureNonceUsed`;
- every request's parameters are read into the SDK's request model of its action
  (`<Action>Request.from_map`) and written out again the way the SDK writes them
  (`Utils.query`): a parameter the model does not have is `InvalidParameter` (400), as
  are a missing required one and a value outside an enumeration ECS documents;
- every answer is an SDK response model's `to_map()` (`<Action>ResponseBody`), and one
  whose keys the model would drop fails the request (HTTP 500), so an answer the real
  SDK could not read is never served.

The calls: DescribeRegions, DescribeInstanceTypes, DescribeAvailableResource,
DescribePrice, DescribeSpotPriceHistory, RunInstances, DescribeInstances, DeleteInstances,
DeleteInstance, CreateSecurityGroup, AuthorizeSecurityGroup, DescribeSecurityGroups,
DeleteSecurityGroup. The errors it gives besides those above: OperationDenied.NoStock for
a (type, zone) set out of stock (`no_stock`, also listed so; `gone_at_launch`, listed with
stock), QuotaExceed.PostPaidInstance once
`quota_left` GPUs are used, InvalidSpotPriceLimit.LowerThanPublicPrice for a limit under
the spot price, DependencyViolation for a security group an instance still holds.

What it does not model: pagination beyond one page (NextToken is always empty), RAM
policies (a key either is the account's or is refused), prepaid instances, images (any
ImageId is accepted), disks, ENIs and EIPs, VPCs and vSwitches (ids are taken as given),
prices that change, stock that changes by itself, regions other than the one it serves.

The metadata service answers at `metadata_url(instance)` what 100.100.100.200 answers on
that instance: hardened-mode tokens, instance-id, private-ipv4, the RAM role's temporary
credentials (the account's own keys, here), and the preemptible instance's termination
time once `interrupt` set it.
"""

from __future__ import annotations

import json
import re
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from tests.fakes.cloud_api import FakeCloud

VERSION = "2014-05-26"
REGION = "cn-hangzhou"
ZONES = ["cn-hangzhou-h", "cn-hangzhou-i", "cn-hangzhou-j"]
# type -> family, GPUs, GPU spec, GPU memory GiB, vCPUs, memory GiB, CNY an hour
TYPES: dict[str, tuple[str, int, str, float, int, float, float]] = {
    "ecs.gn6i-c4g1.xlarge": ("ecs.gn6i", 1, "NVIDIA T4", 16, 4, 15, 11.50),
    "ecs.gn6i-c8g1.2xlarge": ("ecs.gn6i", 1, "NVIDIA T4", 16, 8, 31, 14.00),
    "ecs.gn7i-c8g1.2xlarge": ("ecs.gn7i", 1, "NVIDIA A10", 24, 8, 30, 12.60),
    "ecs.gn7i-c32g1.8xlarge": ("ecs.gn7i", 1, "NVIDIA A10", 24, 32, 188, 22.40),
    "ecs.gn6v-c8g1.2xlarge": ("ecs.gn6v", 1, "NVIDIA V100", 16, 8, 32, 26.46),
    "ecs.gn7-c12g1.3xlarge": ("ecs.gn7", 1, "NVIDIA A100", 80, 12, 94, 34.74),
    "ecs.gn7-c13g1.13xlarge": ("ecs.gn7", 4, "NVIDIA A100", 80, 52, 378, 138.96),
    "ecs.g7.xlarge": ("ecs.g7", 0, "", 0, 4, 16, 1.10),
}
SPOT_SHARE = 0.2  # a preemptible hour costs this share of a pay-as-you-go one, here
REQUIRED = {
    "RunInstances": ["RegionId", "ImageId", "InstanceType", "ZoneId", "VSwitchId"],
    "DescribePrice": ["RegionId"],
    "DescribeAvailableResource": ["RegionId", "DestinationResource"],
    "DescribeSpotPriceHistory": ["RegionId", "NetworkType"],
    "DescribeInstances": ["RegionId"],
    "DeleteInstances": ["RegionId", "InstanceId.1"],
    "DeleteInstance": ["InstanceId"],
    "CreateSecurityGroup": ["RegionId"],
    "AuthorizeSecurityGroup": ["RegionId", "SecurityGroupId"],
    "DescribeSecurityGroups": ["RegionId"],
    "DeleteSecurityGroup": ["RegionId", "SecurityGroupId"],
}
ENUMS = {
    "SpotStrategy": {"NoSpot", "SpotWithPriceLimit", "SpotAsPriceGo"},
    "InstanceChargeType": {"PrePaid", "PostPaid"},
    "HttpTokens": {"optional", "required"},
    "SpotInterruptionBehavior": {"Terminate", "Stop"},
    "PriceUnit": {"Month", "Year", "Hour", "Week"},
    "NetworkType": {"classic", "vpc"},
    "DestinationResource": {
        "Zone",
        "IoOptimized",
        "InstanceType",
        "SystemDisk",
        "DataDisk",
        "Network",
        "ddh",
    },
}


class Refused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class _Request:
    """What the SDK's signer reads of a request."""

    def __init__(self, method: str, pathname: str, query: dict, headers: dict) -> None:
        self.method, self.pathname, self.query, self.headers = method, pathname, query, headers


class FakeEcs(FakeCloud):
    def __init__(self, key_id: str, secret: str) -> None:
        self.key_id, self.secret = key_id, secret
        self.groups: dict[str, dict[str, Any]] = {}
        self.no_stock: set[tuple[str, str]] = set()  # (type, zone) with none left
        self.nonces: set[str] = set()
        super().__init__()

    def _end(self, instance_id: str) -> None:
        self._delete(instance_id)

    # -- the wire ------------------------------------------------------------------------

    def _handler(self, which: str) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, status: int, body: Any, content: str = "application/json") -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", content)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _api(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                request_id = str(uuid.uuid4()).upper()
                try:
                    action, params = fake._checked(self.command, self.path, self.headers, body)
                    answer = fake._answer(action, params)
                    answer["RequestId"] = request_id
                    self._answer(200, fake._shaped(action, answer))
                except Exception as exc:  # the fake's own fault: said, never hidden
                    if not isinstance(exc, Refused):
                        traceback.print_exc()
                        exc = Refused(500, "InternalError", repr(exc))
                    error = {
                        "RequestId": request_id,
                        "HostId": "ecs.aliyuncs.com",
                        "Code": exc.code,
                        "Message": exc.message,
                    }
                    self._answer(exc.status, error, "application/json;charset=utf-8")

            def _metadata(self) -> None:
                status, text = fake._metadata(self.command, self.path, self.headers)
                self._answer(status, text.encode(), "text/plain")

            def do_GET(self) -> None:
                self._api() if which == "api" else self._metadata()

            do_POST = do_GET
            do_PUT = do_GET

        return Handler

    def _checked(
        self, method: str, path: str, headers: Any, body: bytes
    ) -> tuple[str, dict[str, str]]:
        """The action and its parameters, once the request is signed and well formed."""
        from alibabacloud_tea_openapi.utils import Utils

        given = {k.lower(): v for k, v in headers.items()}
        action, version = given.get("x-acs-action", ""), given.get("x-acs-version", "")
        if version != VERSION:
            raise Refused(
                400, "InvalidVersion", f"Specified parameter Version {version} is not valid."
            )
        auth = given.get("authorization", "")
        found = re.match(
            r"ACS3-HMAC-SHA256 Credential=([^,]+),SignedHeaders=([^,]+),Signature=(\w+)$", auth
        )
        if not found:
            raise Refused(
                400,
                "IncompleteSignature",
                "The request signature does not conform to Aliyun standards.",
            )
        key_id, signed = found.group(1), found.group(2).split(";")
        if key_id != self.key_id:
            raise Refused(404, "InvalidAccessKeyId.NotFound", "Specified access key is not found.")
        parts = urlsplit(path)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        if body and "form-urlencoded" in given.get("content-type", ""):
            query |= dict(parse_qsl(body.decode(), keep_blank_values=True))
        signed_headers = {h: given.get(h, "") for h in signed}
        request = _Request(
            method,
            parts.path or "/",
            dict(parse_qsl(parts.query, keep_blank_values=True)),
            signed_headers,
        )
        expected = Utils.get_authorization(
            request, "ACS3-HMAC-SHA256", given.get("x-acs-content-sha256", ""), key_id, self.secret
        )
        if expected != auth:
            raise Refused(
                400,
                "SignatureDoesNotMatch",
                "Specified signature is not matched with our calculation.",
            )
        stamp = datetime.strptime(given.get("x-acs-date", ""), "%Y-%m-%dT%H:%M:%SZ")
        if abs((datetime.now(UTC) - stamp.replace(tzinfo=UTC)).total_seconds()) > 900:
            raise Refused(
                400, "InvalidTimeStamp.Expired", "Specified time stamp or date value is expired."
            )
        nonce = given.get("x-acs-signature-nonce", "")
        with self.lock:
            if nonce in self.nonces:
                raise Refused(
                    400, "SignatureNonceUsed", "Specified signature nonce was used already."
                )
            self.nonces.add(nonce)
        self._check_params(action, query)
        with self.lock:
            self.calls.append((action, query))
        return action, query

    def _check_params(self, action: str, query: dict[str, str]) -> None:
        from alibabacloud_ecs20140526 import models
        from alibabacloud_tea_openapi.utils import Utils

        model = getattr(models, f"{action}Request", None)
        if model is None or action not in ACTIONS:
            raise Refused(404, "InvalidAction.NotFound", f"Specified api {action} is not found.")
        read = model().from_map(_nested(query))
        written = Utils.query(read.to_map())
        unknown = sorted(set(query) - set(written))
        if unknown:
            raise Refused(
                400, "InvalidParameter", f"The parameter {unknown[0]} is not valid for {action}."
            )
        for name in REQUIRED.get(action, []):
            if not query.get(name):
                raise Refused(
                    400,
                    "MissingParameter",
                    f"The input parameter {name.split('.')[0]} that is mandatory for processing this request is not supplied.",
                )
        for name, allowed in ENUMS.items():
            if name in query and query[name] not in allowed:
                raise Refused(
                    400, f"InvalidParameter.{name}", f"The specified parameter {name} is not valid."
                )
        if "RegionId" in query and query["RegionId"] != REGION:
            raise Refused(400, "InvalidRegionId.NotFound", "The specified RegionId does not exist.")

    def _shaped(self, action: str, answer: dict[str, Any]) -> dict[str, Any]:
        """`answer` as the SDK's response model writes it; a key it would drop is a bug here."""
        from alibabacloud_ecs20140526 import models

        model = getattr(models, f"{action}ResponseBody")
        shaped = model().from_map(answer).to_map()
        if shaped != answer:
            raise AssertionError(f"the fake's {action} answer is not {model.__name__}'s: {answer}")
        return dict(shaped)

    # -- the calls -----------------------------------------------------------------------

    def _answer(self, action: str, q: dict[str, str]) -> dict[str, Any]:
        return dict(ACTIONS[action](self, q))

    def describe_regions(self, q: dict[str, str]) -> dict[str, Any]:
        regions = ["cn-hangzhou", "cn-shanghai", "cn-beijing", "cn-shenzhen", "ap-southeast-1"]
        return {
            "Regions": {
                "Region": [
                    {"RegionId": r, "LocalName": r, "RegionEndpoint": f"ecs.{r}.aliyuncs.com"}
                    for r in regions
                ]
            }
        }

    def describe_instance_types(self, q: dict[str, str]) -> dict[str, Any]:
        items = []
        for name, (family, gpus, spec, gpu_mem, cpus, mem, _) in TYPES.items():
            item: dict[str, Any] = {
                "InstanceTypeId": name,
                "InstanceTypeFamily": family,
                "CpuCoreCount": cpus,
                "MemorySize": float(mem),
            }
            if gpus:
                item |= {"GPUAmount": gpus, "GPUSpec": spec, "GPUMemorySize": float(gpu_mem)}
            items.append(item)
        return {"InstanceTypes": {"InstanceType": items}, "NextToken": ""}

    def describe_available_resource(self, q: dict[str, str]) -> dict[str, Any]:
        zones = []
        for zone in ZONES:
            supported = [
                {
                    "Value": name,
                    "Status": "SoldOut" if (name, zone) in self.no_stock else "Available",
                    "StatusCategory": "WithoutStock"
                    if (name, zone) in self.no_stock
                    else "WithStock",
                }
                for name, spec in TYPES.items()
                if not (spec[0] == "ecs.gn7" and zone == "cn-hangzhou-h")  # not sold there
            ]
            zones.append(
                {
                    "ZoneId": zone,
                    "RegionId": REGION,
                    "Status": "Available",
                    "StatusCategory": "WithStock",
                    "AvailableResources": {
                        "AvailableResource": [
                            {
                                "Type": "InstanceType",
                                "SupportedResources": {"SupportedResource": supported},
                            }
                        ]
                    },
                }
            )
        return {"AvailableZones": {"AvailableZone": zones}}

    def describe_price(self, q: dict[str, str]) -> dict[str, Any]:
        kind = TYPES.get(q.get("InstanceType", ""))
        if kind is None:
            raise Refused(
                400, "InvalidInstanceType.NotFound", "The specified InstanceType does not exist."
            )
        price = kind[6]
        return {
            "PriceInfo": {
                "Price": {
                    "Currency": "CNY",
                    "OriginalPrice": price,
                    "DiscountPrice": 0.0,
                    "TradePrice": price,
                }
            }
        }

    def spot_price(self, name: str) -> float:
        return round(TYPES[name][6] * SPOT_SHARE, 3)

    def describe_spot_price_history(self, q: dict[str, str]) -> dict[str, Any]:
        name, zone = q.get("InstanceType", ""), q.get("ZoneId", "")
        if name not in TYPES:
            raise Refused(
                400, "InvalidInstanceType.NotFound", "The specified InstanceType does not exist."
            )
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        prices = [
            {
                "InstanceType": name,
                "ZoneId": z,
                "SpotPrice": self.spot_price(name),
                "OriginPrice": TYPES[name][6],
                "Timestamp": stamp,
                "NetworkType": "vpc",
                "IoOptimized": "optimized",
            }
            for z in ([zone] if zone else ZONES)
        ]
        return {"SpotPrices": {"SpotPriceType": prices}, "Currency": "CNY", "NextOffset": 0}

    def run_instances(self, q: dict[str, str]) -> dict[str, Any]:
        name, zone = q["InstanceType"], q["ZoneId"]
        if name not in TYPES:
            raise Refused(
                400, "InvalidInstanceType.NotFound", "The specified InstanceType does not exist."
            )
        if zone not in ZONES:
            raise Refused(400, "InvalidZoneId.NotFound", "The specified ZoneId does not exist.")
        if (name, zone) in self.no_stock | self.gone_at_launch:
            raise Refused(
                403,
                "OperationDenied.NoStock",
                "The resource is out of stock in the specified zone. Please try other types,"
                " or choose other regions and zones.",
            )
        strategy = q.get("SpotStrategy", "NoSpot")
        if strategy == "SpotWithPriceLimit":
            limit = float(q.get("SpotPriceLimit", "0") or 0)
            if limit < self.spot_price(name):
                raise Refused(
                    400,
                    "InvalidSpotPriceLimit.LowerThanPublicPrice",
                    "The specified parameter SpotPriceLimit can not be lower than current public price.",
                )
        count = int(q.get("Amount", "1"))
        with self.lock:
            gpus = TYPES[name][1] * count
            if self.quota_left is not None:
                if gpus > self.quota_left:
                    raise Refused(
                        403,
                        "QuotaExceed.PostPaidInstance",
                        "The GPU quota of pay-as-you-go instances in the region is exceeded.",
                    )
                self.quota_left -= gpus
            token = q.get("ClientToken")
            if token:
                same = [i for i in self.instances.values() if i["ClientToken"] == token]
                if same:
                    return {"InstanceIdSets": {"InstanceIdSet": [i["InstanceId"] for i in same]}}
            tags = self.tags_of(q)
            ids = []
            for n in range(count):
                instance_id = f"i-bp{uuid.uuid4().hex[:18]}"
                base = q.get("InstanceName", instance_id)
                name_of = (
                    f"{base}{n + 1:03d}" if q.get("UniqueSuffix", "").lower() == "true" else base
                )
                self.instances[instance_id] = {
                    "InstanceId": instance_id,
                    "InstanceName": name_of,
                    "InstanceType": name,
                    "ZoneId": zone,
                    "Status": "Pending",
                    "SpotStrategy": strategy,
                    "Tags": tags,
                    "UserData": q.get("UserData", ""),
                    "RamRoleName": q.get("RamRoleName", ""),
                    "SecurityGroupId": q.get("SecurityGroupId", ""),
                    "HttpTokens": q.get("HttpTokens", "optional"),
                    "ClientToken": token,
                    "CreationTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%MZ"),
                    "Address": self.address_of(instance_id),
                    "started": time.monotonic(),
                }
                ids.append(instance_id)
        for instance_id in ids:
            self.on_launch(self.instances[instance_id])
        return {"InstanceIdSets": {"InstanceIdSet": ids}, "TradePrice": TYPES[name][6] * count}

    def _tagged(self, q: dict[str, str], tags: dict[str, str]) -> bool:
        for n in range(1, 21):
            key = q.get(f"Tag.{n}.Key")
            if key is not None and tags.get(key) != q.get(f"Tag.{n}.Value", ""):
                return False
        return True

    def describe_instances(self, q: dict[str, str]) -> dict[str, Any]:
        found = []
        with self.lock:
            for item in self.instances.values():
                if item["Status"] == "Pending" and time.monotonic() - item["started"] > 0.3:
                    item["Status"] = "Running"
                if not self._tagged(q, item["Tags"]):
                    continue
                found.append(
                    {
                        "InstanceId": item["InstanceId"],
                        "InstanceName": item["InstanceName"],
                        "InstanceType": item["InstanceType"],
                        "ZoneId": item["ZoneId"],
                        "Status": item["Status"],
                        "SpotStrategy": item["SpotStrategy"],
                        "CreationTime": item["CreationTime"],
                        "VpcAttributes": {"PrivateIpAddress": {"IpAddress": [item["Address"]]}},
                        "Tags": {
                            "Tag": [{"TagKey": k, "TagValue": v} for k, v in item["Tags"].items()]
                        },
                    }
                )
        return {
            "Instances": {"Instance": found},
            "TotalCount": len(found),
            "NextToken": "",
        }

    def _delete(self, instance_id: str) -> None:
        with self.lock:
            item = self.instances.pop(instance_id, None)
            if item is not None and self.quota_left is not None:
                self.quota_left += TYPES[item["InstanceType"]][1]
        if item is not None:
            self.on_delete(item)

    def delete_instances(self, q: dict[str, str]) -> dict[str, Any]:
        ids = [v for k, v in q.items() if k.startswith("InstanceId.")]
        for instance_id in ids:
            if instance_id not in self.instances:
                raise Refused(
                    404,
                    "InvalidInstanceId.NotFound",
                    f"The specified InstanceId {instance_id} does not exist.",
                )
        for instance_id in ids:
            self._delete(instance_id)
        return {}

    def delete_instance(self, q: dict[str, str]) -> dict[str, Any]:
        if q["InstanceId"] not in self.instances:
            raise Refused(
                404, "InvalidInstanceId.NotFound", "The specified InstanceId does not exist."
            )
        self._delete(q["InstanceId"])
        return {}

    def create_security_group(self, q: dict[str, str]) -> dict[str, Any]:
        group = f"sg-bp{uuid.uuid4().hex[:18]}"
        tags = self.tags_of(q)
        with self.lock:
            self.groups[group] = {
                "SecurityGroupId": group,
                "SecurityGroupName": q.get("SecurityGroupName", ""),
                "VpcId": q.get("VpcId", ""),
                "Tags": tags,
                "Rules": [],
            }
        return {"SecurityGroupId": group}

    def authorize_security_group(self, q: dict[str, str]) -> dict[str, Any]:
        group = self.groups.get(q["SecurityGroupId"])
        if group is None:
            raise Refused(
                404,
                "InvalidSecurityGroupId.NotFound",
                "The specified SecurityGroupId does not exist.",
            )
        if q.get("IpProtocol", "").upper() not in {"TCP", "UDP", "ICMP", "ICMPV6", "GRE", "ALL"}:
            raise Refused(
                400, "InvalidIpProtocol.Malformed", "The specified IpProtocol is invalid."
            )
        if not any(q.get(k) for k in ("SourceCidrIp", "SourceGroupId", "SourcePrefixListId")):
            raise Refused(
                400, "MissingParameter", "A source (SourceCidrIp, SourceGroupId) is required."
            )
        group["Rules"].append({k: v for k, v in q.items() if k != "RegionId"})
        return {}

    def describe_security_groups(self, q: dict[str, str]) -> dict[str, Any]:
        found = [
            {
                "SecurityGroupId": g["SecurityGroupId"],
                "SecurityGroupName": g["SecurityGroupName"],
                "VpcId": g["VpcId"],
                "Tags": {"Tag": [{"TagKey": k, "TagValue": v} for k, v in g["Tags"].items()]},
            }
            for g in self.groups.values()
            if self._tagged(q, g["Tags"])
            and q.get("SecurityGroupName", g["SecurityGroupName"]) == g["SecurityGroupName"]
            and q.get("VpcId", g["VpcId"]) == g["VpcId"]
        ]
        return {"SecurityGroups": {"SecurityGroup": found}, "TotalCount": len(found)}

    def delete_security_group(self, q: dict[str, str]) -> dict[str, Any]:
        group = q["SecurityGroupId"]
        if group not in self.groups:
            raise Refused(
                404,
                "InvalidSecurityGroupId.NotFound",
                "The specified SecurityGroupId does not exist.",
            )
        if any(i["SecurityGroupId"] == group for i in self.instances.values()):
            raise Refused(
                403,
                "DependencyViolation",
                "There is still instance(s) in the specified security group.",
            )
        del self.groups[group]
        return {}

    # -- the instances' metadata service -------------------------------------------------

    def _metadata(self, method: str, path: str, headers: Any) -> tuple[int, str]:
        instance_id, _, rest = path.lstrip("/").partition("/")
        item = self.instances.get(instance_id)
        if item is None:
            return 404, "no such instance"
        rest = "/" + rest
        if method == "PUT" and rest == "/latest/api/token":
            return 200, f"token-{instance_id}"
        token = headers.get("X-aliyun-ecs-metadata-token")
        if item["HttpTokens"] == "required" and token != f"token-{instance_id}":
            return 401, "a token is required"
        if rest == "/latest/meta-data/instance-id":
            return 200, instance_id
        if rest == "/latest/meta-data/private-ipv4":
            return 200, item["Address"]
        if rest == "/latest/meta-data/instance/spot/termination-time":
            at = item.get("termination_time")
            return (200, at) if at else (404, "Not Found")
        role = "/latest/meta-data/ram/security-credentials/"
        if rest.startswith(role) and rest[len(role) :] == item["RamRoleName"]:
            expires = datetime.now(UTC) + timedelta(hours=1)
            return 200, json.dumps(
                {
                    "AccessKeyId": self.key_id,
                    "AccessKeySecret": self.secret,
                    "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "SecurityToken": "",
                    "LastUpdated": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "Code": "Success",
                }
            )
        return 404, "Not Found"


ACTIONS: dict[str, Callable[[FakeEcs, dict[str, str]], dict[str, Any]]] = {
    "DescribeRegions": FakeEcs.describe_regions,
    "DescribeInstanceTypes": FakeEcs.describe_instance_types,
    "DescribeAvailableResource": FakeEcs.describe_available_resource,
    "DescribePrice": FakeEcs.describe_price,
    "DescribeSpotPriceHistory": FakeEcs.describe_spot_price_history,
    "RunInstances": FakeEcs.run_instances,
    "DescribeInstances": FakeEcs.describe_instances,
    "DeleteInstances": FakeEcs.delete_instances,
    "DeleteInstance": FakeEcs.delete_instance,
    "CreateSecurityGroup": FakeEcs.create_security_group,
    "AuthorizeSecurityGroup": FakeEcs.authorize_security_group,
    "DescribeSecurityGroups": FakeEcs.describe_security_groups,
    "DeleteSecurityGroup": FakeEcs.delete_security_group,
}


def _nested(flat: dict[str, str]) -> dict[str, Any]:
    """The SDK's flattened parameters (Tag.1.Key, SystemDisk.Size, InstanceId.1) as the
    nested map its request models read."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        parts = name.split(".")
        node: Any = out
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if part.isdigit():
                index = int(part) - 1
                while len(node) <= index:
                    node.append(None)
                if last:
                    node[index] = value
                else:
                    if node[index] is None:
                        node[index] = [] if parts[i + 1].isdigit() else {}
                    node = node[index]
            elif last:
                node[part] = value
            else:
                if part not in node:
                    node[part] = [] if parts[i + 1].isdigit() else {}
                node = node[part]
    return out
