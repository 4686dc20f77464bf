"""Tencent Cloud CVM on loopback: the API calls gpuflow makes, checked as CVM checks them,
and the instance metadata service of the instances it "runs".

No offline emulator of CVM exists; this one is written at the wire, with Tencent's own SDK
(tencentcloud-sdk-python-cvm and -common) on the server side:

- every request's TC3-HMAC-SHA256 signature is computed again with the SDK's own signing
  code (`AbstractClient._get_tc3_signature`, the one its clients sign with) and compared:
  an unknown SecretId is `AuthFailure.SecretIdNotFound`, a wrong key
  `AuthFailure.SignatureFailure`, a timestamp more than 5 minutes off
  `AuthFailure.SignatureExpire`; a version other than 2017-03-12 is `InvalidAction`;
- every request's JSON is read into the SDK's request model of its action
  (`<Action>Request._deserialize`): a member the model does not have (the SDK warns "fileds
  are useless") is `UnknownParameter`, as are a missing required one and a value outside
  an enumeration CVM documents;
- every answer is an SDK response model's `_serialize()` (`<Action>Response`), and one the
  model would not read whole fails the request, so an answer the real SDK could not read is
  never served. Errors come as CVM sends them: HTTP 200 with `Response.Error`.

The calls: DescribeRegions, DescribeZones, DescribeZoneInstanceConfigInfos, RunInstances,
DescribeInstances, TerminateInstances. Errors besides those above:
ResourceInsufficient.SpecifiedInstanceType for a (type, zone) out of stock at launch
(`gone_at_launch`), LimitExceeded.InstanceQuota once `quota_left` GPUs are used,
InvalidParameterValue.InvalidRegion for a region it does not serve (DescribeRegions
answers without one, as CVM's does).

What it does not model: prices that change, stock listing (every type sells in every zone
it lists, but for `gone_at_launch`), VPCs, subnets and security groups (ids are taken as
given), images, disks, pagination beyond Offset/Limit, CAM policies (a key either is the
account's or is refused), TERMINATING's duration (a terminated instance is gone at once).

The metadata service answers at `metadata_url(instance)` what metadata.tencentyun.com
answers on that instance: instance-id, local-ipv4, the CAM role's temporary credentials
(the account's own keys, here), and the spot instance's termination time once `interrupt`
set it.
"""

from __future__ import annotations

import json
import re
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.fakes.cloud_api import FakeCloud

VERSION = "2017-03-12"
REGION = "ap-guangzhou"
ZONES = ["ap-guangzhou-3", "ap-guangzhou-4", "ap-guangzhou-6"]
# type -> family, GPUs (fractional for vGPU), vCPUs, memory GiB, CNY an hour pay-as-you-go
TYPES: dict[str, tuple[str, float, int, int, float]] = {
    "GN7.2XLARGE32": ("GN7", 1, 8, 32, 8.68),
    "GN7.5XLARGE80": ("GN7", 1, 20, 80, 11.90),
    "GN10Xp.2XLARGE40": ("GN10Xp", 1, 10, 40, 19.94),
    "GN10Xp.20XLARGE320": ("GN10Xp", 8, 80, 320, 159.52),
    "GT4.4XLARGE96": ("GT4", 1, 16, 96, 31.16),
    "GNV4.3XLARGE42": ("GNV4", 0.25, 12, 42, 3.40),
    "S5.LARGE8": ("S5", 0, 4, 8, 0.62),
}
SPOT_SHARE = 0.2
REQUIRED = {
    "RunInstances": ["Placement", "ImageId"],
    "TerminateInstances": ["InstanceIds"],
}
ENUMS = {
    "InstanceChargeType": {"PREPAID", "POSTPAID_BY_HOUR", "CDHPAID", "SPOTPAID", "CDCPAID"},
}


class Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Request:
    """What the SDK's signer reads of a request."""

    def __init__(self, method: str, uri: str, data: str, header: dict[str, str]) -> None:
        self.method, self.uri, self.data, self.header = method, uri, data, header


class FakeCvm(FakeCloud):
    def __init__(self, secret_id: str, secret_key: str) -> None:
        self.secret_id, self.secret_key = secret_id, secret_key
        super().__init__()

    def _end(self, instance_id: str) -> None:
        self._terminate(instance_id)

    def spot_price(self, name: str) -> float:
        return round(TYPES[name][4] * SPOT_SHARE, 2)

    # -- the wire ------------------------------------------------------------------------

    def _handler(self, which: str) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, status: int, body: bytes, content: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                if which == "metadata":
                    status, text = fake._metadata(self.path)
                    self._answer(status, text.encode(), "text/plain")
                    return
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                request_id = str(uuid.uuid4())
                try:
                    action, params = fake._checked(self.command, self.path, self.headers, body)
                    answer = fake._shaped(action, dict(ACTIONS[action](fake, params)))
                except Refused as exc:
                    answer = {"Error": {"Code": exc.code, "Message": exc.message}}
                except Exception as exc:  # the fake's own fault: said, never hidden
                    traceback.print_exc()
                    answer = {"Error": {"Code": "InternalError", "Message": repr(exc)}}
                answer["RequestId"] = request_id
                data = json.dumps({"Response": answer}).encode()
                self._answer(200, data, "application/json")

            do_GET = do_POST

        return Handler

    def _checked(
        self, method: str, path: str, headers: Any, body: bytes
    ) -> tuple[str, dict[str, Any]]:
        from tencentcloud.common import credential
        from tencentcloud.cvm.v20170312 import cvm_client

        given = {k.lower(): v for k, v in headers.items()}
        action, version = given.get("x-tc-action", ""), given.get("x-tc-version", "")
        if version != VERSION or action not in ACTIONS:
            raise Refused("InvalidAction", f"The action {action} {version} does not exist.")
        found = re.match(
            r"TC3-HMAC-SHA256 Credential=([^/]+)/(\d{4}-\d{2}-\d{2})/(\w+)/tc3_request,"
            r" SignedHeaders=content-type;host, Signature=(\w+)$",
            given.get("authorization", ""),
        )
        if not found:
            raise Refused("AuthFailure.SignatureFailure", "The request signature is malformed.")
        secret_id, date, service, signature = found.groups()
        if secret_id != self.secret_id:
            raise Refused("AuthFailure.SecretIdNotFound", "The SecretId is not found.")
        stamp = int(given.get("x-tc-timestamp", "0"))
        if abs(time.time() - stamp) > 300:
            raise Refused("AuthFailure.SignatureExpire", "The signature has expired.")
        request = _Request(
            method,
            path.split("?")[0] or "/",
            body.decode(),
            {
                "Content-Type": given.get("content-type", ""),
                "Host": given.get("host", ""),
                "X-TC-Timestamp": str(stamp),
            },
        )
        signer = cvm_client.CvmClient(
            credential.Credential(self.secret_id, self.secret_key), REGION
        )
        expected = signer._get_tc3_signature({}, request, date, service, self.secret_key)
        if expected != signature:
            raise Refused(
                "AuthFailure.SignatureFailure", "The provided credentials could not be validated."
            )
        if action != "DescribeRegions" and given.get("x-tc-region") != REGION:
            raise Refused("InvalidParameterValue.InvalidRegion", "The region is not supported.")
        params = json.loads(body or b"{}")
        self._check_params(action, params)
        with self.lock:
            self.calls.append((action, params))
        return action, params

    def _check_params(self, action: str, params: dict[str, Any]) -> None:
        from tencentcloud.cvm.v20170312 import models

        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            getattr(models, f"{action}Request")()._deserialize(params)
        useless = [str(w.message) for w in said if "useless" in str(w.message)]
        if useless:
            raise Refused(
                "UnknownParameter", f"The parameter {useless[0].split()[0]} is not recognized."
            )
        for name in REQUIRED.get(action, []):
            if name not in params:
                raise Refused(
                    "MissingParameter", f"The request is missing a required parameter `{name}`."
                )
        for name, allowed in ENUMS.items():
            if name in params and params[name] not in allowed:
                raise Refused("InvalidParameterValue", f"The value of `{name}` is invalid.")

    def _shaped(self, action: str, answer: dict[str, Any]) -> dict[str, Any]:
        from tencentcloud.cvm.v20170312 import models

        model = getattr(models, f"{action}Response")()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            model._deserialize({**answer, "RequestId": "x"})
        if any("useless" in str(w.message) for w in said):
            raise AssertionError(
                f"the fake's {action} answer is not {type(model).__name__}'s: {answer}"
            )
        shaped = model._serialize()
        shaped.pop("RequestId", None)
        return dict(shaped)

    # -- the calls -----------------------------------------------------------------------

    def describe_regions(self, q: dict[str, Any]) -> dict[str, Any]:
        regions = ["ap-guangzhou", "ap-shanghai", "ap-beijing", "ap-chengdu", "ap-singapore"]
        return {
            "TotalCount": len(regions),
            "RegionSet": [
                {"Region": r, "RegionName": r, "RegionState": "AVAILABLE"} for r in regions
            ],
        }

    def describe_zones(self, q: dict[str, Any]) -> dict[str, Any]:
        return {
            "TotalCount": len(ZONES),
            "ZoneSet": [
                {"Zone": z, "ZoneName": z, "ZoneId": str(100000 + i), "ZoneState": "AVAILABLE"}
                for i, z in enumerate(ZONES)
            ],
        }

    def describe_zone_instance_config_infos(self, q: dict[str, Any]) -> dict[str, Any]:
        wanted = {f["Name"]: set(f["Values"]) for f in q.get("Filters", [])}
        charge = wanted.get("instance-charge-type", {"POSTPAID_BY_HOUR"})
        families = wanted.get("instance-family")
        items = []
        for zone in ZONES:
            for name, (family, gpus, cpus, memory, price) in TYPES.items():
                if families is not None and family not in families:
                    continue
                for kind in sorted(charge):
                    unit = self.spot_price(name) if kind == "SPOTPAID" else price
                    items.append(
                        {
                            "Zone": zone,
                            "InstanceType": name,
                            "InstanceChargeType": kind,
                            "NetworkCard": 0,
                            "Cpu": cpus,
                            "Memory": memory,
                            "InstanceFamily": family,
                            "TypeName": family,
                            "Status": "SELL",
                            "Price": {
                                "UnitPrice": price,
                                "ChargeUnit": "HOUR",
                                "UnitPriceDiscount": unit,
                                "Discount": round(unit / price * 100, 1),
                            },
                            "Gpu": int(gpus * 100) if gpus < 1 else int(gpus),
                            "GpuCount": gpus,
                            "Fpga": 0,
                            "StatusCategory": "EnoughStock",
                        }
                    )
        return {"InstanceTypeQuotaSet": items}

    def run_instances(self, q: dict[str, Any]) -> dict[str, Any]:
        name = q.get("InstanceType", "")
        zone = q["Placement"].get("Zone", "")
        if name not in TYPES:
            raise Refused(
                "InvalidParameterValue.InstanceTypeNotFound",
                f"The instance type {name} does not exist.",
            )
        if zone not in ZONES:
            raise Refused("InvalidZone.MismatchRegion", f"The zone {zone} is not in {REGION}.")
        if (name, zone) in self.gone_at_launch:
            raise Refused(
                "ResourceInsufficient.SpecifiedInstanceType",
                "The specified instance type is sold out in the zone.",
            )
        charge = q.get("InstanceChargeType", "POSTPAID_BY_HOUR")
        if charge == "SPOTPAID" and "InstanceMarketOptions" not in q:
            raise Refused("MissingParameter", "SPOTPAID needs InstanceMarketOptions.")
        count = int(q.get("InstanceCount", 1))
        with self.lock:
            gpus = int(TYPES[name][1]) * count
            if self.quota_left is not None:
                if gpus > self.quota_left:
                    raise Refused(
                        "LimitExceeded.InstanceQuota",
                        "The number of instances exceeds the quota of the account in the region.",
                    )
                self.quota_left -= gpus
            token = q.get("ClientToken")
            same = [
                i["InstanceId"]
                for i in self.instances.values()
                if token and i["ClientToken"] == token
            ]
            if same:
                return {"InstanceIdSet": same}
            tags = {
                t["Key"]: t["Value"]
                for spec in q.get("TagSpecification", [])
                if spec.get("ResourceType") == "instance"
                for t in spec.get("Tags", [])
            }
            ids = []
            for n in range(count):
                instance_id = f"ins-{uuid.uuid4().hex[:8]}"
                base = q.get("InstanceName", instance_id)
                self.instances[instance_id] = {
                    "InstanceId": instance_id,
                    "InstanceName": base.replace("{R:1}", str(n + 1)),
                    "InstanceType": name,
                    "Zone": zone,
                    "InstanceState": "PENDING",
                    "InstanceChargeType": charge,
                    "Tags": tags,
                    "UserData": q.get("UserData", ""),
                    "CamRoleName": q.get("CamRoleName", ""),
                    "ClientToken": token,
                    "CreatedTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "Address": self.address_of(instance_id),
                    "started": time.monotonic(),
                }
                ids.append(instance_id)
        for instance_id in ids:
            self.on_launch(self.instances[instance_id])
        return {"InstanceIdSet": ids}

    def describe_instances(self, q: dict[str, Any]) -> dict[str, Any]:
        filters = [(f["Name"], set(f["Values"])) for f in q.get("Filters", [])]
        found = []
        with self.lock:
            for item in self.instances.values():
                if item["InstanceState"] == "PENDING" and time.monotonic() - item["started"] > 0.3:
                    item["InstanceState"] = "RUNNING"
                if not all(
                    name.startswith("tag:") and item["Tags"].get(name[4:]) in values
                    for name, values in filters
                ):
                    continue
                found.append(
                    {
                        "InstanceId": item["InstanceId"],
                        "InstanceName": item["InstanceName"],
                        "InstanceType": item["InstanceType"],
                        "InstanceState": item["InstanceState"],
                        "InstanceChargeType": item["InstanceChargeType"],
                        "Placement": {"Zone": item["Zone"]},
                        "PrivateIpAddresses": [item["Address"]],
                        "CreatedTime": item["CreatedTime"],
                        "CamRoleName": item["CamRoleName"],
                        "Tags": [{"Key": k, "Value": v} for k, v in item["Tags"].items()],
                    }
                )
        offset, limit = int(q.get("Offset", 0)), int(q.get("Limit", 20))
        return {"TotalCount": len(found), "InstanceSet": found[offset : offset + limit]}

    def _terminate(self, instance_id: str) -> None:
        with self.lock:
            item = self.instances.pop(instance_id, None)
            if item is not None and self.quota_left is not None:
                self.quota_left += int(TYPES[item["InstanceType"]][1])
        if item is not None:
            self.on_delete(item)

    def terminate_instances(self, q: dict[str, Any]) -> dict[str, Any]:
        for instance_id in q["InstanceIds"]:
            if instance_id not in self.instances:
                raise Refused(
                    "InvalidInstanceId.NotFound", f"The instance {instance_id} does not exist."
                )
        for instance_id in q["InstanceIds"]:
            self._terminate(instance_id)
        return {}

    # -- the instances' metadata service -------------------------------------------------

    def _metadata(self, path: str) -> tuple[int, str]:
        instance_id, _, rest = path.lstrip("/").partition("/")
        item = self.instances.get(instance_id)
        if item is None:
            return 404, "no such instance"
        rest = "/" + rest
        if rest == "/latest/meta-data/instance-id":
            return 200, instance_id
        if rest == "/latest/meta-data/local-ipv4":
            return 200, item["Address"]
        if rest == "/latest/meta-data/spot/termination-time":
            at = item.get("termination_time")
            return (200, at) if at else (404, "Not Found")
        role = "/latest/meta-data/cam/security-credentials/"
        if rest.startswith(role) and rest[len(role) :] == item["CamRoleName"]:
            expires = datetime.now(UTC) + timedelta(hours=1)
            return 200, json.dumps(
                {
                    "TmpSecretId": self.secret_id,
                    "TmpSecretKey": self.secret_key,
                    "ExpiredTime": int(expires.timestamp()),
                    "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "Token": "",
                    "Code": "Success",
                }
            )
        return 404, "Not Found"


ACTIONS: dict[str, Callable[[FakeCvm, dict[str, Any]], dict[str, Any]]] = {
    "DescribeRegions": FakeCvm.describe_regions,
    "DescribeZones": FakeCvm.describe_zones,
    "DescribeZoneInstanceConfigInfos": FakeCvm.describe_zone_instance_config_infos,
    "RunInstances": FakeCvm.run_instances,
    "DescribeInstances": FakeCvm.describe_instances,
    "TerminateInstances": FakeCvm.terminate_instances,
}
