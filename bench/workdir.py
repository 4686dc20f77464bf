"""The time a 100 MB working folder (job.workdir) adds to a run's start: seconds from
`gpuflow run` to the job's first line, the same job with and without the folder.

  (a) local, no workdir                      the baseline
  (b) local, a 100 MB workdir                packed here, unpacked from this machine's copy
  (c) local, the same through S3 staging     storage.staging on moto: uploaded, then fetched
                                             by the starter: the path of Kubernetes pods and
                                             EC2 instances (their network aside)
  (d) Slurm, no workdir / a 100 MB workdir   through the shared file system (--slurm: the
                                             Slurm test cluster, started and stopped here;
                                             needs root)

The folder is 100 files of 1 MB of random bytes (nothing to compress: the worst case), with
a file that differs each round, so every round packs, uploads and unpacks it anew. Each case
runs --rounds times (medians printed); the Prefect API is one kept API, started before the
first round (not counted).

    python bench/workdir.py [--rounds 3] [--size-mb 100] [--slurm]
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

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moto_server import start_moto

ROOT = Path(__file__).resolve().parent.parent
GPUFLOW = [sys.executable, "-m", "gpuflow"]
MARK = "gpuflow-bench-first-line"


def folder_of(root: Path, size_mb: int) -> Path:
    code = root / "code"
    code.mkdir(parents=True, exist_ok=True)
    for index in range(size_mb):
        (code / f"blob-{index:03d}.bin").write_bytes(os.urandom(1 << 20))
    return code


def first_line(root: Path, env: dict, workdir: Path | None, **sections) -> float:
    """Run a job that prints MARK through `gpuflow run`; return seconds to that line."""
    job: dict = {"kind": "command", "command": ["python", "-c", f"print('{MARK}')"]}
    if workdir is not None:
        (workdir / "round.txt").write_text(str(time.monotonic_ns()))  # new content each round
        job["workdir"] = str(workdir)
    raw = {"name": "workdir-bench", "job": job, "resources": {"gpus": 0, "allow_cpu": True}}
    raw |= {"metrics": {"plot": False}, **sections}
    path = root / f"job-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(raw))
    started = time.monotonic()
    proc = subprocess.Popen(
        [*GPUFLOW, "run", str(path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = None
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if line.startswith(MARK) and seen is None:
            seen = time.monotonic() - started
    if proc.wait(timeout=600) != 0 or seen is None:
        raise SystemExit("the run failed:\n" + "".join(lines[-30:]))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size-mb", type=int, default=100)
    parser.add_argument("--slurm", action="store_true", help="also on the Slurm test cluster")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpuflow-workdir-bench-"))
    code = folder_of(root, args.size_mb)
    moto, endpoint = start_moto()
    env = dict(os.environ, GPUFLOW_HOME=str(root / "home"), GPUFLOW_API_IDLE_S="3600")
    env |= {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
    }
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="bench", aws_secret_access_key="bench-secret",
    ).create_bucket(Bucket="bench")  # fmt: skip
    staging = {"storage": {"staging": "s3://bench/staging"}}
    slurm_dir = root / "slurm"
    testbed = ROOT / "scripts" / "slurm-testbed.sh"
    cases: dict[str, list[float]] = {}
    try:
        first_line(root, env, None)  # starts the kept API; not counted
        for _ in range(args.rounds):
            cases.setdefault("(a) local, no workdir", []).append(first_line(root, env, None))
            cases.setdefault("(b) local, workdir", []).append(first_line(root, env, code))
            cases.setdefault("(c) local, workdir via S3", []).append(
                first_line(root, env, code, **staging)
            )
        if args.slurm:
            subprocess.run(["bash", str(testbed), "up", "--dir", str(slurm_dir)], check=True)
            env["SLURM_CONF"] = str(slurm_dir / "slurm.conf")
            on_slurm = {
                "placement": {"backend": "slurm", "workspace_root": str(root / "shared")},
                "resources": {"gpus": 1},
                "limits": {"max_duration": "10m"},
            }
            for _ in range(args.rounds):
                cases.setdefault("(d) slurm, no workdir", []).append(
                    first_line(root, env, None, **on_slurm)
                )
                cases.setdefault("(d) slurm, workdir", []).append(
                    first_line(root, env, code, **on_slurm)
                )
    finally:
        moto.terminate()
        if args.slurm:
            subprocess.run(["bash", str(testbed), "down", "--dir", str(slurm_dir)], check=False)
    medians = {name: statistics.median(times) for name, times in cases.items()}
    print(f"rounds: {args.rounds}; a {args.size_mb} MB workdir; median seconds to the first line")
    baselines = {
        "(b)": medians["(a) local, no workdir"],
        "(c)": medians["(a) local, no workdir"],
        "(d) slurm, workdir": medians.get("(d) slurm, no workdir"),
    }
    for name, value in medians.items():
        baseline = next((v for k, v in baselines.items() if name.startswith(k)), None)
        added = "" if baseline is None else f"  (+{value - baseline:.2f} s over no workdir)"
        print(f"  {name:<28} {value:6.2f} s{added}")
    print(f"  all rounds: {cases}")


if __name__ == "__main__":
    main()
