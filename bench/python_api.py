"""The Python API, side by side with what it replaces.

(a) one trivial job: `gpuflow run JOB.yaml` vs a user's flow calling `gpu_job` (a
    subflow), each a fresh process against the same Prefect server;
(b) a sweep of 8 one-GPU jobs (each sleeps --job-s) on 4 fake GPUs from one flow:
    `gpu_jobs` (each a subflow, side by side as GPUs free up) vs the same 8 `gpu_job`
    calls one after another.

    python bench/python_api.py [--rounds 3] [--job-s 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARENT = """
import sys
from prefect import flow
from gpuflow import gpu_job, gpu_jobs

SWEEP = [{{"name": f"sweep-{{i}}", "job": {{"kind": "command", "command": ["sleep", "{job_s}"]}},
          "resources": {{"gpus": 1}}, "placement": {{"gpu_wait": 3600}}}} for i in range(8)]

@flow(name="bench-parent")
def parent(how: str):
    if how == "one":
        gpu_job({{"name": "trivial", "job": {{"kind": "command", "command": ["true"]}}}})
    elif how == "at-once":
        gpu_jobs(SWEEP)
    else:
        for spec in SWEEP:
            gpu_job(spec)

parent(sys.argv[1])
"""


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    started = time.monotonic()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job-s", type=float, default=3.0)
    args = parser.parse_args()
    from tests.conftest import FAKES, free_port, wait_until_serving

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(
            PREFECT_HOME=str(work / "prefect"),
            GPUFLOW_HOME=str(work / "home"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PYTHONPATH=str(FAKES),  # 4 fake GPUs (tests/fakes/pynvml.py)
            FAKE_NVML_GPUS="4",
        )
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            wait_until_serving(f"http://127.0.0.1:{port}/api/health", 120)
            env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
            (work / "parent.py").write_text(PARENT.format(job_s=args.job_s))
            (work / "job.yaml").write_text("name: trivial\njob: {kind: command, command: [true]}\n")
            cli = [sys.executable, "-m", "gpuflow", "run", str(work / "job.yaml")]
            flow = [sys.executable, str(work / "parent.py")]
            rows = {"gpuflow run": [], "gpu_job in a flow": [], "gpu_jobs (8 at once)": [],
                    "8 gpu_job one by one": []}  # fmt: skip
            for _ in range(args.rounds):
                rows["gpuflow run"].append(timed(cli, env, work))
                rows["gpu_job in a flow"].append(timed([*flow, "one"], env, work))
                rows["gpu_jobs (8 at once)"].append(timed([*flow, "at-once"], env, work))
                rows["8 gpu_job one by one"].append(timed([*flow, "in-turn"], env, work))
        finally:
            server.terminate()
            server.wait(30)
    median = {name: statistics.median(times) for name, times in rows.items()}
    print(f"{'':24} {'min':>7} {'median':>7} {'max':>7}   ({args.rounds} rounds, s)")
    for name, times in rows.items():
        print(f"{name:24} {min(times):7.1f} {median[name]:7.1f} {max(times):7.1f}")
    print(
        f"gpu_job in a flow / gpuflow run: {median['gpu_job in a flow'] / median['gpuflow run']:.2f}"
    )
    print(
        "8 one by one / 8 at once on 4 GPUs:"
        f" {median['8 gpu_job one by one'] / median['gpu_jobs (8 at once)']:.2f}"
        f" (each job {args.job_s:g} s: at best 8x{args.job_s:g} s vs 2x{args.job_s:g} s)"
    )


if __name__ == "__main__":
    main()
