"""What every backend that runs a job in its image shares: the registry's credentials from
the spec's block, the environment names an engine keeps for itself, and the pin of an
image by the orchestrator where the units run elsewhere (the registry asked, nothing
pulled here)."""

from __future__ import annotations

from collections.abc import Callable

from gpuflow.tasks import containers
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.saved_blocks import load_block
from gpuflow.tasks.spec import JobSpec

# what an engine reads from its own environment: a job's value of one of these goes on the
# engine's command line (`--env NAME=VALUE`), so a secret may not use these names
ENGINE_OWN = frozenset(
    {"HOME", "PATH", "TMPDIR", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "USER"}
    | {"REGISTRY_AUTH_FILE", "CONTAINERS_CONF", "CONTAINERS_REGISTRIES_CONF", "DOCKER_HOST"}
    | {"DOCKER_CONFIG", "CONTAINER_HOST"}
)


def credentials_of(spec: JobSpec) -> tuple[str | None, str | None]:
    """The user and password image.credentials names (its block), or none."""
    if spec.image is None or spec.image.credentials is None:
        return None, None
    from gpuflow.blocks.registry_credentials import RegistryCredentials

    block = load_block(
        RegistryCredentials,
        spec.image.credentials,
        "image.credentials",
        otherwise="remove image.credentials for a public image",
    )
    registry = containers.registry_of(spec.image.ref)
    if block.registry != registry:
        raise InvalidSpec(
            f"image.credentials: the block {spec.image.credentials!r} is for {block.registry},"
            f" the image is on {registry}; name that registry's block."
        )
    return block.username, block.password.get_secret_value()


def check_secrets_pass_by_name(spec: JobSpec) -> None:
    """A secret never goes on the engine's command line: refuse one named like the
    engine's own environment."""
    for name in spec.secret_env:
        if name in ENGINE_OWN:
            raise InvalidSpec(
                f"secret_env.{name}: a job in an image gets its secrets through the container"
                f" engine's environment, where {name} is the engine's own; give the secret"
                " another name."
            )


def pin_by_registry(spec: JobSpec, say: Callable[[str], None]) -> JobSpec:
    """The spec with its image's digest as the registry gives it now (asked from here;
    the hosts pull that digest): one sentence for an image the registry does not have,
    refuses or a registry that cannot be reached."""
    assert spec.image is not None
    check_secrets_pass_by_name(spec)
    digest = containers.resolve_digest(spec.image.pinned, credentials_of(spec))
    image = spec.image.model_copy(update={"digest": digest})
    say(f"image {spec.image.ref} is {image.pinned}")
    return spec.model_copy(update={"image": image})
