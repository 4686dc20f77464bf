"""The Kubernetes backend on the test cluster's real node (scripts/k8s-testbed.sh up
--real-node): Debian's containerd and runc under a real kubelet, pods in containers of
gpuflow's job image (scripts/build-image.sh). Each test asserts on what that kubelet did:
the container's exit code and reason, its containerd id, the pod's conditions, its events.
Torch kinds stay on the played kubelet (tests/e2e/kubelet.py): this image has no torch."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

import gpuflow.tasks.kinds.registry  # noqa: F401 - the job kinds, for load_spec
from gpuflow.tasks.backends.kubernetes.backend import KubernetesBackend
from gpuflow.tasks.backends.kubernetes.kubeapi import KubeApi, load_config
from gpuflow.tasks.contract import WorkUnit, owner_labels
from gpuflow.tasks.diagnose import diagnose
from gpuflow.tasks.errors import PREEMPTED_EXIT_CODE, InvalidSpec, ProvisionError
from gpuflow.tasks.spec import load_spec
from tests.conftest import S3Server, serve_s3
from tests.e2e.test_kubernetes import wait_gone

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
IMAGE = "gpuflow.local/gpuflow-job:testbed"
PRODUCT = "NVIDIA-A10G"  # the real node's GPU product: no KWOK node has it
SECRET = "real-n0de-s3cret-value"


@dataclass
class RealNode:
    kubeconfig: Path
    name: str
    runtime: str  # the container runtime its kubelet reports
    ip: str  # its address: this host's side of the pods' bridge

    @property
    def testbed(self) -> Path:
        """The test cluster's folder (scripts/k8s-testbed.sh --dir)."""
        return self.kubeconfig.parent


@pytest.fixture(scope="session")
def real_node(tmp_path_factory) -> RealNode:
    """A test cluster with a real node, up for the whole session; gpuflow's job image built
    (cached) and imported into its containerd."""
    if os.geteuid() != 0:
        pytest.skip("the real node needs root (containers, cgroups, network namespaces)")
    script = ROOT / "scripts" / "k8s-testbed.sh"
    started = None
    if kept := os.environ.get("GPUFLOW_REAL_NODE_KUBECONFIG"):  # one already up, as it is
        kubeconfig = Path(kept)
    else:
        build = ROOT / "scripts" / "build-image.sh"
        subprocess.run(["bash", str(build)], check=True, timeout=1200, stdout=subprocess.DEVNULL)
        started = tmp_path_factory.mktemp("k8s-real-node")
        # the MPI Operator's health port is fixed: the Kubernetes tests' cluster has it
        up = ["bash", str(script), "up", "--dir", str(started), "--real-node", "--no-mpi-operator"]
        try:
            subprocess.run(up, check=True, timeout=900)
        except BaseException:  # what it started stops, and its bridge and chain go
            subprocess.run(["bash", str(script), "down", "--dir", str(started)], timeout=300)
            raise
        kubeconfig = started / "kubeconfig"
    api = KubeApi(load_config(yaml.safe_load(kubeconfig.read_text())))
    [node] = api.request("GET", "/api/v1/nodes", params={"labelSelector": "type=real"})["items"]
    [ip] = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
    yield RealNode(
        kubeconfig,
        node["metadata"]["name"],
        node["status"]["nodeInfo"]["containerRuntimeVersion"],
        ip,
    )
    if started is not None:
        subprocess.run(
            ["bash", str(script), "down", "--dir", str(started)], check=True, timeout=300
        )


@pytest.fixture(scope="session")
def pod_s3(real_node, tmp_path_factory) -> Iterator[S3Server]:
    """moto's S3 on the real node's address, which its pods and this host both reach."""
    with serve_s3(real_node.ip, tmp_path_factory.mktemp("pod-moto")) as server:
        yield server


@pytest.fixture
def kube(real_node, monkeypatch) -> KubeApi:
    monkeypatch.setenv("KUBECONFIG", str(real_node.kubeconfig))
    return KubeApi(load_config())


def spec_for(image: str = IMAGE, **limits: Any):
    return load_spec(
        {
            "name": "real-node",
            "job": {"kind": "command", "command": ["true"]},
            "resources": {"gpus": 1, "gpu_product": PRODUCT, **limits.pop("resources", {})},
            "placement": {"backend": "kubernetes", "image": image},
            "limits": limits,
        }
    )


class PodWatch:
    """Every state the API server gives the pods of one selector, the last one kept per
    pod, and whether the pod was deleted: what the kubelet reported, to the end."""

    def __init__(self, kube: KubeApi, selector: str) -> None:
        self.kube, self.selector = kube, selector
        self.last: dict[str, dict] = {}
        self.deleted: set[str] = set()
        self.changed = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        """List, then watch from the list's version, restarting from the last version seen;
        a watch that ended is picked up where it ended, so no deletion between two streams
        is missed. A version the server no longer has (410) lists again: a pod that the new
        list lacks was deleted."""
        path = f"/api/v1/namespaces/{self.kube.namespace}/pods"
        version = None
        while not self._stop:
            if version is None:
                listed = self.kube.request("GET", path, params={"labelSelector": self.selector})
                with self.changed:
                    names = {pod["metadata"]["name"] for pod in listed["items"]}
                    self.deleted |= set(self.last) - names
                    self.last.update({pod["metadata"]["name"]: pod for pod in listed["items"]})
                    self.changed.notify_all()
                version = listed["metadata"]["resourceVersion"]
            params = {
                "watch": "true",
                "labelSelector": self.selector,
                "timeoutSeconds": "5",
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
            }
            with self.kube.http.stream("GET", path, params=params, timeout=None) as answer:
                for line in answer.iter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    pod = event["object"]
                    if event["type"] == "ERROR":  # 410 Gone: that version is compacted
                        version = None
                        break
                    version = pod["metadata"]["resourceVersion"]
                    if event["type"] == "BOOKMARK":
                        continue
                    with self.changed:
                        self.last[pod["metadata"]["name"]] = pod
                        if event["type"] == "DELETED":
                            self.deleted.add(pod["metadata"]["name"])
                        self.changed.notify_all()

    def wait(self, what, seconds: float) -> Any:
        """Return what(self) once it is true, within `seconds` (AssertionError after)."""
        until = time.monotonic() + seconds
        with self.changed:
            while not (found := what(self)):
                left = until - time.monotonic()
                assert left > 0, f"not seen within {seconds} s: {self.last}"
                self.changed.wait(min(left, 1.0))
        return found

    def stop(self) -> None:
        self._stop = True


def running(watch: PodWatch) -> dict | None:
    """Return a pod whose container runs now, else None."""
    for pod in watch.last.values():
        for status in pod.get("status", {}).get("containerStatuses") or []:
            if (status.get("state") or {}).get("running"):
                return pod
    return None


def container(pod: dict) -> dict:
    [status] = pod["status"]["containerStatuses"]
    return status


def terminated(pod: dict) -> dict:
    return (container(pod).get("state") or {}).get("terminated") or {}


def on_the_real_node(pod: dict, node: RealNode) -> None:
    """The pod ran on the real node, in a container its containerd made."""
    assert pod["spec"]["nodeName"] == node.name, f"ran on {pod['spec']['nodeName']}"
    assert container(pod)["containerID"].startswith("containerd://"), node.runtime


def job_pods(kube: KubeApi, cluster_name: str) -> list[dict]:
    return kube.request(
        "GET",
        f"/api/v1/namespaces/{kube.namespace}/pods",
        params={"labelSelector": f"job-name={cluster_name}-main"},
    )["items"]


def run_unit(
    backend, cluster, command, env=None, timeout_s=120, grace_s=30.0, stop=None, lines=None
):
    lines = [] if lines is None else lines  # a caller's list sees the lines as they come
    result = backend.run(
        cluster,
        WorkUnit(name="main", command=command),
        env or {},
        timeout_s,
        lambda _stream, line: lines.append(line),
        should_stop=stop,
        grace_s=grace_s,
    )
    return result, lines


def test_real_node_runs_a_command_in_a_container_with_its_secret_and_no_privileges(kube, real_node):
    """The pod runs in a container of the job image: its variables come from the Secret
    (never the manifest, the pod or its events), as uid 10001 with no capability and no
    service-account token; its output file comes back; teardown leaves nothing."""
    backend = KubernetesBackend()
    run_id = "real-command"
    cluster = backend.provision(spec_for(), owner_labels(run_id, "real-node"))
    script = (
        "id -u; grep CapEff /proc/self/status;"
        " [ -e /var/run/secrets/kubernetes.io/serviceaccount ] && echo token || echo no-token;"
        ' echo "token=$TOKEN"; echo 42 > "$GPUFLOW_OUTPUT_DIR/result.txt"'
    )
    result, lines = run_unit(backend, cluster, ["sh", "-c", script], {"TOKEN": SECRET})
    assert result.exit_code == 0, lines
    assert lines[:4] == ["10001", "CapEff:\t0000000000000000", "no-token", f"token={SECRET}"]
    assert (Path(cluster.workspace) / "outputs" / "result.txt").read_text() == "42\n"
    [pod] = job_pods(kube, cluster.name)
    on_the_real_node(pod, real_node)
    assert terminated(pod)["reason"] == "Completed" and terminated(pod)["exitCode"] == 0
    job = kube.request("GET", f"/apis/batch/v1/namespaces/default/jobs/{cluster.name}-main")
    events = kube.request(
        "GET",
        "/api/v1/namespaces/default/events",
        params={"fieldSelector": f"involvedObject.name={pod['metadata']['name']}"},
    )["items"]
    assert {e["reason"] for e in events} >= {"Scheduled", "Pulled", "Created", "Started"}
    for seen in (job, pod, events):  # what `kubectl describe` would show
        assert SECRET not in json.dumps(seen)
    backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


def test_real_node_streams_every_log_line_to_the_end(kube, real_node):
    """3,000 lines printed as fast as the container can, the last one just before it
    exits: every one arrives, in order, from the real kubelet's log endpoint."""
    backend = KubernetesBackend()
    run_id = "real-logs"
    cluster = backend.provision(spec_for(), owner_labels(run_id, "real-node"))
    program = "for i in range(3000): print(f'line {i:04d}')\nprint('the end')"
    result, lines = run_unit(backend, cluster, [sys.executable, "-c", program])
    assert result.exit_code == 0
    assert lines == [f"line {i:04d}" for i in range(3000)] + ["the end"]
    on_the_real_node(job_pods(kube, cluster.name)[0], real_node)
    backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


def test_real_node_a_container_over_its_memory_limit_ends_oom_killed(kube, real_node):
    """resources.memory is the container's limit: a job that takes more is killed by the
    kernel in its cgroup, the kubelet says OOMKilled, and the run says why."""
    backend = KubernetesBackend()
    run_id = "real-oom"
    spec = spec_for(resources={"memory": "96Mi"})
    cluster = backend.provision(spec, owner_labels(run_id, "real-node"))
    hog = "import time\nheld = []\nwhile True:\n    held.append(bytearray(16 * 2**20))\n    time.sleep(0.01)"
    result, lines = run_unit(backend, cluster, [sys.executable, "-c", hog])
    [pod] = job_pods(kube, cluster.name)
    on_the_real_node(pod, real_node)
    assert terminated(pod)["reason"] == "OOMKilled", terminated(pod)
    assert terminated(pod)["exitCode"] == 137
    assert result.signal == signal.SIGKILL and result.memory_events == {"oom_kill": 1}
    said = diagnose(result.exit_code, result.signal, lines, {"memory_events": result.memory_events})
    assert said is not None and said.kind == "oom_killed", said
    backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


GRACEFUL = """
import signal, sys, time
def on_term(*_):
    print("SIGTERM: saving the checkpoint", flush=True)
    time.sleep({sleep})
    print("checkpoint saved", flush=True)
    sys.exit({code})
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(600)
"""


def test_real_node_an_eviction_gives_the_job_its_stop_grace_not_kubernetes_30_s(kube, real_node):
    """limits.stop_grace_s 60 is the pod's terminationGracePeriodSeconds: evicted (as a
    drained node's pods are), the job's SIGTERM handler sleeps 35 s, past Kubernetes'
    default 30 s, and still saves its checkpoint and exits 75; the run sees a preemption."""
    backend = KubernetesBackend()
    run_id = "real-grace"
    cluster = backend.provision(spec_for(stop_grace_s=60), owner_labels(run_id, "real-node"))
    watch = PodWatch(kube, f"job-name={cluster.name}-main")
    outcome: dict[str, Any] = {}
    program = GRACEFUL.format(sleep=35, code=PREEMPTED_EXIT_CODE)

    seen: list[str] = []

    def follow() -> None:
        outcome["result"], _ = run_unit(
            backend, cluster, [sys.executable, "-c", program], lines=seen
        )

    runner = threading.Thread(target=follow)
    runner.start()
    pod = watch.wait(running, 120)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 60
    name = pod["metadata"]["name"]
    until = time.monotonic() + 120
    while "ready" not in seen:  # the job's SIGTERM handler is in place
        assert time.monotonic() < until and runner.is_alive(), seen
        time.sleep(0.1)
    evicted_at = time.time()
    kube.request(
        "POST",
        f"/api/v1/namespaces/default/pods/{name}/eviction",
        {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name}},
    )
    runner.join(timeout=120)
    assert outcome["result"].exit_code == PREEMPTED_EXIT_CODE  # the run moves on at once
    final = watch.wait(lambda w: w.last[name] if name in w.deleted else None, 120)
    watch.stop()
    on_the_real_node(final, real_node)
    ended = terminated(final)
    assert ended["exitCode"] == PREEMPTED_EXIT_CODE, ended  # not 137: not killed at 30 s
    finished = datetime.fromisoformat(ended["finishedAt"].replace("Z", "+00:00")).timestamp()
    assert finished - evicted_at >= 34, (finished - evicted_at, ended)
    backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


def test_real_node_a_stopped_run_sends_sigterm_the_handler_runs_and_the_pod_goes(kube, real_node):
    """gpuflow stops the unit (a cancelled run): the kubelet sends SIGTERM, the job's
    handler runs and exits with its own code within the grace, and the pod is gone."""
    backend = KubernetesBackend()
    run_id = "real-stop"
    cluster = backend.provision(spec_for(stop_grace_s=20), owner_labels(run_id, "real-node"))
    watch = PodWatch(kube, f"job-name={cluster.name}-main")
    seen: list[str] = []
    program = GRACEFUL.format(sleep=1, code=3)
    stopped = backend.run(
        cluster,
        WorkUnit(name="main", command=[sys.executable, "-c", program]),
        {},
        120,
        lambda _stream, line: seen.append(line),
        should_stop=lambda: "ready" in seen,
        grace_s=20,
    )
    assert stopped.cancelled, stopped
    [name] = watch.wait(lambda w: sorted(w.deleted), 60)
    final = watch.last[name]
    watch.stop()
    on_the_real_node(final, real_node)
    assert terminated(final)["exitCode"] == 3, terminated(final)  # the handler's own exit
    assert job_pods(kube, cluster.name) == []
    backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


def test_real_node_an_image_that_does_not_exist_is_one_sentence_and_leaves_nothing(kube, real_node):
    backend = KubernetesBackend()
    run_id = "real-no-image"
    image = "gpuflow.local/no-such-image:1.0"
    cluster = backend.provision(spec_for(image=image), owner_labels(run_id, "real-node"))
    with pytest.raises(ProvisionError) as refused:
        run_unit(backend, cluster, ["true"])
    message = str(refused.value)
    assert message.startswith(
        f"unit main cannot start: the image '{image}' is not on {real_node.name} and cannot be"
        " pulled (ImagePullBackOff: "
    ), message
    assert message.endswith(
        "or set placement.image or the KubernetesGpuPool block's image to one it has."
    )
    assert "\n" not in message
    backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


def test_real_node_a_program_not_in_the_image_is_named(kube, real_node):
    backend = KubernetesBackend()
    run_id = "real-no-program"
    cluster = backend.provision(spec_for(), owner_labels(run_id, "real-node"))
    result, lines = run_unit(backend, cluster, ["render-farm", "--all"])
    assert result.exit_code == 127, lines
    said = diagnose(result.exit_code, result.signal, lines)
    assert said is not None and said.message.startswith(
        "the program render-farm is not where the job runs"
    ), (said, lines)
    [pod] = job_pods(kube, cluster.name)
    on_the_real_node(pod, real_node)
    assert terminated(pod)["exitCode"] == 127
    backend.teardown(cluster)
    assert wait_gone(kube, run_id) == []


def test_real_node_a_killed_gpuflow_leaves_a_pod_that_its_deadline_ends_and_reap_removes(
    kube, real_node, prefect_api, gpuflow_home, tmp_path
):
    """gpuflow is SIGKILLed while its pod runs: the Job's activeDeadlineSeconds (from
    limits.max_duration) ends the pod on the real node all the same, and `gpuflow reap`
    removes what is left and marks the run Crashed."""
    from tests.conftest import subprocess_env

    job = tmp_path / "job.yaml"
    job.write_text(
        "name: real-deadline\njob: {kind: command, command: [sleep, '600']}\n"
        f"resources: {{gpus: 1, gpu_product: {PRODUCT}}}\n"
        f"placement: {{backend: kubernetes, image: '{IMAGE}'}}\nlimits: {{max_duration: 45s}}\n"
    )
    env = {**subprocess_env(prefect_api, gpuflow_home), "KUBECONFIG": str(real_node.kubeconfig)}
    gpuflow = [sys.executable, "-m", "gpuflow"]
    orchestrator = subprocess.Popen(
        [*gpuflow, "run", str(job)], env=env, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    watch = PodWatch(kube, "gpuflow.io/job=real-deadline")
    pod = watch.wait(running, 180)
    run_id = pod["metadata"]["labels"]["gpuflow.io/flow-run-id"]
    os.kill(orchestrator.pid, signal.SIGKILL)
    orchestrator.wait(timeout=30)
    name = pod["metadata"]["name"]
    job_path = f"/apis/batch/v1/namespaces/default/jobs/{pod['metadata']['labels']['job-name']}"

    def deadline_exceeded(_w) -> bool:
        conditions = kube.request("GET", job_path)["status"].get("conditions") or []
        return any(c.get("reason") == "DeadlineExceeded" for c in conditions)

    watch.wait(deadline_exceeded, 90)
    # the Job controller deletes the pod, the real kubelet stops its container
    final = watch.wait(lambda w: w.last[name] if name in w.deleted else None, 90)
    watch.stop()
    on_the_real_node(final, real_node)
    assert terminated(final).get("exitCode") in (137, 143), terminated(final)
    reaped = subprocess.run(
        [*gpuflow, "reap", "--backend", "kubernetes"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert reaped.returncode == 0, reaped.stderr
    assert f"deleting gpuflow-{run_id} (its gpuflow died)" in reaped.stdout, reaped.stdout
    assert wait_gone(kube, run_id) == []


def test_real_node_render_chunks_run_blender_in_pods_that_upload_their_frames(
    kube, real_node, pod_s3, prefect_api, gpuflow_home, tmp_path, monkeypatch
):
    """A render on the real node: 8 frames in chunks of 2 over its 2 GPUs; each pod (the job
    image's Blender, as uid 10001) fetches the scene from S3, renders its frames on the CPU
    and uploads them itself over the pod network; the run counts them from the real
    kubelet's logs; the credentials reach the pods through the Secret only."""
    import shutil

    from gpuflow.flows.render import render
    from gpuflow.tasks.render.scene import demo_scene
    from gpuflow.tasks.storage import store_for

    blend = demo_scene(shutil.which("blender"), tmp_path / "cube.blend", 8, 32, None)
    scene = pod_s3.url("scenes/cube.blend")
    store_for(scene, pod_s3.settings()).upload_file(scene, blend)
    for key, value in pod_s3.settings().child_env().items():
        monkeypatch.setenv(key, value)
    output = pod_s3.url("renders/cube")
    spec = {
        "name": "real-render",
        "job": {"kind": "render", "scene": scene, "output": output, "chunk": 2, "device": "CPU"},
        "resources": {"gpus": 2, "gpu_product": PRODUCT},
        "placement": {"backend": "kubernetes", "image": IMAGE},
        "metrics": {"plot": False},
    }
    watch = PodWatch(kube, "gpuflow.io/job=real-render")
    state = render(spec, return_state=True)
    assert state.is_completed(), state.message
    listed = sorted(o.url for o in store_for(output, pod_s3.settings()).list(output))
    assert listed == [f"{output}/frame_{i:04d}.png" for i in range(1, 9)]
    job = state.result().metrics.job
    assert (job["frames_rendered"], job["frames_missing"], job["chunks"]) == (8, 0, 4)
    pods = watch.wait(lambda w: list(w.last.values()) if len(w.deleted) == 4 else None, 120)
    watch.stop()
    for pod in pods:
        on_the_real_node(pod, real_node)
        assert terminated(pod)["exitCode"] == 0, terminated(pod)
        assert pod_s3.secret not in json.dumps(pod)
    run_id = str(state.state_details.flow_run_id)
    assert wait_gone(kube, run_id) == []


def test_real_node_the_runs_samples_come_from_the_node_its_pod_ran_on(
    kube, real_node, prefect_api, gpuflow_home
):
    """On Kubernetes the run's metric samples are taken in the unit's pod, on the node it
    landed on (the job image has gpuflow's sampler), not on the host where the flow runs:
    every sample names the real node, and the pod's log lines stay the job's alone."""
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.metrics.sampler import read_samples
    from tests.e2e.helpers import logs_of

    spec = load_spec(
        {
            "name": "real-samples",
            "job": {"kind": "command", "command": ["sh", "-c", "echo busy; sleep 3; echo idle"]},
            "resources": {"gpus": 1, "gpu_product": PRODUCT},
            "placement": {"backend": "kubernetes", "image": IMAGE},
            "metrics": {"interval_s": 0.5, "plot": False},
        }
    )
    state = gpu_pipeline(spec, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    samples = read_samples(Path(result.artifacts_dir) / "samples.jsonl")
    assert len(samples) >= 4, samples
    assert {s["Hostname"] for s in samples} == {real_node.name}
    assert result.metrics.samples == len(samples)
    lines = logs_of(result.flow_run_id)
    assert any(line.endswith("busy") for line in lines)
    assert not any("@@gpuflow-sample" in line for line in lines)
    assert wait_gone(kube, result.flow_run_id) == []


@dataclass
class FlowPlatform:
    """A platform whose Kubernetes worker (with exactly worker-rbac.yaml's rights) puts flow
    runs in `namespace` on the real node's cluster, where backend-rbac.yaml's `gpuflow`
    account may make unit pods; its Prefect server reachable from the pods."""

    platform: Any
    namespace: str
    kube: KubeApi  # in the namespace
    api_url: str  # the Prefect API as the pods reach it

    def deployment_run(self, spec: dict, **variables: str) -> str:
        """`prefect deployment run gpu-pipeline/command-k8s` of `spec` with these job
        variables; return the run's id."""
        argv = ["deployment", "run", "gpu-pipeline/command-k8s"]
        argv += ["--params", json.dumps({"spec": spec})]
        variables.setdefault("env", json.dumps({"PREFECT_API_URL": self.api_url}))
        for key, value in variables.items():
            argv += ["--job-variable", f"{key}={value}"]
        ran = self.platform.run(sys.executable, "-m", "prefect", *argv)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        return re.search(r"UUID: ([0-9a-f-]{36})", ran.stdout).group(1)

    def pods_said(self, run_id: str) -> str:
        """What the run's flow-run pod printed, else what the worker did: for a failure."""
        said = (self.platform.home / "platform" / "k8s-worker.log").read_text()[-3000:]
        for pod in self.kube.request(
            "GET",
            f"/api/v1/namespaces/{self.namespace}/pods",
            params={"labelSelector": f"prefect.io/flow-run-id={run_id}"},
        )["items"]:
            path = f"/api/v1/namespaces/{self.namespace}/pods/{pod['metadata']['name']}/log"
            said = self.kube.http.get(path).text[-3000:]
        return said

    def messages(self, run_id: str) -> list[str]:
        """The run's log on the Prefect server."""
        from uuid import UUID

        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        with self.platform.client() as client:
            found = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)]))
            return [log.message for log in client.read_logs(found)]


@pytest.fixture(scope="module")
def flow_platform(real_node, tmp_path_factory) -> Iterator[FlowPlatform]:
    from tests.e2e.test_kubernetes import apply, up_with_worker, worker_platform

    with pytest.MonkeyPatch.context() as env:  # as `kube` makes it: its source is the file
        env.setenv("KUBECONFIG", str(real_node.kubeconfig))
        kube = KubeApi(load_config())
    namespace = f"flows-real-{os.urandom(3).hex()}"  # a kept test cluster may have older ones
    kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    for doc in yaml.safe_load_all(
        (ROOT / "infra" / "kubernetes" / "backend-rbac.yaml").read_text()
    ):
        if doc["kind"] != "ClusterRole":  # optional, cluster-wide: not needed to run
            apply(kube, doc, namespace)
    in_namespace = KubeApi(load_config(yaml.safe_load(real_node.kubeconfig.read_text())))
    in_namespace.namespace = namespace
    platform, kubeconfig = worker_platform(kube, namespace, tmp_path_factory.mktemp("flows"))
    try:
        up_with_worker(platform, kubeconfig, IMAGE)
        # the Prefect server listens on this host's loopback: pods reach it at the node's address
        expose = ["bash", str(ROOT / "scripts" / "k8s-testbed.sh"), "expose"]
        expose += ["--dir", str(real_node.testbed), "--port", str(platform.port)]
        subprocess.run(expose, check=True, timeout=60)
        api_url = f"http://{real_node.ip}:{platform.port}/api"
        yield FlowPlatform(platform, namespace, in_namespace, api_url)
    finally:
        down = platform.gpuflow("platform", "down", timeout=120)
        kube.request("DELETE", f"/api/v1/namespaces/{namespace}")
    assert down.returncode == 0, down.stdout + down.stderr


def test_real_node_a_deployment_run_is_a_flow_run_pod_whose_pipeline_makes_its_unit_pods(
    flow_platform, real_node
):
    """`prefect deployment run` of command-k8s on gpuflow's pool: the worker (with exactly
    worker-rbac.yaml's rights) makes the flow-run Job; its pod runs the pipeline from the job
    image on the real node (`prefect flow-run execute` in /opt/gpuflow, prefect.yaml's pull
    step), as the `gpuflow` account of backend-rbac.yaml, in-cluster; that pipeline makes the
    unit's pod on the same node; the unit's output is in the run's log on the Prefect server,
    and the run's own objects are gone at its end."""
    from gpuflow.tasks.platform.pool_template import TEARDOWN_MARGIN_S

    fp = flow_platform
    watch = PodWatch(fp.kube, "gpuflow.io/owner=gpuflow")  # the unit pods, gone at teardown
    watches = [watch]
    try:
        spec = {
            "name": "flow-pod",
            "job": {"kind": "command", "command": ["sh", "-c", 'echo "unit on $GPUFLOW_NODE_NAME as $(id -u)"']},
            "resources": {"gpus": 1, "gpu_product": PRODUCT},
            "placement": {"backend": "kubernetes", "image": IMAGE},
            "limits": {"stop_grace_s": 75},
        }  # fmt: skip
        run_id = fp.deployment_run(
            spec,
            gpu_count="0",  # the flow-run pod only drives the run: its unit holds the GPU
            gpu_product=PRODUCT,
            service_account_name="gpuflow",
        )
        flow_watch = PodWatch(fp.kube, f"prefect.io/flow-run-id={run_id}")
        watches.append(flow_watch)

        state = fp.platform.final_state(run_id, 600)
        assert state is not None and state.is_completed(), f"{state}: {fp.pods_said(run_id)}"

        flow_pod = flow_watch.wait(  # the run is Completed just before its process exits
            lambda w: next((p for p in w.last.values() if terminated(p)), None), 120
        )
        on_the_real_node(flow_pod, real_node)
        assert terminated(flow_pod)["exitCode"] == 0, terminated(flow_pod)
        assert flow_pod["spec"]["serviceAccountName"] == "gpuflow"
        assert flow_pod["spec"]["containers"][0]["args"] == ["prefect", "flow-run", "execute"]
        # the pool's defaults: the run's grace and teardown's; no privileges, and it needs none
        assert flow_pod["spec"]["terminationGracePeriodSeconds"] == 75 + TEARDOWN_MARGIN_S
        assert flow_pod["spec"]["containers"][0]["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
        [unit] = [
            p for p in watch.last.values()
            if p["metadata"]["labels"].get("gpuflow.io/flow-run-id") == run_id
        ]  # fmt: skip
        on_the_real_node(unit, real_node)
        assert terminated(unit)["exitCode"] == 0, terminated(unit)
        assert unit["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert unit["metadata"]["name"] != flow_pod["metadata"]["name"]
        messages = fp.messages(run_id)
        assert any(f"unit on {real_node.name} as 10001" in m for m in messages), messages[-20:]
        assert wait_gone(fp.kube, run_id) == []
    finally:
        for watching in watches:
            watching.stop()


def test_real_node_the_readme_example_runs_in_its_working_folder_fetched_from_staging(
    kube, real_node, pod_s3, prefect_api, gpuflow_home, tmp_path, monkeypatch
):
    """job.workdir with storage.staging in S3: the pod (the job image, uid 10001) fetches
    the archive over the pod network with the credentials of the run's Secret, checks its
    hash, unpacks it in its own workspace, runs the setup and starts train.py there."""
    import shutil

    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.storage import store_for
    from tests.e2e.helpers import logs_of

    folder = tmp_path / "project"
    shutil.copytree(ROOT / "tests" / "fixtures" / "owncode", folder)
    for key, value in pod_s3.settings().child_env().items():
        monkeypatch.setenv(key, value)
    staging = pod_s3.url("staging")
    out = "${GPUFLOW_OUTPUT_DIR}/model.json"
    raw = {
        "name": "real-own-code",
        "job": {
            "kind": "command",
            "command": ["python", "train.py", "--epochs", "3", "--out", out],
            "workdir": str(folder),
            "setup": ["id -u > uid.txt; echo set up as $(cat uid.txt)"],
        },
        "resources": {"gpus": 1, "gpu_product": PRODUCT},
        "placement": {"backend": "kubernetes", "image": IMAGE},
        "storage": {"staging": staging},
        "metrics": {"plot": False},
    }
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    run_id = str(state.state_details.flow_run_id)
    logs = "\n".join(logs_of(run_id))
    assert "set up as 10001" in logs and "epoch 2 loss 0.8333" in logs
    assert "files here: .gitignore,data,ddp.py,train.py,uid.txt" in logs
    model = Path(state.result().artifacts_dir) / "outputs" / "model.json"
    assert json.loads(model.read_text())["epochs"] == 3
    [staged] = store_for(staging, pod_s3.settings()).list(staging)
    assert staged.url.endswith(".tar.gz")  # named by its content, for the next run
    assert pod_s3.settings().secret_access_key.get_secret_value() not in logs
    assert wait_gone(kube, run_id) == []


def test_real_node_pulls_the_runs_private_image_by_digest_from_a_registry(
    kube, real_node, tmp_path, prefect_api, monkeypatch
):
    """The same user image the other backends run (Debian's python3, no gpuflow), from a
    registry behind basic auth: gpuflow pins it by digest, the run's pull Secret carries
    the login, the real node's containerd pulls that digest and the unit runs in it, its
    output comes back; teardown removes the Secret. Without credentials: one sentence,
    nothing made."""
    from gpuflow.blocks import RegistryCredentials
    from gpuflow.tasks.contract import Needs
    from tests.e2e.imagebed import PASSWORD, USER, registry

    if not real_node.testbed.joinpath("real-node", "containerd").is_dir():
        pytest.skip("the real node was started by another test bed (no registry settings)")
    with registry(tmp_path / "registry", images=("py-private",)) as bed:
        for key, value in bed.env.items():  # registries.conf: the registry speaks plain HTTP
            monkeypatch.setenv(key, value)
        hosts = real_node.testbed / "real-node" / "containerd" / "certs.d" / bed.host
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts.toml").write_text(
            f'server = "http://{bed.host}"\n[host."http://{bed.host}"]\n'
            '  capabilities = ["pull", "resolve"]\n'
        )
        RegistryCredentials(registry=bed.host, username=USER, password=PASSWORD).save(
            "real-node-registry", overwrite=True
        )
        ref = bed.ref("py", private=True)
        backend = KubernetesBackend()
        spec = load_spec(
            {
                "name": "real-node-image",
                "image": {"ref": ref, "credentials": "real-node-registry"},
                "job": {"kind": "command", "command": ["true"]},
                "resources": {"gpus": 1, "gpu_product": PRODUCT},
                "placement": {"backend": "kubernetes"},
            }
        )
        said: list[str] = []
        public = spec.image.model_copy(update={"credentials": None})
        with pytest.raises(InvalidSpec) as refused:  # before anything is made
            backend.pin_image(spec.model_copy(update={"image": public}), Needs(), said.append)
        assert "name a RegistryCredentials block in image.credentials" in str(refused.value)
        spec = backend.pin_image(spec, Needs(), said.append)
        assert spec.image.digest and spec.image.digest.startswith("sha256:")
        run_id = "real-image"
        cluster = backend.provision(spec, owner_labels(run_id, "real-node-image"))
        script = (
            'python3 -c "import sys; print(sys.executable)"; cat /etc/debian_version >/dev/null'
        )
        script += ' && echo 7 > "$GPUFLOW_OUTPUT_DIR/r.txt"'
        result, lines = run_unit(backend, cluster, ["sh", "-c", script], timeout_s=300)
        assert result.exit_code == 0, lines
        assert lines[0] == "/usr/bin/python3"
        assert (Path(cluster.workspace) / "outputs" / "r.txt").read_text() == "7\n"
        [pod] = job_pods(kube, cluster.name)
        on_the_real_node(pod, real_node)
        assert pod["spec"]["containers"][0]["image"] == spec.image.pinned
        assert pod["spec"]["imagePullSecrets"] == [{"name": f"{cluster.name}-pull"}]
        assert container(pod)["imageID"].endswith(spec.image.digest)
        assert PASSWORD not in json.dumps(pod)
        backend.teardown(cluster)
        assert wait_gone(kube, run_id) == []
        secrets = kube.request("GET", f"/api/v1/namespaces/{kube.namespace}/secrets")["items"]
        assert f"{cluster.name}-pull" not in {s["metadata"]["name"] for s in secrets}
