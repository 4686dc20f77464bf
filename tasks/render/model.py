"""The `job:` section of a render spec (kind `render`)."""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from gpuflow.tasks.render.argv import DEVICES, ENGINES, FORMATS
from gpuflow.tasks.render.frames import FrameSpecError, parse_frames
from gpuflow.tasks.spec import SpecModel, StorageUrl


def _chunk(value: Any) -> Any:
    if value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{value!r} is not a chunk size; give a whole number of frames of at least 1, or auto"
        )
    return value


class RenderJob(SpecModel):
    """Render frames of a Blender scene: chunks of frames, one Blender process per chunk."""

    kind: Literal["render"] = "render"
    scene: str = Field(
        description="The .blend, or a folder or .zip with it and its assets: a local path,"
        " file:/// or s3:// URL."
    )
    blend: str | None = Field(None, description="Which .blend in a folder or .zip holding several.")
    frames: str | None = Field(
        None, description='Frames, e.g. "1-240", "1,5,9", "1-240x10"; default: the scene\'s range.'
    )
    output: StorageUrl = Field(description="Prefix the frames are uploaded to.")
    pattern: str = Field(
        "frame_####", description="Frame file name; # runs become the frame number."
    )
    engine: str | None = Field(
        None, description="CYCLES, EEVEE or WORKBENCH; default: the scene's."
    )
    device: str | None = Field(
        None, description="Cycles device: CPU, CUDA, OPTIX, HIP, ONEAPI, METAL."
    )
    samples: int | None = Field(None, ge=1, le=1_000_000)
    resolution_x: int | None = Field(None, ge=4, le=65536)
    resolution_y: int | None = Field(None, ge=4, le=65536)
    resolution_percentage: int | None = Field(None, ge=1, le=1000)
    threads: int | None = Field(None, ge=1, le=1024, description="Render threads per Blender.")
    file_format: str | None = Field(
        None, description="PNG, JPEG, OPEN_EXR, TIFF, ...; default: the scene's."
    )
    denoise: bool | None = Field(None, description="Cycles denoising on/off; default: the scene's.")
    chunk: Annotated[int | Literal["auto"], BeforeValidator(_chunk)] = Field(
        "auto", description="Frames per Blender process, or auto (measured start-up vs frame time)."
    )
    max_workers: int | None = Field(
        None, ge=1, le=64, description="Chunks at once; default: one per GPU, or 1 without GPUs."
    )
    missing_files: Literal["fail", "warn"] = Field(
        "fail", description="When the scene refers to files that are not there."
    )
    frames_outside_scene: Literal["fail", "warn"] = Field(
        "fail", description="When job.frames asks for frames outside the scene's range."
    )
    blender: str = Field("blender", description="The Blender program: a name on PATH or a path.")
    chunk_retries: int = Field(2, ge=0, le=20, description="Retries of a chunk that crashed.")
    contact_sheet: bool = True
    preview_video: bool = Field(True, description="Make preview.mp4 when ffmpeg is installed.")
    torch: bool = False

    @field_validator("scene")
    @classmethod
    def _scene(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("is empty; give the .blend as a local path, file:/// or s3:// URL")
        if value.startswith("s3://") and not re.match(r"^s3://[^/]+/.+", value):
            raise ValueError(f"{value!r} names no object; write s3://bucket/path/scene.blend")
        if "://" in value and not value.startswith(("s3://", "file:///")):
            raise ValueError(
                f"{value!r} is not a path or storage URL; use a path, file:/// or s3://"
            )
        return value

    @field_validator("frames")
    @classmethod
    def _frames(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_frames(value)
            except FrameSpecError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("engine", "device", "file_format")
    @classmethod
    def _known_name(cls, value: str | None, info: Any) -> str | None:
        if value is None:
            return value
        known = {"engine": ENGINES, "device": DEVICES, "file_format": FORMATS}[info.field_name]
        if value.upper() not in known:
            close = difflib.get_close_matches(value.upper(), list(known), n=1, cutoff=0.75)
            hint = f"did you mean {close[0]}? " if close else ""
            if info.field_name == "device" and value.upper() == "GPU":
                hint = "name the kind of GPU (CUDA or OPTIX for NVIDIA, HIP for AMD); "
            raise ValueError(
                f"{value!r} is not known; {hint}use one of {', '.join(dict.fromkeys(known))}"
            )
        return value.upper()

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, value: str) -> str:
        parts = value.split("/")
        if not value.strip() or value.startswith("/") or ".." in parts or not parts[-1]:
            raise ValueError(
                f"{value!r} is not a file name under job.output; write e.g. frame_#### or shot1/frame_####"
            )
        return value
