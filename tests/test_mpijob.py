"""The MPIJob (Kubeflow MPI Operator v2beta1) built from a JobSpec: pod templates valid
under `kubernetes-validate --strict`, the operator's semantics checked, bad shapes refused."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from gpuflow.commands.mpijob import GPU, MpiJobError, build, layout
from gpuflow.tasks.backends.kubernetes.mpijob import pods, problems
from gpuflow.tasks.spec import load_spec

RUN_ID = "0f8e7d6c-5b4a-4321-9876-543210fedcba"


def spec(**overrides):
    job = {"kind": "hpc", "ranks": 8, "gpus_per_rank": 1, "md": {"atoms": 32000}}
    job |= overrides.pop("job", {})
    resources = {"gpus": 4, "gpu_product": "H100", "memory": "64Gi", "shm": "8Gi"}
    resources |= overrides.pop("resources", {})
    return load_spec(
        {"name": "lj-fluid", "job": job, "resources": resources, "env": {"NCCL_DEBUG": "INFO"}}
        | overrides
    )


@pytest.fixture(scope="module")
def manifest():
    return build(spec(), "ghcr.io/example/gpuflow:1", RUN_ID)


def test_shape_follows_the_spec(manifest):
    body = manifest["spec"]
    assert manifest["apiVersion"] == "kubeflow.org/v2beta1" and manifest["kind"] == "MPIJob"
    assert manifest["metadata"]["name"] == "lj-fluid-0f8e7d6c"
    assert manifest["metadata"]["labels"]["gpuflow.io/flow-run-id"] == RUN_ID
    assert body["slotsPerWorker"] == 4 and body["mpiReplicaSpecs"]["Worker"]["replicas"] == 2
    assert body["runPolicy"]["activeDeadlineSeconds"] == 86400
    worker = body["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"][GPU] == 4
    assert worker["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert worker["tolerations"] == [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    assert worker["volumes"][0]["emptyDir"]["medium"] == "Memory"
    launcher = body["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    command = launcher["command"]
    assert command[:3] == ["mpirun", "-np", "8"]
    assert command[command.index("-x") : command.index("-x") + 2] == ["-x", "LD_LIBRARY_PATH"]
    assert "NCCL_DEBUG" in command and "INFO" not in command  # names only, values via env
    assert command[command.index("--gpus-per-rank") + 1] == "1"
    settings = json.loads(command[command.index("--settings") + 1])
    assert settings["atoms"] == 32000
    assert GPU not in launcher["resources"].get("limits", {})


def test_pod_templates_pass_kubernetes_validate_strict(manifest):
    for pod in pods(manifest):
        kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)


def test_the_cli_validator_accepts_the_pods(manifest, tmp_path):
    path = tmp_path / "pods.yaml"
    path.write_text(yaml.safe_dump_all(pods(manifest)))
    done = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("INFO") == 2


def test_semantics_pass_and_each_break_is_caught(manifest):
    assert problems(manifest) == []
    breaks = {
        "name": (lambda m: m["metadata"].update(name="LJ_fluid"), "DNS-1123"),
        "np": (lambda m: m["spec"].update(slotsPerWorker=3), "-np must equal"),
        "gpus": (
            lambda m: m["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0][
                "resources"
            ]["limits"].update({GPU: "4"}),
            "must be a positive integer",
        ),
        "restart": (
            lambda m: m["spec"]["mpiReplicaSpecs"]["Worker"].update(restartPolicy="Sometimes"),
            "restartPolicy 'Sometimes'",
        ),
        "toleration": (
            lambda m: m["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["tolerations"][
                0
            ].update(effect="NoScheduling"),
            "toleration effect 'NoScheduling'",
        ),
        "replicas": (
            lambda m: m["spec"]["mpiReplicaSpecs"].update(Workers={}),
            "must be Launcher and Worker",
        ),
        "clean": (lambda m: m["spec"]["runPolicy"].update(cleanPodPolicy="Some"), "cleanPod"),
        "deadline": (
            lambda m: m["spec"]["runPolicy"].update(activeDeadlineSeconds=0),
            "activeDeadlineSeconds",
        ),
    }
    for name, (breaking, message) in breaks.items():
        broken = copy.deepcopy(manifest)
        breaking(broken)
        assert any(message in p for p in problems(broken)), name


def test_a_broken_pod_fails_strict_validation(manifest):
    broken = copy.deepcopy(manifest)
    container = broken["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["gpus"] = 4  # not a container field
    with pytest.raises(kubernetes_validate.ValidationError):
        for pod in pods(broken):
            kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize(
    ("job", "resources", "workers", "slots"),
    [
        ({"ranks": 8, "gpus_per_rank": 1}, {"gpus": 4}, 2, 4),
        ({"ranks": 4, "gpus_per_rank": 2}, {"gpus": 8}, 1, 4),
        ({"ranks": 6, "gpus_per_rank": 0, "slots": 3}, {"gpus": 0, "gpu_product": None}, 2, 3),
        ({"ranks": 2, "gpus_per_rank": 0}, {"gpus": 0, "gpu_product": None}, 2, 1),
    ],
)
def test_layouts(job, resources, workers, slots):
    assert layout(spec(job=job, resources=resources)) == (workers, slots)


@pytest.mark.parametrize(
    ("job", "resources", "message"),
    [
        ({"ranks": 6}, {}, "job.ranks: 6 ranks do not fill 2 worker pod(s) of 4 slot(s)"),
        ({"gpus_per_rank": 3}, {}, "resources.gpus: 4 GPU(s) per pod do not split into ranks of 3"),
        ({"hosts": [{"name": "a", "slots": 2}]}, {}, "job.hosts: on Kubernetes the worker pods"),
        ({"build": "make"}, {}, "job.inputs, job.build and job.output run in the workspace"),
    ],
)
def test_shapes_without_an_mpijob_are_refused(job, resources, message):
    with pytest.raises(MpiJobError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build(spec(job=job, resources=resources), "img", RUN_ID)
