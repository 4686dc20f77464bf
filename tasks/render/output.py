"""Rendered frames in storage: which are already there and valid, and uploading new ones
as Blender saves them (checked, checksummed, thumbnailed when the contact sheet wants them).
"""

from __future__ import annotations

import contextlib
import queue
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from gpuflow.tasks.render import logparse
from gpuflow.tasks.render.argv import frame_filename
from gpuflow.tasks.render.images import check_image
from gpuflow.tasks.render.thumbs import thumbnail_rgb
from gpuflow.tasks.storage import FileStore, ObjectInfo, S3Store, join

THUMB_PX = 160
# What a chunk rendering in a pod prints for each frame it put in storage (a FrameRecord
# as JSON), and for each frame it could not (the frame, then why): gpuflow.tasks.render.pod_chunk.
FRAME_MARK = "@@gpuflow-frame"
FRAME_PROBLEM_MARK = "@@gpuflow-frame-problem"


class FrameRecord(BaseModel):
    frame: int
    url: str
    size: int
    sha256: str | None = None
    seconds: float | None = None  # Blender's render time for the frame
    chunk: int | None = None  # None: found from an earlier run
    thumbnail: str | None = None


def frame_url(output: str, pattern: str, frame: int, extension: str) -> str:
    return join(output, frame_filename(pattern, frame, extension))


def existing_frames(
    store: FileStore | S3Store,
    output: str,
    pattern: str,
    frames: list[int],
    extension: str,
    file_format: str,
) -> tuple[dict[int, FrameRecord], list[str]]:
    """Return the frames already present and valid under `output`, and one note per frame
    that is present but broken (it will be rendered again).

    Objects gpuflow uploaded carry their sha256 (checked before upload) and are trusted;
    anything else is read and checked as an image."""
    listed: dict[str, ObjectInfo] = {o.url: o for o in store.list(output)}
    found: dict[int, FrameRecord] = {}
    broken: list[str] = []
    for frame in frames:
        url = frame_url(output, pattern, frame, extension)
        info = listed.get(url)
        if info is None:
            continue
        problem = "is empty" if info.size == 0 else None
        sha = None
        if problem is None and isinstance(store, S3Store):
            sha = store.checksum(url)
        if problem is None and sha is None:
            problem = _check_stored(store, url, file_format)
        if problem:
            broken.append(f"frame {frame} ({url}) {problem}; rendering it again")
            continue
        found[frame] = FrameRecord(frame=frame, url=url, size=info.size, sha256=sha)
    return found, broken


def _check_stored(store: FileStore | S3Store, url: str, file_format: str) -> str | None:
    if isinstance(store, FileStore):
        return check_image(store._path(url), file_format)
    with tempfile.TemporaryDirectory() as scratch:
        local = Path(scratch) / "frame"
        store.download_file(url, local)
        return check_image(local, file_format)


class Uploader:
    """Takes frames as Blender saves them and uploads each from a thread of its own, so a
    slow upload never stalls Blender's output. `finish` waits for what was handed over."""

    def __init__(
        self,
        store: FileStore | S3Store,
        output: str,
        pattern: str,
        extension: str,
        file_format: str,
        chunk: int,
        thumbs: Path | None,
        thumb_frames: set[int],
        on_frame: Callable[[FrameRecord], None],
    ) -> None:
        self.store, self.output, self.pattern = store, output, pattern
        self.extension, self.file_format, self.chunk = extension, file_format, chunk
        self.thumbs, self.thumb_frames = thumbs, thumb_frames
        self.on_frame = on_frame
        self.problems: dict[int, str] = {}
        self.errors: list[Exception] = []
        self._queue: queue.Queue[tuple[int, Path, float | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def put(self, frame: int, path: Path, seconds: float | None) -> None:
        self._queue.put((frame, path, seconds))

    def finish(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            frame, path, seconds = item
            try:
                self._upload(frame, path, seconds)
            except Exception as exc:
                self.errors.append(exc)
                self.problems[frame] = f"could not be uploaded ({exc})"

    def _upload(self, frame: int, path: Path, seconds: float | None) -> None:
        problem = check_image(path, self.file_format)
        if problem:
            self.problems[frame] = problem
            return
        thumbnail = None
        if self.thumbs is not None and frame in self.thumb_frames:
            thumbnail = make_thumbnail(path, self.thumbs / f"{frame}.png")
        url = frame_url(self.output, self.pattern, frame, self.extension)
        info = self.store.upload_file(url, path, move=True)
        self.on_frame(
            FrameRecord(
                frame=frame,
                url=url,
                size=info.size,
                sha256=info.sha256,
                seconds=seconds,
                chunk=self.chunk,
                thumbnail=thumbnail,
            )
        )


class SavedFrames:
    """Follows Blender's log: each frame of `frames` it saves under `scratch` goes to the
    uploader with the render time its `Time:` line gives (Blender prints that after
    Saved:). `saved_at` holds when each was saved (per-frame speed, start-up)."""

    def __init__(
        self, scratch: Path, pattern: str, extension: str, frames: list[int], uploader: Uploader
    ) -> None:
        self.scratch, self.uploader = scratch, uploader
        self.by_name = {frame_filename(pattern, f, extension): f for f in frames}
        self.pending: list[tuple[int, Path]] = []  # saved, waiting for its Time line
        self.saved_at: list[float] = []

    def feed(self, line: str) -> bool:
        """Take one line of Blender's; say whether it was about a saved frame."""
        if (saved := logparse.saved_path(line)) is not None:
            self.hand_over(None)
            self.saved_at.append(time.monotonic())
            path = Path(saved)
            with contextlib.suppress(ValueError):
                frame = self.by_name.get(path.relative_to(self.scratch).as_posix())
                if frame is not None:
                    self.pending.append((frame, path))
            return True
        if self.pending and (seconds := logparse.frame_time(line)) is not None:
            self.hand_over(seconds)
            return True
        return False

    def hand_over(self, seconds: float | None) -> None:
        while self.pending:
            frame, path = self.pending.pop()
            self.uploader.put(frame, path, seconds)


def make_thumbnail(path: Path, target: Path) -> str | None:
    """Return the path of a small PNG of the frame (OpenEXR and Radiance HDR tone-mapped),
    or None when it cannot be decoded."""
    from PIL import Image, UnidentifiedImageError

    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with Image.open(path) as image:
            image.thumbnail((THUMB_PX, THUMB_PX))
            image.convert("RGB").save(target)
        return str(target)
    except (UnidentifiedImageError, OSError, ValueError):
        pass
    try:
        pixels = thumbnail_rgb(path, THUMB_PX)
    except (OSError, ValueError, struct.error):
        return None
    if pixels is None:
        return None
    Image.fromarray(pixels, "RGB").save(target)
    return str(target)
