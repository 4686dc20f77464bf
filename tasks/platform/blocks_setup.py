"""The blocks a fresh setup needs: gpuflow's block types registered, and default documents
created once (never overwritten, so edits made in the UI survive a rerun)."""

from __future__ import annotations

from collections.abc import Callable

from prefect.blocks.core import Block

from gpuflow.blocks import GpuPriceTable, LocalGpuHost, RegistryCredentials
from gpuflow.tasks.backends import registry

DEFAULT_LOCAL_HOST = "local"
DEFAULT_PRICES = "default"


def defaults() -> list[tuple[type[Block], str, Callable[[], Block] | None]]:
    """Return the block types to register, with the name of the document each gets made
    ("" : the type only, as a cluster or an account needs its own): this host's and the
    prices', then every registered backend's (`block_types`)."""
    found: list[tuple[type[Block], str, Callable[[], Block] | None]] = [
        (LocalGpuHost, DEFAULT_LOCAL_HOST, LocalGpuHost),
        (GpuPriceTable, DEFAULT_PRICES, GpuPriceTable),
        (RegistryCredentials, "", None),  # a registry's, as you need one
    ]
    for name in registry.names():
        for block_type in registry.backend_class(name).block_types():
            if all(block_type is not known for known, _, _ in found):
                found.append((block_type, "", None))
    return found


def init_blocks() -> list[tuple[str, str, str]]:
    """Register every gpuflow block type and create the default documents that are missing;
    return (block type slug, document name, "created" | "kept" | "registered") per entry."""
    from prefect_aws import AwsCredentials
    from prefect_kubernetes.credentials import KubernetesClusterConfig

    done = []
    for block_type in (AwsCredentials, KubernetesClusterConfig):
        block_type.register_type_and_schema()
    for block_type, name, make in defaults():
        block_type.register_type_and_schema()
        slug = block_type.get_block_type_slug()
        if not name or make is None:
            done.append((slug, "", "registered"))
            continue
        try:
            block_type.load(name)
            done.append((slug, name, "kept"))
        except ValueError:
            make().save(name)
            done.append((slug, name, "created"))
    return done
