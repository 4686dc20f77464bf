"""What a cloud that rents instances gives gpuflow's instance backends: the protocol a
provider implements (AWS EC2, Alibaba Cloud ECS, Tencent Cloud CVM).

A provider says what its cloud offers (`find_offers`: types, zones and prices, ranked by
gpuflow.tasks.backends.instances.catalog), launches a run's instances from the first offer
with capacity (`launch`; a refusal after which another offer may launch is `NextOffer`),
describes and removes them by the run's owner tags, keeps the run's secret where only its
instances read it, gives the run a network that nothing outside reaches, and turns its
API's failures into one sentence (`error`). Everything else — the mailbox in object
storage, the agent, spot notices, self-termination, the heartbeat, reaping — is the same
on every cloud (gpuflow.tasks.backends.instances.backend and .agent).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, ClassVar

from pydantic import BaseModel

from gpuflow.tasks.backends.instances.catalog import CloudSettings, Offer, nearest
from gpuflow.tasks.backends.instances.mailbox import Mailbox
from gpuflow.tasks.backends.instances.placement import Ask
from gpuflow.tasks.contract import OWNER_LABEL, RUN_LABEL
from gpuflow.tasks.errors import CapacityError, InvalidSpec, Unreachable
from gpuflow.tasks.metrics.cost import PriceTable

# the states of an instance that still holds (or will hold) its machine, in EC2's words;
# a provider maps its own (Alibaba's Pending/Running/Starting/Stopping/Stopped, ...)
LIVE = ["pending", "running", "stopping", "stopped"]
# an elastic fleet's instances and security group carry these (never a run's owner tag)
FLEET_TAG = "gpuflow.io/fleet"
FLEET_OWNER = "gpuflow-fleet"


class Machine(BaseModel):
    """One instance as its cloud describes it."""

    id: str
    state: str  # pending | running | stopping | stopped | shutting-down | terminated
    instance_type: str = ""
    zone: str = ""
    market: str = ""  # spot | on-demand
    address: str = ""
    index: int = 0  # its place in the launch (node 0 first)
    launched_at: datetime
    tags: dict[str, str] = {}


class Launched(BaseModel):
    instance_ids: list[str]
    offer: Offer | None = None  # None: adopted from an earlier try
    adopted: bool = False
    placement_group: str | None = None


class Boot(BaseModel):
    """How a run's instances boot: its image, user-data, root disk, tags and network."""

    image_id: str
    user_data: str
    disk_gib: int
    tags: dict[str, str]
    network: str | None = None  # the run's security group
    subnet: str | None = None  # where the cloud takes one (an elastic fleet's EC2 subnet)
    spot_price_limit: float | None = None  # in the cloud's currency, per instance-hour


class RoleMetadata(BaseModel):
    """Where an instance reads its role's temporary credentials, for a program that runs
    before gpuflow is on it (an elastic fleet's instance publishing its host key): the
    metadata service (its address, or the variable that overrides it), its token dance
    where it has one, the credentials' path and their fields."""

    endpoint: str
    variable: str  # overrides `endpoint` where set
    credentials_path: str
    fields: tuple[str, str, str]  # key id, secret, session token
    token_path: str = ""
    token_ttl_header: str = ""
    token_header: str = ""
    forbid_overwrite: str = ""  # the object store's header that refuses an overwrite


class NextOffer(Exception):
    """The cloud refused one offer (no capacity there, a limit, a price) in a way another
    offer may not meet: its code and message, as the API said them."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code, self.message = code, message


def failover(
    offers: Iterable[Offer],
    nodes: int,
    try_offer: Callable[[Offer], list[str]],
    say: Callable[[str], None],
) -> tuple[Offer, list[str]]:
    """Launch from the first offer `try_offer` does not refuse with NextOffer; return it
    and the instances it made. Each refusal is said; CapacityError (retryable) when every
    offer was refused."""
    tried: list[str] = []
    for offer in offers:
        try:
            ids = try_offer(offer)
        except NextOffer as exc:
            tried.append(f"{offer.instance_type} {offer.market} in {offer.zone}: {exc.code}")
            say(
                f"no {offer.instance_type} ({offer.market}) in {offer.zone} ({exc.code});"
                " trying the next offer"
            )
            continue
        say(
            f"launched {len(ids)} x {offer.instance_type} ({offer.market}) in {offer.zone}:"
            f" {', '.join(ids)}"
        )
        return offer, ids
    raise CapacityError(
        f"no offer had capacity for {nodes} instance(s) ({'; '.join(tried[:6]) or 'no offers'});"
        " allow more types, zones or placement.market: spot-then-on-demand, or retry later"
    )


class Cloud(ABC):
    """One provider's cloud, as a run's settings (its block) reach it."""

    backend: ClassVar[str]  # the backend's name: placement.backend
    label: ClassVar[str]  # its instances' name in sentences: EC2, ECS, CVM
    currency: str = "USD"  # of its prices (a provider may set it per account)
    agent_module: ClassVar[str]  # `python -m` this on an instance starts the agent
    console_hint: ClassVar[str]  # how a user reads an instance's boot output

    def __init__(self, settings: CloudSettings) -> None:
        self.settings = settings

    # -- what the cloud offers ---------------------------------------------------------

    @abstractmethod
    def check_launch(self) -> None:
        """InvalidSpec (one sentence) for settings that cannot launch: no image, no
        control prefix, an install step that cannot be trusted."""

    def check_image(self, kind: str = "an image") -> None:
        """InvalidSpec when the settings name no machine image."""
        if not self.settings.image_id:
            raise InvalidSpec(
                f"{self.settings.field('image_id')}: no machine image is set; set it to"
                f" {kind} with NVIDIA's driver and Python 3.11+ in the fleet's region."
            )

    def check_zones(self, known: list[str], named: Mapping[str, list[str]]) -> None:
        """InvalidSpec for a zone a setting names (`named`: setting -> its zones) that the
        region does not have (`known`), with the nearest names."""
        for setting, zones in named.items():
            stray = [z for z in zones if z not in known]
            if stray and known:
                raise InvalidSpec(
                    f"{self.settings.field(setting)}: {stray[0]!r} is not a zone of"
                    f" {self.settings.region}; zones there: {nearest(stray[0], known)}."
                )

    @abstractmethod
    def find_offers(self, ask: Ask, prices: PriceTable) -> list[Offer]:
        """The ranked offers for `ask` (nothing launched)."""

    # -- a run's instances -------------------------------------------------------------

    @abstractmethod
    def machines(self, tags: Mapping[str, str], states: list[str] | None = None) -> list[Machine]:
        """The instances carrying every one of `tags` in `states` (default: LIVE)."""

    def run_machines(self, run_id: str, states: list[str] | None = None) -> list[Machine]:
        return self.machines({RUN_LABEL: run_id}, states)

    @abstractmethod
    def launch(
        self, offers: list[Offer], nodes: int, boot: Boot, say: Callable[[str], None]
    ) -> Launched:
        """The run's `nodes` instances: adopted when they exist (by its tags), else
        launched from the first offer with capacity; CapacityError when none has."""

    def adopted(self, run_id: str) -> Launched | None:
        """The run's instances when it has some (a retried provision adopts them)."""
        existing = self.run_machines(run_id)
        if not existing:
            return None
        return Launched(instance_ids=[m.id for m in existing], adopted=True)

    def remove(self, run_id: str, say: Callable[[str], None], wait_s: float = 300.0) -> list[str]:
        """Terminate the run's instances; return their ids once the cloud describes every
        one as gone (or `wait_s` passed). Idempotent."""
        ids = [m.id for m in self.run_machines(run_id) if m.state != "shutting-down"]
        self.terminate(ids)
        until = time.monotonic() + wait_s
        while ids and self.run_machines(run_id, [*LIVE, "shutting-down"]):
            if time.monotonic() > until:
                break
            time.sleep(1.0)
        return ids

    @abstractmethod
    def terminate(self, ids: list[str]) -> None:
        """Terminate these instances (untagged ones a reaper found), without waiting."""

    @abstractmethod
    def network(self, run_id: str, tags: Mapping[str, str], nodes: int) -> str | None:
        """The run's network (a security group nothing outside reaches; its nodes reach
        each other), made once; None where the cloud's default is used."""

    @abstractmethod
    def leftovers(self, run_id: str) -> list[str]:
        """Delete what the run left besides instances (volumes, its network, its secret);
        return what went. The mailbox is the backend's."""

    # -- storage and secrets -----------------------------------------------------------

    @abstractmethod
    def storage(self) -> Any:
        """A boto3 S3 client of the cloud's object storage (its S3-compatible API)."""

    @abstractmethod
    def put_secret(self, run_id: str, tags: Mapping[str, str], value: str) -> None:
        """Keep the run's secret (the agents' Prefect token, the run's variables, a registry
        login) where only the run's instances read it; never in user-data."""

    @abstractmethod
    def secret_id(self, run_id: str) -> str:
        """Where an agent reads the run's secret."""

    @abstractmethod
    def agent_settings(self) -> dict[str, Any]:
        """The agent's provider settings (region, endpoints), nothing secret."""

    # -- reaping -----------------------------------------------------------------------

    def tagged(self) -> dict[str, dict[str, Any]]:
        """Run id -> its live instances (`instances`: Machines), the names of its other
        resources (`others`) and their tags (`tags`), for everything tagged gpuflow's
        (instances only, unless a provider makes more)."""
        runs: dict[str, dict[str, Any]] = {}
        for machine in self.machines({OWNER_LABEL: "gpuflow"}):
            self.tagged_entry(runs, machine.tags)["instances"].append(machine)
        return runs

    @staticmethod
    def tagged_entry(runs: dict[str, dict[str, Any]], tags: dict[str, str]) -> dict[str, Any]:
        """The entry of `runs` for the run `tags` name, its tags merged in."""
        run = runs.setdefault(tags.get(RUN_LABEL, ""), {"instances": [], "others": [], "tags": {}})
        run["tags"] |= tags
        return run

    # -- an elastic fleet's instances ----------------------------------------------------

    def role_metadata(self) -> RoleMetadata | None:
        """Where an instance reads its role's credentials; None where the SDK on the image
        finds them itself (AWS's instance profile)."""
        return None

    def fleet_network(
        self, fleet: str, tags: Mapping[str, str], ssh_from: list[str], subnet: str | None
    ) -> str | None:
        """The elastic fleet's security group: SSH in from `ssh_from` (a default of the
        cloud's where empty), its instances reach each other; made once."""
        raise InvalidSpec(f"elastic fleets do not grow on {self.label} yet.")

    def remove_fleet_network(self, fleet: str, say: Callable[[str], None]) -> None:
        """Delete the fleet's security group once its instances are gone (none: nothing)."""
        return None

    def subnet_zone(self, subnet: str) -> str:
        """The zone of `subnet` (an elastic fleet's instances launch there)."""
        raise InvalidSpec(f"a fleet's subnet is not taken on {self.label}.")

    def hourly(self, machine: Machine) -> float | None:
        """What an instance costs an hour at most (on-demand), in USD; None where it is not
        known here (a type the cloud no longer lists, or no USD rate for its currency)."""
        return None

    def in_usd(self, price: float | None, currency: str) -> float | None:
        """`price` in USD at the rate gpuflow knows here (GPUFLOW_USD_PER_<CURRENCY>)."""
        rate = PriceTable().usd_rate(currency)
        return None if price is None or rate is None else price * rate

    # -- failures ----------------------------------------------------------------------

    @abstractmethod
    def error(self, exc: Exception, doing: str) -> InvalidSpec | Unreachable:
        """What went wrong talking to the cloud, as one sentence with its real cause."""


class SecretInMailbox:
    """The run's secret as an object of its mailbox, written with server-side encryption:
    for clouds whose secrets service gpuflow does not use (Alibaba Cloud, Tencent Cloud).
    Only the run's role and gpuflow read it; it goes with the mailbox at teardown."""

    SECRET = "secret.json"
    settings: CloudSettings

    def storage(self) -> Any:
        raise NotImplementedError

    def _mailbox(self, run_id: str) -> Mailbox:
        return Mailbox(self.storage(), self.settings.control_prefix or "", run_id)

    def secret_id(self, run_id: str) -> str:
        return f"{self._mailbox(run_id).url}{self.SECRET}"

    def put_secret(self, run_id: str, tags: Mapping[str, str], value: str) -> None:
        mailbox = self._mailbox(run_id)
        mailbox.s3.put_object(
            Bucket=mailbox.bucket,
            Key=mailbox.prefix + self.SECRET,
            Body=value.encode(),
            ServerSideEncryption="AES256",
        )
