"""Fleet costs on the fleet test bed (scripts/fleet-testbed.sh: hosts in network
namespaces with sshd): what reaching a host over SSH adds to a trivial job, and how long
12 one-GPU runs from 3 processes take to all start on 3 hosts x 4 GPUs.

1. A trivial job (`true`) through gpu_pipeline on a fleet host vs on the local backend,
   alternating, median of --rounds (one Prefect server, a warm-up run of each first).
2. 12 one-GPU runs (each `gpuflow.gpu_jobs` of 4, in 3 processes started at once): seconds
   from the first unit's start to the last's, and from the processes' start to the end.

    sudo python bench/fleet.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SWEEP = textwrap.dedent(
    """
    import json, sys
    import gpuflow
    raw = json.loads(sys.argv[1])
    specs = [{**raw, "name": f"sweep-{sys.argv[2]}-{i}"} for i in range(4)]
    states = gpuflow.gpu_jobs(specs, return_state=True)
    sys.exit(0 if all(s.is_completed() for s in states) else 1)
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-bench-fleet-"))
    os.environ["GPUFLOW_HOME"] = str(scratch / "home")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    bed = scratch / "bed"
    testbed = str(ROOT / "scripts" / "fleet-testbed.sh")
    env = {**os.environ, "FLEET_PYTHON": sys.executable}
    subprocess.run([testbed, "up", str(bed), "g1:4", "g2:4", "g3:4"], check=True, env=env)
    try:
        run(bed, args.rounds)
    finally:
        subprocess.run([testbed, "down", str(bed)], check=True)


def run(bed: Path, rounds: int) -> None:
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from gpuflow.blocks import GpuFleet
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.pipeline.heartbeat import heartbeats_sent_by_gpuflow
    from gpuflow.tasks.spec import load_spec

    hosts = json.loads((bed / "hosts.json").read_text())["hosts"]
    with prefect_test_harness(server_startup_timeout=120):
        api = PREFECT_API_URL.value()
        Secret(value=(bed / "client_key").read_text()).save("bench-fleet-key", overwrite=True)
        entries = [
            {"name": h["name"], "address": h["address"], "known_hosts": h["known_hosts"]}
            for h in hosts
        ]
        GpuFleet(hosts=entries, ssh_key="bench-fleet-key").save("bench", overwrite=True)
        done = subprocess.run(
            [sys.executable, "-m", "gpuflow", "fleet", "apply", "bench"],
            env={**os.environ, "PREFECT_API_URL": api},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        job = {"kind": "command", "command": ["true"]}
        local = load_spec({"name": "bench", "job": job})
        fleet = load_spec(
            {
                "name": "bench",
                "job": job,
                "resources": {"gpus": 1},
                "placement": {"backend": "fleet", "fleet": "bench"},
            }
        )
        with heartbeats_sent_by_gpuflow():
            gpu_pipeline(local)
            gpu_pipeline(fleet)  # warm-up: the wheel is put on the host once
            here, there = [], []
            for _ in range(rounds):
                start = time.perf_counter()
                gpu_pipeline(local)
                here.append(time.perf_counter() - start)
                start = time.perf_counter()
                gpu_pipeline(fleet)
                there.append(time.perf_counter() - start)
        a, b = statistics.median(here), statistics.median(there)
        print(f"{'trivial job (true)':22}{'local backend':>14}{'fleet host (ssh)':>18}")
        print(f"{'median seconds':22}{a:14.3f}{b:18.3f}")
        print(f"local rounds: {' '.join(f'{x:.2f}' for x in here)}")
        print(f"fleet rounds: {' '.join(f'{x:.2f}' for x in there)}")
        print(f"what ssh and the host program cost: {b - a:.3f} s per run (ratio {b / a:.2f})")
        sweep(bed, api)


def sweep(bed: Path, api: str) -> None:
    starts = bed.parent / "starts"
    starts.mkdir()
    mark = f'date +%s.%N > {starts}/"$(basename "$GPUFLOW_WORKSPACE")"'
    raw = {
        "name": "sweep",
        "job": {"kind": "command", "command": ["sh", "-c", mark]},
        "resources": {"gpus": 1},
        "placement": {"backend": "fleet", "fleet": "bench"},
    }
    begun = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SWEEP, json.dumps(raw), str(i)],
            env={**os.environ, "PREFECT_API_URL": api},
        )
        for i in range(3)
    ]
    codes = [p.wait() for p in procs]
    total = time.perf_counter() - begun
    times = sorted(float(p.read_text()) for p in starts.iterdir())
    print(
        f"12 one-GPU runs from 3 processes on 3 x 4 GPUs: exit codes {codes}, {len(times)}"
        f" started; first start to last: {times[-1] - times[0]:.2f} s; processes' start to"
        f" end: {total:.2f} s"
    )


if __name__ == "__main__":
    main()
