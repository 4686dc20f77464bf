"""Spot notice to saved state: seconds from an interruption notice appearing in the
instance metadata (AWS's amazon-ec2-metadata-mock, IMDSv2 only, on 127.0.0.1) to the
training having written its checkpoint and exited 75, per built-in model, against the
two minutes' warning the notice gives.

The training runs (CPU ranks, synthetic data); once it has logged 5 steps the mock is
started with its notice due 3 s later, gpuflow's NoticeWatcher polls at its real interval
(5 s) and the notice sends the job SIGTERM, as the agent does on an instance.

    python bench/spot_notice.py [--ranks 1] [--rounds 2] [--every 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from preempt_grace import MODELS, start_training, stop  # noqa: E402

from gpuflow.tasks.backends.ec2.imds import Imds, Notice, NoticeWatcher  # noqa: E402


def mock(port: int, delay_s: int) -> tuple[subprocess.Popen, float]:
    """Start the metadata mock with its spot notice due in `delay_s`; return it and when
    the notice appears."""
    import httpx

    binary = subprocess.run(
        ["bash", str(ROOT / "scripts" / "imds-mock.sh"), "path"],
        capture_output=True, text=True, check=True,
    ).stdout.split()[-1]  # fmt: skip
    started = time.perf_counter()
    argv = [binary, "spot", "-a", "terminate", "-d", str(delay_s), "-I", "-n", "127.0.0.1"]
    proc = subprocess.Popen(
        [*argv, "-p", str(port)],
        cwd=tempfile.mkdtemp(prefix="gpuflow-aemm-"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ask = {"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    while True:
        try:
            if (
                httpx.put(f"http://127.0.0.1:{port}/latest/api/token", headers=ask).status_code
                == 200
            ):
                return proc, started + delay_s
        except httpx.HTTPError:
            time.sleep(0.02)


def one(work: Path, model: str, ranks: int, every_s: float) -> tuple[float, float, float, int]:
    import socket

    training, _ = start_training(work, model, ranks)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # the notice appears 3 s after the mock starts: somewhere in a poll interval, as on an
    # instance (the watcher polls from the start)
    service, noticed = mock(port, 3)
    seen: list[tuple[float, Notice]] = []
    told = threading.Event()

    def on_notice(notice: Notice) -> None:
        if notice.kind.startswith("spot-"):
            seen.append((time.perf_counter(), notice))
            told.set()

    try:
        with NoticeWatcher(Imds(f"http://127.0.0.1:{port}"), on_notice, every_s=every_s):
            told.wait(60)
            exited, code = stop(training)
    finally:
        os.kill(service.pid, signal.SIGTERM)
        service.wait(timeout=10)
    at, notice = seen[0]
    warning = (notice.at - notice.seen_at).total_seconds()
    return at - noticed, exited, warning, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--every", type=float, default=5.0, help="poll interval, s (5)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuflow-spot-"))
    print(
        f"{'model':12}{'exit':>6}{'notice seen, s':>16}{'SIGTERM->exit, s':>18}"
        f"{'total, s':>10}{'warning, s':>12}{'used':>8}"
    )
    for model in MODELS:
        for _ in range(args.rounds):
            seen_s, exit_s, warning, code = one(work, model, args.ranks, args.every)
            total = seen_s + exit_s
            print(
                f"{model:12}{code:6d}{seen_s:16.2f}{exit_s:18.2f}{total:10.2f}{warning:12.0f}"
                f"{total / warning:8.1%}"
            )


if __name__ == "__main__":
    main()
