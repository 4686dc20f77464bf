"""Launch training: torchrun with one rank per visible GPU (or `cpu_processes` CPU ranks).

Exits with the "preempted" code when every rank saved a checkpoint and stopped on
SIGTERM, so the pipeline retries and resumes; otherwise with torchrun's own code.
The pipeline stops a job by sending SIGTERM to its whole process group: torchrun and
the ranks get it directly, so this process only waits for them (passing it on as well
would reach torchrun twice, which breaks its shutdown).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from tasks.errors import PREEMPTED_EXIT_CODE
from tasks.spec import TrainJob
from tasks.training.entry import PREEMPTED_MARKER


def ranks(job: TrainJob) -> int:
    """Return how many ranks to start: the visible GPUs, else the job's CPU processes."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else job.cpu_processes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job-json", required=True)
    parser.add_argument("--run-name", default="run")
    args = parser.parse_args(argv)
    job = TrainJob.model_validate_json(args.job_json)
    nproc = ranks(job)
    workspace = Path(os.environ.get("GPUFLOW_WORKSPACE", "."))
    for marker in workspace.glob(PREEMPTED_MARKER.format(rank="*")):
        marker.unlink()
    env = dict(os.environ, GPUFLOW_TRAIN_JOB=args.job_json, GPUFLOW_RUN_NAME=args.run_name)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "tasks.training.entry",
    ]
    print(f"launching {nproc} rank(s): {'NCCL on GPUs' if _cuda() else 'gloo on CPU'}", flush=True)
    child = subprocess.Popen(command, env=env)

    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # wait for the ranks' checkpoint
    code = child.wait()
    markers = list(workspace.glob(PREEMPTED_MARKER.format(rank="*")))
    if len(markers) == nproc:
        return PREEMPTED_EXIT_CODE
    return code if code >= 0 else 128 - code


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
