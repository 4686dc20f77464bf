"""Why a pod is not running yet, in one sentence: from the scheduler's own reason and what
the nodes hold. Pure: takes the API's objects as dicts."""

from __future__ import annotations

import math
from typing import Any

from gpuflow.tasks.backends.kubernetes.manifests import GPU, PRODUCT_LABEL


def gpus_of(resources: dict[str, Any]) -> int:
    value = (resources or {}).get(GPU)
    return int(value) if value is not None else 0


def used_gpus(pods: list[dict[str, Any]]) -> dict[str, int]:
    """Return GPUs held on each node by pods that are bound and not finished."""
    used: dict[str, int] = {}
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if not node or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for container in pod["spec"].get("containers", []):
            limits = container.get("resources", {}).get("limits", {})
            used[node] = used.get(node, 0) + gpus_of(limits)
    return used


def explain_pending(
    gpus: int,
    product: str | None,
    nodes: list[dict[str, Any]],
    used: dict[str, int],
    scheduler_message: str,
    machines: int = 1,
) -> tuple[str, str]:
    """Return why a pod asking `gpus` GPUs of `product` (one of `machines` such pods, each
    on a machine of its own) is not scheduled, and what waiting can do: "never" (no node
    could ever take it), "busy" (GPUs are held by others now) or "unclear" (only the
    scheduler's words: a node not ready yet, a taint)."""

    def product_of(node: dict[str, Any]) -> str | None:
        return node.get("metadata", {}).get("labels", {}).get(PRODUCT_LABEL)

    def allocatable(node: dict[str, Any]) -> int:
        return gpus_of(node.get("status", {}).get("allocatable", {}))

    gpu_nodes = [n for n in nodes if allocatable(n) > 0]
    if gpus and not gpu_nodes:
        return (
            "the cluster has no node with nvidia.com/gpu; add GPU nodes or run on another backend.",
            "never",
        )
    where = f"on {product}" if product else "on one node"
    if gpus and product:
        offered = sorted({p for n in gpu_nodes if (p := product_of(n))})
        if product not in offered:
            return (
                f"no node has {product} GPUs (the nodes offer: {', '.join(offered) or 'unlabelled GPUs'});"
                " set resources.gpu_product to one of them or leave it out.",
                "never",
            )
        gpu_nodes = [n for n in gpu_nodes if product_of(n) == product]
    if gpus:
        largest = max(allocatable(n) for n in gpu_nodes)
        if gpus > largest:
            return (
                f"needs {gpus} x {GPU} {where}; the largest node has {largest} in all; lower"
                f" resources.gpus or use {math.ceil(gpus / largest)} nodes"
                f" (resources.nodes) of {largest} GPUs.",
                "never",
            )
        able = sum(1 for n in gpu_nodes if allocatable(n) >= gpus)
        if machines > able:
            return (
                f"needs {machines} nodes with {gpus} x {GPU} each"
                f"{f' on {product}' if product else ''}; the cluster has {able} such node(s);"
                f" lower resources.nodes to {able} or add nodes.",
                "never",
            )
        free = max(allocatable(n) - used.get(n["metadata"]["name"], 0) for n in gpu_nodes)
        if gpus > free:
            return (
                f"needs {gpus} x {GPU} {where}; the most free on any such node now is {free}"
                " (the rest are busy); waiting for GPUs to free up.",
                "busy",
            )
    reason = scheduler_message.split(". preemption:")[0].strip() or "no reason given yet"
    return f"the scheduler cannot place it yet: {reason}.", "unclear"


def free_now(
    gpus: int,
    nodes_wanted: int,
    product: str | None,
    nodes: list[dict[str, Any]],
    used: dict[str, int],
) -> tuple[int, int, str]:
    """Return what the cluster could give a job of `nodes_wanted` pods x `gpus` GPUs of
    `product` now: GPUs of the product free on schedulable ready nodes, how many pods of
    the job would fit at once, and why it cannot start now ("" when it can)."""

    def ready(node: dict[str, Any]) -> bool:
        conditions = node.get("status", {}).get("conditions", [])
        return not node.get("spec", {}).get("unschedulable") and any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
        )

    def labelled(node: dict[str, Any]) -> bool:
        return (
            product is None
            or node.get("metadata", {}).get("labels", {}).get(PRODUCT_LABEL) == product
        )

    usable = [n for n in nodes if ready(n) and labelled(n)]
    free = [
        max(
            0,
            gpus_of(n.get("status", {}).get("allocatable", {}))
            - used.get(n["metadata"]["name"], 0),
        )
        for n in usable
    ]
    fits = sum(f // gpus for f in free) if gpus else len(usable) * nodes_wanted
    what = f"{gpus} x {GPU}{' of ' + product if product else ''}"
    if fits >= nodes_wanted:
        return sum(free), fits, ""
    if not usable:
        return 0, 0, f"no ready schedulable node{' has ' + product if product else ''}"
    return (
        sum(free),
        fits,
        (
            f"{sum(free)} GPU(s) free on {len(usable)} node(s); {nodes_wanted} pod(s) of {what}"
            f" fit {fits} now"
        ),
    )
