"""scripts/gpu-check.sh on a host without a GPU (what CI has): it says so, runs the CPU
parts (preflight, matmul, training stopped half-way and resumed bitwise from its
checkpoint, a Cycles render, the MD kernel), prints one table and exits 0."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_its_cpu_parts_where_there_is_no_gpu(prefect_api, gpuflow_home):
    out = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--quick"],
        env=subprocess_env(prefect_api, gpuflow_home),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = out.stdout[out.stdout.rindex("\ncheck ") :]
    rows = {line.split("  ")[0].strip(): line for line in table.splitlines()[1:] if line.strip()}
    assert "no GPU here" in rows["GPUs"] and "the CPU parts run" in rows["GPUs"]
    assert "TFLOP/s on cpu (float32)" in rows["matmul float32"]
    assert "20 steps on cpu (ddp" in rows["training"]
    resume = rows["checkpoint and resume"]
    assert "10 steps, then 10 more resumed from the step-10 checkpoint" in resume
    assert "bitwise equal" in resume
    assert "4 frames in" in rows["render CPU"] and "atom-steps/s" in rows["MD"]
    assert not [line for line in rows.values() if "  FAIL  " in line]
    assert table.rstrip().endswith("no failure")
