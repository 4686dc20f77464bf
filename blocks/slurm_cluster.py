"""SlurmCluster: where and how a Slurm cluster runs gpuflow's jobs."""

from __future__ import annotations

import getpass

from prefect.blocks.core import Block
from pydantic import Field, field_validator

# sbatch options gpuflow sets itself: a block may not change what teardown and reap rely on
GPUFLOW_SETS = (
    "--comment",
    "--job-name",
    "-J",
    "--wrap",
    "--parsable",
    "--requeue",
    "--no-requeue",
    "--output",
    "-o",
    "--chdir",
    "-D",
    "--gres",
    "--nodes",
    "-N",
    "--time",
    "-t",
)


class SlurmCluster(Block):
    """The partition, account and QOS gpuflow's jobs use on a Slurm cluster, the gres type
    of each GPU product there, the shared folder for workspaces and the cluster's price.

    Commands reach the cluster through the Slurm client on the machine gpuflow runs on
    (with SLURM_CONF as that machine has it), or, with `login_host`, through the cluster's
    login node over SSH: key-only, the key from a Secret block, the host's key checked
    against `known_hosts`.

    Examples:
        ```python
        from gpuflow.blocks import SlurmCluster
        SlurmCluster(
            partition="gpu", account="ml-team", gres_types={"H100": "h100"},
            workspace_root="/shared/gpuflow", gpu_hourly_usd=2.0,
        ).save("hpc")
        ```
        then `placement: {backend: slurm, block: hpc}` in a job spec.
    """

    _block_type_name = "gpuflow Slurm Cluster"
    _block_type_slug = "gpuflow-slurm-cluster"
    _description = "Settings for running gpuflow jobs on a Slurm cluster."

    partition: str | None = Field(
        default=None,
        title="Partition",
        description="Partition the jobs run in (placement.partition wins); empty: the cluster's default.",
    )
    account: str | None = Field(
        default=None, title="Account", description="Slurm account the jobs are charged to."
    )
    qos: str | None = Field(default=None, title="QOS", description="Slurm QOS of the jobs.")
    gres_types: dict[str, str] = Field(
        default_factory=dict,
        title="Gres type per GPU product",
        description="The gres type each gpu_product has in the cluster's gres.conf, e.g."
        " {'H100': 'h100'}; a product not listed is its short name in lower case.",
    )
    workspace_root: str | None = Field(
        default=None,
        title="Workspace root",
        description="A folder on the cluster's shared filesystem that every node and this"
        " machine see (placement.workspace_root wins).",
    )
    sbatch_options: list[str] = Field(
        default_factory=list,
        title="Extra sbatch options",
        description="More options for the job's allocation, e.g. ['--constraint=ib',"
        " '--exclusive'].",
    )
    login_host: str | None = Field(
        default=None,
        title="Login node",
        description="Host name of the cluster's login node, reached over SSH; empty: the"
        " Slurm client on the machine gpuflow runs on.",
    )
    login_user: str = Field(
        default_factory=getpass.getuser,
        title="Login user",
        description="User on the login node (default: the user running gpuflow).",
    )
    login_port: int = Field(default=22, ge=1, le=65535, title="SSH port")
    ssh_key: str | None = Field(
        default=None,
        title="SSH key (Secret block)",
        description="Name of the Secret block holding the private key for the login node;"
        " empty: ssh's own keys (an agent, ~/.ssh).",
    )
    known_hosts: str | None = Field(
        default=None,
        title="Known hosts",
        description="The login node's host key line(s), as in known_hosts (`ssh-keyscan`,"
        " checked); empty: ~/.ssh/known_hosts. A host whose key differs is refused.",
    )
    gpu_hourly_usd: float = Field(
        default=0.0,
        ge=0,
        title="GPU hourly price (USD)",
        description="What the cluster charges for one GPU-hour, for cost reports.",
    )

    @field_validator("gres_types")
    @classmethod
    def _known_products(cls, value: dict[str, str]) -> dict[str, str]:
        from gpuflow.tasks.gpus import canonical_product

        return {canonical_product(product): kind.lower() for product, kind in value.items()}

    @field_validator("login_host")
    @classmethod
    def _a_host(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or value.startswith("-") or " " in value):
            raise ValueError(f"{value!r} is not a host name; give the login node's name")
        return value or None

    @field_validator("sbatch_options")
    @classmethod
    def _not_gpuflows(cls, value: list[str]) -> list[str]:
        for option in value:
            name = option.split("=", 1)[0]
            if not option.startswith("-"):
                raise ValueError(f"{option!r} is not an sbatch option; write e.g. --exclusive")
            if name in GPUFLOW_SETS:
                raise ValueError(
                    f"{name} is set by gpuflow from the job spec; remove it (resources and"
                    " limits set nodes, gres and time)"
                )
        return value
