"""Slurm at scale: 64 one-GPU units through gpuflow (one run of a command with a copy on
each GPU: one allocation of 2 nodes, its 64 copies as steps; with --runs also 64 runs of a
command started at once, each its own allocation and step) vs the same 64
`sbatch --wrap` submitted bare, on
a Slurm test cluster of two nodes with 32 H100s each (scripts/slurm-testbed.sh, started
and stopped here; needs root). Prints the time until each of the 64 has started (its job,
or its step, seen running) and until all have ended, side by side, and the ratio.
Target: gpuflow within 1.5x of bare sbatch.

    python bench/slurm_scale.py [--units 64] [--seconds 10] [--database sqlite|postgresql] [--runs]
        [--only-runs]

With --runs it also prints what each run asked of the Prefect API (requests by route,
writes, events; counted in this process, bench/api_calls.py). --only-runs skips the bare
sbatch and the one-run cases (the ratio then needs an earlier bare figure).

The runs record to the local platform's Prefect server (`gpuflow platform up`) keeping its
runs in PostgreSQL, as a team running many jobs at once would (`--database sqlite`: the
same server on SQLite, whose writes wait on each other).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def squeue(*argv: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", *argv], capture_output=True, text=True, check=True)
    return out.stdout.split()


def until(check, limit_s: float = 900) -> float:
    """Return the monotonic time at which `check()` first held."""
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"not done within {limit_s:.0f} s")
        time.sleep(0.2)
    return time.monotonic()


def bare(units: int, seconds: float) -> tuple[float, float]:
    start = time.monotonic()
    ids = [
        subprocess.run(
            ["sbatch", "--parsable", "--gres=gpu:h100:1", "-o", "/dev/null", "--wrap",
             f"sleep {seconds}"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        for _ in range(units)
    ]  # fmt: skip
    wanted, seen = ",".join(ids), set()

    def all_started() -> bool:
        seen.update(squeue("-t", "RUNNING", "-j", wanted, "-o", "%i"))
        return len(seen) >= units

    running = until(all_started)
    ended = until(lambda: not squeue("-j", wanted, "-o", "%i"))
    return running - start, ended - start


def through_gpuflow(
    units: int, seconds: float, workspaces: Path, one_run: bool = False
) -> tuple[float, float]:
    """Run the units through gpuflow: with `one_run`, one run whose command has a copy on
    each GPU of 2 nodes x units/2 GPUs (one allocation, its copies as steps); else
    `units` runs of one GPU each at once (each its own allocation and step)."""
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.pipeline.heartbeat import heartbeats_sent_by_gpuflow
    from gpuflow.tasks.spec import load_spec

    job = {"kind": "command", "command": ["sleep", str(seconds)]}
    resources = {"gpus": 1, "gpu_product": "H100"}
    runs_wanted = units
    if one_run:
        job["copies"] = "per_gpu"
        resources = {"gpus": units // 2, "nodes": 2, "gpu_product": "H100"}
        runs_wanted = 1
    spec = load_spec(
        {
            "name": "scale",
            "job": job,
            "resources": resources,
            "placement": {"backend": "slurm", "workspace_root": str(workspaces)},
            "limits": {"max_duration": "10m"},
        }
    )

    def one(_: int) -> str | None:
        """Run one job; return why it failed, None when it completed."""
        with heartbeats_sent_by_gpuflow():  # as `gpuflow run` runs a flow
            state = gpu_pipeline(spec, return_state=True)
        return None if state.is_completed() else state.message

    seen: set[str] = set()
    step = ".task-" if one_run else ".main."

    def all_started() -> bool:
        seen.update(name for name in squeue("-s", "-o", "%j") if step in name)
        if any(f.done() and f.result() for f in runs):
            raise SystemExit(
                f"a run failed: {next(f.result() for f in runs if f.done() and f.result())}"
            )
        return len(seen) >= units

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=runs_wanted) as pool:
        runs = [pool.submit(one, i) for i in range(runs_wanted)]
        running = until(all_started)
        failed = [f.result() for f in runs if f.result()]
    ended = time.monotonic()
    if failed:
        raise SystemExit(f"{len(failed)} of {runs_wanted} runs failed: {failed[0]}")
    return running - start, ended - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--database", choices=["sqlite", "postgresql"], default="postgresql")
    parser.add_argument(
        "--runs", action="store_true", help="also as that many runs at once, one GPU each"
    )
    parser.add_argument("--only-runs", action="store_true")
    args = parser.parse_args()
    args.runs = args.runs or args.only_runs
    if args.units < 2 or args.units % 2:
        parser.error("--units: give an even number (the units go to 2 nodes alike)")
    os.environ["GPUFLOW_HOME"] = tempfile.mkdtemp(prefix="gpuflow-bench-")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    testbed = Path(tempfile.mkdtemp(prefix="slurm-bench-"))
    script = ROOT / "scripts" / "slurm-testbed.sh"
    per_node = str(max(4, -(-args.units // 2)))
    subprocess.run(
        ["bash", str(script), "up", "--dir", str(testbed), "--h100-per-node", per_node], check=True
    )
    os.environ["SLURM_CONF"] = str(testbed / "slurm.conf")
    gpuflow = [sys.executable, "-m", "gpuflow", "platform"]
    port = str(free_port())
    try:
        subprocess.run([*gpuflow, "up", "--port", port, "--database", args.database], check=True)
        os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
        auth = Path(os.environ["GPUFLOW_HOME"]) / "platform" / "auth"  # only its user gets in
        os.environ["PREFECT_API_AUTH_STRING"] = auth.read_text().strip()
        through_gpuflow(2, 1, testbed / "workspaces")  # warm-up: imports, the API
        b = bare(args.units, args.seconds)
        one = None
        if not args.only_runs:
            one = through_gpuflow(args.units, args.seconds, testbed / "workspaces", one_run=True)
        many = None
        if args.runs:
            from bench.api_calls import ApiCalls

            with ApiCalls() as calls:
                many = through_gpuflow(args.units, args.seconds, testbed / "workspaces")
    finally:
        subprocess.run([*gpuflow, "down"], check=False)
        from gpuflow.tasks.platform.postgres import data_folder

        shutil.rmtree(data_folder().parent, ignore_errors=True)  # the bench's runs go
        shutil.rmtree(os.environ["GPUFLOW_HOME"], ignore_errors=True)
        subprocess.run(["bash", str(script), "down", "--dir", str(testbed)], check=False)
    print(f"{args.units} one-GPU units of sleep {args.seconds:.0f} s on 2 nodes x {per_node} H100,")
    print(f"recorded by a Prefect server on {args.database}")
    print(f"{'':22}{'bare sbatch':>13}{'gpuflow':>10}{'ratio':>8}   gpuflow as")
    rows = [("one run, copies: per_gpu", one)] if one else []
    rows += [(f"{args.units} runs at once", many)] if many else []
    for how, g in rows:
        for name, i in (("all started, s", 0), ("all ended, s", 1)):
            print(f"{name:22}{b[i]:>13.1f}{g[i]:>10.1f}{g[i] / b[i]:>8.2f}   {how}")
    print("target: gpuflow within 1.5x of bare sbatch")
    if many:
        print(f"what each of the {args.units} runs asked of the API:")
        print(calls.table(args.units))


if __name__ == "__main__":
    main()
