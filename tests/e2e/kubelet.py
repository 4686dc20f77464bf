"""A kubelet played by a test, for the testbed's namespace gpuflow-kubelet (where KWOK
leaves pods running, scripts/testbed/kwok/pod-complete.yaml): each pod the scheduler put
on a node and KWOK marked Running has its container run here (the container's command and
args, the image's python being this one, its env and its Secret's), what it prints served
as the pod's log through KWOK (a Logs object named after the pod: the real log API path),
and how it ended written into the pod's status. A pod being deleted, or gone, gets SIGTERM."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpuflow.tasks.backends.kubernetes.kubeapi import KubeApi, KubeError

NAMESPACE = "gpuflow-kubelet"
ROOT = Path(__file__).resolve().parents[2]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class PlayedKubelet:
    def __init__(self, kube: KubeApi, folder: Path) -> None:
        self.kube, self.folder = kube, folder
        self.pods: dict[str, dict[str, Any]] = {}  # name -> the pod as first run
        self.exits: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> PlayedKubelet:
        with contextlib.suppress(KubeError):  # there from an earlier test
            self.kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        self.folder.mkdir(parents=True, exist_ok=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping = True
        self.thread.join(timeout=10)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    def _watch(self) -> None:
        path = f"/api/v1/namespaces/{NAMESPACE}/pods"
        while not self.stopping:
            with contextlib.suppress(KubeError):
                listed = self.kube.request("GET", path)["items"]
                for pod in listed:
                    name = pod["metadata"]["name"]
                    running = pod["status"].get("phase") == "Running"
                    if running and name not in self.pods:
                        self.pods[name] = pod
                        threading.Thread(target=self._run, args=(pod,), daemon=True).start()
                    proc = self.procs.get(name)
                    if pod["metadata"].get("deletionTimestamp") and proc and proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                # a pod deleted at once (KWOK does not wait for a kubelet): its container
                # is stopped all the same, as a kubelet stops the containers of a pod gone
                present = {pod["metadata"]["name"] for pod in listed}
                for name, proc in list(self.procs.items()):
                    if name not in present and proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)

    def _env(self, container: dict[str, Any], place: Path) -> dict[str, str]:
        env = {"PATH": os.environ["PATH"], "HOME": str(place), "LANG": "C.UTF-8"}
        for source in container.get("envFrom") or []:
            name = source["secretRef"]["name"]
            secret = self.kube.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{name}")
            for key, value in (secret.get("data") or {}).items():
                env[key] = base64.b64decode(value).decode()
        env.update({e["name"]: e.get("value", "") for e in container.get("env") or []})
        # the pod's own disk: its workspace and gpuflow's home (the scene cache) are its own
        env["GPUFLOW_OUTPUT_DIR"] = str(place / "workspace" / "outputs")
        env["GPUFLOW_WORKSPACE"] = str(place / "workspace")
        env["GPUFLOW_HOME"] = str(place / "home")
        return env

    def _run(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        container = pod["spec"]["containers"][0]
        place = self.folder / name
        (place / "workspace").mkdir(parents=True)
        log = place / "unit.log"
        log.touch()
        logs = {
            "apiVersion": "kwok.x-k8s.io/v1alpha1",
            "kind": "Logs",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"logs": [{"containers": [container["name"]], "logsFile": str(log)}]},
        }
        self.kube.request("POST", f"/apis/kwok.x-k8s.io/v1alpha1/namespaces/{NAMESPACE}/logs", logs)
        args = list(container.get("args") or [])
        # the image's interpreter (gpuflow's starter, a launcher after it): this one
        args = [sys.executable if word == "python" else word for word in args]
        started = _now()
        proc = subprocess.Popen(
            [*container.get("command", []), *args],
            cwd=ROOT,
            env=self._env(container, place),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        self.procs[name] = proc
        assert proc.stdout is not None
        with log.open("a") as out:
            for line in proc.stdout:  # CRI's log format, as a kubelet keeps it
                stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                out.write(f"{stamp} stdout F {line.rstrip(chr(10))}\n")
                out.flush()
        code = proc.wait()
        code = code if code >= 0 else 128 - code  # killed by a signal: as a shell says it
        self.exits[name] = code
        status = {
            "phase": "Succeeded" if code == 0 else "Failed",
            "containerStatuses": [
                {
                    "name": container["name"],
                    "image": container["image"],
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "started": False,
                    "state": {
                        "terminated": {
                            "exitCode": code,
                            "reason": "Completed" if code == 0 else "Error",
                            "startedAt": started,
                            "finishedAt": _now(),
                        }
                    },
                }
            ],
        }
        with contextlib.suppress(Exception):  # the pod was deleted meanwhile
            self.kube.http.patch(
                f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/status",
                json={"status": status},
                headers={"Content-Type": "application/merge-patch+json"},
            ).raise_for_status()
