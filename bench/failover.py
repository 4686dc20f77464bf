"""Failover: seconds from `gpuflow run` to the job's first line, on a Slurm test cluster
(scripts/slurm-testbed.sh, started and stopped here; needs root) with two candidates,
partition l4 (one node, 2 L4) and partition gpu (two nodes of H100):

  (a) the free candidate alone (partition gpu);
  (b) the l4 partition first, its GPUs held by another job, its gpu_wait 10 s: the run
      waits 10 s, gives it up, and starts on partition gpu;
  (c) a job preempted on the l4 partition (its Slurm job requeued, exit 75) with
      placement_policy.on_preempt: next: seconds from the requeue to its first line on
      partition gpu.

Printed side by side, with the failover's own cost, (b) - (a) - gpu_wait. Goal: under 5 s.
Each case runs --rounds times (the median is printed); the Prefect API is one kept API,
started before the first round (its start is not counted).

    python bench/failover.py [--rounds 3] [--gpu-wait 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
GPUFLOW = [sys.executable, "-m", "gpuflow"]
MARK = "gpuflow-bench-first-line"


def spec(folder: Path, placements: list[dict], **sections) -> Path:
    path = folder / f"job-{time.monotonic_ns()}.yaml"
    raw = {
        "name": "failover-bench",
        "job": {
            "kind": "command",
            "command": ["sh", "-c", f"echo {MARK} $SLURM_JOB_PARTITION; sleep 30"],
        },
        "resources": {"gpus": 1},
        "limits": {"max_duration": "10m", "stop_grace_s": 5},
        "placement": placements if len(placements) > 1 else placements[0],
        **sections,
    }
    path.write_text(yaml.safe_dump(raw))
    return path


def first_lines(
    path: Path, env: dict, wanted: int, on_first=None, where: str = "gpu"
) -> list[float]:
    """Run `gpuflow run path`; return the seconds from its start to each of the first
    `wanted` times the job printed its first line (then stop waiting for the rest), the
    last of them on partition `where`."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [*GPUFLOW, "run", str(path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[float] = []
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith(MARK):
            seen.append(time.monotonic() - started)
            partition = line.split()[-1]
            if len(seen) == 1 and on_first is not None:
                on_first()
            if len(seen) >= wanted:
                break
    proc.terminate()  # the job sleeps on: gpuflow stops it and tears down
    proc.wait(timeout=120)
    if len(seen) < wanted:
        raise SystemExit(f"the job printed its first line {len(seen)} time(s), not {wanted}")
    if partition != where:
        raise SystemExit(f"the job ran on partition {partition}, not {where}")
    return seen


def gpuflow_jobs() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %k"], capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.splitlines() if "gpuflow.io/owner" in line]


def wait_no_gpuflow_jobs() -> None:
    deadline = time.monotonic() + 120
    while gpuflow_jobs() and time.monotonic() < deadline:
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-wait", type=float, default=10.0)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the Slurm test cluster needs root")
    folder = Path(tempfile.mkdtemp(prefix="gpuflow-failover-"))
    testbed = ROOT / "scripts" / "slurm-testbed.sh"
    subprocess.run(["bash", str(testbed), "up", "--dir", str(folder / "slurm")], check=True)
    env = dict(os.environ, SLURM_CONF=str(folder / "slurm" / "slurm.conf"))
    env |= {"GPUFLOW_HOME": str(folder / "home"), "GPUFLOW_API_IDLE_S": "3600"}
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]
    workspaces = str(folder / "workspaces")
    l4 = {"backend": "slurm", "partition": "l4", "workspace_root": workspaces}
    gpu = {"backend": "slurm", "partition": "gpu", "workspace_root": workspaces}
    try:
        first_lines(spec(folder, [gpu]), env, 1)  # starts the kept API; not counted
        wait_no_gpuflow_jobs()
        direct, failed_over, resumed = [], [], []
        for _ in range(args.rounds):
            direct.append(first_lines(spec(folder, [gpu]), env, 1)[0])
            wait_no_gpuflow_jobs()
            blocker = subprocess.run(
                ["sbatch", "--parsable", "-p", "l4", "--gres=gpu:l4:2", "-o", "/dev/null",
                 "--wrap", "sleep 600"],
                capture_output=True, text=True, check=True, env=env,
            ).stdout.strip()  # fmt: skip
            try:
                full = {**l4, "gpu_wait": args.gpu_wait}
                failed_over.append(first_lines(spec(folder, [full, gpu]), env, 1)[0])
            finally:
                subprocess.run(["scancel", blocker], env=env, check=False)
            wait_no_gpuflow_jobs()
            requeued: list[float] = []

            def requeue(requeued: list[float] = requeued) -> None:
                [job] = gpuflow_jobs()
                requeued.append(time.monotonic())
                subprocess.run(["scontrol", "requeue", job], env=env, check=True)

            path = spec(folder, [l4, gpu], placement_policy={"on_preempt": "next"})
            started = time.monotonic()
            second = first_lines(
                path, env, 2, on_first=lambda: threading.Thread(target=requeue).start()
            )[1]
            resumed.append(started + second - requeued[0])
            wait_no_gpuflow_jobs()
    finally:
        subprocess.run(["bash", str(testbed), "down", "--dir", str(folder / "slurm")], check=False)
    a, b, c = (statistics.median(x) for x in (direct, failed_over, resumed))
    print(f"rounds: {args.rounds}; median seconds from `gpuflow run` to the job's first line")
    print(f"  (a) free candidate directly:                     {a:7.1f} s")
    print(f"  (b) one full candidate first (gpu_wait {args.gpu_wait:g} s):   {b:7.1f} s")
    print(f"  (c) from a preemption to its first line on the next: {c:5.1f} s")
    print(
        f"  failover's own cost, (b) - (a) - gpu_wait:        {b - a - args.gpu_wait:7.1f} s (goal: under 5 s)"
    )
    print(f"  all rounds: a={direct} b={failed_over} c={resumed}")


if __name__ == "__main__":
    main()
