"""Blender command lines, built as argv lists (never through a shell). Pure.

Order matters to Blender: the .blend first, then engine, output and format, then
settings (a --python-expr), then the frames to render, and Cycles' device after `--`.
"""

from __future__ import annotations

import re
from pathlib import PurePath

from pydantic import BaseModel

ENGINES = {
    "CYCLES": "CYCLES",
    "EEVEE": "BLENDER_EEVEE",
    "BLENDER_EEVEE": "BLENDER_EEVEE",
    "BLENDER_EEVEE_NEXT": "BLENDER_EEVEE_NEXT",
    "WORKBENCH": "BLENDER_WORKBENCH",
    "BLENDER_WORKBENCH": "BLENDER_WORKBENCH",
}
DEVICES = ("CPU", "CUDA", "OPTIX", "HIP", "ONEAPI", "METAL")
FORMATS = {
    "PNG": "PNG",
    "JPEG": "JPEG",
    "JPG": "JPEG",
    "OPEN_EXR": "OPEN_EXR",
    "EXR": "OPEN_EXR",
    "OPEN_EXR_MULTILAYER": "OPEN_EXR_MULTILAYER",
    "TIFF": "TIFF",
    "BMP": "BMP",
    "WEBP": "WEBP",
    "TARGA": "TARGA",
    "TARGA_RAW": "TARGA_RAW",
    "HDR": "HDR",
    "JPEG2000": "JPEG2000",
    "CINEON": "CINEON",
    "DPX": "DPX",
    "IRIS": "IRIS",
}
# Blender's extension for each image format (use_file_extension is always on).
EXTENSIONS = {
    "PNG": ".png",
    "JPEG": ".jpg",
    "OPEN_EXR": ".exr",
    "OPEN_EXR_MULTILAYER": ".exr",
    "TIFF": ".tif",
    "BMP": ".bmp",
    "WEBP": ".webp",
    "TARGA": ".tga",
    "TARGA_RAW": ".tga",
    "HDR": ".hdr",
    "JPEG2000": ".jp2",
    "CINEON": ".cin",
    "DPX": ".dpx",
    "IRIS": ".rgb",
}
# Blender's -F option has its own names for some formats; an unknown one is ignored
# without a word (the scene's format is used), so the mapping must be exact.
CLI_FORMATS = {"TARGA": "TGA", "TARGA_RAW": "RAWTGA", "JPEG2000": "JP2"}
MOVIE_FORMATS = ("FFMPEG", "AVI_JPEG", "AVI_RAW")
_HASHES = re.compile(r"#+")


class RenderSettings(BaseModel):
    """What a render may override in the .blend; None keeps the scene's own value."""

    engine: str | None = None
    device: str | None = None
    samples: int | None = None
    resolution_x: int | None = None
    resolution_y: int | None = None
    resolution_percentage: int | None = None
    threads: int | None = None
    file_format: str | None = None
    denoise: bool | None = None


def safe_path(path: str) -> str:
    """Return `path` so Blender cannot read it as an option (a leading dash gets ./)."""
    return f"./{path}" if path.startswith("-") else path


def output_pattern(pattern: str) -> tuple[str, str | None]:
    """Return an output pattern with a frame placeholder, and a note when one was added."""
    if "#" in PurePath(pattern).name:
        return pattern, None
    fixed = f"{pattern}_####" if not pattern.endswith("/") else f"{pattern}frame_####"
    return fixed, f"the output pattern {pattern!r} had no # frame placeholder; using {fixed!r}"


def frame_filename(pattern: str, frame: int, extension: str) -> str:
    """Return the file Blender writes for `frame`: the last # run becomes the frame number,
    zero-padded to its length (four digits appended when there is none), plus the extension."""
    runs = list(_HASHES.finditer(pattern))
    if not runs:
        return f"{pattern}{frame:04d}{extension}"
    last = runs[-1]
    return (
        f"{pattern[: last.start()]}{frame:0{len(last.group())}d}{pattern[last.end() :]}{extension}"
    )


def settings_expr(settings: RenderSettings) -> str:
    """Return the --python-expr that applies the overrides (file extensions always on, so
    gpuflow knows each frame's file name)."""
    lines = ["import bpy", "s = bpy.context.scene", "r = s.render", "r.use_file_extension = True"]
    if settings.resolution_x is not None:
        lines.append(f"r.resolution_x = {int(settings.resolution_x)}")
    if settings.resolution_y is not None:
        lines.append(f"r.resolution_y = {int(settings.resolution_y)}")
    if settings.resolution_percentage is not None:
        lines.append(f"r.resolution_percentage = {int(settings.resolution_percentage)}")
    if settings.threads is not None:
        lines += ["r.threads_mode = 'FIXED'", f"r.threads = {int(settings.threads)}"]
    if settings.samples is not None:
        lines += [
            f"s.cycles.samples = {int(settings.samples)}",
            "if hasattr(s, 'eevee'): s.eevee.taa_render_samples = " + str(int(settings.samples)),
        ]
    if settings.denoise is not None:
        lines.append(f"s.cycles.use_denoising = {bool(settings.denoise)}")
    return "\n".join(lines)


def render_argv(
    blender: str,
    scene: str,
    output: str,
    frames: str,
    settings: RenderSettings,
) -> list[str]:
    """Return the argv that renders `frames` (Blender syntax, e.g. "1..4,9") of `scene`."""
    argv = [blender, "-b", safe_path(scene)]
    if settings.engine:
        argv += ["-E", ENGINES[settings.engine.upper()]]
    argv += ["-o", safe_path(output)]
    if settings.file_format:
        file_format = FORMATS[settings.file_format.upper()]
        argv += ["-F", CLI_FORMATS.get(file_format, file_format)]
    argv += ["--python-expr", settings_expr(settings)]
    argv += ["-f", frames]
    if settings.device:
        argv += ["--", "--cycles-device", settings.device.upper()]
    return argv
