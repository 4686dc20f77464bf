"""The figures a render writes to outputs/result.json: the render stage writes them through
this model and the render kind reads them through it."""

from __future__ import annotations

from pydantic import BaseModel


class RenderResult(BaseModel):
    """A render's figures: frames planned, skipped (already in storage), rendered, missing."""

    frames: int
    frames_skipped: int
    frames_rendered: int
    frames_missing: int
    chunks: int
    blender_invocations: int
    render_s: float
    blender_s: float
    frames_per_s: float
    mean_frame_s: float
    blender: str
    engine: str
    output: str
