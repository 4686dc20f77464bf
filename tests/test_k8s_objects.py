"""The Kubernetes objects a run makes, why a pod is pending, and the API's refusals as one
sentence. Pure: no API server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from gpuflow.tasks.backends.kubernetes.kubeapi import refusal
from gpuflow.tasks.backends.kubernetes.manifests import (
    KubeSettings,
    mpi_job,
    secret,
    service,
    unit_job,
)
from gpuflow.tasks.backends.kubernetes.pending import explain_pending, used_gpus
from gpuflow.tasks.contract import Cluster, MpiLaunch, WorkUnit, owner_labels

RUN = "5b0c9c2e-58a4-4d43-9d7e-2f0f4a3a1b11"

ROOT = Path(__file__).resolve().parents[1]


def cluster(gpus: int = 8, nodes: int = 2) -> Cluster:
    name = f"gpuflow-{RUN}"
    return Cluster(
        backend="kubernetes",
        name=name,
        owner=owner_labels(RUN, "big-train"),
        hostname=f"{name}-0",
        workspace="/workspace",
        gpu_indices=list(range(gpus)),
        nodes=nodes,
        created_at=datetime.now(UTC),
    )


def test_a_unit_job_asks_for_its_gpus_product_and_limits_on_the_object():
    settings = KubeSettings(
        namespace="ml",
        image="registry.example/gpuflow:1.0",
        gpu_product="NVIDIA-H100-80GB-HBM3",
        queue_name="team-a",
        priority_class_name="batch-high",
        shm_bytes=8 * 2**30,
    )
    unit = WorkUnit(
        name="node-1", command=[sys.executable, "-m", "gpuflow.tasks.training.launch"], node=1
    )
    job = unit_job(cluster(), unit, settings, deadline_s=3600)
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert (
        job["spec"]["activeDeadlineSeconds"] == 3600 and job["spec"]["ttlSecondsAfterFinished"] > 0
    )
    assert job["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert pod["priorityClassName"] == "batch-high"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["metadata"]["labels"]["gpuflow.io/flow-run-id"] == RUN
    assert pod["hostname"] == f"gpuflow-{RUN}-1" and pod["subdomain"] == f"gpuflow-{RUN}"
    assert container["args"][:3] == ["python", "-m", "gpuflow.tasks.training.launch"]  # the image's
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": str(8 * 2**30)}
    assert container["envFrom"] == [{"secretRef": {"name": f"gpuflow-{RUN}-env"}}]


@pytest.mark.parametrize(
    ("settings", "grace", "token", "security"),
    [
        # defaults: the run's grace, no API token, no privileges to gain
        (
            KubeSettings(stop_grace_s=45),
            45,
            False,
            {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        ),
        # a fraction of a second is rounded up; zero would mean SIGKILL at once
        (KubeSettings(stop_grace_s=0.2), 1, False, {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}),
        (KubeSettings(stop_grace_s=90.5), 91, False, {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}),
        # a block that names an account mounts its token; one that allows privileges
        # leaves the runtime's defaults
        (KubeSettings(service_account="trainer"), 30, True, {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}),
        (KubeSettings(allow_privilege_escalation=True), 30, False, None),
    ],
)  # fmt: skip
def test_unit_pods_get_the_runs_grace_no_token_and_no_privileges(settings, grace, token, security):
    pod = unit_job(cluster(), WorkUnit(name="main", command=["true"]), settings, 60)["spec"][
        "template"
    ]["spec"]
    assert pod["terminationGracePeriodSeconds"] == grace
    assert pod["automountServiceAccountToken"] is token
    assert pod.get("serviceAccountName") == settings.service_account
    assert pod["containers"][0].get("securityContext") == security


def test_the_grace_comes_from_the_specs_stop_grace_and_the_rest_from_the_block():
    from gpuflow.blocks.kubernetes_pool import KubernetesGpuPool
    from gpuflow.tasks.backends.kubernetes.backend import KubernetesBackend
    from gpuflow.tasks.spec import load_spec

    backend = KubernetesBackend(block="team")  # the block as read, no API asked
    backend.pool = KubernetesGpuPool(service_account="trainer", allow_privilege_escalation=True)
    backend._api = type("Api", (), {"namespace": "ml"})()  # type: ignore[assignment]
    spec = load_spec(
        {
            "name": "g",
            "job": {"kind": "command", "command": ["true"]},
            "limits": {"stop_grace_s": 75},
            "placement": {"backend": "kubernetes"},
        }
    )
    settings = backend.settings(spec)
    assert settings.stop_grace_s == 75
    assert settings.service_account == "trainer" and settings.allow_privilege_escalation


def test_a_cpu_unit_asks_for_no_gpu_and_tolerates_nothing():
    unit = WorkUnit(name="main", command=["echo", "hi"], gpus=[])
    pod = unit_job(cluster(gpus=0, nodes=1), unit, KubeSettings(gpu_product="NVIDIA-L4"), 60)
    pod = pod["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
    assert pod["tolerations"] == [] and "nodeSelector" not in pod


def test_each_node_of_a_run_is_a_machine_of_its_own():
    """Node 1's pod may not share a machine with a GPU pod of the same cluster standing for
    another node; a one-node run and a CPU unit are placed freely."""
    unit = WorkUnit(name="node-1", command=["true"], node=1)
    job = unit_job(cluster(gpus=8, nodes=2), unit, KubeSettings(), 60)
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["template"]["metadata"]["labels"]["gpuflow.io/node"] == "1"
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"] == {
        "matchLabels": {"gpuflow.io/cluster": f"gpuflow-{RUN}"},
        "matchExpressions": [
            {"key": "gpuflow.io/node", "operator": "Exists"},
            {"key": "gpuflow.io/node", "operator": "NotIn", "values": ["1"]},
        ],
    }
    one = unit_job(cluster(gpus=8, nodes=1), unit, KubeSettings(), 60)["spec"]["template"]
    cpu = unit.model_copy(update={"gpus": []})
    apart = unit_job(cluster(gpus=8, nodes=2), cpu, KubeSettings(), 60)["spec"]["template"]
    assert "affinity" not in one["spec"] and "affinity" not in apart["spec"]


def test_secrets_live_in_the_secret_never_in_a_manifest():
    token = "s3cr3t-value-7f1e"
    env = {"HF_TOKEN": token, "AWS_SECRET_ACCESS_KEY": token + "x"}
    job = unit_job(cluster(), WorkUnit(name="main", command=["true"]), KubeSettings(), 60)
    assert token not in json.dumps(job) and token not in json.dumps(service(cluster(), "ml"))
    assert secret(cluster(), "ml", env)["stringData"] == env


def test_the_service_is_headless_and_carries_the_cluster_record():
    made = service(cluster(), "ml")
    assert made["spec"]["clusterIP"] == "None" and made["spec"]["publishNotReadyAddresses"]
    record = json.loads(made["metadata"]["annotations"]["gpuflow.io/cluster-json"])
    assert record["nodes"] == 2 and record["name"] == f"gpuflow-{RUN}"


def node(name: str, gpus: int, product: str | None) -> dict:
    labels = {"nvidia.com/gpu.product": product} if product else {}
    allocatable = {"cpu": "64", "nvidia.com/gpu": str(gpus)} if gpus else {"cpu": "64"}
    return {"metadata": {"name": name, "labels": labels}, "status": {"allocatable": allocatable}}


NODES = [
    node("gpu-h100-0", 8, "NVIDIA-H100-80GB-HBM3"),
    node("gpu-h100-1", 8, "NVIDIA-H100-80GB-HBM3"),
    node("gpu-l4-0", 4, "NVIDIA-L4"),
    node("cpu-0", 0, None),
]
SCHEDULER = (
    "0/4 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, 3 Insufficient"
    " nvidia.com/gpu. preemption: 0/4 nodes are available: 4 No preemption victims found."
)


@pytest.mark.parametrize(
    "gpus, product, used, expected, verdict",
    [
        (
            16,
            "NVIDIA-H100-80GB-HBM3",
            {},
            "needs 16 x nvidia.com/gpu on NVIDIA-H100-80GB-HBM3; the largest node has 8 in all;"
            " lower resources.gpus or use 2 nodes (resources.nodes) of 8 GPUs.",
            "never",
        ),
        (
            1,
            "NVIDIA-A100-SXM4-80GB",
            {},
            "no node has NVIDIA-A100-SXM4-80GB GPUs (the nodes offer: NVIDIA-H100-80GB-HBM3,"
            " NVIDIA-L4); set resources.gpu_product to one of them or leave it out.",
            "never",
        ),
        (
            8,
            "NVIDIA-H100-80GB-HBM3",
            {"gpu-h100-0": 8, "gpu-h100-1": 4},
            "needs 8 x nvidia.com/gpu on NVIDIA-H100-80GB-HBM3; the most free on any such node"
            " now is 4 (the rest are busy); waiting for GPUs to free up.",
            "busy",
        ),
        (
            2,
            None,
            {},
            "the scheduler cannot place it yet: 0/4 nodes are available: 1 node(s) didn't match"
            " Pod's node affinity/selector, 3 Insufficient nvidia.com/gpu.",
            "unclear",
        ),
    ],
)
def test_pending_is_explained_in_one_sentence(gpus, product, used, expected, verdict):
    assert explain_pending(gpus, product, NODES, used, SCHEDULER) == (expected, verdict)


def test_a_cluster_without_gpu_nodes_says_so():
    sentence, verdict = explain_pending(1, None, [node("cpu-0", 0, None)], {}, SCHEDULER)
    assert sentence.startswith("the cluster has no node with nvidia.com/gpu") and verdict == "never"


def test_gpus_in_use_count_bound_unfinished_pods_only():
    def pod(node_name, gpus, phase):
        limits = {"nvidia.com/gpu": str(gpus)}
        return {
            "spec": {"nodeName": node_name, "containers": [{"resources": {"limits": limits}}]},
            "status": {"phase": phase},
        }

    pods = [
        pod("a", 4, "Running"),
        pod("a", 2, "Pending"),
        pod("a", 8, "Succeeded"),
        pod(None, 8, "Pending"),
    ]
    assert used_gpus(pods) == {"a": 6}


def test_an_rbac_refusal_names_the_verb_the_resource_and_the_namespace():
    body = {
        "kind": "Status",
        "reason": "Forbidden",
        "message": 'jobs.batch is forbidden: User "system:serviceaccount:ml:gpuflow" cannot create'
        ' resource "jobs" in API group "batch" in the namespace "ml"',
        "details": {"group": "batch", "kind": "jobs"},
    }
    error = refusal("POST", "/apis/batch/v1/namespaces/ml/jobs", httpx.Response(403, json=body))
    text = str(error)
    assert text.startswith(
        "Kubernetes refused to create jobs in namespace ml for these credentials"
    )
    assert error.status == 403 and text.count(". ") == 0


def test_an_mpi_launcher_becomes_an_mpijob_of_one_worker_per_node():
    from gpuflow.tasks.backends.kubernetes.mpijob import problems

    settings = KubeSettings(
        namespace="ml", gpu_product="NVIDIA-H100-80GB-HBM3", queue_name="team-a", shm_bytes=2**30
    )
    launcher = WorkUnit(
        name="launcher",
        command=[sys.executable, "-m", "gpuflow.tasks.hpc.launch", "--job-json", "{}"],
        launcher=MpiLaunch(hostfile="a slots=8\nb slots=8\n"),
    )
    job = mpi_job(cluster(gpus=8, nodes=2), launcher, settings, deadline_s=600, slots=8)
    assert problems(job) == []
    assert len(job["metadata"]["name"]) + len("-launcher-xxxxx") <= 63
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["metadata"]["labels"]["gpuflow.io/flow-run-id"] == RUN
    assert job["spec"]["slotsPerWorker"] == 8
    assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == 600
    replicas = job["spec"]["mpiReplicaSpecs"]
    worker, head = replicas["Worker"]["template"]["spec"], replicas["Launcher"]["template"]["spec"]
    assert replicas["Worker"]["replicas"] == 2 and replicas["Launcher"]["replicas"] == 1
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert worker["containers"][0]["command"] == ["/usr/sbin/sshd", "-De"]
    assert worker["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {v["name"]: v for v in worker["volumes"]}["dshm"]["emptyDir"]["medium"] == "Memory"
    assert head["containers"][0]["args"][:3] == ["python", "-m", "gpuflow.tasks.hpc.launch"]
    assert "nvidia.com/gpu" not in head["containers"][0]["resources"]["limits"]
    assert {"name": "GPUFLOW_MPI_HOSTFILE", "value": "/etc/mpi/hostfile"} in head["containers"][0][
        "env"
    ]
    # one worker per machine, whatever a machine has free; the launcher goes anywhere
    (term,) = worker["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"] == {
        "matchLabels": {"gpuflow.io/cluster": f"gpuflow-{RUN}"},
        "matchExpressions": [
            {"key": "training.kubeflow.org/job-role", "operator": "In", "values": ["worker"]}
        ],
    }
    assert "affinity" not in head
    for pod in (worker, head):  # the operator names the pods and mounts root's SSH keys
        assert "hostname" not in pod and "subdomain" not in pod
        assert pod["securityContext"] == {"runAsUser": 0}
        assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": f"gpuflow-{RUN}-env"}}]


NONCE = "f00dfeed"  # the run's nonce, as the pod's Secret gives it


def _sampling_follower(tmp_path, said: list[str]):
    """Return a follower of a wrapped unit's log with the run's nonce: the job's lines go
    to `said`, the node's samples to tmp_path/node.jsonl, output files to tmp_path/back."""
    from gpuflow.tasks.backends.kubernetes.logs import LogFollower

    return LogFollower(
        None,
        lambda _stream, line: said.append(line),
        tmp_path / "back",
        tmp_path / "node.jsonl",
        nonce=NONCE,
    )


def _wrapped(tmp_path, *program: str, **env: str) -> subprocess.Popen:
    from gpuflow.tasks.backends.kubernetes.manifests import UNIT_WRAPPER

    return subprocess.Popen(
        ["/bin/sh", "-c", UNIT_WRAPPER, "gpuflow-unit", *program],
        env={
            "PATH": os.environ["PATH"],
            "GPUFLOW_OUTPUT_DIR": str(tmp_path / "out"),
            "GPUFLOW_LOG_NONCE": NONCE,
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_unit_wrapper_keeps_the_exit_code_and_sends_the_outputs_back(tmp_path):
    """What every pod runs around its unit, run here with this host's sh: the unit's lines,
    then its output files as lines the orchestrator turns back into files."""
    from gpuflow.tasks.backends.kubernetes.logs import LogFollower

    out = tmp_path / "out"
    (out / "sub dir").mkdir(parents=True)
    (out / "result.json").write_text('{"samples_per_s": 812.5}')
    (out / "sub dir" / "error.txt").write_text("CUDA out of memory at step 3\n")
    (out / "weights.bin").write_bytes(bytes(range(256)) * 4097)  # just over 1 MiB
    proc = _wrapped(tmp_path, "sh", "-c", "echo training; exit 3")
    lines = proc.communicate(timeout=60)[0].splitlines()
    assert proc.returncode == 3  # the unit's own code
    assert lines[0] == "training"
    said: list[tuple[str, str]] = []
    follower = LogFollower(
        None, lambda stream, line: said.append((stream, line)), tmp_path / "back", nonce=NONCE
    )
    for line in lines[1:]:
        follower._receive(line)
    back = tmp_path / "back"
    assert (back / "result.json").read_text() == '{"samples_per_s": 812.5}'
    assert (back / "sub dir" / "error.txt").read_text() == "CUDA out of memory at step 3\n"
    assert not (back / "weights.bin").exists()
    assert said == [
        (
            "stderr",
            "outputs/weights.bin (1.0 MiB) stayed in the pod: files over 1024 KiB come back"
            " only from storage (write them to your job's output URL)",
        )
    ]
    follower._receive(f"@@gpuflow-output-{NONCE} ../../etc/cron.d/x aGk=")  # climbs out
    assert said[-1] == (
        "stderr",
        "outputs/../../etc/cron.d/x was not taken: it would land outside outputs",
    )
    assert not (tmp_path / "etc").exists()


def test_the_unit_wrapper_samples_the_node_beside_the_unit_into_its_log(tmp_path):
    """With GPUFLOW_SAMPLE_INTERVAL the wrapper runs gpuflow's sampler beside the unit: its
    samples are log lines (named after the pod's node) the follower writes to the node's
    samples file, never to the run's log; the last one comes after the unit ended. Without
    gpuflow in the image the sampler is silently absent and the unit runs all the same."""

    sampling = {
        "GPUFLOW_SAMPLE_INTERVAL": "0.1",
        "GPUFLOW_SAMPLE_GPUS": "",
        "GPUFLOW_NODE_NAME": "gpu-node-7",
        "GPUFLOW_PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
    }
    proc = _wrapped(tmp_path, "sh", "-c", "echo working; sleep 1; echo done", **sampling)
    lines = proc.communicate(timeout=60)[0].splitlines()
    assert proc.returncode == 0
    said: list[str] = []
    follower = _sampling_follower(tmp_path, said)
    for line in lines:
        follower._line(line)
    assert said == ["working", "done"]
    samples = [json.loads(line) for line in (tmp_path / "node.jsonl").read_text().splitlines()]
    assert len(samples) >= 3 and {s["Hostname"] for s in samples} == {"gpu-node-7"}
    follower._line(f"@@gpuflow-sample-{NONCE} {{torn")  # half a line: dropped, not the run's
    assert said == ["working", "done"] and len(
        (tmp_path / "node.jsonl").read_text().splitlines()
    ) == len(samples)
    # a job that prints without a newline (a progress bar) while a sample is written: the
    # sample lands inside the job's line; it is kept, and the job's text stays the job's
    go = tmp_path / "go"  # made once a sample is in the job's line
    script = f"printf 'step 1/2'; until [ -e {go} ]; do sleep 0.05; done; echo ' done'"
    proc = _wrapped(tmp_path, "sh", "-c", script, **sampling)
    lines = []
    for raw in proc.stdout:  # a sample may come before the job's text
        lines.append(raw.rstrip("\n"))
        if raw.startswith("step"):
            break
    go.touch()
    assert lines[-1].startswith(f"step 1/2@@gpuflow-sample-{NONCE} {{")
    lines += proc.communicate(timeout=60)[0].splitlines()
    said.clear()
    kept = len((tmp_path / "node.jsonl").read_text().splitlines())
    for line in lines:
        follower._line(line)
    assert said == ["step 1/2", " done"]
    taken = (tmp_path / "node.jsonl").read_text().splitlines()[kept:]
    assert taken and {json.loads(line)["Hostname"] for line in taken} == {"gpu-node-7"}
    follower._line(f"echo @@gpuflow-sample-{NONCE} {{not a sample")  # the mark in job text
    assert said[-1] == f"echo @@gpuflow-sample-{NONCE} {{not a sample"
    nested = f"@@gpuflow-sample-{NONCE} " + "[" * 100_000  # deeper than json parses
    follower._line(f"x{nested}")
    follower._line(nested)  # and at a line's start: dropped, as a torn sample is
    assert said[-1] == f"x{nested}"
    no_gpuflow = {**sampling, "GPUFLOW_PYTHON": "/nonexistent/python"}
    proc = _wrapped(tmp_path, "sh", "-c", "echo alone", **no_gpuflow)
    assert proc.communicate(timeout=60)[0].splitlines() == ["alone"]
    assert proc.returncode == 0


def test_the_unit_wrapper_passes_sigterm_to_the_unit(tmp_path):
    """A pod's SIGTERM (preemption, deletion) reaches the unit, which checkpoints and exits
    75; the wrapper exits with that code."""
    proc = _wrapped(
        tmp_path,
        "sh",
        "-c",
        "trap 'echo saving; exit 75' TERM; echo started; while :; do sleep 0.1; done",
    )
    assert proc.stdout.readline() == "started\n"
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=30)[0]
    assert proc.returncode == 75
    assert rest.splitlines() == ["saving"]


def test_output_lines_of_the_wrong_shape_and_odd_file_names_lose_nothing(tmp_path):
    """A unit printing marker-like lines of its own, or an output whose name holds a
    newline: those lines stay ordinary log lines, the good files still come back, and the
    wrapper says nothing on stderr."""
    from gpuflow.tasks.backends.kubernetes.logs import LogFollower

    out = tmp_path / "out"
    out.mkdir()
    (out / "a\nb").write_text("x")
    (out / "result.json").write_text('{"k": 1}')
    proc = _wrapped(
        tmp_path, "sh", "-c", "echo '@@gpuflow-output justaname'; echo '@@gpuflow-output-left n x'"
    )
    stdout, stderr = proc.communicate(timeout=60)
    assert stderr == ""
    said: list[tuple[str, str]] = []
    follower = LogFollower(
        None, lambda stream, line: said.append((stream, line)), tmp_path / "back", nonce=NONCE
    )
    for line in stdout.splitlines():
        follower._line(line)
    assert said == [
        ("stdout", "@@gpuflow-output justaname"),
        ("stdout", "@@gpuflow-output-left n x"),
    ]
    assert [p.name for p in (tmp_path / "back").iterdir()] == ["result.json"]


def test_a_job_cannot_print_a_record_of_the_wrapper_s(tmp_path):
    """The run's nonce is taken out of the unit's environment before it starts: a job that
    prints records as the wrapper does (the mark alone, a nonce it guessed, or a record it
    copied from another run's log) writes no file and adds no sample; its lines are its
    own. A Sample or output from the wrapper, with the nonce, still counts."""

    spoof = (
        'env | grep -c GPUFLOW_LOG_NONCE; echo "$GPUFLOW_LOG_NONCE";'
        " echo '@@gpuflow-output result.json eyJ4IjogMX0=';"
        " echo '@@gpuflow-output-0ther result.json eyJ4IjogMX0=';"
        """ echo '@@gpuflow-sample-0ther {"t": 1, "gpus": []}';"""
        ' echo \'{"real": 1}\' > "$GPUFLOW_OUTPUT_DIR/result.json"'
    )
    proc = _wrapped(tmp_path, "sh", "-c", spoof)
    stdout, _ = proc.communicate(timeout=60)
    said: list[str] = []
    follower = _sampling_follower(tmp_path, said)
    for line in stdout.splitlines():
        follower._line(line)
    assert said == [
        "0",
        "",
        "@@gpuflow-output result.json eyJ4IjogMX0=",
        "@@gpuflow-output-0ther result.json eyJ4IjogMX0=",
        '@@gpuflow-sample-0ther {"t": 1, "gpus": []}',
    ]
    assert json.loads((tmp_path / "back" / "result.json").read_text()) == {"real": 1}
    assert not (tmp_path / "node.jsonl").exists()


def test_an_api_server_that_answers_429_is_asked_again_after_its_retry_after():
    """A server just started answers 429 while its storage initializes: the request (a POST
    too: a 429 was not taken) is made again after Retry-After, and its answer returned."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from gpuflow.tasks.backends.kubernetes.kubeapi import KubeApi, KubeConfig

    seen: list[str] = []

    class Busy(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.command)
            busy = len(seen) <= 2
            body = json.dumps(
                {"reason": "TooManyRequests", "message": "storage is (re)initializing"}
                if busy
                else {"kind": "Job", "metadata": {"name": "made"}}
            ).encode()
            self.send_response(429 if busy else 201)
            if busy:
                self.send_header("Retry-After", "1")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = KubeConfig(server=f"http://127.0.0.1:{server.server_port}", source="a test")
        made = KubeApi(config).request("POST", "/apis/batch/v1/namespaces/default/jobs", {})
    finally:
        server.shutdown()
        server.server_close()
    assert made["metadata"]["name"] == "made" and seen == ["POST"] * 3


def test_more_nodes_than_machines_is_never():
    """Each node of a run is a machine of its own: 3 nodes of 8 H100 on a cluster of two
    such machines can never be placed, however many GPUs are free."""
    sentence, verdict = explain_pending(8, "NVIDIA-H100-80GB-HBM3", NODES, {}, SCHEDULER, 3)
    assert verdict == "never"
    assert sentence == (
        "needs 3 nodes with 8 x nvidia.com/gpu each on NVIDIA-H100-80GB-HBM3; the cluster has"
        " 2 such node(s); lower resources.nodes to 2 or add nodes."
    )
    assert explain_pending(4, "NVIDIA-H100-80GB-HBM3", NODES, {}, SCHEDULER, 2)[1] == "unclear"
