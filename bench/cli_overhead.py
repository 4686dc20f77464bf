"""CLI overhead: wall time of `gpuflow run` for `echo hi` against the bare command.

Four ways with no API configured: everything cold (an empty PREFECT_HOME, an empty
bytecode cache: the first command starts a temporary API and keeps it), the second command
(it uses the kept API), a warm command whose API is not kept (GPUFLOW_API_IDLE_S=0: each
command starts its own, as before), and with the local platform up (`gpuflow platform
up`; runs are recorded there). Printed side by side with the difference and ratio to the
bare command.

    python bench/cli_overhead.py [--rounds 2] [--platform-rounds 5] [--platform-only]

The platform row is the median of --platform-rounds commands (goal: at most 1.8 s on 2
cores); --platform-only times that row (and the bare command) alone.
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


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, check=True, timeout=600)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--platform-rounds", type=int, default=5)
    parser.add_argument("--platform-only", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        job = work / "job.yaml"
        job.write_text("name: hi\njob: {kind: command, command: [echo, hi]}\n")
        run = [sys.executable, "-m", "gpuflow", "run", str(job)]
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        base.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's machine keeps bytecode: "warm"
        base["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
        base.pop("GPUFLOW_API_IDLE_S", None)  # the default: kept
        rows: dict[str, list[float]] = {"bare echo hi": [], "temporary API, cold": []}
        rows |= {"second command (kept)": [], "warm, not kept": [], "local platform up": []}
        down = [sys.executable, "-m", "gpuflow", "platform", "down"]
        for round_ in range(0 if args.platform_only else args.rounds):
            rows["bare echo hi"].append(timed(["echo", "hi"]))
            cold = dict(base, GPUFLOW_HOME=str(work / f"home{round_}"))
            cold |= {"PREFECT_HOME": str(work / f"prefect{round_}")}
            cold |= {"PYTHONPYCACHEPREFIX": str(work / f"pycache{round_}")}
            rows["temporary API, cold"].append(timed(run, cold))
            rows["second command (kept)"].append(timed(run, cold))
            timed(down, cold)  # stops the kept API
            not_kept = cold | {"GPUFLOW_HOME": str(work / f"home{round_}-not-kept")}
            not_kept |= {"GPUFLOW_API_IDLE_S": "0"}
            timed(run, not_kept)  # its bytecode and database are warm now
            rows["warm, not kept"].append(timed(run, not_kept))
        platform = dict(base, GPUFLOW_HOME=str(work / "platform-home"))
        timed([sys.executable, "-m", "gpuflow", "platform", "up", "--port", "4291"], platform)
        try:
            timed(run, platform)  # its bytecode warm, as a user's second command
            for _ in range(args.platform_rounds):
                rows["bare echo hi"].append(timed(["echo", "hi"]))
                rows["local platform up"].append(timed(run, platform))
        finally:
            timed(down, platform)
    bare = statistics.median(rows["bare echo hi"])
    print(f"{'':26}{'wall s':>9}{'min':>7}{'max':>7}{'- bare s':>10}{'x bare':>10}")
    for name, times in rows.items():
        if not times:
            continue
        wall = statistics.median(times)
        spread = f"{min(times):>7.2f}{max(times):>7.2f}"
        print(f"{name:26}{wall:>9.2f}{spread}{wall - bare:>10.2f}{wall / bare:>10.0f}")


if __name__ == "__main__":
    main()
