"""Render orchestration cost as the frame count grows: a trivial scene (Workbench, 16x16)
rendered by the render flow at 100, 1,000 and 5,000 frames. Orchestration is the flow's
wall time less the time its Blender processes ran; printed per 1,000 frames next to the
number of chunks. Target: grows no faster than the chunks, under 5 s per 1,000 frames.

    python bench/render_scaling.py [--counts 100,1000,5000] [--chunk auto|N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--counts", default="100,1000,5000")
    parser.add_argument("--chunk", default="auto", help="frames per chunk, or auto")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    os.environ.setdefault("GPUFLOW_HOME", tempfile.mkdtemp(prefix="gpuflow-bench-"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    blender = shutil.which("blender") or sys.exit("blender is not installed")
    work = Path(tempfile.mkdtemp(prefix="render-scaling-"))
    scene = work / "trivial.blend"
    from gpuflow.tasks.render.scene import demo_scene

    demo_scene(
        blender,
        scene,
        max(counts),
        16,
        "bpy.context.scene.render.engine = 'BLENDER_WORKBENCH'",
    )

    from prefect.testing.utilities import prefect_test_harness

    from gpuflow.flows.render import render
    from gpuflow.tasks.pipeline.heartbeat import heartbeats_sent_by_gpuflow

    rows = []
    with prefect_test_harness(server_startup_timeout=120):
        for count in [10, *counts]:  # 10: warm-up
            out = work / f"out-{count}"
            spec = {
                "name": "scaling",
                "job": {
                    "kind": "render",
                    "scene": str(scene),
                    "output": f"file://{out}",
                    "frames": f"1-{count}",
                    "chunk": args.chunk,
                    "contact_sheet": False,
                    "preview_video": False,
                },
                "resources": {"gpus": 1, "allow_cpu": True},
                "metrics": {"plot": False},
            }
            start = time.perf_counter()
            with heartbeats_sent_by_gpuflow():  # as `gpuflow run` runs a flow
                job = render(spec).metrics.job
            wall = time.perf_counter() - start
            if count != 10:
                rows.append((count, job["chunks"], wall, job["blender_s"]))
            shutil.rmtree(out, ignore_errors=True)
    print(
        f"{'frames':>7}{'chunks':>8}{'flow s':>9}{'blender s':>11}{'orch. s':>9}{'orch. s/1000 fr':>17}"
    )
    for count, chunks, wall, blender_s in rows:
        orchestration = wall - blender_s
        per_1000 = orchestration * 1000 / count
        print(
            f"{count:7}{chunks:8}{wall:9.2f}{blender_s:11.2f}{orchestration:9.2f}{per_1000:17.2f}"
        )
    first, last = rows[0], rows[-1]
    print(
        f"orchestration grew {(last[2] - last[3]) / max(1e-9, first[2] - first[3]):.1f}x for"
        f" {last[1] / first[1]:.1f}x the chunks and {last[0] / first[0]:.0f}x the frames;"
        " target: no faster than the chunks, < 5 s per 1,000 frames"
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
