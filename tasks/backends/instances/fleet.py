"""An elastic fleet's instances on any cloud that rents them (GpuFleet.ec2, .alibaba,
.tencent): launched for the fleet through the provider's `Cloud`, kept across runs, reached
over SSH like any host of the fleet, its records under the cloud settings' control prefix.

An instance's user-data only lets the fleet's key in (a public key) and publishes the
instance's own SSH host key to the fleet's records (with the instance's role: AWS's
instance profile through boto3's own chain, Alibaba's RAM role and Tencent's CAM role
through their metadata services): gpuflow then checks the host key like any other host's.
gpuflow itself is pushed over SSH, as on every fleet host. Instances carry the tags
`gpuflow.io/owner: gpuflow-fleet` and `gpuflow.io/fleet: <name>` (never a run's, so the
instance backends' reaper leaves them to the fleet's scaler).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from gpuflow.tasks.backends.elastic import Instance, Want
from gpuflow.tasks.backends.instances.catalog import CloudSettings, Offer
from gpuflow.tasks.backends.instances.cloud import FLEET_OWNER, FLEET_TAG, Boot, Cloud
from gpuflow.tasks.backends.instances.mailbox import Mailbox, addressing_style
from gpuflow.tasks.backends.instances.placement import Ask, InstancePlacement
from gpuflow.tasks.contract import OWNER_LABEL, RUN_LABEL
from gpuflow.tasks.errors import CapacityError, InvalidSpec, Unreachable
from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.spec import Limits, Resources

SLOT_TAG = "gpuflow.io/fleet-slot"
DISK_GIB = 64
OFFERS_FOR_S = 300.0
_OFFERS: dict[tuple, tuple[float, list[Offer]]] = {}
_OFFERS_LOCK = threading.Lock()

# Run on the instance by its user-data, the host key line on standard input: put it at
# BUCKET/KEY with the credentials boto3 finds there itself (AWS's instance profile), if
# nothing is there yet.
_PUBLISH = """\
import sys, boto3
s3 = boto3.client('s3', region_name={region!r}, endpoint_url={url!r})
s3.put_object(Bucket={bucket!r}, Key={key!r}, Body=sys.stdin.read().strip(), IfNoneMatch='*')
"""

# The same with the role's temporary credentials from the metadata service (its token
# first, where it has one), for object storage's S3-compatible API (with the store's own
# header that refuses an overwrite).
_PUBLISH_WITH_ROLE = """\
import json, os, sys, urllib.request as r
import boto3
from botocore.config import Config
at = os.environ.get({variable!r}) or {endpoint!r}
def ask(path, method='GET', headers=None):
    with r.urlopen(r.Request(at + path, method=method, headers=headers or {{}}), timeout=5) as a:
        return a.read().decode()
headers = {{}}
if {token_path!r}:
    headers = {{{token_header!r}: ask({token_path!r}, 'PUT', {{{ttl_header!r}: '300'}})}}
keys = json.loads(ask({credentials!r}, headers=headers))
s3 = boto3.client('s3', region_name={region!r}, endpoint_url={url!r},
    aws_access_key_id=keys[{key_id!r}], aws_secret_access_key=keys[{secret!r}],
    aws_session_token=keys.get({token!r}) or None,
    config=Config(s3={{'addressing_style': {style!r}}}))
def forbid(request, **_):
    request.headers[{forbid!r}] = 'true'
if {forbid!r}:
    s3.meta.events.register('before-sign.s3.PutObject', forbid)
s3.put_object(Bucket={bucket!r}, Key={key!r}, Body=sys.stdin.read().strip(), IfNoneMatch='*')
"""


def _said(doing: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Turn a cloud's failure in the decorated method into one sentence: what it was doing
    (`doing`, with {name}: the fleet's), where, and why."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def said(self: CloudFleetNodes, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except (InvalidSpec, CapacityError, Unreachable):
                raise  # said in one sentence already
            except Exception as exc:
                raise self.cloud.error(exc, doing.format(name=self.name)) from None

        return said

    return wrap


class CloudFleetNodes:
    """An elastic fleet's instances on `cloud`, and its records under the control prefix.
    `section` is the fleet's cloud section (blocks.gpu_fleet.FleetInstances), `placement`
    the provider's placement for the market the section rents on."""

    def __init__(
        self,
        cloud: Cloud,
        placement: InstancePlacement,
        prices: PriceTable,
        section: Any,
        name: str,
        public_key: str,
    ) -> None:
        self.cloud, self.placement, self.prices = cloud, placement, prices
        self.section, self.name, self.public_key = section, name, public_key
        self.at = f"fleet {name!r} {section.cloud}"  # the section, in sentences
        settings: CloudSettings = cloud.settings
        self.settings = settings
        if not settings.control_prefix:
            raise InvalidSpec(
                f"{settings.field('control_prefix')}: an elastic fleet keeps its records"
                " there; set it to an s3:// prefix of the cloud's object storage."
            )
        cloud.check_launch()  # its image, network and role (the host key is published with it)
        self.records = Mailbox(cloud.storage(), settings.control_prefix, f"fleets/{name}")

    # -- what a new instance is ----------------------------------------------------------

    @functools.cached_property
    def offers(self) -> list[Offer]:
        """The offers for the fleet's instance types, in the order they are tried: the
        types as listed, the market's order within each (asked of the cloud once every
        OFFERS_FOR_S per process: every stage of a run reads them)."""
        key = (
            self.section.cloud,
            self.section.block,
            tuple(self.section.instance_types),
            self.section.market,
            getattr(self.section, "subnet", None),
            self.prices.model_dump_json(),  # its prices and rates, as given now
            tuple(
                sorted((k, v) for k, v in os.environ.items() if k.startswith("GPUFLOW_USD_PER_"))
            ),
        )
        with _OFFERS_LOCK:
            cached = _OFFERS.get(key)
        if cached is not None and time.monotonic() - cached[0] < OFFERS_FOR_S:
            return cached[1]
        found = self._offers()
        with _OFFERS_LOCK:
            _OFFERS[key] = (time.monotonic(), found)
        return found

    @_said("read the offers of fleet {name!r}'s instance types")
    def _offers(self) -> list[Offer]:
        ask = Ask(
            resources=Resources(gpus=1),
            placement=self.placement,
            limits=Limits(),
            prices=self.prices,
            prices_field=f"{self.at}.price_table",
        )
        found = self.cloud.find_offers(ask, self.prices)
        subnet = getattr(self.section, "subnet", None)
        zone = self.cloud.subnet_zone(subnet) if subnet else None
        ordered = []
        for wanted in self.section.instance_types:
            ordered += [
                o for o in found if o.instance_type == wanted and (zone is None or o.zone == zone)
            ]
        if not ordered:
            raise InvalidSpec(
                f"{self.at}.instance_types: none of {', '.join(self.section.instance_types)}"
                f" is offered{f' in {zone}' if zone else ''} with GPUs in {self.settings.region};"
                " name GPU instance types that are (gpuflow offers lists them)."
            )
        return ordered

    def boot_timeout_s(self) -> float:
        return float(self.settings.boot_timeout_s)

    def instance_gpus(self) -> tuple[int, str, float]:
        first = self.offers[0]
        return first.gpus, first.product, first.hourly_usd

    # -- instances -----------------------------------------------------------------------

    @_said("list fleet {name!r}'s instances")
    def instances(self) -> list[Instance]:
        found = self.cloud.machines(
            {FLEET_TAG: self.name, OWNER_LABEL: FLEET_OWNER}, ["pending", "running"]
        )
        offers = {(o.instance_type, o.market): o for o in self.offers}
        keys = self.host_keys()
        out = []
        for machine in found:
            slot = machine.tags.get(SLOT_TAG, "")
            offer = offers.get((machine.instance_type, machine.market))
            key = keys.get(machine.id)
            out.append(
                Instance(
                    id=machine.id,
                    slot=int(slot) if slot.isdigit() else None,
                    address=machine.address,
                    instance_type=machine.instance_type,
                    gpus=offer.gpus if offer else 0,
                    product=offer.product if offer else "",
                    market=machine.market,
                    state=machine.state,
                    launched_at=machine.launched_at,
                    known_hosts=f"{machine.address} {key}" if key and machine.address else None,
                    hourly_usd=offer.hourly_usd if offer else 0.0,
                )
            )
        return sorted(out, key=lambda i: (i.slot if i.slot is not None else 1000, i.id))

    @_said("launch an instance for fleet {name!r}")
    def launch(self, slot: int, say: Callable[[str], None]) -> Instance:
        """Launch the instance of `slot` from the first offer with capacity."""
        owner = {
            OWNER_LABEL: FLEET_OWNER,
            FLEET_TAG: self.name,
            SLOT_TAG: str(slot),
            RUN_LABEL: f"fleet-{self.name}-{slot}-{uuid.uuid4().hex[:8]}",
        }
        subnet = getattr(self.section, "subnet", None)
        group = self.cloud.fleet_network(
            self.name,
            {OWNER_LABEL: FLEET_OWNER, FLEET_TAG: self.name},
            list(getattr(self.section, "ssh_from", [])),
            subnet,
        )
        boot = Boot(
            image_id=self.settings.image_id or "",
            user_data=self.user_data(slot),
            disk_gib=DISK_GIB,
            tags=owner,
            network=group,
            subnet=subnet,
        )
        launched = self.cloud.launch(self.offers, 1, boot, say)
        offer = launched.offer or self.offers[0]
        return Instance(
            id=launched.instance_ids[0],
            slot=slot,
            instance_type=offer.instance_type,
            gpus=offer.gpus,
            product=offer.product,
            market=offer.market,
            state="pending",
            launched_at=datetime.now(UTC),
            hourly_usd=offer.hourly_usd,
        )

    @_said("end fleet {name!r}'s instances")
    def end(self, instance_ids: list[str], say: Callable[[str], None]) -> None:
        if not instance_ids:
            return
        self.cloud.terminate(instance_ids)
        say(f"ended {', '.join(instance_ids)}")

    def user_data(self, slot: int) -> str:
        """An instance's boot script: the fleet's public key let in for the SSH user, and
        the instance's host key published to the fleet's records with the instance's own
        role (Python's boto3 on the image). Nothing secret in it."""
        return "\n".join(
            [
                "#!/bin/bash",
                f"# gpuflow: an instance of fleet {self.name} (slot {slot}); gpuflow reaches it"
                " over SSH",
                "set -euo pipefail",
                f"user={shlex.quote(self.section.user)}",
                'home=$(getent passwd "$user" | cut -d: -f6 || true)',
                "# where sshd reads them (an image that keeps them elsewhere sets these)",
                "keys=${AUTHORIZED_KEYS:-$home/.ssh/authorized_keys}",
                "host_key=${SSH_HOST_KEY:-/etc/ssh/ssh_host_ed25519_key.pub}",
                'mkdir -p "$(dirname "$keys")" && chmod 700 "$(dirname "$keys")"',
                f'echo {shlex.quote(self.public_key)} >> "$keys"',
                'chmod 600 "$keys"',
                '[ -z "$home" ] || chown -R "$user" "$(dirname "$keys")" 2>/dev/null || true',
                'for try in $(seq 60); do [ -s "$host_key" ] && break; sleep 1; done',
                "# the host key, for gpuflow to check (the instance's role may write it)",
                f'cut -d" " -f1-2 "$host_key" | python3 -c {shlex.quote(self.publisher(slot))}',
                "",
            ]
        )

    def publisher(self, slot: int) -> str:
        """The Python program that puts the host key line (its standard input) in the
        fleet's records with the instance's role."""
        agent = self.cloud.agent_settings()
        url = agent.get("endpoint_url") or None
        region = agent.get("cloud", {}).get("storage_region") or agent["region"]
        where = {
            "bucket": self.records.bucket,
            "key": self.records.prefix + f"hosts/slot-{slot}.pub",
        }
        role = self.cloud.role_metadata()
        if role is None:
            return _PUBLISH.format(region=region, url=url, **where)
        key_id, secret, token = role.fields
        return _PUBLISH_WITH_ROLE.format(
            variable=role.variable,
            endpoint=role.endpoint,
            token_path=role.token_path,
            token_header=role.token_header,
            ttl_header=role.token_ttl_header,
            credentials=role.credentials_path,
            region=region,
            url=url,
            key_id=key_id,
            secret=secret,
            token=token,
            style=addressing_style(url or ""),
            forbid=role.forbid_overwrite,
            **where,
        )

    @_said("read fleet {name!r}'s host keys")
    def host_keys(self) -> dict[str, str]:
        """Instance id -> the host key it published (under its slot)."""
        keys: dict[str, str] = {}
        for slot, record in self.slots().items():
            data = self.records.get(f"hosts/slot-{slot}.pub") if record.get("instance") else None
            if data:
                keys[record["instance"]] = data.decode().strip()
        return keys

    # -- the fleet's records ---------------------------------------------------------------

    @_said("read fleet {name!r}'s slots")
    def slots(self) -> dict[int, dict[str, Any]]:
        found = {}
        for key in self.records.keys("slots/"):
            record = self.records.get_json(key)
            if record is not None:
                found[int(key.rsplit("/", 1)[1])] = record
        return found

    @_said("take a slot of fleet {name!r}")
    def take_slot(self, slot: int, record: dict[str, Any]) -> bool:
        if not self.records.put_new(f"slots/{slot}", json.dumps(record)):
            return False
        self.records.delete(f"hosts/slot-{slot}.pub")  # a reclaimed instance's, if any
        return True

    @_said("write a slot of fleet {name!r}")
    def set_slot(self, slot: int, record: dict[str, Any]) -> None:
        self.records.put_json(f"slots/{slot}", record)

    @_said("free a slot of fleet {name!r}")
    def free_slot(self, slot: int) -> None:
        self.records.delete(f"hosts/slot-{slot}.pub")
        self.records.delete(f"slots/{slot}")

    @_said("read the runs waiting on fleet {name!r}")
    def wants(self) -> list[Want]:
        found = []
        for key in self.records.keys("wants/"):
            record = self.records.get_json(key)
            if record is not None:
                found.append(Want.model_validate(record))
        return found

    @_said("record a run waiting on fleet {name!r}")
    def want(self, want: Want) -> None:
        self.records.put(f"wants/{want.run}", want.model_dump_json())

    @_said("forget a run waiting on fleet {name!r}")
    def unwant(self, run: str) -> None:
        self.records.delete(f"wants/{run}")

    @_said("record an ended instance of fleet {name!r}")
    def ended(self, instance_id: str, record: dict[str, Any]) -> None:
        self.records.put_json(f"ended/{instance_id}", record)

    @_said("read fleet {name!r}'s ledger")
    def ledger(self) -> list[dict[str, Any]]:
        return [r for k in self.records.keys("ended/") if (r := self.records.get_json(k))]

    @_said("remove fleet {name!r}'s security group and records")
    def remove_all(self, say: Callable[[str], None]) -> None:
        """Delete the fleet's security group (once its instances are gone) and its records."""
        self.cloud.remove_fleet_network(self.name, say)
        self.records.delete_all()
