"""Preemption grace: seconds from SIGTERM to a saved checkpoint and exit 75, per built-in model.

Runs the training launcher (torchrun, --ranks CPU ranks) on a synthetic data set in a
temporary folder, sends SIGTERM to its process group after a few steps, as a spot reclaim
or a Kubernetes eviction would, and times the exit. This is what limits.stop_grace_s and
terminationGracePeriodSeconds must cover (with a margin for slower storage).

    python bench/preempt_grace.py [--ranks 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = {
    "small_cnn": ("classify", {}, "synthetic:classify?samples=512"),
    "tiny_lm": ("lm", {}, "synthetic:lm?samples=512"),
}


def start_training(work: Path, model: str, ranks: int) -> tuple[subprocess.Popen, int]:
    """Start the training launcher on `model` in a session of its own; return it once it
    has logged 5 steps, with the model's parameter count."""
    task, args, source = MODELS[model]
    from gpuflow.tasks.storage import FileStore
    from gpuflow.tasks.training.prepare import prepare

    data = f"file://{work}/{model}-data"
    prepare(source, data, 20_000, FileStore())
    job = {
        "kind": "train",
        "dataset": data,
        "output": f"file://{work}/{model}-out-{time.time_ns()}",
        "model": f"gpuflow.tasks.training.models:{model}",
        "model_args": args,
        "task": task,
        "batch_size": 16,
        "max_steps": 100_000,
        "num_workers": 1,
        "cpu_processes": ranks,
        "log_every": 1,
        "checkpoint": {"every_steps": 100_000, "every_minutes": None},
    }
    workspace = work / f"ws-{time.time_ns()}"
    (workspace / "outputs").mkdir(parents=True)
    env = dict(
        os.environ, GPUFLOW_WORKSPACE=str(workspace), GPUFLOW_OUTPUT_DIR=str(workspace / "outputs")
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuflow.tasks.training.launch", "--job-json", json.dumps(job)],
        env=env,
        cwd=workspace,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    metrics = workspace / "outputs" / "train_metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 5:
        time.sleep(0.05)
    params = sum(
        p.numel()
        for p in __import__("gpuflow.tasks.training.models", fromlist=[model])
        .__dict__[model]()
        .parameters()
    )
    return proc, params


def stop(proc: subprocess.Popen) -> tuple[float, int]:
    """SIGTERM the training's process group; return seconds until it exited, and its code."""
    start = time.perf_counter()
    os.killpg(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=300)
    return time.perf_counter() - start, code


def one(work: Path, model: str, ranks: int) -> tuple[float, int, int]:
    proc, params = start_training(work, model, ranks)
    seconds, code = stop(proc)
    return seconds, code, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuflow-grace-"))
    print(f"{'model':12}{'parameters':>12}{'exit':>6}{'SIGTERM -> exit, s (each round)':>36}")
    for model in MODELS:
        times, code, params = [], None, 0
        for _ in range(args.rounds):
            seconds, code, params = one(work, model, args.ranks)
            times.append(seconds)
        print(f"{model:12}{params:12,d}{code:6d}{'  '.join(f'{t:.2f}' for t in times):>36}")


if __name__ == "__main__":
    main()
