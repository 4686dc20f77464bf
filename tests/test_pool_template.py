"""The GPU Kubernetes work pool template, rendered the way a prefect-kubernetes worker
renders it (pool defaults, then deployment job variables, then per-run overrides), then
checked with `kubernetes-validate --strict` and gpuflow's own rules."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import kubernetes_validate
import pytest
from prefect.client.schemas.objects import FlowRun
from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.platform.k8s_worker import GpuJobConfiguration
from gpuflow.tasks.platform.pool_template import (
    GPU,
    TEARDOWN_MARGIN_S,
    check_job_variables,
    default_gpu_template,
    gpu_template,
    job_problems,
)

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("prefect_api")  # the worker code asks the API for blocks
TEMPLATE = default_gpu_template()


def render(deployment: dict, run: dict | None = None, template: dict = TEMPLATE) -> dict:
    """Return the Job a worker would create for a flow run with these job variables."""
    values = check_job_variables(template, {**deployment, **(run or {})})
    config = asyncio.run(
        KubernetesWorkerJobConfiguration.from_template_and_values(template, values)
    )
    config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4()))
    return config.job_manifest


def render_run(variables: dict, parameters: dict) -> dict:
    """Return the Job gpuflow's worker makes for a run with these parameters."""
    config = asyncio.run(GpuJobConfiguration.from_template_and_values(TEMPLATE, variables))
    run = FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4(), parameters=parameters)
    config.prepare_for_flow_run(run)
    return config.job_manifest


def strict(manifest: dict) -> None:
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


def test_the_checked_in_template_is_the_built_one():
    saved = json.loads((ROOT / "deployments" / "gpu-kubernetes-pool.json").read_text())
    assert saved == json.loads(json.dumps(TEMPLATE))


def test_pool_defaults_render_a_valid_gpu_job():
    job = render({"image": "ghcr.io/you/gpuflow:1"})
    strict(job)
    assert job_problems(job) == []
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"][GPU] == 1
    assert pod["tolerations"] == [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    assert job["spec"]["activeDeadlineSeconds"] == 86400
    assert job["spec"]["completions"] == 1 and "completions" not in pod
    assert {v["name"] for v in pod["volumes"]} == {"dshm", "scratch"}
    assert "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]  # unset: no label
    assert "priorityClassName" not in pod and "nodeSelector" in pod and pod["nodeSelector"] == {}


def test_deployment_variables_then_run_overrides():
    deployment = {
        "image": "ghcr.io/you/gpuflow:1",
        "gpu_count": 2,
        "gpu_product": "NVIDIA-H100-80GB-HBM3",
        "node_selector": {"pool": "gpu-a"},
        "queue_name": "team-gpu",
        "priority_class_name": "batch-high",
        "shm_size": "16Gi",
        "active_deadline_seconds": 7200,
    }
    job = render(deployment, {"gpu_count": 4, "active_deadline_seconds": 600})
    strict(job)
    assert job_problems(job) == []
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"][GPU] == 4  # the run's override wins
    assert job["spec"]["activeDeadlineSeconds"] == 600
    assert pod["nodeSelector"] == {
        "pool": "gpu-a",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    }
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-gpu"
    assert pod["priorityClassName"] == "batch-high"
    assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}


def test_prefect_kubernetes_default_puts_completions_in_the_pod_and_fails_strict():
    default = KubernetesWorker.get_default_base_job_template()
    config = asyncio.run(
        KubernetesWorkerJobConfiguration.from_template_and_values(default, {"image": "img:1"})
    )
    config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4()))
    with pytest.raises(kubernetes_validate.ValidationError, match="completions"):
        strict(config.job_manifest)
    assert any("completions" in p for p in job_problems(config.job_manifest))


def test_own_checks_catch_what_strict_validation_lets_through():
    job = render({"image": "img:1"})
    job["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][GPU] = "2"
    job["spec"]["template"]["spec"]["tolerations"][0]["effect"] = "NoScheduling"
    job["spec"]["activeDeadlineSeconds"] = None
    found = " | ".join(job_problems(job))
    for expected in (
        "restartPolicy must be Never",
        "limit must be a whole number",
        "NoScheduling",
        "activeDeadlineSeconds",
    ):
        assert expected in found


BAD = [
    (
        {"gpu_cout": 2},
        "job_variables.gpu_cout: not a variable of this work pool; did you mean 'gpu_count'?",
    ),
    (
        {"gpu_count": "two"},
        "job_variables.gpu_count: 'two' is not a whole number, e.g. 2; change it",
    ),
    ({"gpu_count": -1}, "job_variables.gpu_count: must be at least 0 (got -1)"),
    (
        {"tolerations": {"key": GPU}},
        "job_variables.tolerations: {'key': 'nvidia.com/gpu'} is not a list",
    ),
    (
        {"tolerations": [{"key": GPU, "effect": "NoScheduling"}]},
        "job_variables.tolerations[0].effect: 'NoScheduling' is not a taint effect",
    ),
    ({"node_selector": {"pool": 3}}, "job_variables.node_selector.pool: 3 is not a string"),
    ({"shm_size": "lots"}, "job_variables.shm_size: 'lots' is not a size; write e.g. 8Gi"),
    (
        {"termination_grace_period_seconds": 0},
        "job_variables.termination_grace_period_seconds: must be at least 1 (got 0)",
    ),
    (
        {"termination_grace_period_seconds": "90s"},
        "job_variables.termination_grace_period_seconds: '90s' is not a whole number, e.g. 2",
    ),
    (
        {"security_context": "unprivileged"},
        "job_variables.security_context: 'unprivileged' is not a mapping; change it",
    ),
    (
        {"image_pull_policy": "Sometimes"},
        "job_variables.image_pull_policy: 'Sometimes' is not one of IfNotPresent",
    ),
]


@pytest.mark.parametrize(
    ("variables", "sentence"), BAD, ids=[next(iter(v)) + str(i) for i, (v, _) in enumerate(BAD)]
)
def test_bad_job_variables_are_named(variables, sentence):
    with pytest.raises(InvalidSpec) as caught:
        check_job_variables(TEMPLATE, variables)
    assert sentence in str(caught.value)


def test_the_builder_leaves_its_input_alone():
    default = KubernetesWorker.get_default_base_job_template()
    before = json.dumps(default, sort_keys=True)
    gpu_template(default)
    assert json.dumps(default, sort_keys=True) == before


def test_a_flow_run_pod_drops_privileges_and_gets_its_runs_stop_grace_and_teardown():
    spec = {"name": "long-save", "job": {"kind": "command", "command": ["true"]}}
    spec["limits"] = {"stop_grace_s": 120}
    job = render_run({"image": "img:1"}, {"spec": spec})
    strict(job)
    assert job_problems(job) == []
    pod = job["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 120 + TEARDOWN_MARGIN_S
    assert pod["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    # a spec naming no grace: the spec's default; one gpuflow cannot read: the same (the run
    # then fails in its pod, saying why)
    for limits in (None, {"stop_grace_s": "forever"}):
        spec = {"name": "x", "job": {"kind": "command", "command": ["true"]}, "limits": limits}
        pod = render_run({"image": "img:1"}, {"spec": spec})["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 30 + TEARDOWN_MARGIN_S


def test_job_variables_name_the_grace_and_the_security_context_over_the_defaults():
    spec = {"name": "x", "job": {"kind": "command", "command": ["true"]}}
    spec["limits"] = {"stop_grace_s": 600}
    variables = {"image": "img:1", "termination_grace_period_seconds": 45, "security_context": {}}
    job = render_run(check_job_variables(TEMPLATE, variables), {"spec": spec})
    strict(job)
    pod = job["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 45  # the variable wins over the spec
    assert pod["containers"][0]["securityContext"] == {}  # the image's own


def test_a_flow_run_pod_inherits_the_workers_settings_but_not_its_prefect_home(tmp_path):
    from prefect.settings import PREFECT_HOME, PREFECT_WORKER_QUERY_SECONDS, temporary_settings

    spec = {"name": "x", "job": {"kind": "command", "command": ["true"]}}
    with temporary_settings(
        {PREFECT_HOME: tmp_path / "worker-home", PREFECT_WORKER_QUERY_SECONDS: 3}
    ):
        job = render_run({"image": "img:1"}, {"spec": spec})
        given = render_run({"image": "img:1", "env": {"PREFECT_HOME": "/home/app/.prefect"}}, {})
    env = {
        e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["PREFECT_WORKER_QUERY_SECONDS"] == "3.0"  # the worker's settings still go along
    assert "PREFECT_HOME" not in env  # a folder on the worker's host
    env = {
        e["name"]: e.get("value") for e in given["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["PREFECT_HOME"] == "/home/app/.prefect"  # one the job variables name
