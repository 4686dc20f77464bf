"""Sampler overhead: CPU time the metrics sampler uses at 1 Hz, as a share of one core.

Measures this process's CPU time over the window with the sampler running, next to the
same window with no sampler, and prints both with the difference. Uses the real NVML
(and the GPUs) when present; --fake-gpus N stands a fake NVML in for N GPUs.
Target: under 1% of one core.

    python bench/sampler_overhead.py [--seconds 60] [--interval 1] [--fake-gpus 0]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cpu_share(seconds: float, sampler_factory) -> tuple[float, int]:
    start_cpu, start = time.process_time(), time.perf_counter()
    sampler = sampler_factory() if sampler_factory else None
    if sampler:
        sampler.start()
    time.sleep(seconds)
    if sampler:
        sampler.stop()
    used = time.process_time() - start_cpu
    return used / (time.perf_counter() - start) * 100.0, sampler.count if sampler else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--fake-gpus", type=int, default=0)
    args = parser.parse_args()

    from gpuflow.tasks import nvml
    from gpuflow.tasks.metrics.sampler import Sampler

    module = None
    if args.fake_gpus:
        spec = importlib.util.spec_from_file_location(
            "pynvml", ROOT / "tests" / "fakes" / "pynvml.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.config["gpus"] = args.fake_gpus
    gpus = [g.index for g in nvml.query(module).gpus]
    out = Path(tempfile.mkdtemp(prefix="gpuflow-sampler-")) / "samples.jsonl"

    idle, _ = cpu_share(args.seconds, None)
    busy, count = cpu_share(args.seconds, lambda: Sampler(out, gpus, args.interval, module))
    print(
        f"GPUs sampled: {len(gpus)} ({'fake NVML' if module else 'NVML' if gpus else 'none: host only'})"
    )
    print(f"{'':22}{'no sampler':>12}{'sampler':>12}")
    print(f"{'CPU % of one core':22}{idle:12.4f}{busy:12.4f}")
    print(f"samples taken: {count} in {args.seconds:.0f} s at {args.interval} s")
    print(f"sampler cost: {busy - idle:.4f} % of one core   target: < 1 %")


if __name__ == "__main__":
    main()
