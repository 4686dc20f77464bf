"""GpuFleet: GPU servers that outlive a run, shared by every gpuflow process that uses them."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from prefect.blocks.core import Block
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def _a_host_name(value: str) -> str:
    value = value.strip()
    if not value or value.startswith("-") or any(c in value for c in " \t/@:"):
        raise ValueError(f"{value!r} is not a host name or address; give the server's name or IP")
    return value


class FleetHost(BaseModel):
    """One GPU server of an SSH fleet, as gpuflow reaches it."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(title="Address", description="Host name or IP address of the server.")
    name: str | None = Field(
        default=None, title="Name", description="What runs and reports call it (default: address)."
    )
    port: int = Field(default=22, ge=1, le=65535, title="SSH port")
    user: str = Field(default="root", min_length=1, title="User")
    ssh_key: str | None = Field(
        default=None,
        title="SSH key (Secret block)",
        description="Name of the Secret block holding the private key (no passphrase) for"
        " this host; empty: the fleet's ssh_key.",
    )
    known_hosts: str = Field(
        default="",
        title="Known hosts",
        description="The host's key line(s), as in known_hosts (`ssh-keyscan`, checked); a"
        " host whose key differs is refused. Lines for the jump host go here too.",
    )
    jump: str | None = Field(
        default=None,
        title="Jump host",
        description="user@host[:port] of a bastion the connection goes through (its key line"
        " in known_hosts, the same key); empty: straight there.",
    )
    gpus: int | None = Field(
        default=None,
        ge=0,
        title="GPUs",
        description="How many GPUs the host has; `fleet apply` names a host whose NVML sees fewer.",
    )
    python: str = Field(
        default="python3",
        title="Python",
        description="The interpreter gpuflow runs on the host (3.11 or newer, with pydantic,"
        " psutil and PyYAML).",
    )

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return _a_host_name(value)

    @field_validator("jump")
    @classmethod
    def _jump(cls, value: str | None) -> str | None:
        if not value:
            return None
        user, _, rest = value.rpartition("@")
        host, _, port = rest.partition(":")
        _a_host_name(host)
        if not user or (port and not port.isdigit()):
            raise ValueError(f"{value!r} is not user@host[:port]; write e.g. admin@bastion:22")
        return value

    @property
    def label(self) -> str:
        return self.name or self.address


class HostCheck(BaseModel):
    """What `gpuflow fleet apply` found on a host."""

    host: str
    ok: bool
    reason: str = ""
    python: str | None = None
    gpus: int = 0
    products: list[str] = []
    driver: str | None = None
    cpus: int = 0
    disk_free_gib: float = 0.0
    wheel: str | None = None  # the gpuflow wheel installed there (its SHA-256)
    checked_at: str | None = None


class FleetNodes(BaseModel):
    """How many instances an elastic fleet keeps: never fewer than min, never more than max."""

    model_config = ConfigDict(extra="forbid")

    min: int = Field(default=0, ge=0, title="Fewest instances")
    max: int = Field(default=1, ge=0, le=100, title="Most instances")

    @model_validator(mode="after")
    def _ordered(self) -> FleetNodes:
        if self.max == 0:
            raise ValueError(
                "max is 0: the fleet could never have an instance; set max to 1 or more"
            )
        if self.min > self.max:
            raise ValueError(
                f"min ({self.min}) is above max ({self.max}); set min to at most {self.max}"
            )
        return self


class FleetInstances(BaseModel):
    """An elastic fleet's instances on a cloud: launched as runs wait for GPUs, kept across
    runs, ended after `idle_duration_s` without a claim (down to `nodes.min`). Each cloud
    has its section (`ec2`, `alibaba`, `tencent`); a fleet grows on one."""

    model_config = ConfigDict(extra="forbid")

    cloud: ClassVar[str]  # the instance backend it launches through
    label: ClassVar[str]  # its instances, in sentences
    type_example: ClassVar[str]

    block: str = Field(
        min_length=1,
        title="Cloud settings block",
        description="Its region, zones, credentials, image, role and control prefix.",
    )
    nodes: FleetNodes = Field(default_factory=FleetNodes, title="Instances (min..max)")
    instance_types: list[str] = Field(
        min_length=1,
        title="Instance types",
        description="What a new instance may be, tried in order.",
    )
    market: Literal["spot", "on-demand", "spot-then-on-demand"] = Field(
        "on-demand",
        title="Market",
        description="Rent spot instances, on-demand ones, or spot first then on-demand. A spot"
        " reclaim is a preemption of the units on the instance.",
    )
    user: str = Field(
        "ubuntu", min_length=1, title="SSH user", description="The image's login user."
    )
    idle_duration_s: float = Field(
        600.0,
        ge=10,
        title="Idle duration (seconds)",
        description="An instance with no claim this long is ended (down to nodes.min).",
    )
    grow_after_s: float = Field(
        5.0,
        ge=0,
        title="Grow after (seconds)",
        description="A run that has waited this long for GPUs makes the fleet grow.",
    )
    price_table: str | None = Field(
        None,
        title="Price table (GpuPriceTable block)",
        description="Prices over the defaults, and the rate to USD of a cloud that prices in"
        " another currency (CNY on Alibaba Cloud and Tencent Cloud).",
    )

    @field_validator("instance_types")
    @classmethod
    def _types(cls, value: list[str]) -> list[str]:
        for name in value:
            if not cls.is_type(name):
                raise ValueError(
                    f"{name!r} is not an {cls.label} instance type; write e.g. {cls.type_example}"
                )
        return value

    @classmethod
    def is_type(cls, name: str) -> bool:
        return "." in name and " " not in name


class FleetEc2(FleetInstances):
    """An elastic fleet's EC2 instances, in a subnet of the fleet's choosing."""

    cloud: ClassVar[str] = "ec2"
    label: ClassVar[str] = "EC2"
    type_example: ClassVar[str] = "g6.xlarge"

    ssh_from: list[str] = Field(
        default_factory=list,
        title="SSH allowed from",
        description="CIDRs allowed to reach the instances' SSH port (where gpuflow runs);"
        " empty: the fleet's own subnet only.",
    )
    subnet: str | None = Field(
        None, title="Subnet", description="Subnet id to launch in; empty: the zone's default."
    )


class FleetEcs(FleetInstances):
    """An elastic fleet's Alibaba Cloud ECS instances, in the EcsGpuFleet's vSwitches; no
    public address (gpuflow reaches them inside the VPC, or over a VPN or peering)."""

    cloud: ClassVar[str] = "alibaba"
    label: ClassVar[str] = "ECS"
    type_example: ClassVar[str] = "ecs.gn7i-c8g1.2xlarge"

    user: str = Field("root", min_length=1, title="SSH user", description="The image's login user.")
    ssh_from: list[str] = Field(
        default_factory=list,
        title="SSH allowed from",
        description="CIDRs allowed to reach the instances' SSH port (where gpuflow runs);"
        " empty: private addresses only (10/8, 172.16/12, 192.168/16).",
    )

    @classmethod
    def is_type(cls, name: str) -> bool:
        return name.startswith("ecs.") and " " not in name


class FleetCvm(FleetInstances):
    """An elastic fleet's Tencent Cloud CVM instances, in the CvmGpuFleet's subnets and its
    security group (which must let SSH in from where gpuflow runs)."""

    cloud: ClassVar[str] = "tencent"
    label: ClassVar[str] = "CVM"
    type_example: ClassVar[str] = "GN7.2XLARGE32"

    @model_validator(mode="before")
    @classmethod
    def _no_ssh_from(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("ssh_from"):
            raise ValueError(
                "ssh_from: a Tencent Cloud fleet's instances join the CvmGpuFleet's"
                " security_group; let SSH in there from where gpuflow runs, and remove ssh_from"
            )
        return values


class GpuFleet(Block):
    """GPU servers that outlive a run: existing machines reached over SSH. Runs share them
    by GPU; every gpuflow process that uses the fleet claims GPUs on the hosts themselves,
    as leases it renews, so no GPU is given twice and a killed orchestrator's GPUs come
    free once its lease lapses.

    Examples:
        ```python
        from gpuflow.blocks import GpuFleet
        GpuFleet(
            ssh_key="lab-key",
            hosts=[{"address": "10.0.0.5", "known_hosts": "10.0.0.5 ssh-ed25519 AAAA...", "gpus": 8}],
        ).save("lab")
        ```
        then `gpuflow fleet apply lab`, and `placement: {backend: fleet, fleet: lab}`.
    """

    _block_type_name = "gpuflow GPU Fleet"
    _block_type_slug = "gpuflow-gpu-fleet"
    _description = "GPU servers gpuflow's runs share over SSH."

    hosts: list[FleetHost] = Field(default_factory=list, title="Hosts")
    ssh_key: str | None = Field(
        default=None,
        title="SSH key (Secret block)",
        description="Name of the Secret block holding the private key the hosts accept.",
    )
    lease_s: float = Field(
        default=60.0,
        ge=5,
        le=3600,
        title="Lease (seconds)",
        description="How long a claim outlives its holder's last renewal: a killed"
        " orchestrator's GPUs come free, and its units stop, this long after it went.",
    )
    gpu_hourly_usd: float = Field(
        default=0.0, ge=0, title="GPU hourly price (USD)", description="For cost reports."
    )
    ec2: FleetEc2 | None = Field(
        default=None,
        title="Elastic EC2 instances",
        description="Grow the fleet with EC2 instances as runs wait, and end them when idle.",
    )
    alibaba: FleetEcs | None = Field(
        default=None,
        title="Elastic Alibaba Cloud ECS instances",
        description="Grow the fleet with ECS instances as runs wait, and end them when idle.",
    )
    tencent: FleetCvm | None = Field(
        default=None,
        title="Elastic Tencent Cloud CVM instances",
        description="Grow the fleet with CVM instances as runs wait, and end them when idle.",
    )
    checked: list[HostCheck] = Field(
        default_factory=list,
        title="Last check",
        description="What `gpuflow fleet apply` found on each host (written by it).",
    )

    @model_validator(mode="after")
    def _hosts_once(self) -> GpuFleet:
        seen: dict[str, int] = {}
        for i, host in enumerate(self.hosts):
            for key in {host.label, f"{host.address}:{host.port}"}:
                if key in seen:
                    raise ValueError(
                        f"hosts[{i}] ({host.label}) is listed twice (hosts[{seen[key]}]);"
                        " remove one of them"
                    )
                seen[key] = i
        return self

    @model_validator(mode="after")
    def _one_cloud(self) -> GpuFleet:
        named = [n for n in ("ec2", "alibaba", "tencent") if getattr(self, n) is not None]
        if len(named) > 1:
            raise ValueError(
                f"{' and '.join(named)}: an elastic fleet grows on one cloud; keep one of"
                " these sections (a pool places runs across fleets of different clouds)"
            )
        return self

    @property
    def elastic(self) -> FleetInstances | None:
        """The section of the cloud the fleet grows on (None: listed hosts only)."""
        return self.ec2 or self.alibaba or self.tencent

    def host(self, name: str) -> FleetHost | None:
        return next((h for h in self.hosts if h.label == name), None)

    def serving(self) -> list[tuple[FleetHost, HostCheck]]:
        """Return the hosts the last apply found fit to serve, with what it found."""
        checks = {c.host: c for c in self.checked}
        return [
            (h, checks[h.label]) for h in self.hosts if h.label in checks and checks[h.label].ok
        ]
