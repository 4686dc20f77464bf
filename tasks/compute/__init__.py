"""Compute backends behind one Protocol; `get_backend` picks the module by name."""

from __future__ import annotations

from typing import Any

from tasks.compute.base import Backend, Cluster, JobResult, TeardownReport, WorkUnit


def get_backend(name: str, placement: Any = None) -> Backend:
    """Return the backend registered under `name` ("local", "kubernetes"), looking where
    `placement` (a spec's) says: for Kubernetes, its block's cluster and its namespace."""
    if name == "local":
        from tasks.compute.local import LocalBackend

        return LocalBackend()
    if name == "kubernetes":
        from tasks.compute.kubernetes import KubernetesBackend

        if placement is None:
            return KubernetesBackend()
        return KubernetesBackend(placement.block, placement.namespace)
    if name == "ec2":
        from tasks.errors import InvalidSpec

        raise InvalidSpec(
            "placement.backend: ec2 ranks offers (gpuflow offers JOB.yaml) but does not launch"
            " instances in this version; use local or kubernetes to run the job."
        )
    raise ValueError(f"unknown backend {name!r}")


__all__ = ["Backend", "Cluster", "JobResult", "TeardownReport", "WorkUnit", "get_backend"]
