"""Compute backends behind one Protocol; `get_backend` picks the module by name."""

from __future__ import annotations

from tasks.compute.base import Backend, Cluster, JobResult, TeardownReport, WorkUnit


def get_backend(name: str) -> Backend:
    """Return the backend registered under `name` ("local", "kubernetes")."""
    if name == "local":
        from tasks.compute.local import LocalBackend

        return LocalBackend()
    if name == "kubernetes":
        from tasks.compute.kubernetes import KubernetesBackend

        return KubernetesBackend()
    raise ValueError(f"unknown backend {name!r}")


__all__ = ["Backend", "Cluster", "JobResult", "TeardownReport", "WorkUnit", "get_backend"]
