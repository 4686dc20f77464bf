"""One render chunk where the frames are rendered, not where the flow runs (a Kubernetes
pod): fetch the scene from storage, run Blender on the chunk's frames, and upload each
frame as it is saved, checked and checksummed, from this machine.

Blender's lines are printed as they come; each frame put in storage is printed as one
`@@gpuflow-frame <FrameRecord JSON>` line, and each that could not be as
`@@gpuflow-frame-problem <frame> <why>`: the render stage, following the pod's log, counts
frames by those lines. The exit code is Blender's (2 when the scene cannot be fetched).
SIGTERM (the pod being stopped) reaches Blender; frames it saved are still uploaded.

    python -m gpuflow.tasks.render.pod_chunk --chunk-json '{"scene": "s3://...", ...}'
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from pydantic import BaseModel

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.render.argv import RenderSettings, render_argv
from gpuflow.tasks.render.frames import blender_frames
from gpuflow.tasks.render.output import (
    FRAME_MARK,
    FRAME_PROBLEM_MARK,
    FrameRecord,
    SavedFrames,
    Uploader,
)
from gpuflow.tasks.render.scene import fetch, find_blend
from gpuflow.tasks.storage import S3Settings, StorageError, store_for


class PodChunk(BaseModel):
    """What a chunk needs to render where it runs: no path of the flow's host in it."""

    scene: str  # a storage URL
    blend: str | None = None
    output: str  # a storage URL
    pattern: str
    extension: str
    file_format: str
    frames: list[int]
    index: int
    blender: str = "blender"
    settings: RenderSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuflow.tasks.render.pod_chunk")
    parser.add_argument("--chunk-json", required=True)
    chunk = PodChunk.model_validate_json(parser.parse_args(argv).chunk_json)

    printing = threading.Lock()

    def say(line: str) -> None:
        # one write per line: the node's sampler writes to the same log, and unbuffered
        # (as in the job image) print() writes the text and its newline apart
        with printing:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    s3 = S3Settings.from_env()
    try:
        blend = find_blend(fetch(chunk.scene, s3), chunk.blend)
        store = store_for(chunk.output, s3)
    except (InvalidSpec, StorageError) as exc:
        print(f"gpuflow: chunk {chunk.index}: {exc}", file=sys.stderr, flush=True)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix=f"gpuflow-chunk-{chunk.index}-"))
    uploader = Uploader(
        store,
        chunk.output,
        chunk.pattern,
        chunk.extension,
        chunk.file_format,
        chunk.index,
        None,
        set(),
        lambda record: say(f"{FRAME_MARK} {record.model_dump_json()}"),
    )
    saved = SavedFrames(scratch, chunk.pattern, chunk.extension, chunk.frames, uploader)
    command = render_argv(
        chunk.blender,
        str(blend),
        str(scratch / chunk.pattern),
        blender_frames(chunk.frames),
        chunk.settings,
    )
    try:
        blender = subprocess.Popen(
            command,
            env={**os.environ, "TMPDIR": str(scratch)},  # its temporary folder goes with scratch
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
        )
    except OSError as exc:
        print(f"gpuflow: chunk {chunk.index}: cannot start {chunk.blender}: {exc}", file=sys.stderr)
        return 127

    def stop(signum: int, _frame: object) -> None:
        blender.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    try:
        assert blender.stdout is not None
        for line in blender.stdout:
            # Blender's lines (the scene's own scripts print too) never pass for a record
            # of this program's: one that starts with a mark is relayed behind a space
            text = line.rstrip("\n")
            say(f" {text}" if text.startswith("@@gpuflow") else text)
            saved.feed(line)
        code = blender.wait()
    finally:
        saved.hand_over(None)
        uploader.finish()  # frames Blender saved are uploaded even when it was stopped
        shutil.rmtree(scratch, ignore_errors=True)
    for frame, problem in sorted(uploader.problems.items()):
        say(f"{FRAME_PROBLEM_MARK} {frame} {problem}")
    return code if code >= 0 else 128 - code


def record_of(line: str) -> FrameRecord | tuple[int, str] | None:
    """Return what one of the chunk's marked lines says: a frame in storage, or a frame
    and why it is not; None for any other line (or a mark not in that shape)."""
    if line.startswith(FRAME_MARK + " "):
        try:
            return FrameRecord.model_validate_json(line[len(FRAME_MARK) + 1 :])
        except ValueError:
            return None
    if line.startswith(FRAME_PROBLEM_MARK + " "):
        frame, _, why = line[len(FRAME_PROBLEM_MARK) + 1 :].partition(" ")
        if frame.lstrip("-").isdigit() and why:
            return int(frame), why
    return None


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
