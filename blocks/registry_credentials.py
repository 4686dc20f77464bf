"""RegistryCredentials: a user and password (or token) for a private container registry."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr


class RegistryCredentials(Block):
    """What gpuflow logs in to a private registry with when it pulls a job's image
    (`image.credentials` names the block). The password is written for the pull only, in a
    file only you can read, removed after; never on a command line, in a log or to the job.

    Examples:
        ```python
        from gpuflow.blocks import RegistryCredentials
        RegistryCredentials(
            registry="ghcr.io", username="me", password="ghp_..."
        ).save("ghcr")
        ```
    """

    _block_type_name = "gpuflow Registry Credentials"
    _block_type_slug = "gpuflow-registry-credentials"
    _description = "A user and password (or token) for a private container image registry."

    registry: str = Field(
        title="Registry",
        description="The registry's host (and port), e.g. ghcr.io or registry.example.com:5000.",
    )
    username: str = Field(title="Username")
    password: SecretStr = Field(title="Password or token")
