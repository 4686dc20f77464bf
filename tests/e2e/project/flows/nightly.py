"""A user's own flows calling gpuflow: one job, a sweep fanned out as subflows, a failure
both ways, async jobs, and a job run outside any flow. Prints what came back as JSON."""

from __future__ import annotations

import asyncio
import json
import sys

from prefect import flow
from prefect.runtime import flow_run

from blocks import NAME
from gpuflow import (
    CommandJob,
    JobFailed,
    JobSpec,
    Placement,
    Resources,
    gpu_job,
    gpu_job_async,
    gpu_jobs,
)
from tasks import greet

STAMP = 'date +%s.%N >> "$GPUFLOW_OUTPUT_DIR/times"'
# each job of the sweep waits until a second one runs (a barrier: the jobs run side by side)
SWEEP = (
    f'{STAMP}; echo "$CUDA_VISIBLE_DEVICES" > "$GPUFLOW_OUTPUT_DIR/gpu"; touch "$BARRIER/$JOB";'
    ' until [ "$(ls "$BARRIER" | wc -l)" -ge 2 ]; do sleep 0.05; done; sleep 0.2;'
    f" {STAMP}"
)


def said(run) -> dict:
    return {
        "name": run.name,
        "id": run.flow_run_id,
        "state": run.state,
        "exit_code": run.exit_code,
        "artifacts": str(run.artifacts_dir),
        "gpu_hours": run.gpu_hours,
        "url": run.url,
    }


@flow(name="nightly")
def nightly(sweep: int, barrier: str) -> dict:
    mine = gpu_job(
        JobSpec(
            name="mine",
            job=CommandJob(
                command=["sh", "-c", f'echo {greet()} {NAME} > "$GPUFLOW_OUTPUT_DIR/said"']
            ),
        )
    )
    runs = gpu_jobs(
        [
            JobSpec(
                name=f"sweep-{i}",
                job=CommandJob(command=["sh", "-c", SWEEP]),
                resources=Resources(gpus=1),
                placement=Placement(gpu_wait=600),
                env={"BARRIER": barrier, "JOB": str(i)},
            )
            for i in range(sweep)
        ]
    )
    state = gpu_job(
        {"name": "fails", "job": {"kind": "command", "command": ["sh", "-c", "exit 3"]}},
        return_state=True,
    )
    try:
        gpu_job({"name": "raises", "job": {"kind": "command", "command": ["sh", "-c", "exit 4"]}})
        raised = None
    except JobFailed as exc:
        raised = str(exc)
    return {
        "parent": str(flow_run.id),
        "mine": said(mine),
        "sweep": [said(r) for r in runs],
        "state": state.name,
        "raised": raised,
    }


@flow(name="nightly-async")
async def nightly_async() -> list[dict]:
    jobs = [
        {"name": f"async-{i}", "job": {"kind": "command", "command": ["true"]}} for i in range(2)
    ]
    return [said(r) for r in await asyncio.gather(*(gpu_job_async(j) for j in jobs))]


if __name__ == "__main__":
    out = nightly(int(sys.argv[1]), sys.argv[2])
    out["async"] = asyncio.run(nightly_async())
    out["alone"] = said(gpu_job({"name": "alone", "job": {"kind": "command", "command": ["true"]}}))
    print("RESULT " + json.dumps(out))
