"""The Kubernetes backend against a cluster of your own, when GPUFLOW_K8S_E2E_KUBECONFIG
names its kubeconfig (GPUFLOW_K8S_E2E_IMAGE: an image with `true`, default busybox):
a CPU unit runs to Succeeded and leaves nothing, and a request no node can take is refused
in one sentence. Without the variable these tests are skipped; the testbed suite
(test_kubernetes.py) always runs."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from gpuflow.tasks.backends.kubernetes.backend import KubernetesBackend
from gpuflow.tasks.contract import WorkUnit, owner_labels
from gpuflow.tasks.errors import ProvisionError
from gpuflow.tasks.spec import load_spec

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.environ.get("GPUFLOW_K8S_E2E_KUBECONFIG"),
        reason="GPUFLOW_K8S_E2E_KUBECONFIG names no cluster of your own",
    ),
]


@pytest.fixture
def cluster_of_yours(monkeypatch) -> None:
    monkeypatch.setenv("KUBECONFIG", os.environ["GPUFLOW_K8S_E2E_KUBECONFIG"])


def spec_for(gpus: int) -> object:
    image = os.environ.get("GPUFLOW_K8S_E2E_IMAGE", "busybox:1.36")
    return load_spec(
        {
            "job": {"kind": "command", "command": ["true"]},
            "resources": {"gpus": gpus},
            "placement": {"backend": "kubernetes", "image": image},
        }
    )


def test_a_cpu_unit_succeeds_and_leaves_nothing(cluster_of_yours):
    backend = KubernetesBackend()
    spec = spec_for(0)
    backend.check(spec)
    run_id = f"e2e-{uuid.uuid4()}"
    cluster = backend.provision(spec, owner_labels(run_id, "gpuflow-e2e"))
    try:
        result = backend.run(
            cluster, WorkUnit(name="main", command=["true"]), {}, 600, lambda *_: None
        )
        assert result.exit_code == 0
    finally:
        backend.teardown(cluster)
    until = time.monotonic() + 120
    while backend.list_owned({"gpuflow.io/flow-run-id": run_id}) and time.monotonic() < until:
        time.sleep(1)
    assert backend.list_owned({"gpuflow.io/flow-run-id": run_id}) == []


def test_a_request_no_node_can_take_is_refused(cluster_of_yours):
    backend = KubernetesBackend()
    cluster = backend.provision(spec_for(64), owner_labels(f"e2e-{uuid.uuid4()}", "gpuflow-e2e"))
    try:
        with pytest.raises(ProvisionError, match="cannot be placed"):
            backend.run(cluster, WorkUnit(name="main", command=["true"]), {}, 600, lambda *_: None)
    finally:
        backend.teardown(cluster)
