"""GpuFleet: GPU servers that outlive a run, shared by every gpuflow process that uses them."""

from __future__ import annotations

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

    def host(self, name: str) -> FleetHost | None:
        return next((h for h in self.hosts if h.label == name), None)

    def serving(self) -> list[tuple[FleetHost, HostCheck]]:
        """Return the hosts the last apply found fit to serve, with what it found."""
        checks = {c.host: c for c in self.checked}
        return [
            (h, checks[h.label]) for h in self.hosts if h.label in checks and checks[h.label].ok
        ]
