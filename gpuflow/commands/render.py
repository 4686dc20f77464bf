"""`gpuflow render SCENE --out URL` and `gpuflow demo render`: Blender frames to storage."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gpuflow.commands.common import EXIT_INVALID, add_job_options, number, spec_from
from gpuflow.commands.jobs import run_job

HELP = "render a Blender scene's frames to storage"


def add(commands: Any) -> list[tuple[str, str]]:
    rend = commands.add_parser("render", description=HELP[0].upper() + HELP[1:] + ".")
    rend.add_argument("scene", help="a .blend, folder or .zip: a local path, file:/// or s3:// URL")
    rend.add_argument("--frames", help="e.g. 1-240, 1,5,9 or 1-240x10 (default: the scene's)")
    rend.add_argument("--out", required=True, help="file:///path or s3://bucket/prefix")
    rend.add_argument("--engine", help="CYCLES, EEVEE or WORKBENCH (default: the scene's)")
    rend.add_argument("--device", help="Cycles device: CPU, CUDA, OPTIX, HIP, ONEAPI")
    rend.add_argument("--samples", type=number(1, 1 << 24))
    rend.add_argument("--resolution-percentage", type=number(1, 32767))
    rend.add_argument("--format", dest="file_format", help="PNG, OPEN_EXR, JPEG, TIFF, ...")
    rend.add_argument("--chunk", default="auto", help="frames per Blender process, or auto")
    rend.add_argument("--workers", dest="max_workers", type=number(1, 4096), help="chunks at once")
    rend.add_argument("--pattern", help="frame file name, e.g. shot1/frame_####")
    rend.add_argument("--blender", help="the Blender program (default: blender on PATH)")
    rend.add_argument(
        "--allow-missing-files",
        action="store_true",
        help="render although the scene refers to files that are not there",
    )
    add_job_options(rend, "render", gpus=1)
    rend.set_defaults(handler=lambda args: run_job(render_spec(args)))
    return [("render", HELP)]


def render_spec(args: argparse.Namespace) -> dict:
    """Return the job spec the `render` options describe."""
    scene = args.scene
    if "://" not in scene:
        scene = str(Path(scene).expanduser().absolute())
    job: dict = {"kind": "render", "scene": scene, "output": args.out, "chunk": args.chunk}
    if args.allow_missing_files:
        job["missing_files"] = "warn"
    options = ("frames", "engine", "device", "samples", "resolution_percentage", "file_format")
    return spec_from(args, job, (*options, "max_workers", "blender", "pattern"))


def render_demo() -> int:
    """Build a small animated scene with Blender and render it to $GPUFLOW_HOME/renders."""
    from gpuflow.tasks.host import gpuflow_home, resolve_program

    blender = resolve_program("blender")
    if blender is None:
        print(
            "gpuflow: the render demo needs Blender; install it (apt-get install blender) or"
            " run `bash scripts/demo.sh render`.",
            file=sys.stderr,
        )
        return EXIT_INVALID
    from gpuflow.tasks.render.scene import demo_scene

    home = gpuflow_home()
    scene = home / "demo" / "turning-cube.blend"
    if not scene.is_file():
        demo_scene(blender, scene, 24, 96)
    out = f"file://{home / 'renders' / 'demo'}"
    print(f"rendering {scene} (24 frames) to {out}")
    return run_job(
        {
            "name": "render-demo",
            "job": {"kind": "render", "scene": str(scene), "output": out, "frames": "1-24"},
            "resources": {"gpus": 1, "allow_cpu": True},
        }
    )
