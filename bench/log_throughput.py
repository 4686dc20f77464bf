"""Log throughput: lines per second from a job's stdout to the console and to the API.

Starts one temporary Prefect API for the bench, then runs `seq 1 N` bare and as a
gpuflow job (`gpuflow run`), and `echo hi` as a gpuflow job to learn the fixed cost of a
run. Lines/s = N / (wall of the seq run - wall of the echo run). Also counts the lines
that reached the console and the API: both must be N, in order.

    python bench/log_throughput.py [--lines 100000] [--rounds 2]
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


def gpuflow_run(work: Path, command: list[str], env: dict[str, str]) -> tuple[float, str]:
    job = work / "job.yaml"
    job.write_text(f"name: chatty\njob: {{kind: command, command: {command}}}\n")
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "gpuflow", "run", str(job)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return time.perf_counter() - started, out.stdout + out.stderr


def numbers_in(text: str, lines: int) -> int:
    """Return how many of 1..lines appear, in order, as lines of `text`."""
    want = 1
    for line in text.splitlines():
        if line.rsplit(" - ", 1)[-1].strip() == str(want):
            want += 1
    return want - 1


def api_lines(lines: int) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort, LogSort

    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
        messages: list[str] = []
        offset = 0
        while True:
            page = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])),
                sort=LogSort.TIMESTAMP_ASC,
                offset=offset,
                limit=200,
            )
            messages += [log.message for log in page]
            offset += len(page)
            if len(page) < 200:
                break
    return numbers_in("\n".join(messages), lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["GPUFLOW_HOME"] = str(work / "home")
        os.environ["PREFECT_HOME"] = str(work / "prefect")
        from gpuflow.tasks.platform import api

        server = api.start_temporary(lambda _: None, keep_s=0)
        env = dict(os.environ, PREFECT_API_URL=server.url)
        with api.using(server):
            bare, echo, chatty = [], [], []
            for _ in range(args.rounds):
                started = time.perf_counter()
                subprocess.run(["seq", "1", str(args.lines)], stdout=subprocess.DEVNULL, check=True)
                bare.append(time.perf_counter() - started)
                echo.append(gpuflow_run(work, ["echo", "hi"], env)[0])
                wall, console = gpuflow_run(work, ["seq", "1", str(args.lines)], env)
                chatty.append(wall)
            in_console = numbers_in(console, args.lines)
            in_api = api_lines(args.lines)
    fixed, wall = statistics.median(echo), statistics.median(chatty)
    rate = args.lines / max(wall - fixed, 1e-3)
    bare_rate = args.lines / statistics.median(bare)
    print(f"{'':24}{'wall s':>10}{'lines/s':>14}")
    print(f"{'bare seq':24}{statistics.median(bare):>10.3f}{bare_rate:>14,.0f}")
    print(f"{'gpuflow run echo hi':24}{fixed:>10.2f}{'':>14}")
    print(f"{'gpuflow run seq':24}{wall:>10.2f}{rate:>14,.0f}")
    print(f"bare / gpuflow lines/s: {bare_rate / rate:.1f}x")
    print(f"lines in order: console {in_console:,}/{args.lines:,}, API {in_api:,}/{args.lines:,}")


if __name__ == "__main__":
    main()
