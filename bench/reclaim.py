"""One reclaim pass over N runs' live series: seconds, against a real Prometheus.

Starts a Pushgateway (in memory) and a Prometheus scraping it every second on loopback,
and a temporary Prefect API; creates N running flow runs, pushes one live group per run
(2 GPUs each, written by gpuflow's exposition; every other run idle), waits until
Prometheus holds them for longer than the window, then times dry-run reclaim passes
(the Prometheus queries and the Prefect lookups of the idle runs). Prints 100 runs and N
side by side with the ratio, so the scaling shows through this machine's noise.

    python bench/reclaim.py [--runs 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WINDOW_S = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(argv: list[str], ready: str) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1200):
        try:
            urllib.request.urlopen(ready, timeout=1)
            return proc
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    raise RuntimeError(f"{argv[0]} did not start")


def sample(util: float) -> dict:
    return {
        "t": time.time(),
        "Hostname": "node-1",
        "host": {"cpu_percent": 10.0, "memory_used_bytes": 1 << 30},
        "gpus": [
            {"gpu": i, "UUID": f"GPU-{i}", "modelName": "NVIDIA H100 80GB HBM3",
             "DCGM_FI_DEV_GPU_UTIL": util, "DCGM_FI_DEV_FB_USED": 1024.0}
            for i in range(2)
        ],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["GPUFLOW_HOME"] = str(work / "home")
        os.environ["PREFECT_HOME"] = str(work / "prefect")
        gw_port, prom_port = free_port(), free_port()
        gateway = f"http://127.0.0.1:{gw_port}"
        prometheus = f"http://127.0.0.1:{prom_port}"
        pushgateway = shutil.which("prometheus-pushgateway") or "pushgateway"
        procs.append(
            serve(
                [pushgateway, f"--web.listen-address=127.0.0.1:{gw_port}", "--persistence.file="],
                f"{gateway}/-/ready",
            )
        )
        config = work / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: pushgateway\n"
            f"    honor_labels: true\n    static_configs: [{{targets: ['127.0.0.1:{gw_port}']}}]\n"
        )
        procs.append(
            serve(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                f"{prometheus}/-/ready",
            )
        )  # fmt: skip
        try:
            report(args, gateway, prometheus)
        finally:
            for proc in procs:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)


def report(args: argparse.Namespace, gateway: str, prometheus: str) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from gpuflow.tasks.metrics.prometheus import delete, exposition, push
    from gpuflow.tasks.platform import api
    from gpuflow.tasks.platform import reclaim as reclaiming

    @flow(name="bench-held")
    def held() -> None:
        return None

    server = api.start_temporary(lambda _: None, keep_s=0)
    results = {}
    with api.using(server), get_client(sync_client=True) as client:
        ids = [str(client.create_flow_run(held, state=Running()).id) for _ in range(args.runs)]
        settings = reclaiming.check(prometheus, 5.0, f"{WINDOW_S}s", "0s")
        for count in sorted({min(100, args.runs), args.runs}):
            pushed = time.perf_counter()
            for i, run_id in enumerate(ids[:count]):
                text = exposition(sample(0.0 if i % 2 == 0 else 80.0), None, run_id, f"job-{i % 7}")
                push(gateway, text, run_id, f"job-{i % 7}", "run")
            push_s = time.perf_counter() - pushed
            time.sleep(WINDOW_S + 3)  # scraped for longer than the window
            walls, found = [], []
            for _ in range(args.rounds):
                started = time.perf_counter()
                decided = reclaiming.reclaim_pass(settings, True, lambda line, loud: None)
                walls.append(time.perf_counter() - started)
                found.append(sum(d.action == "cancel" for d in decided))
            results[count] = (statistics.median(walls), found[-1], push_s)
            for i, run_id in enumerate(ids[:count]):
                delete(gateway, run_id, f"job-{i % 7}", "run")
            time.sleep(6)  # the deleted groups go stale before the next size
    print(f"{'runs':>6} {'pass s':>8} {'idle found':>11} {'push s':>8}")
    for count, (wall, idle, push_s) in results.items():
        print(f"{count:>6} {wall:>8.2f} {idle:>11} {push_s:>8.1f}")
    if len(results) == 2:
        (small, (a, _, _)), (big, (b, _, _)) = results.items()
        print(f"{big} / {small} runs: {big / small:.0f}x the runs, {b / a:.1f}x the pass time")


if __name__ == "__main__":
    main()
