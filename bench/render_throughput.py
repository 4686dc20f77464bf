"""Render throughput: the same N frames (a) by one bare Blender process, (b) by the render
flow with automatic chunks, (c) by one Blender process per frame. Prints frames/s and
the ratios. Targets: (b) >= 0.85x (a) at 24 frames, >= 0.95x (a) with --long; (b) >= 3x (c).

The three alternate in each round so that machine noise hits all of them; (b) runs
against a warm API with its output emptied each round; with --cold its scene cache is
emptied too, so it also pays the Blender call that inspects the scene (about one start-up).

    python bench/render_throughput.py [--frames 24] [--size 128] [--samples 256] [--rounds 3] [--cold]
    python bench/render_throughput.py --long   # 240 frames, one chunk per CPU

--long renders 240 frames at 960 samples with one worker per CPU, each given one chunk of
240/CPUs frames (job.max_workers, job.chunk). Measured on 2 cores: about 0.2 s a frame
(Cycles' adaptive sampling stops early, so 384 samples cost about the same); longer frames
only lower the share of the flow's fixed cost. (c), a Blender per frame, is left out there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", action="store_true", help="240 frames, one chunk per CPU")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="empty the scene cache before each flow run, so (b) pays Blender's scene inspection",
    )
    args = parser.parse_args()
    workers, chunk = None, "auto"
    if args.long:
        args.frames, args.samples = 240, 960
        workers = os.cpu_count() or 1
        chunk = -(-args.frames // workers)
    home = Path(os.environ.setdefault("GPUFLOW_HOME", tempfile.mkdtemp(prefix="gpuflow-bench-")))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    blender = shutil.which("blender") or sys.exit("blender is not installed")
    work = Path(tempfile.mkdtemp(prefix="render-bench-"))
    scene = work / "scene.blend"
    from gpuflow.tasks.render.scene import demo_scene

    demo_scene(
        blender,
        scene,
        args.frames,
        args.size,
        f"bpy.context.scene.cycles.samples = {args.samples}",
    )

    from prefect.testing.utilities import prefect_test_harness

    from gpuflow.flows.render import render
    from gpuflow.tasks.pipeline.heartbeat import heartbeats_sent_by_gpuflow

    def bare() -> float:
        out = work / "bare"
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        subprocess.run(
            [blender, "-b", str(scene), "-o", f"{out}/f_####", "-s", "1", "-e", str(args.frames), "-a"],
            check=True,
            capture_output=True,
        )  # fmt: skip
        return time.perf_counter() - start

    def per_frame() -> float:
        out = work / "single"
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        for frame in range(1, args.frames + 1):
            subprocess.run(
                [blender, "-b", str(scene), "-o", f"{out}/f_####", "-f", str(frame)],
                check=True,
                capture_output=True,
            )
        return time.perf_counter() - start

    chunks: list[int] = []

    def flow() -> float:
        out = work / "flow"
        shutil.rmtree(out, ignore_errors=True)
        if args.cold:
            shutil.rmtree(home / "cache", ignore_errors=True)
        spec = {
            "name": "bench",
            "job": {
                "kind": "render",
                "scene": str(scene),
                "output": f"file://{out}",
                "chunk": chunk,
                "max_workers": workers,
            },
            "resources": {"gpus": 1, "allow_cpu": True},
            "metrics": {"plot": False},
        }
        start = time.perf_counter()
        with heartbeats_sent_by_gpuflow():  # as `gpuflow run` runs a flow
            result = render(spec)
        elapsed = time.perf_counter() - start
        chunks.append(result.metrics.job["chunks"])
        return elapsed

    with prefect_test_harness(server_startup_timeout=120):
        flow()  # warm-up: the API, imports
        times: dict[str, list[float]] = {"a": [], "b": [], "c": []}
        for _ in range(args.rounds):
            times["a"].append(bare())
            times["b"].append(flow())
            if not args.long:
                times["c"].append(per_frame())
    n = args.frames
    rate = {k: n / statistics.median(v) for k, v in times.items() if v}
    cache = "cold: scene inspected every run" if args.cold else "warm: scene inspection cached"
    print(
        f"{args.frames} frames, {args.size}x{args.size}, Cycles {args.samples} samples, CPU; {cache}"
    )
    print(f"{'':28}{'median s':>10}{'frames/s':>10}   rounds")
    names = {
        "a": "(a) one bare blender -a",
        "b": "(b) render flow, auto",
        "c": "(c) blender per frame",
    }
    for key, label in names.items():
        if not times[key]:
            continue
        rounds = " ".join(f"{t:.2f}" for t in times[key])
        print(f"{label:28}{statistics.median(times[key]):10.2f}{rate[key]:10.2f}   {rounds}")
    print(f"chunks chosen by the flow: {chunks[1:]}")
    print(f"(b)/(a) = {rate['b'] / rate['a']:.2f}  target >= {0.95 if args.long else 0.85}")
    if "c" in rate:
        print(f"(b)/(c) = {rate['b'] / rate['c']:.2f}  target >= 3")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
