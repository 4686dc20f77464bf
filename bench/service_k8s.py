"""A service on the Kubernetes test cluster (scripts/k8s-testbed.sh; KWOK's nodes, so no
image is pulled and no program starts: what is measured is gpuflow's and the control
plane's part), its HPA reading DCGM_FI_DEV_GPU_UTIL through the custom metrics API from
a real Prometheus (scrape every 1 s) that this script feeds as dcgm-exporter would:

1. Cold start: the run's start to the Deployment's first ready replica.
2. The HPA's reaction to a load step (target 60 %): each ready pod's GPU from 30 % to
   95 %: seconds until 3 replicas are wanted; to 10 %: until 1 (stabilisation window 0).
   The controller-manager's HPA sync period is 2 s here (15 s by default).

    python bench/service_k8s.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from uuid import UUID

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TESTBED = str(ROOT / "scripts" / "k8s-testbed.sh")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-bench-k8s-service-"))
    os.environ.update(
        GPUFLOW_HOME=str(scratch / "home"),
        KUBECONFIG=str(scratch / "bed" / "kubeconfig"),
        PREFECT_LOGGING_LEVEL="WARNING",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    started = []
    try:
        subprocess.run(
            ["bash", TESTBED, "up", "--dir", str(scratch / "bed"), "--no-mpi-operator"], check=True
        )
        gateway, prometheus = _prometheus(scratch, started)
        subprocess.run(
            ["bash", TESTBED, "adapter", "--dir", str(scratch / "bed"), "--prometheus", prometheus],
            check=True,
        )
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=120):
            rows = [_round(gateway) for _ in range(args.rounds)]
    finally:
        for proc in started:
            proc.terminate()
        subprocess.run(["bash", TESTBED, "down", "--dir", str(scratch / "bed")], check=False)
    for name, index in (
        ("cold start, run start to the first ready replica", 0),
        ("HPA: 30 -> 95 % until 3 replicas wanted", 1),
        ("HPA: 95 -> 10 % until 1 replica wanted", 2),
    ):
        values = [row[index] for row in rows]
        print(
            f"{name:<52} min {min(values):5.1f} s, median {statistics.median(values):5.1f} s,"
            f" max {max(values):5.1f} s ({len(values)} rounds)"
        )


def _round(gateway: str) -> tuple[float, float, float]:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.backends.kubernetes.kubeapi import KubeApi, load_config
    from gpuflow.tasks.spec import load_spec
    from tests.e2e.test_service_kubernetes import APPS, _seen, pods, push_utilisation, spec

    kube = KubeApi(load_config())
    began = time.monotonic()
    runner = threading.Thread(
        target=lambda: gpu_pipeline(load_spec(spec()), return_state=True), daemon=True
    )
    runner.start()
    util, stop = {"now": 30.0}, threading.Event()

    def deployment() -> dict:
        found = kube.request("GET", APPS, params={"labelSelector": "gpuflow.io/job=k8s-service"})
        items = [i for i in found["items"] if not i["metadata"].get("deletionTimestamp")]
        return items[0] if items else {}

    def until(condition, what: str) -> float:
        deadline = time.monotonic() + 300
        while not condition():
            if time.monotonic() > deadline:
                stop.set()
                raise SystemExit(f"the bench waited too long for {what}: {_seen(kube)}")
            time.sleep(0.1)
        return time.monotonic()

    first = until(lambda: deployment().get("status", {}).get("readyReplicas", 0) >= 1, "a replica")
    first -= began
    name = deployment()["metadata"]["name"]

    def dcgm() -> None:
        while not stop.is_set():
            for pod in pods(kube, name):
                push_utilisation(gateway, pod, util["now"])
            stop.wait(1.0)

    threading.Thread(target=dcgm, daemon=True).start()
    time.sleep(3)  # the 30 % reading in place
    util["now"], step = 95.0, time.monotonic()
    up = until(lambda: deployment()["spec"]["replicas"] == 3, "3 replicas wanted") - step
    until(lambda: deployment().get("status", {}).get("readyReplicas", 0) == 3, "3 ready")
    time.sleep(3)
    util["now"], step = 10.0, time.monotonic()
    down = until(lambda: deployment()["spec"]["replicas"] == 1, "1 replica wanted") - step
    stop.set()
    run_id = deployment()["metadata"]["labels"]["gpuflow.io/flow-run-id"]
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(UUID(run_id), Cancelling(), force=True)
    runner.join(timeout=120)
    until(lambda: not deployment(), "the Deployment gone")
    print(f"round: first {first:.1f} s, up {up:.1f} s, down {down:.1f} s", file=sys.stderr)
    return first, up, down


def _prometheus(scratch: Path, started: list) -> tuple[str, str]:
    """Start a Pushgateway and a Prometheus scraping it every second; return their URLs."""
    from tests.conftest import free_port

    gateway_port, prometheus_port = free_port(), free_port()
    gateway = shutil.which("prometheus-pushgateway") or "pushgateway"
    started.append(
        subprocess.Popen(
            [gateway, f"--web.listen-address=127.0.0.1:{gateway_port}", "--persistence.file="],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )
    config = scratch / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: pushgateway\n"
        f"    honor_labels: true\n    static_configs: [{{targets: ['127.0.0.1:{gateway_port}']}}]\n"
    )
    started.append(
        subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={scratch / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prometheus_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )
    url = f"http://127.0.0.1:{prometheus_port}"
    for address in (f"http://127.0.0.1:{gateway_port}/-/ready", f"{url}/-/ready"):
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(address, timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{address} did not answer") from None
                time.sleep(0.1)
    return f"http://127.0.0.1:{gateway_port}", url


if __name__ == "__main__":
    main()
