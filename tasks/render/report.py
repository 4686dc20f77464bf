"""What a render shows: a contact sheet of its frames, a preview video, per-frame times."""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
from pathlib import Path

from gpuflow.tasks.outputs import read_result
from gpuflow.tasks.pictures import picture
from gpuflow.tasks.render.output import FrameRecord
from gpuflow.tasks.render.result import RenderResult

SHEET_MAX = 48  # thumbnails on one contact sheet


def sheet_frames(frames: list[int], limit: int = SHEET_MAX) -> list[int]:
    """Return up to `limit` frames spread evenly over `frames`, first and last included."""
    if len(frames) <= limit:
        return list(frames)
    step = (len(frames) - 1) / (limit - 1)
    return sorted({frames[round(i * step)] for i in range(limit)})


def contact_sheet(thumbnails: dict[int, Path], target: Path, title: str) -> Path | None:
    """Draw the thumbnails in a grid with their frame numbers; None when there are none."""
    from PIL import Image, ImageDraw

    if not thumbnails:
        return None
    images = {frame: Image.open(path).convert("RGB") for frame, path in sorted(thumbnails.items())}
    width = max(i.width for i in images.values()) + 8
    height = max(i.height for i in images.values()) + 22
    columns = min(8, len(images))
    rows = math.ceil(len(images) / columns)
    sheet = Image.new("RGB", (max(columns * width + 8, 240), rows * height + 30), "#202020")
    draw = ImageDraw.Draw(sheet)
    draw.text((8, 8), title, fill="#ffffff")
    for i, (frame, image) in enumerate(images.items()):
        x, y = 8 + (i % columns) * width, 30 + (i // columns) * height
        sheet.paste(image, (x, y))
        draw.text((x, y + image.height + 2), f"{frame}", fill="#dddddd")
    target.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(target)
    return target


def preview_video(thumbnails: dict[int, Path], target: Path, fps: float) -> Path | None:
    """Encode the thumbnails in frame order as an H.264 MP4 with ffmpeg; None without
    ffmpeg or with fewer than two frames."""
    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None or len(thumbnails) < 2:
        return None
    with tempfile.TemporaryDirectory() as scratch:
        listing = Path(scratch) / "frames.txt"
        listing.write_text(
            "".join(
                f"file '{Path(p).as_posix()}'\nduration {1 / fps:.6f}\n"
                for _, p in sorted(thumbnails.items())
            )
        )
        done = subprocess.run(
            [
                ffmpeg,
                "-y",
                "-loglevel",
                "error",
                "-f",
                "concat",
                "-safe",
                "0",
                "-i",
                str(listing),
                "-vf",
                "pad=ceil(iw/2)*2:ceil(ih/2)*2",
                "-pix_fmt",
                "yuv420p",
                str(target),
            ],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=300,
        )
    return target if done.returncode == 0 and target.is_file() else None


def frame_rows(records: list[FrameRecord]) -> list[dict[str, object]]:
    """Return one table row per frame: its time, chunk and where it is."""
    return [
        {
            "frame": r.frame,
            "seconds": round(r.seconds, 3) if r.seconds is not None else None,
            "chunk": r.chunk if r.chunk is not None else "earlier run",
            "bytes": r.size,
            "url": r.url,
        }
        for r in sorted(records, key=lambda r: r.frame)
    ]


TABLE_MAX_ROWS = 2000


def summary(outputs: Path, out: Path, name: str) -> list[str]:
    """Publish the per-frame table artifact; return the summary's render lines."""
    import json

    from prefect.artifacts import create_table_artifact

    from gpuflow.tasks.api_client import publish

    lines: list[str] = []
    frames_file = out / "outputs" / "frames.json"
    records = (
        [FrameRecord.model_validate(r) for r in json.loads(frames_file.read_text())]
        if frames_file.is_file()
        else []
    )
    rows = frame_rows(records)
    if rows:
        shown = rows[:TABLE_MAX_ROWS]
        more = f" (first {len(shown)} of {len(rows)})" if len(rows) > len(shown) else ""
        publish(
            create_table_artifact,
            key="gpuflow-render-frames",
            table=shown,
            description=f"Per-frame render times for {name}{more}",
        )
    figures = read_result(out / "outputs" / "result.json", RenderResult)
    if figures is not None:
        lines.append(
            f"- frames: {figures.frames_rendered} rendered, {figures.frames_skipped}"
            f" already in storage, {figures.frames_missing} missing, of {figures.frames}"
            f" ({figures.chunks} chunks, {figures.frames_per_s} frames/s,"
            f" Blender {figures.blender}, {figures.engine})"
        )
        lines.append(f"- output: `{figures.output}`")
    sheet, preview = out / "outputs" / "contact-sheet.png", out / "outputs" / "preview.mp4"
    if sheet.is_file():
        lines.append(picture("contact sheet", sheet))
    if preview.is_file():
        lines.append(f"- preview: `{preview}`")
    return lines
