"""Failure classifier vs log streaming: lines per second on a 100 MB log.

Streams a generated 100 MB job log (training lines with a CUDA OOM traceback near the end)
through the local backend as a real job (`cat`), three ways, and prints them side by side:

  stream      the backend's streaming alone: every line to a no-op sink
  as run      streaming, then the classifier over the unit's tail, as the run stage does
  every line  streaming with the classifier applied to each line as it arrives (what
              gpuflow avoids: shown to size the cost it would add)

plus the classifier alone over every line of the file without its traceback (no
streaming; nothing matches, so every row reads every line: its worst case). Ratios are to
`stream`; timings here are noisy, so compare ratios, and run it twice.

    python bench/classifier.py [--mb 100] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LINES = [
    "step {i} loss 2.3{j} lr 0.000{j} throughput 1843.{j} samples/s data_wait 0.01{j}s",
    "[rank0] epoch 3 shard s3://bucket/datasets/cnn/shard-{i:06d}.tar done",
    "W1130 18:00:0{j} torch/distributed/elastic: heartbeat ok ({i})",
]
TAIL = [
    "Traceback (most recent call last):",
    '  File "train.py", line 88, in <module>',
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB"
    " total capacity; 77.02 GiB already allocated; 1.10 GiB free)",
]


def write_log(path: Path, megabytes: int) -> int:
    want = megabytes * 1_000_000
    lines = 0
    with path.open("w") as out:
        size = 0
        while size < want:
            chunk = "".join(
                LINES[k % 3].format(i=lines + k, j=k % 10) + "\n" for k in range(10_000)
            )
            out.write(chunk)
            size += len(chunk)
            lines += 10_000
        out.write("\n".join(TAIL) + "\n")
    return lines + len(TAIL)


def stream(log: Path, per_line) -> tuple[float, object]:
    """Run `cat log` as a job on the local backend; return the wall time and the diagnosis."""
    from gpuflow.tasks.backends.local.backend import LocalBackend
    from gpuflow.tasks.contract import WorkUnit, owner_labels
    from gpuflow.tasks.diagnose import diagnose
    from gpuflow.tasks.kinds import registry  # noqa: F401 - registers the kinds' job models
    from gpuflow.tasks.spec import load_spec

    spec = load_spec({"name": "bench", "job": {"kind": "command", "command": ["true"]}})
    backend = LocalBackend()
    cluster = backend.provision(spec, owner_labels(f"bench-{time.time_ns()}", "bench"))
    try:
        started = time.perf_counter()
        result = backend.run(
            cluster, WorkUnit(name="main", command=["cat", str(log)]), {}, 3600, per_line
        )
        found = diagnose(1, None, result.log_tail) if per_line is not _noop else None
        wall = time.perf_counter() - started
    finally:
        backend.teardown(cluster)
    return wall, found


def _noop(stream_name: str, line: str) -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from gpuflow.tasks.diagnose import match

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["GPUFLOW_HOME"] = str(Path(tmp) / "home")
        log = Path(tmp) / "job.log"
        lines = write_log(log, args.mb)
        walls: dict[str, list[float]] = {"stream": [], "as run": [], "every line": []}
        found = {}

        def as_run(stream_name: str, line: str) -> None:
            return None

        def every_line(stream_name: str, line: str) -> None:
            if (hit := match([line])) is not None:
                found["every line"] = hit

        for _ in range(args.rounds):
            walls["stream"].append(stream(log, _noop)[0])
            wall, found["as run"] = stream(log, as_run)
            walls["as run"].append(wall)
            walls["every line"].append(stream(log, every_line)[0])
        text = log.read_text().splitlines()[: -len(TAIL)]
        started = time.perf_counter()
        alone = match(text)
        alone_s = time.perf_counter() - started
    base = statistics.median(walls["stream"])
    print(f"{lines:,} lines, {args.mb} MB, {args.rounds} round(s), median wall")
    print(f"{'way':<12} {'seconds':>8} {'lines/s':>12} {'vs stream':>10}  diagnosis")
    for way, times in walls.items():
        wall = statistics.median(times)
        hit = found.get(way)
        said = hit.kind if hit is not None else "-"
        print(f"{way:<12} {wall:8.2f} {lines / wall:12,.0f} {wall / base:9.2f}x  {said}")
    print(
        f"{'match alone':<12} {alone_s:8.2f} {lines / alone_s:12,.0f} {alone_s / base:9.2f}x"
        f"  {alone.kind if alone else '-'}"
    )


if __name__ == "__main__":
    main()
