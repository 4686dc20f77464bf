"""A service on the Kubernetes test cluster: a Deployment, a Service and a real
HorizontalPodAutoscaler (autoscaling/v2) on DCGM_FI_DEV_GPU_UTIL, read through the custom
metrics API (the API server's aggregation layer, the test cluster's adapter) from a real
Prometheus. The test stands in for dcgm-exporter: it pushes each pod's utilisation to a
Pushgateway that Prometheus scrapes. The HPA scales the Deployment up and down; cancelling
the run leaves no Deployment, Service, HPA or pod."""

from __future__ import annotations

import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from uuid import UUID

import pytest

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline.checks import check_pool
from gpuflow.tasks.spec import load_spec
from tests.e2e.test_service import events_until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA-H100-80GB-HBM3"
APPS = "/apis/apps/v1/namespaces/default/deployments"
HPAS = "/apis/autoscaling/v2/namespaces/default/horizontalpodautoscalers"


def spec(**job) -> dict:
    return {
        "name": "k8s-service",
        "job": {
            "kind": "service",
            "command": ["python", "serve.py"],
            "ready": {"path": "/health"},
            "replicas": {"min": 1, "max": 3},
            "scaling": {"gpu_util": 60, "down_after_s": 0},
            **job,
        },
        "resources": {"gpus": 1, "gpu_product": H100},
        "placement": {"backend": "kubernetes"},
        "limits": {"max_duration": "15m"},
    }


@pytest.fixture
def custom_metrics(testbed, kube, prometheus):
    """The custom metrics API, served from this test's Prometheus; unregistered and its
    adapter stopped by PID afterwards (an APIService nobody answers slows discovery for
    the rest of the session)."""
    import os
    import signal

    script = ROOT / "scripts" / "k8s-testbed.sh"
    folder = testbed.parent
    subprocess.run(
        ["bash", str(script), "adapter", "--dir", str(folder), "--prometheus", prometheus.url],
        check=True,
        timeout=180,
    )
    yield prometheus
    kube.request(
        "DELETE", "/apis/apiregistration.k8s.io/v1/apiservices/v1beta2.custom.metrics.k8s.io"
    )
    pidfile = folder / "pids" / "metrics-adapter"
    os.kill(int(pidfile.read_text()), signal.SIGTERM)
    pidfile.unlink()


def pods(kube, name: str) -> list[str]:
    found = kube.request(
        "GET",
        "/api/v1/namespaces/default/pods",
        params={"labelSelector": f"gpuflow.io/service={name}"},
    )
    return [
        p["metadata"]["name"]
        for p in found["items"]
        if not p["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
    ]


def _seen(kube) -> list:
    """What the cluster holds of the test's service, for a failure's message."""
    found = kube.request(
        "GET",
        "/api/v1/namespaces/default/pods",
        params={"labelSelector": "gpuflow.io/job=k8s-service"},
    )
    nodes = kube.request("GET", "/api/v1/nodes")["items"]
    hpa = kube.request("GET", HPAS)["items"]
    return [
        [
            (
                p["metadata"]["name"][-5:],
                p["status"].get("phase"),
                [(c["type"], c["status"]) for c in p["status"].get("conditions", [])],
            )
            for p in found["items"]
        ],
        [
            (
                n["metadata"]["name"],
                [
                    (c["type"], c["status"])
                    for c in n["status"].get("conditions", [])
                    if c["type"] == "Ready"
                ],
            )
            for n in nodes
        ],
        [h.get("status") for h in hpa],
    ]


def push_utilisation(gateway: str, pod: str, util: float) -> None:
    """What dcgm-exporter would say of the pod's GPU (with its pod and namespace)."""
    body = f'DCGM_FI_DEV_GPU_UTIL{{namespace="default",gpu="0"}} {util}\n'.encode()
    request = urllib.request.Request(
        f"{gateway}/metrics/job/dcgm/pod/{pod}", data=body, method="PUT"
    )
    urllib.request.urlopen(request, timeout=10).read()


def test_the_hpa_scales_the_deployment_on_gpu_utilisation_and_nothing_is_left(
    kube, custom_metrics, prefect_api, gpuflow_home
):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    states = []
    runner = threading.Thread(
        target=lambda: states.append(gpu_pipeline(load_spec(spec()), return_state=True))
    )
    runner.start()
    util = {"now": 30.0}
    stop = threading.Event()
    deployment: dict = {}

    def wait_for(condition, what: str, seconds: float = 120) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            assert runner.is_alive(), f"the run ended before {what}: {states}"
            assert time.monotonic() < deadline, f"{what} did not happen: {_seen(kube)}"
            time.sleep(0.5)

    def wanted() -> int:
        found = kube.request("GET", APPS, params={"labelSelector": "gpuflow.io/job=k8s-service"})
        items = found["items"]
        deployment.update(items[0] if items else {})
        return items[0]["spec"]["replicas"] if items else 0

    def dcgm() -> None:  # every ready pod's GPU at util["now"], once a second
        while not stop.is_set():
            name = deployment.get("metadata", {}).get("name")
            for pod in pods(kube, name) if name else []:
                push_utilisation(custom_metrics.gateway, pod, util["now"])
            stop.wait(1.0)

    exporter = threading.Thread(target=dcgm, daemon=True)
    try:
        wait_for(lambda: wanted() == 1, "the Deployment")
        exporter.start()
        name = deployment["metadata"]["name"]
        hpa = kube.request("GET", f"{HPAS}/{name}")
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "DCGM_FI_DEV_GPU_UTIL"
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
        util["now"] = 95.0
        wait_for(lambda: wanted() == 3, "the HPA scaling up to 3")
        metric = kube.request(
            "GET",
            "/apis/custom.metrics.k8s.io/v1beta2/namespaces/default/pods/*/DCGM_FI_DEV_GPU_UTIL",
            params={"labelSelector": f"gpuflow.io/service={name}"},
        )
        assert metric["items"] and {i["value"] for i in metric["items"]} == {"95"}
        util["now"] = 10.0
        wait_for(lambda: wanted() == 1, "the HPA scaling down to 1")
        run_id = deployment["metadata"]["labels"]["gpuflow.io/flow-run-id"]
        with get_client(sync_client=True) as client:
            [flow_run] = [r for r in client.read_flow_runs() if str(r.id).startswith(run_id[:8])]
            client.set_flow_run_state(UUID(str(flow_run.id)), Cancelling(), force=True)
        runner.join(timeout=120)
        assert not runner.is_alive()
    finally:
        stop.set()
        if runner.is_alive():
            runner.join(timeout=120)
    [state] = states
    assert state.is_cancelled(), state
    scaled = events_until(
        "gpuflow.service.scaled",
        str(flow_run.id),
        lambda found: any(e["to"] == 1 < e["from"] for e in found),
    )
    ups = [e for e in scaled if e["to"] > e["from"] > 0]
    assert ups and all("HorizontalPodAutoscaler" in e["why"] for e in ups), scaled
    selector = {"labelSelector": f"gpuflow.io/flow-run-id={run_id}"}
    deadline = time.monotonic() + 60
    while True:
        left = [
            f"{kind}/{item['metadata']['name']}"
            for kind, path in (
                ("deployment", APPS),
                ("hpa", HPAS),
                ("service", "/api/v1/namespaces/default/services"),
                ("pod", "/api/v1/namespaces/default/pods"),
            )
            for item in kube.request("GET", path, params=selector)["items"]
            if not item["metadata"].get("deletionTimestamp")
        ]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == []


@pytest.mark.parametrize(
    ("job", "said"),
    [
        ({"scaling": {"rps": 10}}, "job.scaling.rps: on kubernetes the HorizontalPodAutoscaler"),
        (
            {"replicas": {"min": 0, "max": 2}},
            "job.replicas.min: on kubernetes a HorizontalPodAutoscaler keeps at least one",
        ),
        ({"workdir": "."}, "job.workdir: on kubernetes each replica runs its command in the image"),
    ],
)
def test_what_the_hpa_cannot_do_is_one_sentence(kube, prefect_api, gpuflow_home, job, said):
    with pytest.raises(InvalidSpec) as caught:
        check_pool(load_spec(spec(**job)))
    assert str(caught.value).startswith(said)


class StillRunning:
    """Every run still Running in its API: what a SIGKILLed gpuflow on another host
    leaves (nothing here marks its run over)."""

    def state(self, run_id, api_url):
        return "running"

    def states(self, runs):
        return {run: "running" for run in runs}


def test_a_service_past_its_deadline_is_reaped_though_its_run_looks_alive(kube, gpuflow_home):
    """gpuflow is gone (no process here to find dead) and its run still says Running: the
    objects' own deadline is what the reaper goes by."""
    from datetime import UTC, datetime, timedelta

    from gpuflow.tasks.backends.kubernetes import serving
    from gpuflow.tasks.backends.kubernetes.backend import KubernetesBackend
    from gpuflow.tasks.backends.kubernetes.state import KubeState
    from gpuflow.tasks.contract import owner_labels, state_of
    from gpuflow.tasks.service.native import replicated

    job = load_spec(spec(scaling={"gpu_util": 60}))
    [(placed, _)] = check_pool(job)
    backend = KubernetesBackend.at(placed.placement)
    run_id = "7e57dead-0000-4000-8000-00000000dead"
    cluster = backend.provision(placed, owner_labels(run_id, "k8s-service"))
    # its orchestrator is this process, alive: only the deadline says it is over
    settings = state_of(cluster, KubeState).settings
    app = replicated(placed)
    past = datetime.now(UTC) - timedelta(seconds=1)
    for path, manifest in (
        (APPS, serving.deployment(cluster, app, settings, past)),
        (HPAS, serving.autoscaler(cluster, app, "default", past)),
    ):
        kube.request("POST", path, manifest)
    said: list[str] = []
    backend.reap(False, said.append, StillRunning())
    assert any(
        cluster.name in line and "past the run's deadline (limits.max_duration)" in line
        for line in said
    ), said
    selector = {"labelSelector": f"gpuflow.io/cluster={cluster.name}"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = [
            item["metadata"]["name"]
            for path in (APPS, HPAS, "/api/v1/namespaces/default/services")
            for item in kube.request("GET", path, params=selector)["items"]
            if not item["metadata"].get("deletionTimestamp")
        ]
        if not left:
            break
        time.sleep(0.5)
    assert left == []
