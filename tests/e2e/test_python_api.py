"""gpuflow from a Prefect user's own project (tests/e2e/project: its own flows/, tasks/ and
blocks.py beside gpuflow): one job, a sweep of 8 one-GPU jobs on 4 GPUs fanned out as
subflows of the user's flow, a failure returned as a state and raised as JobFailed, async
jobs gathered in an async flow, and a job run outside any flow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from uuid import UUID

import pytest

from tests.conftest import subprocess_env
from tests.e2e.helpers import nothing_left

pytestmark = pytest.mark.e2e
PROJECT = Path(__file__).parent / "project"
SWEEP, GPUS = 8, 4


def parent_of(flow_run_id: str) -> str | None:
    """Return the flow run whose task started `flow_run_id` as a subflow, or None."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(flow_run_id))
        if run.parent_task_run_id is None:
            return None
        return str(client.read_task_run(run.parent_task_run_id).flow_run_id)


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """Return how many of the (start, end) spans overlapped at most."""
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    now = most = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_a_users_own_flow_runs_gpu_jobs_as_subflows(prefect_api, gpuflow_home, tmp_path):
    env = subprocess_env(prefect_api, gpuflow_home, fake_gpus=GPUS)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "flows.nightly", str(SWEEP), str(barrier)],
        cwd=PROJECT,  # the project's own flows/ and tasks/ come first on sys.path
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line.removeprefix("RESULT "))
    parent = out["parent"]

    mine = out["mine"]
    assert (mine["state"], mine["exit_code"]) == ("Completed", 0)
    assert (
        Path(mine["artifacts"]) / "outputs" / "said"
    ).read_text() == "their-tasks their-blocks\n"
    assert parent_of(mine["id"]) == parent

    sweep = out["sweep"]
    assert [r["name"] for r in sweep] == [f"sweep-{i}" for i in range(SWEEP)]
    assert {(r["state"], r["exit_code"]) for r in sweep} == {("Completed", 0)}
    assert {parent_of(r["id"]) for r in sweep} == {parent}
    spans, devices = [], set()
    for r in sweep:
        outputs = Path(r["artifacts"]) / "outputs"
        start, end = map(float, (outputs / "times").read_text().split())
        spans.append((start, end))
        devices.add((outputs / "gpu").read_text().strip())
        assert r["gpu_hours"] > 0
    assert devices <= {str(i) for i in range(GPUS)}
    assert most_at_once(spans) <= GPUS  # never more jobs than GPUs at once
    assert most_at_once(spans) > 1  # and side by side (each waited for a second one)

    assert out["state"] == "Failed"
    assert out["raised"].startswith("the job exited with code 4")
    assert [(r["name"], r["state"]) for r in out["async"]] == [
        ("async-0", "Completed"),
        ("async-1", "Completed"),
    ]
    assert out["alone"]["state"] == "Completed" and parent_of(out["alone"]["id"]) is None
    assert "Traceback" not in done.stderr
    assert nothing_left(gpuflow_home)


def test_a_kind_with_its_own_flow_runs_as_that_flow_from_a_users_flow(prefect_api, gpuflow_home):
    """An hpc job from the Python API runs as the hpc flow (as `gpuflow hpc` and the
    deployments run it), a subflow of the caller's, with the kind's typed model."""
    import shutil

    from prefect import flow

    from gpuflow import HpcJob, JobSpec, gpu_job

    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (scripts/test.sh installs it)")
    write = 'echo "rank $OMPI_COMM_WORLD_RANK" > "$GPUFLOW_OUTPUT_DIR/rank-$OMPI_COMM_WORLD_RANK"'

    @flow(name="users-hpc")
    def users() -> tuple[str, object]:
        from prefect.runtime import flow_run

        job = HpcJob(kind="hpc", ranks=2, program=["sh", "-c", write])
        return str(flow_run.id), gpu_job(JobSpec(name="md-from-python", job=job))

    parent, run = users()
    assert (run.state, run.exit_code) == ("Completed", 0)
    assert sorted(p.name for p in (run.artifacts_dir / "outputs").iterdir()) == ["rank-0", "rank-1"]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        child = client.read_flow_run(UUID(run.flow_run_id))
        assert client.read_flow(child.flow_id).name == "hpc"
    assert parent_of(run.flow_run_id) == parent
    assert nothing_left(gpuflow_home)


def test_a_sweep_with_one_bad_spec_starts_none_of_its_jobs(prefect_api, gpuflow_home):
    """gpu_jobs runs every spec's checks (the backend's too) before any job starts."""
    from gpuflow import InvalidSpec, gpu_jobs

    good = {"name": "good", "job": {"kind": "command", "command": ["true"]}}
    bad = {**good, "name": "bad", "resources": {"disk": "100000Ti"}}
    with pytest.raises(InvalidSpec, match=r"resources\.disk asks for"):
        gpu_jobs([good, bad])
    assert not (gpuflow_home / "runs").exists()  # nothing ran, nothing collected
    assert nothing_left(gpuflow_home)
