"""Pipeline overhead: the same 10 s command through gpu_pipeline vs as a bare subprocess.

The API is warm (one Prefect server for the whole script, one warm-up run first); the
two ways alternate so that machine noise hits both. Prints seconds and the ratio.
Target: overhead at most 0.5 s, heartbeats (crashed-run detection) kept.

    python bench/pipeline_overhead.py [--seconds 10] [--rounds 3]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GPUFLOW_HOME", tempfile.mkdtemp(prefix="gpuflow-bench-"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    from prefect.testing.utilities import prefect_test_harness

    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.pipeline.heartbeat import heartbeats_sent_by_gpuflow
    from gpuflow.tasks.spec import load_spec

    command = ["sleep", str(args.seconds)]
    spec = load_spec({"name": "bench", "job": {"kind": "command", "command": command}})
    with prefect_test_harness(server_startup_timeout=120):
        gpu_pipeline(load_spec({"job": {"kind": "command", "command": ["true"]}}))  # warm-up
        bare, piped = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            subprocess.run(command, check=True)
            bare.append(time.perf_counter() - start)
            start = time.perf_counter()
            with heartbeats_sent_by_gpuflow():  # as `gpuflow run` runs a flow
                gpu_pipeline(spec)
            piped.append(time.perf_counter() - start)
    b, p = statistics.median(bare), statistics.median(piped)
    print(f"{'':18}{'bare subprocess':>16}{'gpu_pipeline':>14}")
    print(f"{'median seconds':18}{b:16.3f}{p:14.3f}")
    print(f"bare rounds:     {' '.join(f'{x:.2f}' for x in bare)}")
    print(f"pipeline rounds: {' '.join(f'{x:.2f}' for x in piped)}")
    print(f"overhead: {p - b:.3f} s   ratio pipeline/bare: {p / b:.3f}   target: overhead <= 0.5 s")


if __name__ == "__main__":
    main()
