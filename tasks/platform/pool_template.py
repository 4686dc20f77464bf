"""The GPU Kubernetes work pool's base job template, built from prefect-kubernetes' default,
and the checks job variables and rendered Jobs must pass. Pure: dicts in, dicts out.

Prefect ignores job variables it does not know and renders whatever types it is given, so
gpuflow checks them itself (`check_job_variables`) before a deployment is made or a run is
submitted, and checks the rendered Job (`job_problems`) in tests.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
from typing import Any

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.gpus import GPU_PRODUCT_LABEL
from gpuflow.tasks.gpus import GPU_RESOURCE as GPU
from gpuflow.tasks.spec import Limits

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
TOLERATION_OPERATORS = ("Exists", "Equal")
_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")

# A deleted flow-run pod's pipeline stops its units (each gets limits.stop_grace_s), then
# tears down, uploads artifacts and records the run's state: this much on top.
TEARDOWN_MARGIN_S = 30

GPU_VARIABLES: dict[str, dict[str, Any]] = {
    "gpu_count": {
        "title": "GPUs",
        "description": "nvidia.com/gpu limit of the flow-run pod (whole GPUs).",
        "type": "integer",
        "minimum": 0,
        "maximum": 64,
        "default": 1,
    },
    "gpu_product": {
        "title": "GPU product",
        "description": "nvidia.com/gpu.product node label, e.g. NVIDIA-H100-80GB-HBM3; gpuflow"
        " adds it to node_selector when it checks the job variables.",
        "type": "string",
    },
    "node_selector": {
        "title": "Node selector",
        "description": "Node labels the pod must land on.",
        "type": "object",
        "additionalProperties": {"type": "string"},
        "default": {},
    },
    "tolerations": {
        "title": "Tolerations",
        "description": "Pod tolerations; the default tolerates the GPU nodes' taint.",
        "type": "array",
        "items": {"type": "object"},
        "default": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}],
    },
    "active_deadline_seconds": {
        "title": "Deadline (seconds)",
        "description": "The Job is stopped after this long, so a hung or unschedulable GPU pod"
        " does not wait or hold GPUs forever.",
        "type": "integer",
        "minimum": 1,
        "default": 86400,
    },
    "shm_size": {
        "title": "Shared memory",
        "description": "Size of the memory-backed /dev/shm (DataLoader workers, NCCL), e.g. 8Gi.",
        "type": "string",
        "default": "8Gi",
    },
    "scratch_size": {
        "title": "Scratch space",
        "description": "Size of the scratch volume mounted at /scratch (job workspaces).",
        "type": "string",
        "default": "50Gi",
    },
    "queue_name": {
        "title": "Kueue queue",
        "description": "Kueue LocalQueue to admit the Job through (kueue.x-k8s.io/queue-name).",
        "type": "string",
    },
    "priority_class_name": {
        "title": "Priority class",
        "description": "PriorityClass of the pod.",
        "type": "string",
    },
    "termination_grace_period_seconds": {
        "title": "Termination grace (seconds)",
        "description": "Between SIGTERM and SIGKILL when the pod is deleted, evicted or"
        " preempted. Unset: the run's limits.stop_grace_s plus"
        f" {TEARDOWN_MARGIN_S} s for gpuflow's teardown (Kubernetes' own default is 30 s"
        " whatever the job needs).",
        "type": "integer",
        "minimum": 1,
        "maximum": 7200,
    },
    "security_context": {
        "title": "Container security context",
        "description": "The container's securityContext; the default lets no process gain"
        " privileges and drops every capability. {} for the image's own.",
        "type": "object",
        "default": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    },
}


def gpu_template(default: dict[str, Any]) -> dict[str, Any]:
    """Return the GPU pool's base job template made from prefect-kubernetes' `default`."""
    template = copy.deepcopy(default)
    manifest = template["job_configuration"]["job_manifest"]
    job_spec = manifest["spec"]
    pod = job_spec["template"]["spec"]
    # The default puts completions/parallelism in the pod spec, where they are invalid:
    # they belong to the Job.
    job_spec["completions"] = pod.pop("completions", 1)
    job_spec["parallelism"] = pod.pop("parallelism", 1)
    job_spec["activeDeadlineSeconds"] = "{{ active_deadline_seconds }}"
    manifest["metadata"]["labels"] = {KUEUE_QUEUE_LABEL: "{{ queue_name }}"}
    container = pod["containers"][0]
    container["resources"]["limits"][GPU] = "{{ gpu_count }}"
    container["volumeMounts"] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": "/scratch"},
    ]
    container["env"] = "{{ env }}"
    container["securityContext"] = "{{ security_context }}"
    pod["nodeSelector"] = "{{ node_selector }}"
    pod["tolerations"] = "{{ tolerations }}"
    pod["priorityClassName"] = "{{ priority_class_name }}"
    # unset: the worker sets it from the run's spec (flow_run_grace_seconds)
    pod["terminationGracePeriodSeconds"] = "{{ termination_grace_period_seconds }}"
    pod["volumes"] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "{{ shm_size }}"}},
        {"name": "scratch", "emptyDir": {"sizeLimit": "{{ scratch_size }}"}},
    ]
    template["variables"]["properties"].update(copy.deepcopy(GPU_VARIABLES))
    template["variables"]["description"] = (
        "Variables of gpuflow's GPU Kubernetes pool: prefect-kubernetes' own plus GPUs,"
        " placement, deadline, termination grace, security context, shared memory, scratch"
        " and queueing."
    )
    return template


def flow_run_grace_seconds(parameters: dict[str, Any] | None) -> int:
    """Return the flow-run pod's terminationGracePeriodSeconds for a run of gpuflow's flows:
    its spec's limits.stop_grace_s (the default where the spec names none, or is not one
    gpuflow can read: the run then fails in its pod, with the reason) plus the teardown's."""
    spec = (parameters or {}).get("spec")
    limits = spec.get("limits") if isinstance(spec, dict) else None
    try:
        grace = Limits.model_validate(limits or {}).stop_grace_s
    except ValueError:
        grace = Limits().stop_grace_s
    return math.ceil(grace) + TEARDOWN_MARGIN_S


def check_job_variables(
    template: dict[str, Any], variables: dict[str, Any], where: str = "job_variables"
) -> dict[str, Any]:
    """Return `variables` ready for the pool (gpu_product folded into node_selector); raise
    InvalidSpec naming the first unknown or ill-typed one and its fix."""
    schema = template["variables"]["properties"]
    if not isinstance(variables, dict):
        raise InvalidSpec(f"{where}: must be a mapping of variable names to values")
    for name, value in variables.items():
        if name not in schema:
            close = difflib.get_close_matches(name, list(schema), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(sorted(schema))}"
            raise InvalidSpec(f"{where}.{name}: not a variable of this work pool; {hint}")
        _check_type(f"{where}.{name}", value, schema[name])
    checked = dict(variables)
    if "tolerations" in checked:
        for i, toleration in enumerate(checked["tolerations"]):
            _check_toleration(f"{where}.tolerations[{i}]", toleration)
    for name in ("shm_size", "scratch_size"):
        if name in checked and not _QUANTITY.match(str(checked[name])):
            raise InvalidSpec(
                f"{where}.{name}: {checked[name]!r} is not a size; write e.g. 8Gi or 512Mi"
            )
    if "gpu_product" in checked:
        selector = dict(checked.get("node_selector") or {})
        selector[GPU_PRODUCT_LABEL] = checked.pop("gpu_product")
        checked["node_selector"] = selector
    return checked


def _check_type(where: str, value: Any, schema: dict[str, Any]) -> None:
    kinds = {s.get("type") for s in schema.get("anyOf", [schema])} - {None}
    if value is None and ("null" in kinds or not kinds):
        return
    checks = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "null": lambda v: v is None,
    }
    if kinds and not any(checks[k](value) for k in kinds if k in checks):
        words = {"integer": "a whole number, e.g. 2", "array": "a list", "object": "a mapping"}
        wanted = " or ".join(words.get(k, f"a {k}") for k in sorted(kinds - {"null"}))
        raise InvalidSpec(f"{where}: {value!r} is not {wanted}; change it")
    if "enum" in schema and value not in schema["enum"]:
        raise InvalidSpec(f"{where}: {value!r} is not one of {', '.join(schema['enum'])}")
    for bound, ok in (("minimum", lambda v, b: v >= b), ("maximum", lambda v, b: v <= b)):
        if bound in schema and isinstance(value, int | float) and not ok(value, schema[bound]):
            word = "at least" if bound == "minimum" else "at most"
            raise InvalidSpec(f"{where}: must be {word} {schema[bound]} (got {value!r})")
    if isinstance(value, dict) and "additionalProperties" in schema:
        for key, item in value.items():
            if isinstance(schema["additionalProperties"], dict):
                _check_type(f"{where}.{key}", item, schema["additionalProperties"])


def _check_toleration(where: str, toleration: Any) -> None:
    if not isinstance(toleration, dict):
        raise InvalidSpec(
            f"{where}: {toleration!r} is not a toleration; write {{key, operator, effect}}"
        )
    unknown = set(toleration) - {"key", "operator", "value", "effect", "tolerationSeconds"}
    if unknown:
        raise InvalidSpec(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if toleration.get("operator", "Equal") not in TOLERATION_OPERATORS:
        raise InvalidSpec(f"{where}.operator: use Exists or Equal")
    effect = toleration.get("effect")
    if effect is not None and effect not in TOLERATION_EFFECTS:
        raise InvalidSpec(
            f"{where}.effect: {effect!r} is not a taint effect; use one of"
            f" {', '.join(TOLERATION_EFFECTS)}"
        )


def job_problems(manifest: dict[str, Any]) -> list[str]:
    """Return what is wrong with a rendered flow-run Job beyond its schema: a whole GPU
    count, restartPolicy Never, the Job-level completions, valid toleration effects, a
    deadline, memory-backed /dev/shm and DNS-1123 names."""
    found: list[str] = []
    spec = manifest.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    if "completions" in pod or "parallelism" in pod:
        found.append("completions/parallelism belong to the Job spec, not the pod spec")
    if pod.get("restartPolicy") != "Never":
        found.append(f"restartPolicy must be Never (got {pod.get('restartPolicy')!r})")
    deadline = spec.get("activeDeadlineSeconds")
    if not isinstance(deadline, int) or isinstance(deadline, bool) or deadline < 1:
        found.append(f"activeDeadlineSeconds must be a positive integer (got {deadline!r})")
    for container in pod.get("containers", []):
        gpus = container.get("resources", {}).get("limits", {}).get(GPU)
        if gpus is not None and (not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0):
            found.append(f"{GPU} limit must be a whole number (got {gpus!r})")
        if not _DNS_1123_LABEL.match(container.get("name", "")):
            found.append(f"container name {container.get('name')!r} is not a DNS-1123 label")
    for toleration in pod.get("tolerations", []):
        if toleration.get("effect") not in (None, *TOLERATION_EFFECTS):
            found.append(f"toleration effect {toleration.get('effect')!r} is not valid")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    if volumes.get("dshm", {}).get("emptyDir", {}).get("medium") != "Memory":
        found.append("/dev/shm must be a memory-backed emptyDir")
    name = manifest.get("metadata", {}).get("generateName") or manifest.get("metadata", {}).get(
        "name", ""
    )
    if not _DNS_1123_LABEL.match(name.rstrip("-")) or len(name) > 63:
        found.append(f"job name {name!r} is not a DNS-1123 name of at most 63 characters")
    for key, value in manifest.get("metadata", {}).get("labels", {}).items():
        if not isinstance(value, str) or len(value) > 63:
            found.append(f"label {key}: {value!r} is not a label value")
    return found


def default_gpu_template() -> dict[str, Any]:
    """Return the GPU pool template built from the installed prefect-kubernetes' default."""
    from prefect_kubernetes.worker import KubernetesWorker

    return gpu_template(KubernetesWorker.get_default_base_job_template())


if __name__ == "__main__":  # regenerate deployments/gpu-kubernetes-pool.json
    import json
    import sys

    json.dump(default_gpu_template(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
