"""Kubernetes backend at scale, on the test cluster (scripts/k8s-testbed.sh, KWOK nodes):

- provision -> every pod Running, for 1, 8 and 64 pods (seconds and pods/s);
- `reap --backend kubernetes` of 1,000 owned objects (500 runs' Service + Secret);
- the same 10 s job through gpu_pipeline on the local backend and on Kubernetes (ratio);
- with --real-node (root; the test cluster's real node, containerd + kubelet): a unit pod
  of gpuflow's job image to Running and to its first log line, against a bare Pod of the
  same image and command made straight through the API (what `kubectl run` does), side by
  side, the two alternating.

    python bench/k8s_scale.py [--pods 1,8,64] [--reap-runs 500] [--seconds 10] [--real-node]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", default="1,8,64")
    parser.add_argument("--reap-runs", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--real-node", action="store_true")
    parser.add_argument("--rounds", type=int, default=5, help="real-node pairs (median)")
    args = parser.parse_args()
    os.environ.setdefault("GPUFLOW_HOME", tempfile.mkdtemp(prefix="gpuflow-bench-"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # a timeout's SIGTERM still stops the test cluster (the `finally` below runs)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    folder = Path(tempfile.mkdtemp(prefix="k8s-bench-"))
    script = ROOT / "scripts" / "k8s-testbed.sh"
    if args.real_node:
        subprocess.run(["bash", str(ROOT / "scripts" / "build-image.sh")], check=True)
    up = [
        "bash",
        str(script),
        "up",
        "--dir",
        str(folder),
        *(["--real-node"] if args.real_node else []),
    ]
    subprocess.run(up, check=True)
    os.environ["KUBECONFIG"] = str(folder / "kubeconfig")
    try:
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=120):
            print(f"{'pods':>6}{'to all Running s':>18}{'pods/s':>9}")
            for count in [int(c) for c in args.pods.split(",")]:
                seconds = pods_running(count)
                print(f"{count:6}{seconds:18.2f}{count / seconds:9.1f}")
            seconds = reap_objects(args.reap_runs)
            print(f"reap of {2 * args.reap_runs} owned objects: {seconds:.2f} s")
            local, kube = pipeline_pair(args.seconds)
            print(
                f"{args.seconds:.0f} s job through gpu_pipeline: local {local:.2f} s,"
                f" kubernetes {kube:.2f} s, ratio kubernetes/local {kube / local:.3f}"
            )
            if args.real_node:
                bare, unit = real_node_pair(args.rounds)
                print(
                    f"real node, median of {args.rounds}: {'bare pod':>10}{'gpuflow unit':>14}{'ratio':>8}"
                )
                for what in ("to Running", "to first line"):
                    print(
                        f"  {what + ' s':20}{bare[what]:10.2f}{unit[what]:14.2f}"
                        f"{unit[what] / bare[what]:8.2f}"
                    )
    finally:
        subprocess.run(["bash", str(script), "down", "--dir", str(folder)], check=False)


def pods_running(count: int) -> float:
    """Return seconds from provision to every one of `count` CPU pods Running."""
    from gpuflow.tasks.backends.kubernetes.backend import KubernetesBackend
    from gpuflow.tasks.contract import WorkUnit, owner_labels
    from gpuflow.tasks.kinds import registry  # noqa: F401 - registers the kinds' job models
    from gpuflow.tasks.pipeline.running import run_units
    from gpuflow.tasks.spec import load_spec

    backend = KubernetesBackend()
    spec = load_spec(
        {
            "job": {"kind": "command", "command": ["sleep", "600"]},
            "resources": {"nodes": count},
            "placement": {"backend": "kubernetes"},
        }
    )
    stop = threading.Event()
    started = time.perf_counter()
    cluster = backend.provision(spec, owner_labels(f"scale-{count}", "bench"))
    units = [WorkUnit(name=f"n{i}", command=["sleep", "600"], node=i) for i in range(count)]
    runner = threading.Thread(
        target=run_units,
        args=(backend, cluster, units, {}, 900, lambda u: lambda *_: None, stop.is_set, 0),
    )
    runner.start()
    api = backend.api()
    selector = {"labelSelector": f"gpuflow.io/cluster={cluster.name}"}
    while True:
        pods = api.request("GET", f"/api/v1/namespaces/{api.namespace}/pods", params=selector)
        running = [p for p in pods["items"] if p["status"].get("phase") == "Running"]
        if len(running) == count:
            break
        if not runner.is_alive():
            raise SystemExit(f"the {count} units ended before all ran; see the lines above")
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    stop.set()
    runner.join()
    backend.teardown(cluster)
    return seconds


def reap_objects(runs: int) -> float:
    """Return seconds `reap` takes on Kubernetes over `runs` clusters (Service + Secret each)
    whose flow runs the API does not know."""
    import uuid

    from gpuflow.tasks.backends.kubernetes.backend import KubernetesBackend
    from gpuflow.tasks.backends.kubernetes.manifests import secret
    from gpuflow.tasks.contract import owner_labels
    from gpuflow.tasks.kinds import registry  # noqa: F401 - registers the kinds' job models
    from gpuflow.tasks.platform.reap import reap
    from gpuflow.tasks.spec import load_spec

    backend = KubernetesBackend()
    api = backend.api()
    spec = load_spec(
        {"job": {"kind": "command", "command": ["true"]}, "placement": {"backend": "kubernetes"}}
    )
    for _ in range(runs):
        cluster = backend.provision(spec, owner_labels(str(uuid.uuid4()), "bench"))
        api.request(
            "POST",
            f"/api/v1/namespaces/{api.namespace}/secrets",
            secret(cluster, api.namespace, {"A": "b"}),
        )
    started = time.perf_counter()
    done = reap(False, lambda line: None, "kubernetes")
    seconds = time.perf_counter() - started
    assert done["clusters"] == runs, done
    owned = {"labelSelector": "gpuflow.io/owner=gpuflow"}
    for kind in ("services", "secrets"):
        left = api.request("GET", f"/api/v1/namespaces/{api.namespace}/{kind}", params=owned)
        assert not left["items"], f"{len(left['items'])} {kind} left after the reap"
    return seconds


def pipeline_pair(job_s: float, rounds: int = 3) -> tuple[float, float]:
    """Return the median wall seconds of a `sleep job_s` run on each backend, the two
    alternating so that machine noise hits both (a first, warm-up pair is not counted)."""
    import statistics

    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.kinds import registry  # noqa: F401 - registers the kinds' job models
    from gpuflow.tasks.spec import load_spec

    timings: dict[str, list[float]] = {"local": [], "kubernetes": []}
    for round_ in range(rounds + 1):
        for backend in ("local", "kubernetes"):
            spec = load_spec(
                {
                    "name": "bench",
                    "job": {"kind": "command", "command": ["sleep", str(int(job_s))]},
                    "placement": {"backend": backend},
                    "metrics": {"plot": False},
                }
            )
            started = time.perf_counter()
            state = gpu_pipeline(spec, return_state=True)
            assert state.is_completed(), state.message
            if round_:
                timings[backend].append(time.perf_counter() - started)
    return statistics.median(timings["local"]), statistics.median(timings["kubernetes"])


IMAGE = "gpuflow.local/gpuflow-job:testbed"
REAL_PRODUCT = "NVIDIA-A10G"  # the real node's GPUs (scripts/testbed/real-node.sh)


def _watch_pod(api, selector: str, started: float, out: dict, done: threading.Event) -> None:
    """Record when the first pod of `selector` is Running (polled every 50 ms, the same
    for both sides)."""
    path = f"/api/v1/namespaces/{api.namespace}/pods"
    while not done.is_set() and "to Running" not in out:
        for pod in api.request("GET", path, params={"labelSelector": selector})["items"]:
            if pod["status"].get("phase") == "Running":
                out["to Running"] = time.perf_counter() - started
        time.sleep(0.05)


def real_node_pair(rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Return the median seconds to Running and to the first log line of a bare Pod and of
    a gpuflow unit pod on the real node (same image, same command), alternating."""
    import statistics

    from gpuflow.tasks.backends.kubernetes.backend import KubernetesBackend
    from gpuflow.tasks.backends.kubernetes.kubeapi import KubeError
    from gpuflow.tasks.contract import WorkUnit, owner_labels
    from gpuflow.tasks.kinds import registry  # noqa: F401 - registers the kinds' job models
    from gpuflow.tasks.spec import load_spec

    backend = KubernetesBackend()
    api = backend.api()
    command = ["sh", "-c", "echo first; sleep 2"]
    spec = load_spec(
        {
            "job": {"kind": "command", "command": command},
            "resources": {"gpus": 1, "gpu_product": REAL_PRODUCT},
            "placement": {"backend": "kubernetes", "image": IMAGE},
        }
    )
    bare: dict[str, list[float]] = {"to Running": [], "to first line": []}
    unit: dict[str, list[float]] = {"to Running": [], "to first line": []}
    for round_ in range(rounds + 1):  # the first pair warms both up and is not counted
        name = f"bare-{round_}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"bench": name}},
            "spec": {
                "restartPolicy": "Never",
                "nodeSelector": {"nvidia.com/gpu.product": REAL_PRODUCT},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                "containers": [
                    {
                        "name": "bare",
                        "image": IMAGE,
                        "command": command,
                        "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    }
                ],
            },
        }
        seen: dict[str, float] = {}
        done = threading.Event()
        started = time.perf_counter()
        api.request("POST", f"/api/v1/namespaces/{api.namespace}/pods", pod)
        watcher = threading.Thread(
            target=_watch_pod, args=(api, f"bench={name}", started, seen, done)
        )
        watcher.start()
        log = f"/api/v1/namespaces/{api.namespace}/pods/{name}/log"
        while "to first line" not in seen:
            try:
                for _ in api.stream(log, {"follow": "true"}):
                    seen["to first line"] = time.perf_counter() - started
                    break
            except KubeError:  # not started yet: the kubelet has no log to serve
                time.sleep(0.05)
        watcher.join()
        api.request(
            "DELETE", f"/api/v1/namespaces/{api.namespace}/pods/{name}", {"gracePeriodSeconds": 0}
        )
        mine: dict[str, float] = {}
        done = threading.Event()
        started = time.perf_counter()
        cluster = backend.provision(spec, owner_labels(f"bench-real-{round_}", "bench"))

        def first_line(_stream: str, _line: str, out: dict = mine, t0: float = started) -> None:
            out.setdefault("to first line", time.perf_counter() - t0)

        watcher = threading.Thread(
            target=_watch_pod,
            args=(api, f"gpuflow.io/cluster={cluster.name}", started, mine, done),
        )
        watcher.start()
        backend.run(cluster, WorkUnit(name="main", command=command), {}, 120, first_line)
        done.set()
        watcher.join()
        backend.teardown(cluster)
        if round_:
            for what in bare:
                bare[what].append(seen[what])
                unit[what].append(mine[what])
    return (
        {k: statistics.median(v) for k, v in bare.items()},
        {k: statistics.median(v) for k, v in unit.items()},
    )


if __name__ == "__main__":
    main()
