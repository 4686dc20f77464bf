"""The Kubernetes backend against a real control plane (etcd, kube-apiserver, scheduler,
controller-manager on loopback) with KWOK's simulated GPU nodes: two 8 x H100, one 4 x L4,
one CPU-only (scripts/k8s-testbed.sh). Faults are injected at the API server: a test
labels a pod for KWOK's failure stage, or deletes a node."""

from __future__ import annotations

import base64
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from gpuflow.tasks.backends.kubernetes.backend import KubernetesBackend
from gpuflow.tasks.backends.kubernetes.kubeapi import KubeApi
from gpuflow.tasks.contract import MpiLaunch, WorkUnit, owner_labels
from gpuflow.tasks.errors import ProvisionError
from gpuflow.tasks.kinds.registry import get_kind
from gpuflow.tasks.pipeline.running import run_units
from gpuflow.tasks.spec import load_spec
from tests.e2e.kubelet import NAMESPACE as KUBELET_NS
from tests.e2e.kubelet import PlayedKubelet

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA-H100-80GB-HBM3"
FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
SLEEPER = WorkUnit(name="main", command=["sleep", "300"])  # the testbed runs it for 300 s


def spec_for(gpus: int = 1, product: str | None = H100, nodes: int = 1, **placement):
    resources = {"gpus": gpus, "nodes": nodes, **({"gpu_product": product} if product else {})}
    return load_spec(
        {
            "name": "k8s-test",
            "job": {"kind": "command", "command": ["echo", "hello"]},
            "resources": resources,
            "placement": {"backend": "kubernetes", **placement},
        }
    )


def owned(kube: KubeApi, run_id: str) -> list[str]:
    """Return every object left in the namespace with this run's label, as kind/name."""
    selector = {"labelSelector": f"gpuflow.io/flow-run-id={run_id}"}
    left = []
    for kind, path in [
        ("service", f"/api/v1/namespaces/{kube.namespace}/services"),
        ("secret", f"/api/v1/namespaces/{kube.namespace}/secrets"),
        ("job", f"/apis/batch/v1/namespaces/{kube.namespace}/jobs"),
        ("pod", f"/api/v1/namespaces/{kube.namespace}/pods"),
        ("mpijob", f"/apis/kubeflow.org/v2beta1/namespaces/{kube.namespace}/mpijobs"),
    ]:
        items = kube.request("GET", path, params=selector).get("items", [])
        left += [f"{kind}/{i['metadata']['name']}" for i in items if not _terminating(i)]
    return left


def _terminating(item: dict) -> bool:
    return bool(item["metadata"].get("deletionTimestamp"))


def wait_gone(kube: KubeApi, run_id: str, seconds: float = 60) -> list[str]:
    until = time.monotonic() + seconds
    while (left := owned(kube, run_id)) and time.monotonic() < until:
        time.sleep(0.5)
    return left


def test_a_unit_runs_as_a_job_on_a_node_of_the_product_and_teardown_leaves_nothing(kube):
    backend = KubernetesBackend()
    spec = spec_for(gpus=4, product="NVIDIA-L4")
    backend.check(spec)
    run_id = "run-l4-single"
    cluster = backend.provision(spec, owner_labels(run_id, "k8s-test"))
    again = backend.provision(spec, owner_labels(run_id, "k8s-test"))
    assert again.adopted and again.name == cluster.name  # a retried provision adopts
    [unit] = [WorkUnit(name="main", command=["echo", "hello"])]
    result = backend.run(cluster, unit, {"TOKEN": "t0p-s3cret"}, 120, lambda *_: None)
    assert result.exit_code == 0 and not result.timed_out
    job = kube.request("GET", f"/apis/batch/v1/namespaces/default/jobs/{cluster.name}-main")
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert job["spec"]["activeDeadlineSeconds"] >= 120
    assert "t0p-s3cret" not in str(job)  # the variables are in the Secret
    [pod] = kube.request(
        "GET",
        "/api/v1/namespaces/default/pods",
        params={"labelSelector": f"job-name={cluster.name}-main"},
    )["items"]
    assert pod["spec"]["nodeName"] == "gpu-l4-0" and pod["status"]["phase"] == "Succeeded"
    assert len(set(owned(kube, run_id))) == 4  # service, secret, job, pod
    report = backend.teardown(cluster)
    assert not report.already_gone
    assert wait_gone(kube, run_id) == []
    assert backend.teardown(cluster).already_gone
    assert backend.list_owned({"gpuflow.io/flow-run-id": run_id}) == []


def test_a_private_image_is_pulled_with_a_secret_of_the_run_that_teardown_removes(
    kube, prefect_api
):
    """image.credentials: the run's pods pull with a dockerconfigjson Secret of its own
    (the password in no Job, pod or log), gone with the run."""
    import base64
    import json

    from gpuflow.blocks import RegistryCredentials

    RegistryCredentials(registry="registry.example", username="me", password="pw-k8s-91").save(
        "k8s-pull-test", overwrite=True
    )
    backend = KubernetesBackend()
    spec = load_spec(
        {
            "name": "k8s-test",
            "image": {"ref": "registry.example/team/x:1", "credentials": "k8s-pull-test"},
            "job": {"kind": "command", "command": ["echo", "hello"]},
            "resources": {"gpus": 1, "gpu_product": H100},
            "placement": {"backend": "kubernetes"},
        }
    )
    run_id = "run-pull-secret"
    cluster = backend.provision(spec, owner_labels(run_id, "k8s-test"))
    ns = kube.namespace
    made = kube.request("GET", f"/api/v1/namespaces/{ns}/secrets/{cluster.name}-pull")
    assert made["type"] == "kubernetes.io/dockerconfigjson"
    config = json.loads(base64.b64decode(made["data"][".dockerconfigjson"]))
    assert config["auths"]["registry.example"]["auth"] == base64.b64encode(b"me:pw-k8s-91").decode()
    unit = WorkUnit(name="main", command=["echo", "hello"])
    result = backend.run(cluster, unit, {}, 120, lambda *_: None)
    assert result.exit_code == 0
    job = kube.request("GET", f"/apis/batch/v1/namespaces/{ns}/jobs/{cluster.name}-main")
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["imagePullSecrets"] == [{"name": f"{cluster.name}-pull"}]
    assert pod_spec["containers"][0]["image"] == "registry.example/team/x:1"
    assert "pw-k8s-91" not in json.dumps(job)
    backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


def test_two_nodes_run_one_unit_each_with_stable_names(kube):
    backend = KubernetesBackend()
    spec = spec_for(gpus=8, nodes=2)
    cluster = backend.provision(spec, owner_labels("run-two-nodes", "k8s-test"))
    assert cluster.rendezvous == f"{cluster.name}-0.{cluster.name}:29400"
    units = [WorkUnit(name=f"node-{i}", command=["true"], node=i) for i in (0, 1)]
    result = run_units(
        backend, cluster, units, {}, 120, lambda u: lambda *_: None, lambda: False, 5
    )
    assert result.exit_code == 0
    pods = kube.request(
        "GET",
        "/api/v1/namespaces/default/pods",
        params={"labelSelector": f"gpuflow.io/cluster={cluster.name}"},
    )["items"]
    assert sorted(p["spec"]["hostname"] for p in pods) == [f"{cluster.name}-0", f"{cluster.name}-1"]
    assert {p["spec"]["nodeName"] for p in pods} <= {"gpu-h100-0", "gpu-h100-1"}
    backend.teardown(cluster)
    assert wait_gone(kube, "run-two-nodes") == []


@pytest.mark.parametrize(
    "gpus, product, expected",
    [
        (
            16,
            H100,
            f"needs 16 x nvidia.com/gpu on {H100}; the largest node has 8 in all; lower resources.gpus or use 2 nodes",
        ),
        (
            1,
            "NVIDIA-A100-SXM4-80GB",
            "no node has NVIDIA-A100-SXM4-80GB GPUs (the nodes offer: NVIDIA-H100-80GB-HBM3, NVIDIA-L4)",
        ),
    ],
)
def test_a_pod_no_node_can_take_is_refused_in_one_sentence(kube, gpus, product, expected):
    backend = KubernetesBackend()
    run_id = f"run-pending-{gpus}"
    cluster = backend.provision(
        spec_for(gpus=gpus, product=product), owner_labels(run_id, "k8s-test")
    )
    with pytest.raises(ProvisionError) as refused:
        backend.run(cluster, WorkUnit(name="main", command=["true"]), {}, 120, lambda *_: None)
    assert expected in str(refused.value)
    backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


def test_a_unit_that_fails_reports_its_exit_code(kube):
    backend = KubernetesBackend()
    run_id = "run-fails"
    cluster = backend.provision(spec_for(gpus=1), owner_labels(run_id, "k8s-test"))

    def inject() -> None:  # at the API server: KWOK's failure stage, exit code 3
        until = time.monotonic() + 60
        while time.monotonic() < until:
            pods = kube.request(
                "GET",
                "/api/v1/namespaces/default/pods",
                params={"labelSelector": f"job-name={cluster.name}-main"},
            )["items"]
            if pods:
                patch = {
                    "metadata": {
                        "labels": {FAIL_LABEL: "true"},
                        "annotations": {f"{FAIL_LABEL}/exit-code": "3"},
                    }
                }
                kube.http.patch(
                    f"/api/v1/namespaces/default/pods/{pods[0]['metadata']['name']}",
                    json=patch,
                    headers={"Content-Type": "application/strategic-merge-patch+json"},
                ).raise_for_status()
                return
            time.sleep(0.05)

    injector = threading.Thread(target=inject)
    injector.start()
    result = backend.run(cluster, SLEEPER, {}, 600, lambda *_: None)
    injector.join()
    assert result.exit_code == 3
    backend.teardown(cluster)


def test_the_pipeline_runs_a_job_on_kubernetes_and_leaves_nothing(kube, prefect_api, gpuflow_home):
    from gpuflow.flows.pipeline import gpu_pipeline
    from tests.e2e.helpers import artifacts_of

    state = gpu_pipeline(spec_for(gpus=8), return_state=True)
    assert state.is_completed(), state.message
    run_id = str(state.state_details.flow_run_id)
    assert state.result().exit_code == 0
    preflight = str(artifacts_of(run_id)["gpuflow-preflight"].data)
    assert f"1 kubernetes node(s) x 8 GPU(s) of {H100}" in preflight
    assert wait_gone(kube, run_id) == []


def pods_of(kube: KubeApi, selector: str, namespace: str = "default") -> list[dict]:
    return kube.request(
        "GET", f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": selector}
    )["items"]


def patch_pod(kube: KubeApi, name: str, patch: dict, namespace: str = "default") -> None:
    kube.http.patch(
        f"/api/v1/namespaces/{namespace}/pods/{name}",
        json=patch,
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    ).raise_for_status()


def when_running(
    kube: KubeApi, selector: str, then, seconds: float = 60, namespace: str = "default"
) -> threading.Thread:
    """Call `then(pod)` once the first pod matching `selector` runs; in a thread."""

    def watch() -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            pods = pods_of(kube, selector, namespace)
            if pods and pods[0]["status"].get("phase") == "Running":
                then(pods[0])
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch)
    thread.start()
    return thread


def test_a_lost_node_is_a_preemption(kube, testbed):
    backend = KubernetesBackend()
    run_id = "run-node-lost"
    cluster = backend.provision(spec_for(gpus=8), owner_labels(run_id, "k8s-test"))
    lost: list[str] = []

    def lose_node(pod: dict) -> None:
        lost.append(pod["spec"]["nodeName"])
        kube.request("DELETE", f"/api/v1/nodes/{lost[0]}")

    watcher = when_running(kube, f"job-name={cluster.name}-main", lose_node)
    try:
        # the simulated pod runs 60 s: its node goes long before (a 1 s pod could end first
        # on a busy machine)
        result = backend.run(
            cluster, WorkUnit(name="main", command=["sleep", "60"]), {}, 300, lambda *_: None
        )
        watcher.join()
        assert lost, "the pod never ran"
        assert result.exit_code == 75  # preempted: the run stage retries and resumes
    finally:
        backend.teardown(cluster)
        restore_nodes(kube, testbed, lost)


def restore_nodes(kube: KubeApi, testbed: Path, names: list[str]) -> None:
    """Create the testbed's nodes `names` again (from the testbed's nodes.yaml)."""
    for doc in (testbed.parent / "nodes.yaml").read_text().split("---\n"):
        if any(f"name: {name}\n" in doc for name in names):
            kube.http.post(
                "/api/v1/nodes", content=doc, headers={"Content-Type": "application/yaml"}
            ).raise_for_status()
    wait_ready(kube, names)


def wait_ready(kube: KubeApi, names: list[str], seconds: float = 60) -> None:
    until = time.monotonic() + seconds
    for name in names:
        while time.monotonic() < until:
            node = kube.request("GET", f"/api/v1/nodes/{name}")
            conditions = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}
            if conditions.get("Ready") == "True":
                break
            time.sleep(0.2)


def test_busy_gpus_are_waited_for_then_a_retryable_capacity_error(kube):
    from gpuflow.tasks.errors import CapacityError, is_retryable

    blocker = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "l4-blocker"},  # owned by no Job: the testbed keeps it running
        "spec": {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "containers": [
                {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "4"}}}
            ],
        },
    }
    kube.request("POST", "/api/v1/namespaces/default/pods", blocker)
    backend = KubernetesBackend()
    run_id = "run-busy"
    spec = spec_for(gpus=4, product="NVIDIA-L4", gpu_wait="3s")
    cluster = backend.provision(spec, owner_labels(run_id, "k8s-test"))
    try:
        with pytest.raises(CapacityError) as busy:
            backend.run(cluster, WorkUnit(name="main", command=["true"]), {}, 120, lambda *_: None)
        assert is_retryable(busy.value)
        assert "not placed within 3 s (placement.gpu_wait)" in str(busy.value)
        assert (
            "needs 4 x nvidia.com/gpu on NVIDIA-L4; the most free on any such node now is 0"
            in str(busy.value)
        )
    finally:
        kube.request(
            "DELETE", "/api/v1/namespaces/default/pods/l4-blocker", {"gracePeriodSeconds": 0}
        )
        backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


def test_a_gpu_quota_is_named(kube):
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "quota-test"}}
    kube.request("POST", "/api/v1/namespaces", namespace)
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "gpus"},
        "spec": {"hard": {"requests.nvidia.com/gpu": "2"}},
    }
    kube.request("POST", "/api/v1/namespaces/quota-test/resourcequotas", quota)
    # admission enforces a quota only once its controller has filled in its status
    until = time.monotonic() + 60
    while time.monotonic() < until:
        made = kube.request("GET", "/api/v1/namespaces/quota-test/resourcequotas/gpus")
        if made.get("status", {}).get("hard"):
            break
        time.sleep(0.2)
    assert made.get("status", {}).get("hard"), "the quota controller never counted the quota"
    spec = spec_for(gpus=4, product="NVIDIA-L4", namespace="quota-test")
    backend = KubernetesBackend.at(spec.placement)
    backend.check(spec)
    cluster = backend.provision(spec, owner_labels("run-quota", "k8s-test"))
    with pytest.raises(ProvisionError, match="the namespace's ResourceQuota refuses the pod"):
        backend.run(cluster, WorkUnit(name="main", command=["true"]), {}, 120, lambda *_: None)
    backend.teardown(cluster)


def test_a_missing_namespace_is_named_before_anything_is_made(kube):
    from gpuflow.tasks.errors import InvalidSpec

    with pytest.raises(
        InvalidSpec, match=r"placement\.namespace: the namespace 'no-such-team' does not exist"
    ):
        spec = spec_for(namespace="no-such-team")
        KubernetesBackend.at(spec.placement).check(spec)


def test_a_stopped_unit_is_deleted_and_teardown_leaves_nothing(kube):
    backend = KubernetesBackend()
    run_id = "run-cancelled"
    cluster = backend.provision(spec_for(gpus=1), owner_labels(run_id, "k8s-test"))
    running = threading.Event()
    watcher = when_running(kube, f"job-name={cluster.name}-main", lambda pod: running.set())
    # `sleep 600` keeps the simulated pod Running until it is stopped (a pod that ends by
    # itself within a second could beat the stop check on a busy machine)
    result = backend.run(
        cluster,
        WorkUnit(name="main", command=["sleep", "600"]),
        {},
        300,
        lambda *_: None,
        running.is_set,
        1,
    )
    watcher.join()
    assert result.cancelled and result.exit_code is None
    jobs = f"/apis/batch/v1/namespaces/default/jobs/{cluster.name}-main"
    until = time.monotonic() + 30
    while _exists(kube, jobs) and time.monotonic() < until:
        time.sleep(0.2)
    assert not _exists(kube, jobs)  # the stopped unit's Job was deleted
    backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


def _exists(kube: KubeApi, path: str) -> bool:
    from gpuflow.tasks.backends.kubernetes.kubeapi import KubeError

    try:
        found = kube.request("GET", path)
    except KubeError as exc:
        if exc.status == 404:
            return False
        raise
    return not found["metadata"].get("deletionTimestamp")


def apply(kube: KubeApi, doc: dict, namespace: str) -> None:
    paths = {
        "ServiceAccount": f"/api/v1/namespaces/{namespace}/serviceaccounts",
        "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
        "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
        "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    }
    kube.request("POST", paths[doc["kind"]], doc)


def token_kubeconfig(kube: KubeApi, namespace: str, account: str, path: Path) -> Path:
    """Write a kubeconfig for the testbed that authenticates as service account `account` of
    `namespace` (a token from the TokenRequest API), its context in that namespace."""
    import yaml

    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}}
    token = kube.request(
        "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token", request
    )["status"]["token"]
    admin = yaml.safe_load(Path(kube.config.source).read_text())
    context = {"cluster": admin["clusters"][0]["name"], "user": account, "namespace": namespace}
    limited = {
        **admin,
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": context}],
        "current-context": account,
    }
    path.write_text(yaml.safe_dump(limited))
    return path


def worker_platform(kube: KubeApi, namespace: str, tmp_path: Path):
    """Return a platform (not started) whose Kubernetes worker will run with exactly
    worker-rbac.yaml's Role in `namespace`, and the kubeconfig holding that token."""
    import yaml

    from tests.conftest import free_port
    from tests.e2e.helpers import Platform

    for doc in yaml.safe_load_all((ROOT / "infra/kubernetes/worker-rbac.yaml").read_text()):
        apply(kube, doc, namespace)
    kubeconfig = token_kubeconfig(kube, namespace, "prefect-worker", tmp_path / "kubeconfig")
    platform = Platform(tmp_path / "home", free_port())
    platform.env["KUBECONFIG"] = "/nonexistent"  # the worker must use --kubeconfig's cluster
    return platform, kubeconfig


def up_with_worker(platform, kubeconfig: Path, image: str) -> subprocess.CompletedProcess:
    """`gpuflow platform up` with a Kubernetes worker on `kubeconfig`'s cluster, jobs running
    `image`; asserts that it started."""
    up = platform.gpuflow(
        "platform", "up", "--port", str(platform.port),
        "--kubeconfig", str(kubeconfig), "--image", image,
    )  # fmt: skip
    assert up.returncode == 0, up.stdout + up.stderr
    return up


def test_the_backend_runs_with_exactly_its_role_and_one_verb_less_is_named(
    kube, tmp_path, monkeypatch
):
    import yaml

    namespace = "rbac-test"
    kube.request(
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
    )
    docs = list(
        yaml.safe_load_all((ROOT / "infra" / "kubernetes" / "backend-rbac.yaml").read_text())
    )
    for doc in docs:
        if doc["kind"] != "ClusterRole":  # the optional node reader stays unbound here
            apply(kube, doc, namespace)
    token_kubeconfig(kube, namespace, "gpuflow", tmp_path / "kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))

    backend = KubernetesBackend()
    spec = spec_for(gpus=1)
    backend.check(spec)  # may not read namespaces: not needed, not an error
    cluster = backend.provision(spec, owner_labels("run-rbac", "k8s-test"))
    assert (
        backend.run(
            cluster, WorkUnit(name="main", command=["true"]), {"K": "v"}, 120, lambda *_: None
        ).exit_code
        == 0
    )
    assert backend.teardown(cluster).name == cluster.name
    assert wait_gone(kube_in(kube, namespace), "run-rbac") == []

    role = next(d for d in docs if d["kind"] == "Role")
    for rule in role["rules"]:
        if rule["resources"] == ["jobs"]:
            rule["verbs"].remove("create")
    kube.request(
        "PUT",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles/gpuflow-backend",
        role,
    )
    time.sleep(1)  # the authorizer's cache
    cluster = backend.provision(spec, owner_labels("run-rbac-2", "k8s-test"))
    with pytest.raises(ProvisionError) as refused:
        backend.run(cluster, WorkUnit(name="main", command=["true"]), {}, 120, lambda *_: None)
    assert (
        f"Kubernetes refused to create jobs in namespace {namespace} for these credentials"
        in str(refused.value)
    )
    backend.teardown(cluster)


def kube_in(kube: KubeApi, namespace: str) -> KubeApi:
    """The admin's client, looking at `namespace`."""
    kube.namespace = namespace
    return kube


def test_reap_deletes_what_a_killed_gpuflow_left_and_marks_its_run_crashed(
    kube, testbed, prefect_api, gpuflow_home, tmp_path
):
    import os
    import signal
    import sys

    from tests.conftest import subprocess_env
    from tests.e2e.helpers import process_gone

    job = tmp_path / "job.yaml"
    job.write_text(
        "name: reap-test\njob: {kind: command, command: [sleep, '300']}\n"
        "resources: {gpus: 1}\nplacement: {backend: kubernetes}\n"
    )
    env = {**subprocess_env(prefect_api, gpuflow_home), "KUBECONFIG": str(testbed)}
    gpuflow = [sys.executable, "-m", "gpuflow"]
    orchestrator = subprocess.Popen(
        [*gpuflow, "run", str(job)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    until, running = time.monotonic() + 120, []
    while not running and time.monotonic() < until and orchestrator.poll() is None:
        running = [
            p
            for p in pods_of(kube, "gpuflow.io/job=reap-test")
            if p["status"].get("phase") == "Running"
        ]
        time.sleep(0.2)
    assert running, "the job's pod never ran"
    run_id = running[0]["metadata"]["labels"]["gpuflow.io/flow-run-id"]
    os.kill(orchestrator.pid, signal.SIGKILL)
    orchestrator.wait(timeout=30)
    assert process_gone(orchestrator.pid)
    assert owned(kube, run_id)  # the killed gpuflow could not tear down

    def reap(*options: str) -> subprocess.CompletedProcess:
        command = [*gpuflow, "reap", "--backend", "kubernetes", *options]
        return subprocess.run(
            command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )

    looked = reap("--dry-run")
    assert looked.returncode == 0, looked.stderr
    assert "would delete gpuflow-" in looked.stdout and "its gpuflow died" in looked.stdout
    assert owned(kube, run_id)  # a dry run deletes nothing

    reaped = reap()
    assert reaped.returncode == 0, reaped.stderr
    assert (
        "1 leftover cluster(s)" in reaped.stdout and "1 flow run(s) marked Crashed" in reaped.stdout
    )
    assert wait_gone(kube, run_id) == []

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run_id).state.type.value == "CRASHED"


def test_preflight_shows_where_a_kubernetes_job_would_run(kube, testbed, tmp_path, capsys):
    from gpuflow.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(
        "job: {kind: command, command: [nvidia-smi]}\n"
        "resources: {gpus: 8, gpu_product: H100}\nplacement: {backend: kubernetes}\n"
    )
    assert main(["preflight", str(job)]) == 0
    out = capsys.readouterr().out
    assert f"cluster: {kube.config.server} (credentials from {testbed})" in out
    assert "image: ghcr.io/gpuflow/gpuflow-job:0.1" in out and "namespace: default" in out
    assert f"gpus: 1 node(s) x 8 nvidia.com/gpu of {H100}" in out
    job.write_text(
        job.read_text().replace("backend: kubernetes", "backend: kubernetes, namespace: nope")
    )
    assert main(["preflight", str(job)]) == 1
    assert (
        "[fail] namespace: placement.namespace: the namespace 'nope' does not exist"
        in capsys.readouterr().out
    )


def test_the_pipeline_retries_a_unit_whose_node_was_lost_and_completes(
    kube, testbed, prefect_api, gpuflow_home
):
    from gpuflow.flows.pipeline import gpu_pipeline
    from tests.e2e.helpers import logs_of

    spec = load_spec(
        {
            "name": "node-lost",
            "job": {"kind": "command", "command": ["sleep", "20"]},
            "resources": {"gpus": 8, "gpu_product": H100},
            "placement": {"backend": "kubernetes"},
            "retry": {"run": {"retries": 2, "delay_s": 0}},
        }
    )
    lost: list[str] = []

    def lose_node(pod: dict) -> None:
        lost.append(pod["spec"]["nodeName"])
        kube.request("DELETE", f"/api/v1/nodes/{lost[0]}")

    watcher = when_running(kube, "gpuflow.io/job=node-lost", lose_node, seconds=120)
    try:
        state = gpu_pipeline(spec, return_state=True)
        watcher.join()
    finally:
        restore_nodes(kube, testbed, lost)
    assert state.is_completed(), state.message
    assert lost, "the first pod never ran"
    run_id = str(state.state_details.flow_run_id)
    assert any("interrupted and saved its state (exit 75)" in line for line in logs_of(run_id))
    assert wait_gone(kube, run_id) == []


def test_the_job_network_policy_is_accepted_and_selects_gpuflows_pods(kube):
    import yaml

    from gpuflow.tasks.backends.kubernetes.manifests import labels

    policy = yaml.safe_load((ROOT / "infra" / "kubernetes" / "job-networkpolicy.yaml").read_text())
    path = "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies"
    made = kube.request("POST", path, policy)
    try:
        selected = made["spec"]["podSelector"]["matchLabels"]
        pod_labels = labels(
            KubernetesBackend().provision(spec_for(), owner_labels("run-netpol", "k8s-test"))
        )
        assert selected.items() <= pod_labels.items()  # every gpuflow job pod is covered
    finally:
        kube.request("DELETE", f"{path}/{policy['metadata']['name']}")
        KubernetesBackend().teardown(
            KubernetesBackend().list_owned({"gpuflow.io/flow-run-id": "run-netpol"})[0]
        )


def pipeline_noting(spec, note) -> Any:
    """Run `spec` through gpu_pipeline while `note()` is called every 0.1 s in a thread:
    the objects live only while the run does, so tests note them as they come."""
    from gpuflow.flows.pipeline import gpu_pipeline

    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            note()
            time.sleep(0.1)

    recorder = threading.Thread(target=loop)
    recorder.start()
    try:
        return gpu_pipeline(spec, return_state=True)
    finally:
        stop.set()
        recorder.join()


def test_training_on_two_nodes_is_one_torchrun_per_node_meeting_at_one_address(
    kube, prefect_api, gpuflow_home, tmp_path
):
    from gpuflow.tasks.storage import FileStore
    from gpuflow.tasks.training.prepare import prepare

    dataset = f"file://{tmp_path}/data"
    prepare("synthetic:classify?samples=64", dataset, 4_096, FileStore())
    spec = load_spec(
        {
            "name": "ddp-2x8",
            "job": {
                "kind": "train",
                "dataset": dataset,
                "output": f"file://{tmp_path}/out",
                "num_workers": 1,
            },
            "resources": {"gpus": 8, "nodes": 2, "gpu_product": H100},
            "placement": {"backend": "kubernetes"},
        }
    )
    seen: dict[str, dict] = {}

    def record() -> None:
        found = kube.request(
            "GET",
            "/apis/batch/v1/namespaces/default/jobs",
            params={"labelSelector": "gpuflow.io/job=ddp-2x8"},
        )["items"]
        seen.update({j["metadata"]["name"]: j for j in found})

    state = pipeline_noting(spec, record)
    assert state.is_completed(), state.message
    assert len(seen) == 2
    commands = sorted(j["spec"]["template"]["spec"]["containers"][0]["args"] for j in seen.values())
    ranks = [c[c.index("--node-rank") + 1] for c in commands]
    assert sorted(ranks) == ["0", "1"]
    assert {c[c.index("--nnodes") + 1] for c in commands} == {"2"}
    [rendezvous] = {c[c.index("--rendezvous") + 1] for c in commands}
    hosts = sorted(j["spec"]["template"]["spec"]["hostname"] for j in seen.values())
    assert rendezvous == f"{hosts[0]}.{hosts[0][:-2]}:29400"  # node 0's stable name
    for job in seen.values():
        pod = job["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert pod["containers"][0]["args"][:3] == ["python", "-m", "gpuflow.tasks.training.launch"]
    assert wait_gone(kube, str(state.state_details.flow_run_id)) == []


def test_a_kubernetes_gpu_pool_block_names_the_cluster_and_how_pods_are_made(
    kube, testbed, prefect_api, monkeypatch
):
    import yaml
    from prefect_kubernetes.credentials import KubernetesClusterConfig

    from gpuflow.blocks.kubernetes_pool import KubernetesGpuPool

    config = KubernetesClusterConfig(
        config=yaml.safe_load(testbed.read_text()), context_name="gpuflow-testbed"
    )
    KubernetesGpuPool(
        cluster_config=config,
        namespace="default",
        image="registry.example/gpuflow:2.0",
        gpu_product="NVIDIA-L4",
        queue_name="team-a",
    ).save("testbed-l4", overwrite=True)
    monkeypatch.delenv("KUBECONFIG")  # the block alone says where the cluster is
    monkeypatch.setenv("HOME", str(testbed.parent))  # and no ~/.kube/config stands in
    spec = spec_for(gpus=2, product=None, block="testbed-l4")
    backend = KubernetesBackend.at(spec.placement)
    cluster = backend.provision(spec, owner_labels("run-block", "k8s-test"))
    try:
        assert (
            backend.run(
                cluster, WorkUnit(name="main", command=["true"]), {}, 120, lambda *_: None
            ).exit_code
            == 0
        )
        job = kube.request("GET", f"/apis/batch/v1/namespaces/default/jobs/{cluster.name}-main")
        pod = job["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == "registry.example/gpuflow:2.0"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    finally:
        backend.teardown(cluster)


def test_the_prefect_worker_runs_a_deployment_as_a_gpu_job_on_a_node_of_the_runs_product(
    kube, testbed, tmp_path
):
    """`gpuflow platform up --kubeconfig` starts gpuflow's Kubernetes worker; a run of a
    deployment whose GPU product and count come only from the run's job variables (what the
    UI's run form sends) becomes a Job with those on the real API server, and its pod lands on
    a node of that product. A bad job variable fails the run with one sentence, nothing made."""
    namespace = "worker-e2e"
    kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    platform, kubeconfig = worker_platform(kube, namespace, tmp_path)
    image = "registry.internal/ml/gpuflow-job:0.1"
    try:
        up = up_with_worker(platform, kubeconfig, image)
        assert "started a Kubernetes worker" in up.stdout
        with platform.client() as client:
            pool = client.read_work_pool("gpuflow-gpu-k8s")
            assert pool.type == "gpuflow-kubernetes"
            deployment = client.read_deployment_by_name("gpu-pipeline/command-k8s")
            assert deployment.job_variables["image"] == image
            assert deployment.job_variables["namespace"] == namespace

        def start(*variables: str) -> str:
            argv = ["deployment", "run", "gpu-pipeline/command-k8s"]
            for pair in variables:  # the namespace is the kubeconfig's
                argv += ["--job-variable", pair]
            ran = platform.run(sys.executable, "-m", "prefect", *argv)
            assert ran.returncode == 0, ran.stdout + ran.stderr
            return re.search(r"UUID: ([0-9a-f-]{36})", ran.stdout).group(1)

        run_id = start("gpu_product=NVIDIA-L4", "gpu_count=2", "queue_name=team-a")
        jobs_path = f"/apis/batch/v1/namespaces/{namespace}/jobs"
        selector = {"labelSelector": f"prefect.io/flow-run-id={run_id}"}
        until, jobs = time.monotonic() + 120, []
        while not jobs and time.monotonic() < until:
            jobs = kube.request("GET", jobs_path, params=selector)["items"]
            time.sleep(0.5)
        assert len(jobs) == 1, (platform.home / "platform" / "k8s-worker.log").read_text()[-3000:]
        job = jobs[0]
        pod = job["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["image"] == image
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        assert job["spec"]["activeDeadlineSeconds"] == 86400
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        pods_path = f"/api/v1/namespaces/{namespace}/pods"
        until, node = time.monotonic() + 60, None
        while not node and time.monotonic() < until:
            pods = kube.request("GET", pods_path, params=selector)["items"]
            node = next((p["spec"].get("nodeName") for p in pods), None)
            time.sleep(0.5)
        assert node == "gpu-l4-0"  # the only node of that product

        bad = start("shm_size=lots")
        state = platform.final_state(bad, 60)
        assert state.is_crashed()
        assert "job_variables.shm_size: 'lots' is not a size; write e.g. 8Gi" in state.message
        bad_selector = {"labelSelector": f"prefect.io/flow-run-id={bad}"}
        assert kube.request("GET", jobs_path, params=bad_selector)["items"] == []
    finally:
        down = platform.gpuflow("platform", "down", timeout=120)
        kube.request("DELETE", f"/api/v1/namespaces/{namespace}")
    assert down.returncode == 0 and "stopped the k8s-worker" in down.stdout


def test_the_kueue_gpu_queue_examples_are_accepted_by_kueues_own_api(kube):
    """infra/kubernetes/kueue-gpu-queues.yaml against Kueue's CRDs (with their validation
    rules) on the API server, strictly (an unknown field fails); its flavors are the
    products the GPU nodes carry."""
    import yaml

    docs = list(yaml.safe_load_all((ROOT / "infra/kubernetes/kueue-gpu-queues.yaml").read_text()))
    plural = {
        "ResourceFlavor": "resourceflavors",
        "ClusterQueue": "clusterqueues",
        "LocalQueue": "localqueues",
        "WorkloadPriorityClass": "workloadpriorityclasses",
    }
    made = []
    try:
        for doc in docs:
            namespace = doc["metadata"].get("namespace")
            where = f"namespaces/{namespace}/" if namespace else ""
            path = f"/apis/{doc['apiVersion']}/{where}{plural[doc['kind']]}"
            kube.request("POST", path, doc, params={"fieldValidation": "Strict"})
            made.append(f"{path}/{doc['metadata']['name']}")
        bad = next(d for d in docs if d["kind"] == "ClusterQueue")
        bad = {**bad, "metadata": {"name": "bad"}, "spec": {**bad["spec"], "gpuQuota": 8}}
        from gpuflow.tasks.backends.kubernetes.kubeapi import KubeError

        with pytest.raises(KubeError, match="gpuQuota"):  # strict: a field Kueue lacks fails
            kube.request(
                "POST",
                f"/apis/{bad['apiVersion']}/clusterqueues",
                bad,
                {"fieldValidation": "Strict"},
            )
    finally:
        for path in reversed(made):
            kube.request("DELETE", path)
    products = {
        n["metadata"]["labels"].get("nvidia.com/gpu.product")
        for n in kube.request("GET", "/api/v1/nodes")["items"]
    }
    flavors = [d for d in docs if d["kind"] == "ResourceFlavor"]
    assert {f["spec"]["nodeLabels"]["nvidia.com/gpu.product"] for f in flavors} <= products
    queue = next(d for d in docs if d["kind"] == "ClusterQueue")
    (group,) = queue["spec"]["resourceGroups"]
    assert "nvidia.com/gpu" in group["coveredResources"]
    assert {f["name"] for f in group["flavors"]} == {f["metadata"]["name"] for f in flavors}


def test_an_hpc_job_on_two_nodes_is_an_mpijob_run_by_the_mpi_operator(
    kube, prefect_api, gpuflow_home
):
    """8 ranks on 2 nodes x 4 H100: gpuflow submits a Kubeflow MPIJob (the testbed runs the
    real MPI Operator), whose worker pods hold the GPUs on nodes of the product and whose
    launcher runs gpuflow's MPI launcher over the operator's hostfile; nothing is left."""
    from gpuflow.tasks.backends.kubernetes.mpijob import problems

    spec = load_spec(
        {
            "name": "md-2x4",
            "job": {"kind": "hpc", "ranks": 8, "gpus_per_rank": 1, "md": {"atoms": 256}},
            "resources": {"gpus": 4, "nodes": 2, "gpu_product": H100},
            "placement": {"backend": "kubernetes"},
        }
    )
    mpijobs: dict[str, dict] = {}
    pods: dict[str, dict] = {}

    def record() -> None:
        found = kube.request(
            "GET",
            "/apis/kubeflow.org/v2beta1/namespaces/default/mpijobs",
            params={"labelSelector": "gpuflow.io/job=md-2x4"},
        )["items"]
        mpijobs.update({j["metadata"]["name"]: j for j in found})
        for name in mpijobs:
            for pod in pods_of(kube, f"training.kubeflow.org/job-name={name}"):
                if pod["spec"].get("nodeName"):
                    pods[pod["metadata"]["name"]] = pod

    state = pipeline_noting(spec, record)
    assert state.is_completed(), state.message
    (job,) = mpijobs.values()
    assert problems(job) == []
    assert job["spec"]["slotsPerWorker"] == 4
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2
    container = worker["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert worker["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": H100}
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert launcher["args"][:3] == ["python", "-m", "gpuflow.tasks.hpc.launch"]
    assert {"name": "GPUFLOW_MPI_HOSTFILE", "value": "/etc/mpi/hostfile"} in launcher["env"]
    assert "nvidia.com/gpu" not in launcher["resources"].get("limits", {})
    roles = {
        name: (p["metadata"]["labels"]["training.kubeflow.org/job-role"], p["spec"]["nodeName"])
        for name, p in pods.items()
    }
    workers = sorted(node for role, node in roles.values() if role == "worker")
    assert workers == ["gpu-h100-0", "gpu-h100-1"]  # one worker on each node of the product
    assert any(role == "launcher" for role, _ in roles.values())
    assert wait_gone(kube, str(state.state_details.flow_run_id)) == []


def test_a_lost_mpi_worker_node_is_a_preemption(kube, testbed):
    backend = KubernetesBackend()
    cluster = backend.provision(spec_for(gpus=8, nodes=2), owner_labels("run-mpi-lost", "k8s-test"))
    lost: list[str] = []

    def lose_node(pod: dict) -> None:
        lost.append(pod["spec"]["nodeName"])
        kube.request("DELETE", f"/api/v1/nodes/{lost[0]}")

    selector = "training.kubeflow.org/job-role=worker,training.kubeflow.org/replica-index=1"
    watcher = when_running(kube, selector, lose_node)
    launcher = WorkUnit(
        name="launcher",
        command=["sleep", "300"],  # the testbed runs it for 300 s
        launcher=MpiLaunch(hostfile="node-0 slots=8\nnode-1 slots=8\n"),
    )
    try:
        result = backend.run(cluster, launcher, {}, 300, lambda *_: None)
        watcher.join()
        assert lost and result.exit_code == 75  # preempted: the run stage retries
    finally:
        backend.teardown(cluster)
        restore_nodes(kube, testbed, lost)
    assert wait_gone(kube, "run-mpi-lost") == []


def test_a_units_log_lines_stream_to_the_run_as_the_pod_prints_them(kube, testbed):
    """The pod's log (KWOK serves it through the real kubelet API path: API server -> the
    node's endpoint) reaches `on_line` line by line, in order, and ends the result's tail."""
    from datetime import UTC, datetime

    from gpuflow.tasks.backends.kubernetes.logs import log_nonce

    namespace = "gpuflow-logs"  # where the testbed's ClusterLogs serves pod-logs/unit.log
    kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    printed = [f"step {i}: loss {1 / (i + 1):.3f}" for i in range(5)] + ["done"]
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    log = testbed.parent / "pod-logs" / "unit.log"  # CRI's format, as a kubelet keeps it
    log.unlink(missing_ok=True)  # no log yet: the first requests fail, gpuflow asks again

    def first_lines(pod: dict) -> None:
        time.sleep(1.5)
        log.write_text("".join(f"{stamp} stdout F {line}\n" for line in printed[:2]))

    writer = when_running(kube, "gpuflow.io/job=k8s-test", first_lines, namespace=namespace)
    spec = spec_for(gpus=1, product="NVIDIA-L4", namespace=namespace)
    backend = KubernetesBackend.at(spec.placement)
    cluster = backend.provision(spec, owner_labels("run-logs", "k8s-test"))
    lines: list[tuple[str, str]] = []

    def on_line(stream: str, line: str) -> None:
        lines.append((stream, line))
        if len(lines) == 2:  # the pod prints the rest while it runs: they follow
            with log.open("a") as more:
                more.write("".join(f"{stamp} stdout F {line}\n" for line in printed[2:]))

    # what the unit wrapper prints at the end: the unit's output files, sent back
    result_json = base64.b64encode(b'{"loss": 0.167}').decode()
    nonce = log_nonce(cluster.name)  # what the wrapper has from the pod's Secret
    printed += [
        f"@@gpuflow-output-{nonce} result.json {result_json}",
        f"@@gpuflow-output-left-{nonce} 3221225472 model.safetensors",
    ]
    try:
        result = backend.run(
            cluster, WorkUnit(name="main", command=["sleep", "15"]), {}, 120, on_line
        )
        writer.join()
        outputs = Path(cluster.workspace) / "outputs"  # this host's side, for collect
        assert (outputs / "result.json").read_text() == '{"loss": 0.167}'
        # a gpuflow killed before it read them: its reap takes them from the ended pod's
        # log (the nonce read from the run's Secret), whichever process asks
        shutil.rmtree(outputs)
        with KubernetesBackend.at(spec.placement).outputs_here(cluster) as kept:
            assert kept == outputs and sorted(p.name for p in kept.iterdir()) == ["result.json"]
            assert (kept / "result.json").read_text() == '{"loss": 0.167}'
    finally:
        backend.teardown(cluster)
        kube.request("DELETE", f"/api/v1/namespaces/{namespace}")
    assert not Path(cluster.workspace).exists()  # gone with the cluster
    assert result.exit_code == 0
    assert [line for _, line in lines[:6]] == printed[:6]
    assert lines[6:] == [  # the output lines are taken out of the log
        (
            "stderr",
            "outputs/model.safetensors (3072.0 MiB) stayed in the pod: files over 1024 KiB"
            " come back only from storage (write them to your job's output URL)",
        )
    ]
    assert result.log_tail[-1] == "done"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_gpuflow_during_a_kubernetes_run_deletes_everything(
    sig, kube, testbed, tmp_path, prefect_api, gpuflow_home
):
    """`gpuflow run` stopped (SIGTERM, or Ctrl-C's SIGINT) while its unit runs on the
    cluster: the unit's Job and every object of the run are deleted, the run is Crashed."""
    from tests.conftest import subprocess_env

    job = tmp_path / "job.yaml"
    job.write_text(
        "name: k8s-stop\n"
        "job: {kind: command, command: [sleep, '300']}\n"
        "resources: {gpus: 2, gpu_product: NVIDIA-H100-80GB-HBM3}\n"
        "placement: {backend: kubernetes}\n"
    )
    env = {**subprocess_env(prefect_api, gpuflow_home), "KUBECONFIG": str(testbed)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuflow", "run", str(job)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    selector = "gpuflow.io/job=k8s-stop"
    until, running = time.monotonic() + 120, []
    while not running and time.monotonic() < until and proc.poll() is None:
        running = [p for p in pods_of(kube, selector) if p["status"].get("phase") == "Running"]
        time.sleep(0.2)
    assert running, proc.stdout.read() if proc.poll() is not None else "no pod ran"
    run_id = running[0]["metadata"]["labels"]["gpuflow.io/flow-run-id"]
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, out[-3000:]
    assert "Traceback" not in out
    assert f"gpuflow: stopped by {signal.Signals(sig).name}" in out
    assert wait_gone(kube, run_id) == []  # Job, pod, Secret and Service: all gone
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(UUID(run_id)).state.is_crashed()


def render_on_kubernetes(scene: str, output: str, **job) -> dict:
    return {
        "name": "k8s-render",
        "job": {"kind": "render", "scene": scene, "output": output, **job},
        "resources": {"gpus": 4, "gpu_product": "NVIDIA-L4"},
        "placement": {"backend": "kubernetes", "namespace": KUBELET_NS},
        "metrics": {"plot": False},
    }


def test_render_chunks_spread_over_gpu_pods_that_upload_their_own_frames(
    kube, testbed, prefect_api, s3_server, s3_scene, tmp_path, gpuflow_home
):
    """A render on Kubernetes: 8 frames in chunks of 2 over 4 GPUs are 4 Jobs of one GPU
    each on the L4 node; in each pod (run here by a played kubelet: the container's real
    command, env and Secret) the chunk program fetches the scene from S3, runs Blender and
    uploads its frames; the run counts them from the pods' logs, writes its contact sheet
    from storage, and leaves no object. A rerun renders nothing."""
    from PIL import Image

    from gpuflow.flows.render import render
    from gpuflow.tasks.storage import store_for
    from tests.e2e.helpers import logs_of

    output = s3_server.url("k8s-renders/cube")
    # the played kubelet's machine has no GPU: Blender in the "pods" renders on its CPU
    spec = render_on_kubernetes(s3_scene, output, chunk=2, device="CPU")
    with PlayedKubelet(kube, tmp_path / "kubelet") as kubelet:
        state = render(spec, return_state=True)
    assert state.is_completed(), state.message
    run_id = str(state.state_details.flow_run_id)
    pods = kubelet.pods.values()
    assert sorted(p["metadata"]["labels"]["gpuflow.io/unit"] for p in pods) == [
        f"chunk-{i}" for i in range(4)
    ]
    for pod in pods:  # one GPU each, on the product's node
        assert pod["spec"]["nodeName"] == "gpu-l4-0"
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
    assert set(kubelet.exits.values()) == {0}
    store = store_for(output, s3_server.settings())
    listed = sorted(o.url for o in store.list(output))
    assert listed == [f"{output}/frame_{i:04d}.png" for i in range(1, 9)]
    job = state.result().metrics.job
    assert (job["frames_rendered"], job["frames_missing"], job["chunks"]) == (8, 0, 4)
    sheet = Path(state.result().artifacts_dir) / "outputs" / "contact-sheet.png"
    with Image.open(sheet) as image:  # thumbnails made from the frames in storage
        assert image.getextrema() != ((0, 0), (0, 0), (0, 0))
    secret = s3_server.settings().secret_access_key.get_secret_value()
    for pod in pods:  # the credentials reached the pods through the Secret only
        assert secret not in json.dumps(pod)
    assert not any(secret in line for line in logs_of(run_id))
    assert wait_gone(kube_in(kube, KUBELET_NS), run_id) == []
    with PlayedKubelet(kube, tmp_path / "kubelet-again") as again:
        rerun = render(spec, return_state=True)
    assert rerun.is_completed(), rerun.message
    assert rerun.result().metrics.job["frames_skipped"] == 8
    assert again.pods == {}  # nothing left to render: no pod


@pytest.mark.parametrize(
    ("where", "field"),
    [("scene", "job.scene"), ("output", "job.output")],
)
def test_a_render_whose_scene_or_output_pods_cannot_reach_is_refused_before_anything_is_made(
    kube, prefect_api, s3_scene, tmp_path, gpuflow_home, where, field
):
    """A scene on this host's disk, or frames to a local folder: pods cannot read or write
    there, so the run fails in one sentence naming the field, and makes nothing."""
    from gpuflow.flows.render import render

    local = {"scene": str(tmp_path / "cube.blend"), "output": (tmp_path / "out").as_uri()}
    places = {"scene": s3_scene, "output": "s3://gpuflow-test/k8s-renders/refused"}
    places[where] = local[where]
    (tmp_path / "cube.blend").write_bytes(b"BLENDER")
    state = render(render_on_kubernetes(places["scene"], places["output"]), return_state=True)
    assert state.is_failed()
    assert f"InvalidSpec: {field}: {local[where]} is not in S3, and on kubernetes" in state.message
    assert "give an s3:// URL" in state.message
    selector = {"labelSelector": "gpuflow.io/job=k8s-render"}
    assert (
        kube.request("GET", f"/api/v1/namespaces/{KUBELET_NS}/services", params=selector)["items"]
        == []
    )


def test_hpc_on_several_nodes_without_the_mpi_operator_is_refused_before_anything_is_made(
    kube, testbed
):
    """The cluster stops serving MPIJobs (the CRD removed; put back afterwards): an hpc job
    on 2 nodes is refused by `check` in one sentence, one node still passes."""
    from gpuflow.tasks.backends.kubernetes.kubeapi import KubeError
    from gpuflow.tasks.errors import InvalidSpec

    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    saved = kube.request("GET", f"{crds}/mpijobs.kubeflow.org")
    kube.request("DELETE", f"{crds}/mpijobs.kubeflow.org")

    def served() -> bool:  # answered, not 404 nor 429 "storage is (re)initializing"
        try:
            kube.request("GET", "/apis/kubeflow.org/v2beta1/mpijobs")
        except KubeError:
            return False
        return True

    def hpc(nodes: int):
        return load_spec(
            {
                "name": "md",
                "job": {"kind": "hpc", "ranks": 2 * nodes, "gpus_per_rank": 1, "md": {}},
                "resources": {"gpus": 2, "nodes": nodes},
                "placement": {"backend": "kubernetes"},
            }
        )

    try:
        until = time.monotonic() + 60
        while served() and time.monotonic() < until:
            time.sleep(0.2)
        with pytest.raises(InvalidSpec) as refused:
            KubernetesBackend().check(hpc(nodes=2), get_kind("hpc").needs(hpc(nodes=2)))
        assert str(refused.value).startswith(
            "resources.nodes: MPI ranks on 2 nodes run as an MPIJob, and"
        )
        assert "install the Kubeflow MPI Operator there or use 1 node" in str(refused.value)
        KubernetesBackend().check(hpc(nodes=1), get_kind("hpc").needs(hpc(nodes=1)))  # one pod
    finally:
        for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
            saved["metadata"].pop(key, None)
        saved.pop("status", None)
        until = time.monotonic() + 60
        while time.monotonic() < until:  # the old one may still be terminating
            try:
                kube.request("POST", crds, saved)
                break
            except KubeError:  # 409 while the old one is still terminating
                time.sleep(0.5)
        while not served() and time.monotonic() < until:
            time.sleep(0.2)


def test_a_restarted_api_server_is_followed_again_and_nothing_is_duplicated(kube, testbed):
    """The API server stopped and started again (etcd keeps the state) while the unit's pod
    runs: the backend follows the same pod again, the unit completes, exactly one Job and
    one pod were made for it, and teardown leaves nothing."""
    backend = KubernetesBackend()
    spec = spec_for(gpus=1, product="NVIDIA-L4")
    run_id = "run-api-restart"
    cluster = backend.provision(spec, owner_labels(run_id, "k8s-test"))
    script = ROOT / "scripts" / "k8s-testbed.sh"
    restarted: list[subprocess.CompletedProcess] = []

    def restart(pod: dict) -> None:
        restarted.append(
            subprocess.run(
                ["bash", str(script), "restart-api", "--dir", str(testbed.parent)],
                capture_output=True,
                text=True,
                timeout=300,
            )
        )

    selector = f"gpuflow.io/flow-run-id={run_id}"
    restarter = when_running(kube, selector, restart)
    lines: list[tuple[str, str]] = []
    try:
        result = backend.run(
            cluster,
            WorkUnit(name="main", command=["sleep", "20"]),
            {},
            240,
            lambda stream, line: lines.append((stream, line)),
        )
        restarter.join()
        (done,) = restarted
        assert done.returncode == 0, done.stdout + done.stderr
        assert "up again" in done.stdout + done.stderr
        assert result.exit_code == 0 and not result.timed_out, (result, lines)
        jobs = kube.request(
            "GET",
            f"/apis/batch/v1/namespaces/{kube.namespace}/jobs",
            params={"labelSelector": selector},
        )["items"]
        assert len(jobs) == 1 and len(pods_of(kube, selector, kube.namespace)) == 1
    finally:
        backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


OWN_CODE = Path(__file__).resolve().parents[1] / "fixtures" / "owncode"


def test_the_readme_example_runs_in_its_working_folder_in_a_pod(
    kube, testbed, prefect_api, gpuflow_home, tmp_path
):
    """job.workdir on Kubernetes, its archive on a path the node shares with this host:
    the pod (run here by a played kubelet) starts gpuflow's starter, which unpacks the
    folder into the pod's workspace, runs the setup once and becomes the command there,
    ${GPUFLOW_OUTPUT_DIR} being the pod's own; its loss lines are the run's figures."""
    import shutil

    from gpuflow.flows.pipeline import gpu_pipeline
    from tests.e2e.helpers import logs_of

    folder = tmp_path / "project"
    shutil.copytree(OWN_CODE, folder)
    (folder / "scratch").mkdir()
    (folder / "scratch" / "left-out.bin").write_bytes(b"\0" * 100)
    out = "${GPUFLOW_OUTPUT_DIR}/model.json"
    raw = {
        "name": "k8s-own-code",
        "job": {
            "kind": "command",
            "command": ["python", "train.py", "--epochs", "3", "--out", out],
            "workdir": str(folder),
            "setup": ["echo set up in $PWD"],
        },
        "resources": {"gpus": 1, "gpu_product": H100},
        "placement": {"backend": "kubernetes", "namespace": KUBELET_NS},
        "metrics": {"plot": False, "from_log": [r"epoch (?P<epoch>\d+) loss (?P<loss>[\d.]+)"]},
    }
    with PlayedKubelet(kube, tmp_path / "kubelet") as kubelet:
        state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    [pod] = kubelet.pods.values()
    args = pod["spec"]["containers"][0]["args"]
    assert args[:3] == ["python", "-m", "gpuflow.tasks.workdir"]
    assert args[4:] == ["--", "python", "train.py", "--epochs", "3", "--out", out]
    assert set(kubelet.exits.values()) == {0}
    logs = "\n".join(logs_of(state.state_details.flow_run_id))
    assert "set up in " in logs and "/workspace/work" in logs
    assert "files here: .gitignore,data,ddp.py,train.py" in logs
    assert state.result().metrics.from_log == {"epoch": 2.0, "loss": 0.8333}
    assert wait_gone(kube_in(kube, KUBELET_NS), str(state.state_details.flow_run_id)) == []


def test_torchrun_on_two_nodes_is_one_torchrun_per_pod_meeting_at_the_first_pods_name(
    kube, prefect_api, gpuflow_home, tmp_path
):
    """launcher: torchrun on two nodes of 8 GPUs: a Job per node whose pod starts
    gpuflow's torchrun with 8 ranks, node ranks 0 and 1, at node 0's stable name on the
    rendezvous port the Service opens; each pod learns both nodes' names."""
    import shutil

    folder = tmp_path / "project"
    shutil.copytree(OWN_CODE, folder)
    spec = load_spec(
        {
            "name": "ddp-own-2x8",
            "job": {
                "kind": "command",
                "command": ["python", "ddp.py"],
                "workdir": str(folder),
                "launcher": "torchrun",
            },
            "resources": {"gpus": 8, "nodes": 2, "gpu_product": H100},
            "placement": {"backend": "kubernetes"},
        }
    )
    seen: dict[str, dict] = {}
    secrets: dict[str, dict] = {}

    def record() -> None:
        found = kube.request(
            "GET",
            "/apis/batch/v1/namespaces/default/jobs",
            params={"labelSelector": "gpuflow.io/job=ddp-own-2x8"},
        )["items"]
        seen.update({j["metadata"]["name"]: j for j in found})
        for item in kube.request(
            "GET",
            "/api/v1/namespaces/default/secrets",
            params={"labelSelector": "gpuflow.io/job=ddp-own-2x8"},
        )["items"]:
            secrets[item["metadata"]["name"]] = item

    state = pipeline_noting(spec, record)
    assert state.is_completed(), state.message
    assert len(seen) == 2
    pods = [j["spec"]["template"]["spec"] for j in seen.values()]
    hosts = sorted(p["hostname"] for p in pods)
    first = f"{hosts[0]}.{hosts[0][:-2]}"  # node 0's stable name in the run's Service
    for pod in pods:
        args = pod["containers"][0]["args"]
        launch = args[args.index("--") + 1 :]
        assert launch[:4] == ["python", "-m", "gpuflow.tasks.torchrun", "--nproc-per-node=8"]
        assert launch[4:8] == [
            "--nnodes=2",
            f"--node-rank={int(pod['hostname'][-1])}",
            f"--master-addr={first}",
            "--master-port=29400",
        ]
        assert launch[8:] == ["--", "python", "ddp.py"]
    [secret] = secrets.values()
    env = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert env["GPUFLOW_MASTER_ADDR"] == first
    assert env["GPUFLOW_NODE_ADDRS"] == f"{first},{hosts[1]}.{hosts[1][:-2]}"
    assert wait_gone(kube, str(state.state_details.flow_run_id)) == []
