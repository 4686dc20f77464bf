"""Frame specs and chunks: pure functions, no Blender, no Prefect.

A frame spec is what people type: "1-100", "1..100", "1,3,5", "1-100x5" (every 5th),
or a mixture; duplicates collapse and frames come out sorted. Chunks are runs of frames
rendered by one Blender process, sized to amortise Blender's start-up.
"""

from __future__ import annotations

import math
import re
import statistics

MAX_FRAME = 1_048_574  # Blender's MAXFRAME
_ITEM = re.compile(r"^(\d+)(?:(?:-|\.\.)(\d+)(?:x(\d+))?)?$")


class FrameSpecError(ValueError):
    """A frame spec that cannot be read; the message says how to write it."""


def parse_frames(spec: str) -> list[int]:
    """Return the sorted, distinct frames of `spec`; FrameSpecError names the bad part."""
    text = spec.replace(" ", "")
    if not text:
        raise FrameSpecError("the frame spec is empty; write e.g. 1-240, 1,5,9 or 1-240x10")
    frames: set[int] = set()
    for item in text.split(","):
        match = _ITEM.match(item)
        if not match:
            raise FrameSpecError(
                f"{item!r} is not a frame, a range A-B or a stepped range A-BxS; write e.g. 1-240x10"
            )
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) else start
        step = int(match.group(3)) if match.group(3) else 1
        if step == 0:
            raise FrameSpecError(f"{item!r} has step 0; the step after x must be at least 1")
        if end < start:
            raise FrameSpecError(f"{item!r} runs backwards; write {end}-{start}")
        if end > MAX_FRAME:
            raise FrameSpecError(f"{item!r} goes past Blender's last frame {MAX_FRAME}")
        frames.update(range(start, end + 1, step))
    return sorted(frames)


def label(frames: list[int]) -> str:
    """Return frames as people write them: runs of three or more as A-B, the rest listed."""
    parts: list[str] = []
    run: list[int] = []
    for frame in [*frames, None]:
        if run and (frame is None or frame != run[-1] + 1):
            parts.append(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ",".join(map(str, run)))
            run = []
        if frame is not None:
            run.append(frame)
    return ",".join(parts)


def blender_frames(frames: list[int]) -> str:
    """Return the -f argument for `frames` in Blender's own syntax (A..B ranges)."""
    return label(frames).replace("-", "..")


def chunk(frames: list[int], size: int) -> list[list[int]]:
    """Return `frames` cut into consecutive chunks of `size` frames (the last may be shorter)."""
    if size < 1:
        raise FrameSpecError("chunk size must be at least 1")
    return [frames[i : i + size] for i in range(0, len(frames), size)]


def auto_chunk_size(
    frames: int,
    startup_s: float,
    per_frame_s: float,
    workers: int = 1,
    overhead: float = 0.1,
) -> int:
    """Return a chunk size whose start-up costs at most `overhead` of its render time,
    but small enough that every worker gets a chunk."""
    if frames < 1:
        raise FrameSpecError("there are no frames to chunk")
    per_frame_s = max(per_frame_s, 1e-6)
    amortised = math.ceil(startup_s / (overhead * per_frame_s))
    fair_share = math.ceil(frames / max(1, workers))
    return max(1, min(amortised, fair_share))


def outside(frames: list[int], first: int, last: int) -> list[int]:
    """Return the frames outside the scene's range first..last."""
    return [f for f in frames if f < first or f > last]


FIRST_CHUNK_MAX = 10  # before any frame is timed: assume a frame costs about a start-up


class ChunkSizer:
    """Chunk sizes: a fixed size, or `auto` from measured start-up and per-frame seconds.

    With one worker there is nothing to balance, so the first chunk takes every frame
    (start-up is paid once). With several, first chunks are small; their timings size the
    rest so start-up costs about a tenth of each chunk, while every worker still gets work.
    """

    def __init__(self, chunk: int | str, startup_s: float, workers: int) -> None:
        self.fixed = chunk if isinstance(chunk, int) else None
        self.startups = [startup_s] if startup_s > 0 else []
        self.frame_times: list[float] = []
        self.workers = max(1, workers)

    def learn(self, per_frame_s: float, startup_s: float) -> None:
        self.frame_times.append(per_frame_s)
        self.startups.append(startup_s)

    def next(self, remaining: int) -> int:
        """Return the size of the next chunk when `remaining` frames are left to hand out."""
        if self.fixed is not None:
            return self.fixed
        fair = math.ceil(remaining / self.workers)
        if not self.frame_times:
            return fair if self.workers == 1 else max(1, min(fair, FIRST_CHUNK_MAX))
        startup = statistics.median(self.startups) if self.startups else 1.0
        return auto_chunk_size(
            remaining, startup, statistics.median(self.frame_times), self.workers
        )
