"""gpuflow installed from its wheel, away from the repository: `gpuflow demo` runs the
smoke job, and `gpuflow platform up` finds its prefect.yaml inside the package, deploys
and records a run there, then `platform down` stops it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
# what a site without gpuflow's extras cannot import (pyproject.toml's optional dependencies)
HIDE_EXTRAS = """
import sys

EXTRAS = {"torch", "webdataset", "boto3", "botocore", "prefect_aws", "prefect_kubernetes",
          "kubernetes", "mpi4py", "av", "alibabacloud_ecs20140526", "tencentcloud"}


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in EXTRAS:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
"""


def test_the_wheel_works_without_the_repository(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("gpuflow-*.whl")
    target = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(target),  # the installed wheel first; its dependencies from here
        "GPUFLOW_HOME": str(tmp_path / "home"),
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "GPUFLOW_API_IDLE_S": "0",
    }

    def gpuflow(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "gpuflow", *argv],
            cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        return done, time.monotonic() - started

    where = subprocess.run(
        [sys.executable, "-c", "import gpuflow.tasks.platform.local as l; print(l.PROJECT_FILE)"],
        cwd=elsewhere, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert where.stdout.strip() == str(target / "gpuflow" / "prefect.yaml"), where.stderr[-2000:]
    # `pip install gpuflow` without extras: the modules they bring cannot be imported
    light = tmp_path / "light"
    light.mkdir()
    (light / "sitecustomize.py").write_text(HIDE_EXTRAS)
    env["PYTHONPATH"] = f"{target}:{light}"
    demo, _ = gpuflow("demo")
    assert demo.returncode == 0, (demo.stdout + demo.stderr)[-3000:]
    assert "smoke: completed" in demo.stdout
    assert "TFLOP/s on cpu (float32, numpy: torch is not installed)" in demo.stdout
    needing = {
        "aws": "placement.backend: the ec2 backend needs boto3 and prefect_aws",
        "alibaba": "placement.backend: the alibaba backend needs alibabacloud_ecs20140526 and"
        " boto3",
        "train": "job.kind: a train job here needs torch and webdataset",
    }
    (elsewhere / "aws.yaml").write_text(
        "job: {kind: command, command: [nvidia-smi]}\nplacement: {backend: ec2}\n"
    )
    (elsewhere / "alibaba.yaml").write_text(
        "job: {kind: command, command: [nvidia-smi]}\nplacement: {backend: alibaba}\n"
    )
    (elsewhere / "train.yaml").write_text(
        f"job: {{kind: train, dataset: 'file://{tmp_path}/d', output: 'file://{tmp_path}/o'}}\n"
    )
    for extra, sentence in needing.items():
        refused, _ = gpuflow("run", f"{extra}.yaml")
        assert refused.returncode == 2, (refused.stdout + refused.stderr)[-3000:]
        assert refused.stderr.strip() == (
            f"gpuflow: invalid input: {sentence}, which this gpuflow was installed without;"
            f" install its extra: pip install 'gpuflow[{extra}]'."
        )
    env["PYTHONPATH"] = str(target)
    port = str(free_port())
    up, _ = gpuflow("platform", "up", "--port", port)
    try:
        assert up.returncode == 0, (up.stdout + up.stderr)[-3000:]
        assert "deployments created from prefect.yaml" in up.stdout + up.stderr
        submitted, _ = gpuflow("submit", "gpu-pipeline/command-local", "--wait")
        assert submitted.returncode == 0, (submitted.stdout + submitted.stderr)[-3000:]
    finally:
        down, _ = gpuflow("platform", "down")
    assert down.returncode == 0, (down.stdout + down.stderr)[-3000:]
