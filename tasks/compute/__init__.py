"""Compute backends behind one Protocol; `get_backend` picks the module by name."""

from __future__ import annotations

from typing import Any

from tasks.compute.base import Backend, Cluster, JobResult, TeardownReport, WorkUnit


def get_backend(name: str, placement: Any = None) -> Backend:
    """Return the backend registered under `name` ("local", "kubernetes", "ec2"), looking where
    `placement` (a spec's) says: for Kubernetes, its block's cluster and its namespace; for EC2, its fleet block."""
    if name == "local":
        from tasks.compute.local import LocalBackend

        return LocalBackend()
    if name == "kubernetes":
        from tasks.compute.kubernetes import KubernetesBackend

        if placement is None:
            return KubernetesBackend()
        return KubernetesBackend(placement.block, placement.namespace)
    if name == "ec2":
        from tasks.compute.ec2 import Ec2Backend

        return Ec2Backend(placement.block if placement is not None else None)
    raise ValueError(f"unknown backend {name!r}")


__all__ = ["Backend", "Cluster", "JobResult", "TeardownReport", "WorkUnit", "get_backend"]
