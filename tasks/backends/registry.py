"""Backends by name. Every backend implements gpuflow.tasks.backends.base.Backend; adding one is a
package with a class that has `name`, `capabilities` and the verbs, plus a `register` call."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gpuflow.tasks.backends import elastic
from gpuflow.tasks.backends.alibaba.backend import AlibabaBackend
from gpuflow.tasks.backends.base import AddsNodes, Backend, ServesReplicas
from gpuflow.tasks.backends.ec2.backend import Ec2Backend
from gpuflow.tasks.backends.fleet.backend import FleetBackend
from gpuflow.tasks.backends.instances.backend import InstanceBackend
from gpuflow.tasks.backends.instances.fleet import CloudFleetNodes
from gpuflow.tasks.backends.instances.placement import InstancePlacement
from gpuflow.tasks.backends.kubernetes.backend import KubernetesBackend
from gpuflow.tasks.backends.local.backend import LocalBackend
from gpuflow.tasks.backends.slurm.backend import SlurmBackend
from gpuflow.tasks.backends.tencent.backend import TencentBackend
from gpuflow.tasks.contract import Cluster
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.extras import require
from gpuflow.tasks.metrics.cost import add_list_prices, remove_list_prices
from gpuflow.tasks.placement import prices_named
from gpuflow.tasks.runscope import once
from gpuflow.tasks.spec import Placement, add_placement_model, remove_placement_model

_BACKENDS: dict[str, type[Backend]] = {}
_BUILT_IN_CLASSES = (
    LocalBackend,
    KubernetesBackend,
    Ec2Backend,
    SlurmBackend,
    FleetBackend,
    AlibabaBackend,
    TencentBackend,
)
BUILT_IN = tuple(b.name for b in _BUILT_IN_CLASSES)


def register(backend: type[Backend]) -> type[Backend]:
    """Add a backend class under its `name`, and its placement model to the spec; return it.
    A backend whose capabilities say it adds nodes or serves replicas must have the verbs
    (AddsNodes, ServesReplicas): TypeError otherwise, when it is registered."""
    for says, verbs in ((backend.capabilities.adds_nodes, AddsNodes),
                        (backend.capabilities.serves_replicas, ServesReplicas)):  # fmt: skip
        if says and not issubclass(backend, verbs):
            raise TypeError(f"backend {backend.name!r} says it can but lacks {verbs.__name__}")
    _BACKENDS[backend.name] = backend
    add_placement_model(backend.name, backend.placement_model)
    add_list_prices(backend.name, backend.list_prices)
    if issubclass(backend, InstanceBackend):
        # an elastic fleet grows on a cloud's instances: the fleet backend reaches them
        # through this (no backend imports another)
        elastic.CLOUDS[backend.name] = _fleet_nodes(backend)
    return backend


def unregister(name: str) -> None:
    """Remove a backend `register` added; built-in backends stay."""
    if name not in BUILT_IN and _BACKENDS.pop(name, None) is not None:
        remove_placement_model(name)
        remove_list_prices(name)
        elastic.CLOUDS.pop(name, None)


def get_backend(name: str, placement: Placement | None = None) -> Backend:
    """Return the backend registered under `name`, looking where `placement` (a spec's) says:
    its block and, for Kubernetes, its namespace. InvalidSpec for a name none has. One
    object per placement in a run (tasks/runscope.py): its block is read once."""
    cls = backend_class(name)
    key = ("backend", name, None if placement is None else placement.model_dump_json())
    return once(key, lambda: cls.at(placement))


def names() -> list[str]:
    """Return the names of the registered backends, built-in first, in registration order
    (every list of backends gpuflow shows or accepts reads it)."""
    return list(_BACKENDS)


def backend_class(name: str, field: str = "placement.backend") -> type[Backend]:
    """Return the class registered under `name`; InvalidSpec, naming `field`, for a name
    none has."""
    if name not in _BACKENDS:
        raise InvalidSpec(f"{field}: {name!r} is not a backend; use one of: {', '.join(_BACKENDS)}")
    return _BACKENDS[name]


def reaper(name: str, block: str | None, namespace: str | None) -> Backend:
    """Return the backend `gpuflow reap --backend NAME --block B --namespace N` asks."""
    return backend_class(name, "--backend").reaper(block, namespace)


def backend_for(cluster: Cluster) -> Backend:
    """Return the backend `cluster` was made with, rebuilt from what its state records
    (once per cluster state in a run)."""
    cls = _BACKENDS[cluster.backend]
    key = ("cluster", cluster.backend, json.dumps(cluster.state, sort_keys=True, default=str))
    return once(key, lambda: cls.of(cluster))


def _fleet_nodes(backend: type[InstanceBackend]) -> Callable[[Any, str, str], elastic.Nodes]:
    """A maker of an elastic fleet's instances on `backend`'s cloud, from the fleet's
    section of that cloud (GpuFleet.ec2, .alibaba, .tencent)."""

    def make(section: Any, fleet: str, public_key: str) -> elastic.Nodes:
        field = f"fleet {fleet!r} {section.cloud}"
        require(backend.extra, field, f"an elastic fleet on {section.label}")
        instances = backend()
        cloud = instances.cloud_of(instances.settings_named(section.block, f"{field}.block"))
        placement = instances.placement_model.model_validate(
            {"backend": backend.name, "block": section.block, "market": section.market}
        )
        assert isinstance(placement, InstancePlacement)
        prices = prices_named(section.price_table, f"{field}.price_table")
        return CloudFleetNodes(cloud, placement, prices, section, fleet, public_key)

    return make


for _builtin in _BUILT_IN_CLASSES:
    register(_builtin)
