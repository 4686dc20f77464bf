"""infra/: the Prometheus alert rules load, and their unit tests pass (Debian's promtool)."""

from __future__ import annotations

import os
import shutil
import subprocess
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
    from tasks.metrics.prometheus import _SUMMARY
    from tasks.metrics.sampler import GPU_FIELDS

    rules = (RULES / "gpuflow-rules.yml").read_text()
    for name in ("DCGM_FI_DEV_GPU_UTIL", "gpuflow_run_gpu_util_mean", "gpuflow_run_gpu_hours"):
        assert name in rules
        assert name in GPU_FIELDS or name in _SUMMARY
